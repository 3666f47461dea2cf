"""The pipeline DAG: prepare -> generate -> reconstruct -> validate -> extract, over Parquet parts.

Tasks receive the config and part numbers (references), never rows or tensors; each per-part task reads its
inputs from the run directory and returns small stats, so Prefect bookkeeping grows with shards, not samples.
Every stage is resumable on its own: a part whose completion marker records the current fingerprints of its
input parts (and the current recipe) is skipped without a task run; a part built from inputs that changed since
(a retried responses part, a new completion format) is rebuilt. See `tasks.status.plan`.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from prefect import flow, get_run_logger, tags, task, unmapped
from prefect.artifacts import MarkdownArtifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from flows.artifact_keys import run_key
from flows.budget_stop import mark_budget_stopped
from flows.crashed_leftovers import RUN_TAG, close_crashed_leftovers
from flows.extract_handoff import extract_on_deployment, require_extract_deployment
from flows.failed_samples import publish_failed_samples
from flows.generate_progress import (
    PROGRESS_KEY,
    LogProgressListener,
    PrefectProgressListener,
    logged_events,
    publish_generate_summary,
    retire_progress_of_this_run,
)
from flows.params import RunParameters, in_slice, resolve_run
from flows.retry_policy import retry_transient
from flows.run_names import flow_run_name, run_dir_label
from tasks.common.artifact_store import RunStore
from tasks.common.config import PipelineConfig
from tasks.common.run_summary import run_summary_markdown
from tasks.common.schemas import REPORTS_DIR, SCORES_STAGE, STAGES
from tasks.common.shards import PART_RE, PartRef, atomic_write_text, done_parts, read_marker
from tasks.estimate.display import NO_LATENCY_RUN, estimate_text
from tasks.estimate.estimate import check_budget, estimate_run
from tasks.extract.stage import HiddenStateRunner, extract_part, make_runner, needs_forward_pass
from tasks.generate.endpoint_wait import wait_for_endpoint
from tasks.generate.endpoints import CompletionMarkers
from tasks.generate.engine import budget_stop_message, generate_parts, nothing_to_send_summary
from tasks.generate.progress import Listener
from tasks.generate.settlement import pending_notice
from tasks.generate.spill import spill_dir, waiting_segments
from tasks.generate.store_sync import LogMirror
from tasks.prepare.datasets import MANIFEST, QUARANTINE, prepare_datasets
from tasks.prepare.empty_input import require_prompts
from tasks.reconstruct.completion_format import CompletionFormat, format_for
from tasks.reconstruct.special_tokens import format_table, verify_special_tokens
from tasks.reconstruct.stage import endpoint_prompt_notice, model_ids_notice, reconstruct_part, repair_table
from tasks.reconstruct.template_clock import template_prints_date
from tasks.reconstruct.tokenizer_loading import load_tokenizer
from tasks.scoring import check_parity_gate, provider_rows, publish_score_report
from tasks.status.plan import (
    generate_todo,
    hidden_states_todo,
    recipe_digests,
    record_report,
    recorded_summary,
    report_key,
    reusable_report,
    tokens_todo,
    validation_todo,
)
from tasks.status.report import RunStatus, rerun_summary, run_status, write_failed_file
from tasks.status.unfinished import status_notes
from tasks.validate.checks import check_gates, gate_violations, summarize_validation, validate_part
from tasks.validate.report import artifact_markdown, overview_table, write_validation_report

TASK_OPTIONS: dict[str, Any] = {
    "cache_policy": NO_CACHE,
    "retries": 2,
    # One number, not a list: the UI's task page shows a list of delays as "Retry Delay: NaNs".
    "retry_delay_seconds": 5,
    "retry_condition_fn": retry_transient,
}

_RUNNERS: dict[str, HiddenStateRunner] = {}


def _format(cfg: PipelineConfig) -> CompletionFormat:
    return format_for(cfg, load_tokenizer(cfg.tokenizer))


@task(name="prepare", **TASK_OPTIONS)
def prepare_task(cfg: PipelineConfig) -> dict[str, Any]:
    result = prepare_datasets(cfg)
    if result.quarantined:
        get_run_logger().warning("%d malformed rows quarantined in %s", result.quarantined, result.quarantine_path)
    require_prompts(result.to_dict(), {ds.name: str(ds.path) for ds in cfg.datasets})
    return result.to_dict()


@task(name="estimate", **TASK_OPTIONS)
def estimate_task(cfg: PipelineConfig) -> dict[str, Any]:
    """Cost and wall time of what is left to send, printed before the first paid request; a run whose cheapest
    outcome already crosses endpoint.max_cost_usd is refused here (EstimateOverBudgetError)."""
    estimate = estimate_run(cfg, load_tokenizer(cfg.tokenizer))
    text = estimate_text(estimate, no_latency=NO_LATENCY_RUN)
    get_run_logger().info("estimate before sending anything:\n%s", text)
    if estimate.prices.disagreement:
        get_run_logger().warning("%s", estimate.prices.disagreement)
    create_markdown_artifact(
        key=run_key("estimate", cfg.run_dir), markdown=f"# Estimate (nothing sent)\n\n```\n{text}\n```"
    )
    check_budget(estimate)
    return {**estimate.to_dict(), "text": text}


@task(name="check-tokenizer", **TASK_OPTIONS)
def check_tokenizer_task(cfg: PipelineConfig) -> str:
    """Fail before any request is sent if the format's special tokens do not map to their own single ids, or
    `reconstruct.repair_from` teaches no rule source."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    fmt = _format(cfg)
    rows = verify_special_tokens(tokenizer, fmt)
    get_run_logger().info("completion format %s\n%s", fmt.name, format_table(rows))
    repair_table(cfg, fmt)  # a repair_from that teaches nothing stops the run before answers are bought
    return fmt.name


