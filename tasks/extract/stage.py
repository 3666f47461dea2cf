"""The extract stage: one `tokens` part in, one `hidden_states` index part (plus its safetensors shards) out.

Resumable per part: a part whose marker records the current tokens (and validation) parts and recipe, and the
final-state meaning of `storage.FINAL_STATE`, is returned as is, without running a batch on the model; an
unfinished or stale part's marker is removed first, then its shards are deleted and rewritten, because only the
index part (written last, with its marker) makes shards visible to readers.

The model and the disk run concurrently: the main thread launches forward passes and hands each batch to
`HostStager` (device-to-host copy on a side stream) and then to the `ShardStreamWriter` thread, which checks
and writes the previous batches while the next one computes.

With `scoring.enabled` (and a backend that can score: `PipelineConfig.scores_extracted`) every part also gets a
scores part (`scores.py`), written after its index part: scored in the same forward pass where the backend can
(`hf`), else from the stored final states right after the part is written (`sglang`). A current index part whose
scores are missing or stale gets them without a forward pass when its final states are stored; an aux-only part
is extracted again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import pyarrow as pa
import torch

from tasks.common.config import PipelineConfig
from tasks.common.errors import ConfigError
from tasks.common.schemas import HIDDEN_STATES_INDEX
from tasks.common.shards import (
    Build,
    PartRef,
    is_current,
    read_marker,
    read_part,
    read_provenance,
    recipe_digest,
    write_part,
)
from tasks.common.state_inputs import excluded_ids, hidden_states_inputs
from tasks.extract.capture import CapturedBatch, HostStager
from tasks.extract.gpu_check import check_before_load
from tasks.extract.score_head import ScoreHead
from tasks.extract.scores import (
    ScoreCollector,
    check_vocabulary,
    ensure_scores,
    refloorable,
    score_starts,
    scores_current,
    stores_final_states,
    write_scores_part,
)
from tasks.extract.storage import (
    DATA_DIR,
    DTYPES,
    FINAL_STATE,
    FINAL_STATE_META,
    HIDDEN_DIR,
    NO_FINAL_STATE,
    FreeSpaceProbe,
    StateLayout,
    clear_stale_shards,
    disk_free_bytes,
    ensure_space,
    estimate_bytes,
    marker_is_current,
    plan_shards,
)
from tasks.extract.writer import ShardStreamWriter

logger = logging.getLogger(__name__)

WRITER_QUEUE_BATCHES = 2
"""Batches staged ahead of the writer: enough to keep the disk busy while the next forward pass runs, few
enough that host memory stays a small multiple of one batch's states."""


class HiddenStateRunner(Protocol):
    """What the stage needs from a backend (`HFHiddenStateRunner`, `SGLangHiddenStateRunner`)."""

    backend: str
    layers: list[int]
    hidden_size: int
    dtype: torch.dtype
    dtype_name: str
    store_final_state: bool

    def provenance(self) -> dict[str, Any]: ...

    def plan_batches(self, lengths: Sequence[int]) -> list[list[int]]: ...

    def iter_captures(
        self, sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]
    ) -> Iterator[CapturedBatch]: ...

    def scoring(self, score_from: Sequence[int], chunk_tokens: int) -> AbstractContextManager[None]:
        """While open, captured batches also carry their answer tokens' scores (backends whose `scores_in_pass`
        is true; the others raise)."""
        ...


def make_runner(cfg: PipelineConfig) -> HiddenStateRunner:
    ext = cfg.extract
    for verdict in check_before_load(ext.device, ext.device_map, ext.backend):
        logger.info("torch kernels for %s", verdict.describe())
    if cfg.extract.backend == "sglang":
        from tasks.extract.sglang_backend import SGLangHiddenStateRunner

        return SGLangHiddenStateRunner.from_config(cfg)
    from tasks.extract.hf_backend import HFHiddenStateRunner

    return HFHiddenStateRunner.from_config(cfg)


