"""The extract stage: one `tokens` part in, one `hidden_states` index part (plus its safetensors shards) out.

Resumable per part: a part with a completion marker is returned as is, without running a batch on the model;
an unfinished part's leftover shards are deleted and rewritten, because only the index part (written last,
with its marker) makes shards visible to readers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import pyarrow as pa
import torch

from tasks.config import PipelineConfig
from tasks.errors import CaptureMismatchError, ConfigError
from tasks.extract.hf_backend import CapturedBatch, HFHiddenStateRunner
from tasks.extract.storage import (
    DATA_DIR,
    HIDDEN_DIR,
    FreeSpaceProbe,
    ShardLocation,
    ShardWriter,
    clear_stale_shards,
    disk_free_bytes,
    ensure_space,
    estimate_bytes,
)
from tasks.schemas import HIDDEN_STATES_INDEX
from tasks.shards import PartRef, read_marker, read_part, write_part


class HiddenStateRunner(Protocol):
    """What the stage needs from a backend; `HFHiddenStateRunner` is the one this build ships."""

    backend: str
    layers: list[int]
    hidden_size: int
    dtype: torch.dtype
    dtype_name: str

    def provenance(self) -> dict[str, Any]: ...

    def iter_captures(self, sequences: Sequence[Sequence[int]]) -> Iterator[CapturedBatch]: ...


def make_runner(cfg: PipelineConfig) -> HFHiddenStateRunner:
    if cfg.extract.backend == "sglang":
        raise ConfigError("extract.backend 'sglang' is not available in this build; use extract.backend: hf")
    return HFHiddenStateRunner.from_config(cfg)


def _check_runner_matches(cfg: PipelineConfig, runner: HiddenStateRunner) -> None:
    """A runner built from another config would write states the index labels wrongly."""
    if runner.dtype_name != cfg.extract.dtype:
        raise ConfigError(f"runner dtype {runner.dtype_name} != extract.dtype {cfg.extract.dtype}")
    if cfg.extract.layers is not None and list(runner.layers) != list(cfg.extract.layers):
        raise ConfigError(f"runner layers {runner.layers} != extract.layers {cfg.extract.layers}")
    if runner.backend != cfg.extract.backend:
        raise ConfigError(f"runner backend {runner.backend!r} != extract.backend {cfg.extract.backend!r}")


def failed_validation_ids(cfg: PipelineConfig, part: int) -> set[str] | None:
    """Sample ids whose validation verdict is "fail"; None when this part has no finished validation part."""
    ref = PartRef(cfg.run_dir, "validation", part)
    if not ref.is_done():
        return None
    columns = read_part(ref, columns=["sample_id", "verdict"]).to_pydict()
    return {sid for sid, v in zip(columns["sample_id"], columns["verdict"], strict=True) if v == "fail"}


def extract_part(
    cfg: PipelineConfig,
    part: int,
    runner: HiddenStateRunner,
    *,
    free_bytes: FreeSpaceProbe = disk_free_bytes,
) -> dict[str, Any]:
    """Capture and store hidden states for every (non-failed) sample of tokens part `part`; returns stats."""
    out_ref = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    if out_ref.is_done():
        stats: dict[str, Any] = read_marker(out_ref)["stats"]
        return stats
    _check_runner_matches(cfg, runner)
    tokens = read_part(PartRef(cfg.run_dir, "tokens", part), columns=["sample_id", "dataset", "input_ids"])
    failed = failed_validation_ids(cfg, part) if cfg.extract.skip_failed_validation else None
    rows = [r for r in tokens.to_pylist() if failed is None or r["sample_id"] not in failed]
    n_tokens = sum(len(r["input_ids"]) for r in rows)

    data_dir = cfg.run_dir / HIDDEN_DIR / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    stale = clear_stale_shards(cfg.run_dir, part)
    needed = estimate_bytes(n_tokens, runner.hidden_size, runner.dtype)
    ensure_space(data_dir, needed, f"{out_ref} ({len(rows)} samples, {n_tokens} tokens)", free_bytes)

    writer = ShardWriter(
        cfg.run_dir,
        part,
        layers=list(runner.layers),
        hidden_size=runner.hidden_size,
        dtype=runner.dtype,
        max_shard_bytes=cfg.extract.max_shard_bytes,
    )
    locations: dict[int, ShardLocation] = {}
    padded_tokens = 0
    batches = 0
    for batch in runner.iter_captures([r["input_ids"] for r in rows]):
        batches += 1
        padded_tokens += batch.padded_tokens
        if len(batch.states) != len(batch.indices):
            first = rows[batch.indices[0]]["sample_id"] if batch.indices else "<empty batch>"
            raise CaptureMismatchError(first, "captures per batch", len(batch.indices), len(batch.states))
        for i, states in zip(batch.indices, batch.states, strict=True):
            row = rows[i]
            if i in locations:
                raise CaptureMismatchError(row["sample_id"], "captures of this sample", 1, 2)
            ids = torch.tensor(row["input_ids"], dtype=torch.int32)
            locations[i] = writer.add(row["sample_id"], ids, states.aux, states.final)
    writer.flush()
    missing = [i for i in range(len(rows)) if i not in locations]
    if missing:
        raise CaptureMismatchError(rows[missing[0]]["sample_id"], "captures of this sample", 1, 0)

    layers = list(runner.layers)
    index = pa.table(
        {
            "sample_id": [r["sample_id"] for r in rows],
            "dataset": [r["dataset"] for r in rows],
            "shard": [locations[i].shard for i in range(len(rows))],
            "offset": [locations[i].offset for i in range(len(rows))],
            "length": [len(r["input_ids"]) for r in rows],
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
        "shards": len(writer.shards),
        "oversize_shards": writer.oversize_shards,
        "stale_files_removed": stale,
        "batches": batches,
        "padded_tokens": padded_tokens,
        "padding_waste_frac": (padded_tokens - n_tokens) / padded_tokens if padded_tokens else 0.0,
    }
    write_part(out_ref, index, {**cfg.provenance(), **runner.provenance()}, stats)
    return stats
