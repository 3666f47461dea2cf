"""A run's extracted samples, part by part, as trainers need them: ids, loss mask, aux and final states.

The hidden-states index gives each sample's shard slice; the loss mask lives in the `tokens` part of the same
number and is joined by sample_id. Before a sample leaves this module its stored input ids are compared with
the tokens part's ids and its states are re-checked (shape, dtype, finite), and its shard must declare the
pre-norm final state (`storage.FINAL_STATE`), so an export can never pair states with the wrong tokens or mask,
nor hand a trainer states of another meaning than the one it is written for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.common.shards import PartRef, done_parts, read_part, read_provenance
from tasks.export.errors import ExportError
from tasks.extract.storage import (
    AUX_KEY,
    DTYPES,
    FINAL_KEY,
    HIDDEN_DIR,
    IDS_KEY,
    StateLayout,
    check_capture,
    check_shard_meaning,
    open_shard,
)


@dataclass(frozen=True)
class ExportSample:
    """One sample; `aux` [L, 3H] and `final` [L, H] (the input of the final norm) may be views of the shard."""

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


@dataclass(frozen=True)
class SourcePart:
    """One finished hidden-states part: its index rows (in index order) and the tokens' loss masks."""

    ref: PartRef
    rows: list[dict[str, Any]]
    provenance: dict[str, Any]

    @property
    def sample_ids(self) -> list[str]:
        return [str(r["sample_id"]) for r in self.rows]

    @property
    def layout(self) -> StateLayout | None:
        if not self.rows:
            return None
        first = self.rows[0]
        return StateLayout(tuple(first["layers"]), int(first["hidden_size"]), DTYPES[str(first["dtype"])])


def source_parts(run_dir: Path) -> list[SourcePart]:
    refs = done_parts(Path(run_dir), HIDDEN_DIR)
    if not refs:
        raise ExportError(f"{run_dir} has no finished {HIDDEN_DIR} parts to export")
    return [SourcePart(ref, read_part(ref).to_pylist(), read_provenance(ref.path)) for ref in refs]


def iter_samples(part: SourcePart) -> Iterator[ExportSample]:
    """The part's samples in index order, each shard opened once."""
    ref = part.ref
    tokens_ref = ref.with_stage("tokens")
    if not tokens_ref.is_done():
        raise ExportError(f"{tokens_ref} is missing: the loss masks of {ref} come from it")
    tokens = read_part(tokens_ref, columns=["sample_id", "input_ids", "loss_mask"]).to_pylist()
    by_id = {t["sample_id"]: t for t in tokens}
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for row in part.rows:
            sample_id = str(row["sample_id"])
            token_row = by_id.get(sample_id)
            if token_row is None:
                raise ExportError(f"sample {sample_id} of {ref} is not in {tokens_ref}")
            shard = str(row["shard"])
            if shard not in handles:
                path = ref.run_dir / HIDDEN_DIR / shard
                handles[shard] = stack.enter_context(open_shard(path))
            yield _load(handles[shard], row, token_row, ref)


def _load(handle: Any, row: dict[str, Any], token_row: dict[str, Any], ref: PartRef) -> ExportSample:
    sample_id = str(row["sample_id"])
    offset, length = int(row["offset"]), int(row["length"])
    if FINAL_KEY not in set(handle.keys()):
        raise ExportError(
            f"{ref} stores aux states only (extract.store_final_state: false); SpecForge and speculators both "
            "train on the final hidden state, so this run cannot be exported to them"
        )
    check_shard_meaning(ref.run_dir / HIDDEN_DIR / str(row["shard"]), handle.metadata(), has_final=True)
    ids = handle.get_slice(IDS_KEY)[offset : offset + length]
    aux = handle.get_slice(AUX_KEY)[offset : offset + length]
    final = handle.get_slice(FINAL_KEY)[offset : offset + length]
    layout = StateLayout(tuple(row["layers"]), int(row["hidden_size"]), DTYPES[str(row["dtype"])])
    check_capture(sample_id, length, aux, final, layout)
    expected_ids = token_row["input_ids"]
    if ids.tolist() != expected_ids:
        raise ExportError(f"sample {sample_id}: stored input ids differ from {ref.with_stage('tokens')}'s")
    mask = token_row["loss_mask"]
    if len(mask) != length:
        raise ExportError(f"sample {sample_id}: loss mask has {len(mask)} entries, states have {length} tokens")
    return ExportSample(
        sample_id,
        ids.to(torch.int64),
        torch.tensor(mask, dtype=torch.int64),
        aux,
        final,
    )