def _check_runner_matches(cfg: PipelineConfig, runner: HiddenStateRunner) -> None:
    """A runner built from another config would write states the index labels wrongly."""
    if runner.dtype_name != cfg.extract.dtype:
        raise ConfigError(f"runner dtype {runner.dtype_name} != extract.dtype {cfg.extract.dtype}")
    if cfg.extract.layers is not None and list(runner.layers) != list(cfg.extract.layers):
        raise ConfigError(f"runner layers {runner.layers} != extract.layers {cfg.extract.layers}")
    if runner.backend != cfg.extract.backend:
        raise ConfigError(f"runner backend {runner.backend!r} != extract.backend {cfg.extract.backend!r}")
    if runner.store_final_state != cfg.extract.store_final_state:
        raise ConfigError(
            f"runner store_final_state {runner.store_final_state} != extract.store_final_state "
            f"{cfg.extract.store_final_state}"
        )


EXTRACT_CODE_VERSION = 1
"""Bump when a code change alters the stored states or index rows for the same inputs."""


def hidden_states_recipe(cfg: PipelineConfig) -> dict[str, Any]:
    """What shapes a hidden-states part besides its inputs, from the config alone (deciding that a part is
    current must not load the model). Batching, device and shard-size knobs are left out: they do not change the
    states, and re-extracting for them would cost GPU hours."""
    ecfg = cfg.extract
    model_config = cfg.extract_model_path / "config.json"
    model_digest = hashlib.sha256(model_config.read_bytes()).hexdigest() if model_config.is_file() else None
    return {
        "stage": "hidden_states",
        "code_version": EXTRACT_CODE_VERSION,
        "model_path": str(cfg.extract_model_path),
        "model_config_sha256": model_digest,
        "backend": ecfg.backend,
        "layers": ecfg.layers,
        "dtype": ecfg.dtype,
        "store_final_state": ecfg.store_final_state,
        "final_state": FINAL_STATE,
        "skip_failed_validation": ecfg.skip_failed_validation,
    }


def hidden_states_build(cfg: PipelineConfig, part: int) -> Build:
    """The build a current hidden-states part records: its tokens part (and, when failed samples are skipped,
    which samples its validation part leaves out: `tasks.common.state_inputs`) and the recipe."""
    out = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    inputs = hidden_states_inputs(out, cfg.extract.skip_failed_validation)
    return Build(inputs, recipe_digest(hidden_states_recipe(cfg)))


def index_current(cfg: PipelineConfig, part: int) -> bool:
    """The hidden-states part itself (index, shards) is current; its scores are another matter."""
    ref = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    return is_current(ref, hidden_states_build(cfg, part)) and marker_is_current(read_marker(ref)["stats"])


def hidden_states_current(cfg: PipelineConfig, part: int) -> bool:
    """Nothing left to do for this part: its states and (with scoring on) its scores are current."""
    return index_current(cfg, part) and (not cfg.scores_extracted or scores_current(cfg, part))


HOST_SPECIFIC = ("model_path", "model_config_sha256")
"""Recipe fields only the host that reads the model can judge."""


def current_for_another_host(cfg: PipelineConfig, part: int) -> bool:
    """Whether a host that hands extraction to another (the CPU worker, the GPU pool's deployment) can tell this
    part needs nothing: exactly `hidden_states_current` where this host reads the model's config; elsewhere, its
    inputs and scores are current and the recipe recorded with it (`extract_recipe` in the provenance, matching
    the marker's digest) equals this config's in everything but the model's path and config digest. A part
    written before the recipe was recorded is not judged current (the GPU run decides)."""
    if (cfg.extract_model_path / "config.json").is_file():
        return hidden_states_current(cfg, part)
    ref = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    if not ref.is_done():
        return False
    marker = read_marker(ref)
    recorded = read_provenance(ref.path).get("extract_recipe")
    if not isinstance(recorded, dict) or marker.get("recipe") != recipe_digest(recorded):
        return False
    here = hidden_states_recipe(cfg)
    if any(recorded.get(k) != v for k, v in here.items() if k not in HOST_SPECIFIC):
        return False
    inputs = Build(hidden_states_build(cfg, part).inputs)
    return (
        inputs.matches(marker)
        and marker_is_current(marker["stats"])
        and (not cfg.scores_extracted or scores_current(cfg, part))
    )


