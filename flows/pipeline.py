"""The pipeline DAG: prepare -> generate -> reconstruct -> validate -> extract, over Parquet parts.

Tasks receive the config and part numbers (references), never rows or tensors; each per-part task reads its
inputs from the run directory and returns small stats, so Prefect bookkeeping grows with shards, not samples.
Every stage is resumable on its own: a part with a completion marker is skipped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from blocks.endpoint import InferenceEndpointBlock
from flows.retry_policy import retry_transient
from tasks.completion_format import CompletionFormat, resolve_format
from tasks.config import PipelineConfig, load_config
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part, make_runner
from tasks.generate.endpoints import CompletionMarkers
from tasks.generate.engine import generate_parts
from tasks.prepare import prepare_datasets
from tasks.reconstruct import reconstruct_part
from tasks.report import write_validation_report
from tasks.shards import PartRef, atomic_write_text
from tasks.special_tokens import format_table, verify_special_tokens
from tasks.tokenizer_loading import load_tokenizer
from tasks.validate import check_gates, summarize_validation, validate_part

TASK_OPTIONS: dict[str, Any] = {
    "cache_policy": NO_CACHE,
    "retries": 2,
    "retry_delay_seconds": [2, 10],
    "retry_condition_fn": retry_transient,
}

_RUNNERS: dict[str, HFHiddenStateRunner] = {}


def _format(cfg: PipelineConfig) -> CompletionFormat:
    return resolve_format(cfg.tokenizer.completion_format, load_tokenizer(cfg.tokenizer))


@task(name="prepare", **TASK_OPTIONS)
def prepare_task(cfg: PipelineConfig) -> dict[str, Any]:
    result = prepare_datasets(cfg)
    if result.quarantined:
        get_run_logger().warning("%d malformed rows quarantined in %s", result.quarantined, result.quarantine_path)
    return result.to_dict()


@task(name="check-tokenizer", **TASK_OPTIONS)
def check_tokenizer_task(cfg: PipelineConfig) -> str:
    """Fail before any request is sent if the format's special tokens do not map to their own single ids."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    fmt = _format(cfg)
    rows = verify_special_tokens(tokenizer, fmt)
    get_run_logger().info("completion format %s\n%s", fmt.name, format_table(rows))
    return fmt.name


@task(name="generate", task_run_name="generate-{n_parts}-parts", **TASK_OPTIONS)
def generate_task(cfg: PipelineConfig, parts: list[int], n_parts: int) -> dict[str, Any]:
    tokenizer = load_tokenizer(cfg.tokenizer)
    reasoning_close, end_of_turn = _format(cfg).markers()
    refs = [PartRef(cfg.run_dir, "prompts", p) for p in parts]
    summary = generate_parts(cfg, refs, CompletionMarkers(reasoning_close, end_of_turn), tokenizer)
    return summary.to_dict()


@task(name="reconstruct", task_run_name="reconstruct-part-{part:05d}", **TASK_OPTIONS)
def reconstruct_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    return reconstruct_part(cfg, part, _format(cfg))


@task(name="validate", task_run_name="validate-part-{part:05d}", **TASK_OPTIONS)
def validate_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    return validate_part(cfg, part, _format(cfg))


@task(name="validation-report", **TASK_OPTIONS)
def validation_report_task(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Writes the report and the artifact first, then applies the gates, so a failed gate is explainable."""
    summary = summarize_validation(cfg)
    report = write_validation_report(cfg.run_dir, summary)
    create_table_artifact(
        key="validation-summary",
        table=summary,
        description=f"Per-dataset validation summary of {cfg.run_dir} (full report: {report})",
    )
    check_gates(summary, cfg.validation)
    return summary


@task(name="extract", task_run_name="extract-part-{part:05d}", **TASK_OPTIONS)
def extract_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    key = json.dumps([str(cfg.extract_model_path), cfg.extract.model_dump(mode="json")], sort_keys=True)
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = _RUNNERS[key] = make_runner(cfg)
    return extract_part(cfg, part, runner)


def _done(cfg: PipelineConfig, stage: str, parts: list[int]) -> list[int]:
    return [p for p in parts if PartRef(cfg.run_dir, stage, p).is_done()]


def run_extract(cfg: PipelineConfig, parts: list[int]) -> list[dict[str, Any]]:
    """One model in one process: parts run one after another so the weights are loaded once."""
    return [extract_task(cfg, p) for p in _done(cfg, "tokens", parts)]


def run_pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    started = time.monotonic()
    stats: dict[str, Any] = {"run_dir": str(cfg.run_dir), "config": cfg.public_dump()}
    stats["prepare"] = prepare = prepare_task(cfg)
    parts: list[int] = prepare["parts"]
    stats["completion_format"] = check_tokenizer_task(cfg)
    stats["generate"] = generate_task(cfg, parts, len(parts))

    reconstruct_parts = _done(cfg, "responses", parts)
    stats["reconstruct"] = reconstruct_task.map(unmapped(cfg), reconstruct_parts).result()
    validate_parts = _done(cfg, "tokens", parts)
    stats["validate"] = validate_task.map(unmapped(cfg), validate_parts).result()
    stats["validation_summary"] = validation_report_task(cfg)
    if cfg.extract.enabled:
        stats["extract"] = run_extract(cfg, parts)
    stats["wall_s"] = round(time.monotonic() - started, 3)
    atomic_write_text(cfg.run_dir / "run_summary.json", json.dumps(stats, indent=2, default=str))
    create_markdown_artifact(key="run-summary", markdown=_markdown_summary(stats))
    return stats


def _markdown_summary(stats: dict[str, Any]) -> str:
    prep = stats["prepare"]
    gen = stats["generate"]
    lines = [
        f"# eagle3-datagen run `{stats['run_dir']}`",
        f"- wall time: {stats['wall_s']} s",
        f"- prompts: {sum(d['kept'] for d in prep['datasets'].values())} kept, {prep['quarantined']} quarantined",
        f"- generate: {json.dumps(gen.get('total', gen), default=str)}",
        f"- tokens parts: {len(stats['reconstruct'])}, validation parts: {len(stats['validate'])}, "
        f"extract parts: {len(stats.get('extract', []))}",
    ]
    return "\n".join(lines)


def resolve_config(config_path: str, overrides: dict[str, Any] | None, endpoint_block: str | None) -> PipelineConfig:
    cfg = load_config(Path(config_path), overrides)
    if endpoint_block:
        block = cast(InferenceEndpointBlock, InferenceEndpointBlock.load(endpoint_block))
        cfg = cfg.model_copy(update={"endpoint": block.to_endpoint_config(cfg.endpoint)})
    return cfg


@flow(name="eagle3-pipeline", log_prints=True)
def pipeline(
    config_path: str, overrides: dict[str, Any] | None = None, endpoint_block: str | None = None
) -> dict[str, Any]:
    """Run every stage; each resumes from the completion markers already in the run directory.

    `endpoint_block` names an InferenceEndpointBlock whose fields (and secret key) replace the YAML's endpoint.
    """
    return run_pipeline(resolve_config(config_path, overrides, endpoint_block))


@flow(name="eagle3-extract", log_prints=True)
def extract_flow(config_path: str, overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Hidden-state extraction alone: the flow the GPU work pool runs over an existing run directory."""
    cfg = resolve_config(config_path, overrides, None)
    parts = sorted(int(p.stem.split("-")[1]) for p in (cfg.run_dir / "tokens").glob("part-*.parquet"))
    return run_extract(cfg, parts)