@task(name="generate", task_run_name="generate-{n_parts}-parts", **TASK_OPTIONS)
def generate_task(
    cfg: PipelineConfig, parts: list[int], n_parts: int, mirror: LogMirror | None = None
) -> dict[str, Any]:
    """All parts in one task: one global in-flight window across shards, no barrier at part boundaries; with a
    store, `mirror` copies the spend ledger and the journal there at every commit. Its log has a progress line
    every LOG_EVERY_S and one line per outage start and end."""
    logger = get_run_logger()
    wait_for_endpoint(cfg.endpoint, announce=logger.warning)  # up to outage_abort_s, as the stage itself waits
    tokenizer = load_tokenizer(cfg.tokenizer)
    refs = [PartRef(cfg.run_dir, "prompts", p) for p in parts]
    markers = CompletionMarkers.of(_format(cfg))
    listeners: list[Listener] = [
        PrefectProgressListener(run_key(PROGRESS_KEY, cfg.run_dir)),
        LogProgressListener(logger),
    ]
    with logged_events(logger):
        summary = generate_parts(cfg, refs, markers, tokenizer, listeners=listeners, on_commit=mirror)
    out = summary.to_dict()
    out["datasets"] = publish_generate_summary(cfg, parts)
    if summary.stopped == "budget":
        get_run_logger().warning(
            budget_stop_message(
                summary.counted_usd, cfg.endpoint.max_cost_usd, summary.pending_usd, cfg.endpoint.account_settlement
            )
        )
    notice = pending_notice(summary.spend, cfg.endpoint.account_settlement)
    if notice:
        get_run_logger().warning(notice)
    return out


@task(name="reconstruct", task_run_name="reconstruct-part-{part:05d}", **TASK_OPTIONS)
def reconstruct_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    return reconstruct_part(cfg, part, _format(cfg))


@task(name="validate", task_run_name="validate-part-{part:05d}", **TASK_OPTIONS)
def validate_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    return validate_part(cfg, part, _format(cfg))