def needs_forward_pass(cfg: PipelineConfig, part: int) -> bool:
    """Whether making this part current needs the target model loaded (not for scores alone, unless the part
    stores aux states only and has no scores to recount)."""
    if not index_current(cfg, part):
        return True
    if not cfg.scores_extracted or scores_current(cfg, part) or refloorable(cfg, part):
        return False
    return not stores_final_states(cfg, part)


_HEADS: dict[tuple[str, str, str], ScoreHead] = {}


def score_head_for(cfg: PipelineConfig, runner: HiddenStateRunner | None) -> ScoreHead:
    """The runner's own head when it exposes one (hf), else the target's norm and lm_head read alone from the
    checkpoint, once per process (sglang, or scores of finished parts when no model is loaded)."""
    head = getattr(runner, "score_head", None) if runner is not None else None
    if isinstance(head, ScoreHead):
        return head
    from tasks.extract.hf_backend import resolve_device

    device = resolve_device(cfg.extract.device)
    key = (str(cfg.extract_model_path), cfg.extract.dtype, str(device))
    if key not in _HEADS:
        _HEADS[key] = ScoreHead.load(
            cfg.extract_model_path,
            DTYPES[cfg.extract.dtype],
            device,
            trust_remote_code=cfg.tokenizer.trust_remote_code,
        )
    return _HEADS[key]


def failed_validation_ids(cfg: PipelineConfig, part: int) -> set[str] | None:
    """Sample ids whose validation verdict is "fail" or "drop" (validation.tool_call_policy); None when this part
    has no finished validation part."""
    ref = PartRef(cfg.run_dir, "validation", part)
    return excluded_ids(ref) if ref.is_done() else None


def extract_part(
    cfg: PipelineConfig,
    part: int,
    runner: HiddenStateRunner | None,
    *,
    free_bytes: FreeSpaceProbe = disk_free_bytes,
) -> dict[str, Any]:
    """Capture and store hidden states for every (non-failed) sample of tokens part `part`, and score their
    answers; returns stats. `runner` may be None when `needs_forward_pass` says the part needs no model."""
    out_ref = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    build = hidden_states_build(cfg, part)
    if is_current(out_ref, build):
        stats: dict[str, Any] = read_marker(out_ref)["stats"]
        if marker_is_current(stats):
            if not cfg.scores_extracted:
                return stats
            scored = ensure_scores(cfg, part, lambda: score_head_for(cfg, runner))
            if scored is not None:
                return {**stats, "scores": scored}
        out_ref.marker.unlink()  # another final-state meaning, or aux-only without scores: redo it
    if runner is None:
        raise ConfigError(f"{out_ref} needs a forward pass, and no hidden-state runner was given")
    _check_runner_matches(cfg, runner)
    tokens = read_part(
        PartRef(cfg.run_dir, "tokens", part), columns=["sample_id", "dataset", "input_ids", "prompt_len"]
    )
    failed = failed_validation_ids(cfg, part) if cfg.extract.skip_failed_validation else None
    rows = [r for r in tokens.to_pylist() if failed is None or r["sample_id"] not in failed]
    sequences: list[list[int]] = [r["input_ids"] for r in rows]
    lengths = [len(s) for s in sequences]
    n_tokens = sum(lengths)
    in_pass = cfg.scores_extracted and bool(getattr(runner, "scores_in_pass", False))
    starts = score_starts(rows) if in_pass else None
    collector = None
    if starts is not None:
        check_vocabulary([r["sample_id"] for r in rows], sequences, score_head_for(cfg, runner).vocab_size)
        expected = [n - start for n, start in zip(lengths, starts, strict=True)]
        collector = ScoreCollector([r["sample_id"] for r in rows], expected, cfg.scoring.low_prob_floor)

    data_dir = cfg.run_dir / HIDDEN_DIR / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    out_ref.marker.unlink(missing_ok=True)  # a stale index must not point at shards being rewritten
    stale = clear_stale_shards(cfg.run_dir, part)
    needed = estimate_bytes(n_tokens, runner.hidden_size, runner.dtype, store_final_state=runner.store_final_state)
    ensure_space(data_dir, needed, f"{out_ref} ({len(rows)} samples, {n_tokens} tokens)", free_bytes)

    layout = StateLayout(tuple(runner.layers), runner.hidden_size, runner.dtype, runner.store_final_state)
    batches = runner.plan_batches(lengths)
    plan = plan_shards(part, [i for b in batches for i in b], lengths, layout, cfg.extract.max_shard_bytes)
    writer = ShardStreamWriter(
        cfg.run_dir,
        plan,
        layout,
        [r["sample_id"] for r in rows],
        sequences,
        queue_batches=WRITER_QUEUE_BATCHES,
        on_ready=collector.collect if collector is not None else None,
    )
    stager = HostStager()
    padded_tokens = 0
    n_batches = 0
    started = time.monotonic()
    scoring = nullcontext() if starts is None else runner.scoring(starts, cfg.scoring.logits_chunk_tokens)
    try:
        with scoring:
            for batch in runner.iter_captures(sequences, batches):
                n_batches += 1
                padded_tokens += batch.padded_tokens
                writer.submit(stager.stage(batch))
        writer.close()
    except BaseException:
        writer.abort()
        raise

    layers = list(runner.layers)
    index = pa.table(
        {
            "sample_id": [r["sample_id"] for r in rows],
            "dataset": [r["dataset"] for r in rows],
            "shard": [plan.shards[p.shard].name for p in plan.placements],
            "offset": [p.offset for p in plan.placements],
            "length": lengths,
            "layers": [layers] * len(rows),
            "hidden_size": [runner.hidden_size] * len(rows),
            "dtype": [runner.dtype_name] * len(rows),
        },
        schema=HIDDEN_STATES_INDEX,
    )
    stats = {
        "samples": len(rows),
        "skipped_failed_validation": len(tokens) - len(rows),
        "validation_part_found": failed is not None,
        "tokens": n_tokens,
        "bytes": writer.bytes_written,
        "estimated_bytes": needed,
        "shards": len(plan.shards),
        "oversize_shards": plan.oversize_shards,
        "stale_files_removed": stale,
        "batches": n_batches,
        "padded_tokens": padded_tokens,
        "padding_waste_frac": (padded_tokens - n_tokens) / padded_tokens if padded_tokens else 0.0,
        "store_final_state": runner.store_final_state,
        FINAL_STATE_META: FINAL_STATE if runner.store_final_state else NO_FINAL_STATE,
        "writer_busy_s": round(writer.busy_s, 4),
        "writer_ready_wait_s": round(writer.ready_wait_s, 4),
        "submit_wait_s": round(writer.submit_wait_s, 4),
    }
    provenance = {**cfg.provenance(), **runner.provenance(), "extract_recipe": hidden_states_recipe(cfg)}
    write_part(out_ref, index, provenance, stats, build)
    if collector is not None:
        head = score_head_for(cfg, runner).describe()
        datasets = [r["dataset"] for r in rows]
        return {**stats, "scores": write_scores_part(cfg, part, collector.table(datasets), "extraction", head, started)}
    if cfg.scores_extracted:
        return {**stats, "scores": ensure_scores(cfg, part, lambda: score_head_for(cfg, runner))}
    return stats