@task(name="validation-report", **TASK_OPTIONS)
def validation_report_task(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Writes the report (HTML with plots, markdown, summary.json) and the artifacts first, then applies the
    gates, so a failed gate is explainable from the report and the UI."""
    key = report_key(cfg.run_dir, cfg.validation.model_dump(mode="json"))
    recorded = recorded_summary(cfg.run_dir, key)
    summary = summarize_validation(cfg) if recorded is None else recorded
    violations = gate_violations(summary, cfg.validation, cfg.endpoint.retry_failed)
    report = reusable_report(cfg.run_dir, key)
    if report is None or recorded is None:
        if report is None:
            report = write_validation_report(cfg.run_dir, summary, violations, cfg.validation.billing_tolerance_frac)
        record_report(cfg.run_dir, key, report, summary)
    create_table_artifact(
        key=run_key("validation-summary", cfg.run_dir),
        table=overview_table(summary),
        description=f"Validation summary of {cfg.run_dir}, one column per dataset (full report: {report})",
    )
    create_markdown_artifact(
        key=run_key("validation-report", cfg.run_dir), markdown=artifact_markdown(report, summary, violations)
    )
    if violations:
        get_run_logger().error("validation gates crossed; report: %s", report)
    check_gates(summary, cfg.validation, cfg.endpoint.retry_failed)
    return summary


@task(name="extract", task_run_name="extract-part-{part:05d}", **TASK_OPTIONS)
def extract_task(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    key = json.dumps([str(cfg.extract_model_path), cfg.extract.model_dump(mode="json")], sort_keys=True)
    runner = _RUNNERS.get(key)
    if runner is None and needs_forward_pass(cfg, part):  # scores alone never load the whole model
        runner = _RUNNERS[key] = make_runner(cfg)
    return extract_part(cfg, part, runner)


def _done(cfg: PipelineConfig, stage: str, parts: list[int]) -> list[int]:
    return [p for p in parts if PartRef(cfg.run_dir, stage, p).is_done()]


def _push(store: RunStore | None, cfg: PipelineConfig, stage: str, parts: list[int]) -> None:
    if store is not None:
        for part in _done(cfg, stage, parts):
            store.push_part(PartRef(cfg.run_dir, stage, part))


def _push_files(store: RunStore | None, cfg: PipelineConfig, stage: str) -> None:
    """Stage-level files (manifest, quarantine, reports): everything in the stage folder but parts and markers."""
    if store is None:
        return
    for path in sorted((cfg.run_dir / stage).glob("*")):
        if path.is_file() and not path.name.startswith(".") and not PART_RE.match(path.name):
            store.push_file(path)


def _pull(store: RunStore | None, *stages: str) -> None:
    if store is not None:
        for stage in stages:
            store.pull_stage(stage)
            store.pull_optional(f"{stage}/{MANIFEST}")


def _parts(cfg: PipelineConfig, stage: str) -> list[int]:
    return [r.part for r in done_parts(cfg.run_dir, stage)]


def stage_prepare(cfg: PipelineConfig, store: RunStore | None) -> dict[str, Any]:
    result = prepare_task(cfg)
    _push(store, cfg, "prompts", result["parts"])
    _push_files(store, cfg, "prompts")
    return result


def stage_generate(cfg: PipelineConfig, store: RunStore | None, parts: list[int]) -> dict[str, Any]:
    spilled = waiting_segments(spill_dir(cfg))  # generate takes them back
    if not generate_todo(cfg, parts) and not spilled:
        get_run_logger().info(
            "generate: nothing to send: every sample of the %d responses parts is done, or failed deterministically "
            "and is not resent with these settings (no endpoint wait)",
            len(parts),
        )
        nothing = nothing_to_send_summary(cfg.run_dir, parts)
        total = nothing.total()
        retire_progress_of_this_run(
            run_key(PROGRESS_KEY, cfg.run_dir),
            f"generate: final (a later attempt found nothing left to send: {total['skipped_already_done']:,} "
            f"samples done, {total['kept_failed']:,} kept as failed)",
            100.0,
        )
        return nothing.to_dict()
    check_tokenizer_task(cfg)
    # Every host's spend and journaled answers first (the cap holds on any worker, a dead host's answers are
    # not bought again); then this run's are mirrored at every commit.
    mirror = LogMirror(store, cfg.endpoint.commit_every_s) if store is not None else None
    if mirror is not None:
        mirror.pull()
        mirror.start()
    try:
        stats = generate_task(cfg, parts, len(parts), mirror)
    finally:
        if mirror is not None:
            mirror.close()
    _push(store, cfg, "responses", parts)
    if mirror is not None:
        mirror.drop_replayed_journals()
    return stats


def _budget_stopped(stats: dict[str, Any]) -> bool:
    return bool(stats.get("total", {}).get("stopped") == "budget")


def close_failure_summary(cfg: PipelineConfig) -> None:
    """A run that completes replaces the run directory's failure-summary when its latest version is a failure
    (an earlier attempt, the UI's Retry, or an earlier run of the same directory): the UI showed that failure as
    the latest news of a directory a later run had finished."""
    from prefect.artifacts import Artifact
    from prefect.runtime import flow_run

    key = run_key("failure-summary", cfg.run_dir)
    latest = getattr(Artifact.get(key), "data", None)  # the latest version's markdown, or None: no such key
    if latest is None or not str(latest).split("\n", 1)[0].endswith(FAILED_HEADING_END):
        return
    attempt = int(flow_run.run_count or 1)
    create_markdown_artifact(
        key=key,
        markdown=f"# `{flow_run.name}` completed (attempt {attempt})\n\nThe failure in the older versions of this "
        "key is over: this run finished (see run-summary and run-status; the failed-samples tables hold what is "
        "still failed).",
    )


def _finish(stats: dict[str, Any], cfg: PipelineConfig) -> Any:
    """A run the cost cap ended is not a failure: it completes (a plain Completed, so every run list shows it),
    its message says so, and `mark_budget_stopped` tags it and tells automations."""
    close_failure_summary(cfg)
    if stats.get("dry_run"):  # a plain Completed looked like a run that had bought its answers
        return Completed(message="DryRun: nothing was sent; the estimate artifact says what a run would", data=stats)
    generate = stats.get("generate", stats)
    if _budget_stopped(generate):
        total = generate["total"]
        message = budget_stop_message(
            total["run_dir_counted_usd"],
            cfg.endpoint.max_cost_usd,
            total["run_dir_pending_usd"],
            cfg.endpoint.account_settlement,
        )
        mark_budget_stopped(message)
        return Completed(message=f"BudgetStopped: {message}", data=stats)
    return stats


def pull_send_times(cfg: PipelineConfig, store: RunStore | None) -> None:
    """Every host's spend ledger, where the chat template prints the date: its prompts are rendered at the time
    each request was sent (`template_clock`), which a host that never ran generate otherwise does not have (it
    fell back to the part's finish time, a day late for an answer bought just before midnight)."""
    if store is not None and template_prints_date(cfg.tokenizer.path):
        LogMirror(store, cfg.endpoint.commit_every_s).pull(with_journals=False)


def stage_cpu(
    cfg: PipelineConfig, store: RunStore | None, parts: list[int], run: RunParameters | None = None
) -> dict[str, Any]:
    """reconstruct + validate over parts, on threads in this process or on a local Dask cluster; no subflow at all
    when every tokens and validation part is current."""
    out: dict[str, Any]
    fmt = _format(cfg)
    built = _done(cfg, "responses", parts), _done(cfg, "tokens", parts)
    rebuild = tokens_todo(cfg, fmt, built[0])
    if rebuild:  # only a tokens part being built renders prompts
        pull_send_times(cfg, store)
    if not rebuild and not validation_todo(cfg, fmt, built[1]):
        out = {"reconstruct": _reused(cfg, "tokens", built[0]), "validate": _reused(cfg, "validation", built[1])}
    elif run is not None and run.cpu_task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        runner: Any = DaskTaskRunner(cluster_kwargs={"n_workers": run.dask_workers, "threads_per_worker": 1})
        with tags(RUN_TAG):
            out = cpu_stages_flow.with_options(task_runner=runner)(cfg, parts)
    else:
        with tags(RUN_TAG):  # the heartbeat automation covers runs so tagged: a dead host's subflow ends Crashed too
            out = cpu_stages_flow(cfg, parts)
    for notice in (model_ids_notice(cfg, out["reconstruct"]), endpoint_prompt_notice(out["reconstruct"])):
        if notice:
            get_run_logger().warning("%s", notice)
    _push(store, cfg, "tokens", parts)
    _push(store, cfg, "validation", parts)
    try:
        out["validation_summary"] = validation_report_task(cfg)
    finally:
        _push_files(store, cfg, REPORTS_DIR)
    return out


def _reused(cfg: PipelineConfig, stage: str, parts: list[int]) -> list[dict[str, Any]]:
    """Marker stats of the parts a stage did not rebuild: O(parts) small reads, no task runs."""
    return [{**read_marker(PartRef(cfg.run_dir, stage, p))["stats"], "reused": True} for p in parts]


@flow(name="eagle3-cpu-stages", log_prints=True, flow_run_name=flow_run_name)
def cpu_stages_flow(cfg: PipelineConfig, parts: list[int]) -> dict[str, Any]:
    fmt = _format(cfg)
    ready = _done(cfg, "responses", parts)
    todo = tokens_todo(cfg, fmt, ready)
    reconstructed = reconstruct_task.map(unmapped(cfg), todo).result()
    reconstructed += _reused(cfg, "tokens", [p for p in ready if p not in todo])
    ready = _done(cfg, "tokens", parts)
    todo = validation_todo(cfg, fmt, ready)
    validated = validate_task.map(unmapped(cfg), todo).result()
    validated += _reused(cfg, "validation", [p for p in ready if p not in todo])
    return {"reconstruct": reconstructed, "validate": validated}


def run_extract(cfg: PipelineConfig, parts: list[int], store: RunStore | None = None) -> list[dict[str, Any]]:
    """One model in one process: parts run one after another so the weights are loaded once, and not at all when
    every hidden-states part is current. Results in part order (`reused` marks a part left as it was)."""
    ready = _done(cfg, "tokens", parts)
    todo = hidden_states_todo(cfg, ready)
    kept = [p for p in ready if p not in todo]
    results = dict(zip(kept, _reused(cfg, "hidden_states", kept), strict=True))
    for part in todo:
        results[part] = extract_task(cfg, part)
        _push(store, cfg, "hidden_states", [part])
        _push(store, cfg, SCORES_STAGE, [part])
    return [results[p] for p in ready]


def extract_elsewhere(cfg: PipelineConfig, parts: list[int], run: RunParameters) -> list[dict[str, Any]]:
    """Extraction on the GPU pool's deployment, unless every hidden-states part is current as far as this host
    can tell (`current_for_another_host`): a nightly rerun of a finished run directory needs no GPU worker, and
    must not fail for want of one or wait behind a training run that holds the pool."""
    from tasks.extract.stage import current_for_another_host

    ready = _done(cfg, "tokens", parts)
    if all(current_for_another_host(cfg, p) for p in ready):
        get_run_logger().info("every hidden-states part is current: no extraction run on %s", run.extract_deployment)
        return _reused(cfg, "hidden_states", ready)
    return extract_on_deployment(run, cfg.run_dir.name)


def publish_scores(cfg: PipelineConfig, store: RunStore | None) -> dict[str, Any]:
    """The provider-parity report section and artifacts, after extraction; `run_pipeline` applies its gate once
    the run summary is written. Not a task: a no-op rerun reads only `reports/scores.json`."""
    report = publish_score_report(cfg.run_dir, cfg.scoring)
    summary = report.summary
    create_markdown_artifact(key=run_key("provider-parity", cfg.run_dir), markdown=report.markdown)
    create_table_artifact(
        key=run_key("provider-parity-table", cfg.run_dir),
        table=provider_rows(summary) or [{"serving": None, "samples": "0"}],
        description=f"The target's scores of each provider's answers in {cfg.run_dir} (report: {report.path})",
    )
    if summary["named"]:
        get_run_logger().warning("provider parity: %s", "; ".join(summary["named_lines"]))
    _push_files(store, cfg, REPORTS_DIR)
    return summary


def run_pipeline(
    cfg: PipelineConfig, store: RunStore | None = None, run: RunParameters | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    stats: dict[str, Any] = {"run_dir": str(cfg.run_dir), "config": cfg.public_dump()}
    stats["prepare"] = prepare = stage_prepare(cfg, store)
    parts: list[int] = prepare["parts"]
    stats["completion_format"] = cfg.tokenizer.completion_format_name
    if (run is not None and run.dry_run) or generate_todo(cfg, parts):
        stats["estimate"] = estimate_task(cfg)
    else:  # the estimate would price nothing: no task run, no re-read of every dataset and response part
        stats["estimate"] = {"requests": 0, "text": "nothing to send: every sample is done or kept as failed"}
    if run is not None and run.dry_run:
        stats["dry_run"] = True
        stats["wall_s"] = round(time.monotonic() - started, 3)
        return stats
    stats["generate"] = stage_generate(cfg, store, parts)
    if _budget_stopped(stats["generate"]):
        stats["stopped"] = "budget"
    else:
        stats.update(stage_cpu(cfg, store, parts, run))
        if cfg.extract.enabled and run is not None and run.extract_deployment:
            stats["extract"] = extract_elsewhere(cfg, parts, run)
        elif cfg.extract.enabled:
            stats["extract"] = run_extract(cfg, parts, store)
    if store is not None and run is not None and run.extract_deployment:
        _pull(store, "hidden_states", SCORES_STAGE)
    scored = cfg.scores_extracted and "stopped" not in stats
    if scored:
        stats["scores"] = publish_scores(cfg, store)
    stats["status"] = publish_status(cfg, extracted_here=not (run is not None and run.extract_deployment))
    stats["wall_s"] = round(time.monotonic() - started, 3)
    atomic_write_text(cfg.run_dir / "run_summary.json", json.dumps(stats, indent=2, default=str))
    if store is not None:
        store.push_file(cfg.run_dir / "run_summary.json")
    create_markdown_artifact(key=run_key("run-summary", cfg.run_dir), markdown=_markdown_summary(stats))
    if scored:
        check_parity_gate(stats["scores"], cfg.scoring)
    return stats


def publish_status(cfg: PipelineConfig, extracted_here: bool = True) -> dict[str, Any]:
    """The `status` view of the run directory as artifacts (markdown + table) and the failed-samples file; logs
    a warning naming the disagreement when stages do not hold what the stage before them finished. Hidden-state
    parts extracted on the GPU pool are checked against their inputs only: that host's model path and backend
    block are not this host's to judge."""
    recipes = recipe_digests(cfg, _format(cfg))
    if not extracted_here:
        recipes.pop("hidden_states")
    status = run_status(
        cfg.run_dir,
        recipes,
        cfg.extract.enabled,
        cfg.extract.skip_failed_validation,
        cfg.endpoint.retry_failed,
        cfg.scores_extracted,
    )
    failed_file = write_failed_file(status)
    publish_failed_samples(status.failure_records(), failed_file, cfg.run_dir, [d.name for d in cfg.datasets])
    # paid answers in unfinished parts, spend, a failed disk's spilled answers
    notes = "".join(f"- {line}\n" for line in status_notes(cfg.run_dir, cfg.endpoint.spill_dir))
    create_markdown_artifact(key=run_key("run-status", cfg.run_dir), markdown=f"{status.markdown()}\n{notes}")
    create_table_artifact(
        key=run_key("run-status-table", cfg.run_dir),
        table=status.rows(),
        description=f"Samples per dataset and stage in {cfg.run_dir}; failed and quarantined ids in {failed_file}",
    )
    if status.quarantined:
        get_run_logger().warning(
            "%d input rows quarantined (%s)", len(status.quarantined), cfg.run_dir / "prompts" / QUARANTINE
        )
    if not status.consistent:
        get_run_logger().warning("stages disagree: %s", "; ".join(status.problems))
    return {**status.to_dict(), "failed_file": str(failed_file)}


def _markdown_summary(stats: dict[str, Any]) -> str:
    """Per-stage counts from the run directory's completion markers (what is really there, whichever worker or
    deployment wrote it), the generate totals as a table, and the budget stop if any."""
    return run_summary_markdown(stats)


FAILED_HEADING_END = " failed"
"""How the first line of a failure-summary ends: "# `<flow run name>` failed"."""


def failure_summary_hook(flow_obj: Any, flow_run: Any, state: Any) -> None:
    """on_failure: a markdown artifact saying which stage stopped where and what a rerun changes, plus the
    failed-samples tables, so the UI answers 'what broke' first."""
    message_lines = [line.strip() for line in str(state.message or "").splitlines() if line.strip()]
    lines = [
        f"# `{flow_run.name}`{FAILED_HEADING_END}",
        "",
        f"**{state.type.value}**: {message_lines[0] if message_lines else ''}",
    ]
    lines += [f"- {line}" for line in message_lines[1:]]
    lines.append("")
    key = failure_summary_key(flow_run.parameters)
    with warnings.catch_warnings():  # the hook may run outside the run's context: the run is named explicitly
        warnings.simplefilter("ignore", FutureWarning)
        try:
            run = RunParameters.model_validate(flow_run.parameters.get("run", {}))
            cfg = resolve_run(run).cfg
            lines += _run_dir_report(cfg, flow_run.id) if _parts(cfg, "prompts") else _refused_lines(cfg)
        except Exception as exc:  # the hook must report, never raise: the run has already failed
            lines.append(f"(run directory not inspected: {type(exc).__name__}: {exc})")
        MarkdownArtifact(key=key, markdown="\n".join(lines), flow_run_id=flow_run.id).create()


def _refused_lines(cfg: PipelineConfig) -> list[str]:
    """A run that stopped before prepare finished a part (a refused form: an unknown extract deployment, a
    missing block): nothing of it is in the run directory, so there is no stage table, status or failed-samples
    file to show, and inspecting the directory would create it (`_status.json`, an empty `failed_samples.jsonl`)
    and report an empty prompts stage as a disagreement."""
    return [
        f"Nothing to resume: no part of run directory `{cfg.run_dir}` was prepared, so there is no stage table,",
        "status or failed-samples file to show. Change what the error above names and run again; the run starts",
        "at prepare.",
    ]


def _run_dir_report(cfg: PipelineConfig, flow_run_id: Any) -> list[str]:
    """What a run that got past prepare left: finished parts per stage, what a rerun changes, the status view,
    and the failed-samples file and tables."""
    lines = [f"Run directory `{cfg.run_dir}`; finished parts per stage:"]
    lines += [f"- {stage}: {len(_parts(cfg, stage))}" for stage in STAGES]
    status = run_status(
        cfg.run_dir, None, cfg.extract.enabled, cfg.extract.skip_failed_validation, cfg.endpoint.retry_failed
    )
    failed_file = write_failed_file(status)
    lines += ["", "## What a rerun with the same parameters changes", "", *rerun_outlook(status), ""]
    lines += [status.markdown().replace("# status of", "## status of", 1), ""]
    lines.append(f"Failed and quarantined samples: `{failed_file}` (tables: the failed-samples artifacts)")
    datasets = [d.name for d in cfg.datasets]
    publish_failed_samples(status.failure_records(), failed_file, cfg.run_dir, datasets, flow_run_id)
    return lines


def failure_summary_key(parameters: dict[str, Any]) -> str:
    """Keyed by the run directory the form names, as every artifact is: a run whose blocks or deployment do not
    resolve still says which directory it was for. Bare only when the form does not tell the directory."""
    label = run_dir_label(parameters)
    return run_key("failure-summary", label) if label else "failure-summary"


def rerun_outlook(status: RunStatus) -> list[str]:
    """Sentences (markdown list items) on what rerunning the same parameters does: resume, retry which failed
    samples, and stop again at which crossed gate unless the setting it names changes."""
    lines = ["- It resumes from the finished parts above; nothing finished is done again."]
    if status.blocking_gates:
        lines.append("- It stops at these validation gates again unless what each names changes:")
        lines += [f"  - {gate}" for gate in status.blocking_gates]
    retried = [g for g in status.gates_crossed if g not in status.blocking_gates]
    if retried:
        lines.append("- It retries the failed samples behind these gates, so it may pass them:")
        lines += [f"  - {gate}" for gate in retried]
    lines += [f"- Failed samples: {line}" for line in rerun_summary(status.failed)]
    return lines


FLOW_OPTIONS: dict[str, Any] = {
    "log_prints": True,
    "flow_run_name": flow_run_name,  # `pipeline-<run dir>-<6 hex>`, not Prefect's random "myrtle-squid"
    "on_failure": [failure_summary_hook],
    "on_running": [close_crashed_leftovers],
}


@flow(name="eagle3-pipeline", **FLOW_OPTIONS)
def pipeline(run: RunParameters) -> dict[str, Any]:
    """Every stage; each resumes from the completion markers already in the run directory."""
    resolved = resolve_run(run)
    if resolved.cfg.extract.enabled and run.extract_deployment:
        require_extract_deployment(run.extract_deployment)
    _pull(resolved.store, *STAGES, SCORES_STAGE)
    return _finish(run_pipeline(resolved.cfg, resolved.store, run), resolved.cfg)


@flow(name="eagle3-prepare", **FLOW_OPTIONS)
def prepare_flow(run: RunParameters) -> dict[str, Any]:
    resolved = resolve_run(run)
    return stage_prepare(resolved.cfg, resolved.store)


@flow(name="eagle3-generate", **FLOW_OPTIONS)
def generate_flow(run: RunParameters) -> dict[str, Any]:
    """Generate for every prepared part; a rerun retries only failed samples."""
    resolved = resolve_run(run)
    _pull(resolved.store, "prompts", "responses")
    return _finish(stage_generate(resolved.cfg, resolved.store, _parts(resolved.cfg, "prompts")), resolved.cfg)


@flow(name="eagle3-validate", **FLOW_OPTIONS)
def validate_flow(run: RunParameters) -> dict[str, Any]:
    """Reconstruct + validate (they share the tokenizer and run on CPU workers)."""
    resolved = resolve_run(run)
    _pull(resolved.store, "prompts", "responses", "tokens", "validation")
    return stage_cpu(resolved.cfg, resolved.store, _parts(resolved.cfg, "responses"), run)


@flow(name="eagle3-extract", **FLOW_OPTIONS)
def extract_flow(run: RunParameters) -> list[dict[str, Any]]:
    """Hidden-state extraction alone: the flow the GPU work pool runs over an existing run directory."""
    resolved = resolve_run(run)
    _pull(resolved.store, "tokens", "validation", "hidden_states", SCORES_STAGE)
    parts = [p for p in _parts(resolved.cfg, "tokens") if in_slice(p, run.part_slice)]
    results = run_extract(resolved.cfg, parts, resolved.store)
    done = _done(resolved.cfg, "tokens", parts)
    rows = [
        {"part": p, "reused": bool(r.get("reused")), **{k: r.get(k) for k in EXTRACT_COLUMNS}}
        for p, r in zip(done, results, strict=True)
    ]
    create_table_artifact(
        key=run_key("extract-summary", resolved.cfg.run_dir),
        table=rows or [{"part": None, "reused": None, **dict.fromkeys(EXTRACT_COLUMNS)}],
        description=f"Hidden-state parts in {resolved.cfg.run_dir} (reused: left as a previous run wrote it)"
        + (f" (slice {run.part_slice})" if run.part_slice else ""),
    )
    return results


EXTRACT_COLUMNS = ("samples", "skipped_failed_validation", "tokens", "bytes", "shards", "padding_waste_frac")
