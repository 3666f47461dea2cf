"""The target's scores of its own training data: one scores part per hidden-states part, beside its index.

Per extracted sample (`schemas.SCORES`): how many answer tokens were scored, the mean negative log-likelihood
the target gives them, the share that were its top-1 choice, the longest run of tokens below
`scoring.low_prob_floor`, the log-probability of the last answer token (the end of turn), and every answer
token's log-probability (4 bytes a token, beside the ~57 KB a token of Kimi-K2.5 states), so a new floor is
applied without a model.

Lineage: a scores part is built from its hidden-states index part (its marker records that part's fingerprint)
and the scoring recipe (`scores_recipe`), never the other way round, so a scoring setting that changes never
makes hidden states stale. Three ways to build one, cheapest first (`ensure_scores`): a new floor over the
stored per-token log-probabilities of a scores part built from the same index part; the stored pre-norm final
states through the target's norm and lm_head alone (`score_head.ScoreHead`, no forward pass); or, for aux-only
runs, nothing here: the caller re-extracts the part, scoring in the same pass. During extraction the scores come
with the states (`ScoreCollector`) and the part is written right after the index part.

Checked where produced: every sample of the index gets exactly one row, with as many scores as it has answer
tokens, all finite; a `CaptureMismatchError` names the sample otherwise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors import safe_open

from tasks.common.config import PipelineConfig
from tasks.common.errors import CaptureMismatchError
from tasks.common.schemas import SCORES, SCORES_STAGE
from tasks.common.shards import (
    Build,
    PartRef,
    fingerprint,
    input_fingerprints,
    is_current,
    read_marker,
    read_part,
    recipe_digest,
    write_part,
)
from tasks.extract.score_head import ScoreHead, first_scored_position, plan_token_scores
from tasks.extract.storage import FINAL_KEY, HIDDEN_DIR, check_shard_meaning
from tasks.extract.writer import HostBatch

SCORES_CODE_VERSION = 1
"""Bump when a code change alters the stored scores for the same tokens, model and settings."""

RESCORE_BATCH_TOKENS = 4096
"""Stored final states gathered per lm_head pass when rescoring without a forward pass."""


def scores_recipe(cfg: PipelineConfig) -> dict[str, Any]:
    """What shapes a scores part besides its index part: the code and the floor its stored runs count below."""
    return {"stage": "scores", "code_version": SCORES_CODE_VERSION, "low_prob_floor": cfg.scoring.low_prob_floor}


def scores_build(cfg: PipelineConfig, part: int) -> Build:
    return Build(input_fingerprints(PartRef(cfg.run_dir, SCORES_STAGE, part)), recipe_digest(scores_recipe(cfg)))


def scores_current(cfg: PipelineConfig, part: int) -> bool:
    return is_current(PartRef(cfg.run_dir, SCORES_STAGE, part), scores_build(cfg, part))


def longest_run_below(logprobs: np.ndarray, floor: float) -> int:
    """Longest run of consecutive tokens whose probability is below `floor`."""
    below = logprobs < math.log(floor)
    if not below.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], below.astype(np.int8), [0]))))
    return int((edges[1::2] - edges[::2]).max())


def sample_scores(logprobs: np.ndarray, top1: np.ndarray | None, floor: float) -> dict[str, Any]:
    """One sample's row (without ids): `top1` None keeps the rate out (the caller carries it over)."""
    n = int(logprobs.shape[0])
    return {
        "scored_tokens": n,
        "mean_nll": float(-logprobs.astype(np.float64).mean()) if n else None,
        "top1_rate": (float(top1.mean()) if n else None) if top1 is not None else None,
        "longest_low_prob_run": longest_run_below(logprobs, floor),
        "end_logprob": float(logprobs[-1]) if n else None,
        "token_logprobs": logprobs.astype(np.float32),
    }


def _checked(
    sample_id: str, logprobs: torch.Tensor, top1: torch.Tensor, expected: int
) -> tuple[np.ndarray, np.ndarray]:
    if logprobs.shape[0] != expected or top1.shape[0] != expected:
        raise CaptureMismatchError(sample_id, "scored answer tokens", expected, int(logprobs.shape[0]))
    values = logprobs.numpy().copy()
    bad = ~np.isfinite(values)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise CaptureMismatchError(
            sample_id, "target log-probabilities", "all finite", f"{int(bad.sum())} not finite, first at {first}"
        )
    return values, top1.numpy().copy()


class ScoreCollector:
    """Per-sample scores of one part as batches land on the host (called on the stage's writer thread)."""

    def __init__(self, sample_ids: Sequence[str], expected: Sequence[int], floor: float) -> None:
        self.sample_ids = list(sample_ids)
        self.expected = list(expected)
        self.floor = floor
        self.rows: list[dict[str, Any] | None] = [None] * len(self.sample_ids)

    def collect(self, batch: HostBatch) -> None:
        first = self.sample_ids[batch.indices[0]] if batch.indices else "<empty batch>"
        scores = batch.scores
        if scores is None:
            raise CaptureMismatchError(first, "token scores of the batch", "computed in the pass", "none")
        if len(scores.counts) != len(batch.indices):
            raise CaptureMismatchError(
                first, "per-sample score counts in batch", len(batch.indices), len(scores.counts)
            )
        if sum(scores.counts) != scores.logprobs.shape[0]:
            raise CaptureMismatchError(first, "scores in batch", sum(scores.counts), int(scores.logprobs.shape[0]))
        row = 0
        for i, count in zip(batch.indices, scores.counts, strict=True):
            sample_id = self.sample_ids[i]
            if self.rows[i] is not None:
                raise CaptureMismatchError(sample_id, "scores of this sample", 1, 2)
            values, top1 = _checked(
                sample_id, scores.logprobs[row : row + count], scores.top1[row : row + count], self.expected[i]
            )
            self.rows[i] = sample_scores(values, top1, self.floor)
            row += count

    def table(self, datasets: Sequence[str]) -> pa.Table:
        missing = [i for i, r in enumerate(self.rows) if r is None]
        if missing:
            raise CaptureMismatchError(self.sample_ids[missing[0]], "scores of this sample", 1, 0)
        rows = [r for r in self.rows if r is not None]
        return scores_table(self.sample_ids, datasets, rows)


def scores_table(sample_ids: Sequence[str], datasets: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    columns: dict[str, Any] = {"sample_id": list(sample_ids), "dataset": list(datasets)}
    for name in ("scored_tokens", "mean_nll", "top1_rate", "longest_low_prob_run", "end_logprob"):
        columns[name] = [r[name] for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r["token_logprobs"]) for r in rows], out=offsets[1:])
    values = np.concatenate([r["token_logprobs"] for r in rows]) if rows else np.zeros(0, np.float32)
    columns["token_logprobs"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))
    return pa.table(columns, schema=SCORES)


def score_starts(tokens: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per tokens row, its first scored position: the answer starts at `prompt_len`."""
    return [first_scored_position(int(r["prompt_len"]), len(r["input_ids"])) for r in tokens]


def check_vocabulary(sample_ids: Sequence[str], sequences: Sequence[Sequence[int]], vocab_size: int) -> None:
    """A token id the lm_head has no row for cannot be scored (nor, on a GPU, gathered without a device assert)."""
    for sample_id, seq in zip(sample_ids, sequences, strict=True):
        top = max(seq, default=-1)
        if top >= vocab_size:
            raise CaptureMismatchError(sample_id, "token id within the lm_head's vocabulary", f"< {vocab_size}", top)


def _stats(table: pa.Table, source: str, started: float) -> dict[str, Any]:
    nll = [v for v in table.column("mean_nll").to_pylist() if v is not None]
    return {
        "samples": table.num_rows,
        "scored_tokens": sum(table.column("scored_tokens").to_pylist()),
        "mean_nll": float(np.mean(nll)) if nll else None,
        "source": source,
        "code_version": SCORES_CODE_VERSION,
        "wall_s": round(time.monotonic() - started, 4),
    }


def write_scores_part(
    cfg: PipelineConfig, part: int, table: pa.Table, source: str, extra: Mapping[str, Any], started: float
) -> dict[str, Any]:
    """Written after its index part, whose fingerprint it records; `source` says how the scores were computed."""
    ref = PartRef(cfg.run_dir, SCORES_STAGE, part)
    stats = {**_stats(table, source, started), "low_prob_floor": cfg.scoring.low_prob_floor}
    provenance = {**cfg.provenance(), "scoring": scores_recipe(cfg), "scores_source": source, **extra}
    write_part(ref, table, provenance, stats, scores_build(cfg, part))
    return stats


def refloorable(cfg: PipelineConfig, part: int) -> bool:
    """A finished scores part from the same index part and code, differing at most in its floor."""
    ref = PartRef(cfg.run_dir, SCORES_STAGE, part)
    if not ref.is_done():
        return False
    marker = read_marker(ref)
    index = fingerprint(PartRef(cfg.run_dir, HIDDEN_DIR, part))
    return marker.get("inputs") == {HIDDEN_DIR: index} and marker.get("stats", {}).get("code_version") == (
        SCORES_CODE_VERSION
    )


def refloor_part(cfg: PipelineConfig, part: int) -> dict[str, Any]:
    """The stored runs recounted below the configured floor from the stored per-token log-probabilities."""
    started = time.monotonic()
    ref = PartRef(cfg.run_dir, SCORES_STAGE, part)
    old = read_part(ref)
    floor = cfg.scoring.low_prob_floor
    rows = []
    for row in old.to_pylist():
        values = np.asarray(row["token_logprobs"], dtype=np.float32)
        rows.append({**row, "longest_low_prob_run": longest_run_below(values, floor), "token_logprobs": values})
    table = scores_table(old.column("sample_id").to_pylist(), old.column("dataset").to_pylist(), rows)
    return write_scores_part(cfg, part, table, "refloor", {}, started)


def stores_final_states(cfg: PipelineConfig, part: int) -> bool:
    """The finished index part's shards hold the pre-norm final state (the run did not store aux states only)."""
    stats = read_marker(PartRef(cfg.run_dir, HIDDEN_DIR, part)).get("stats", {})
    return bool(stats.get("store_final_state", True))


def rescore_part(cfg: PipelineConfig, part: int, head: ScoreHead) -> dict[str, Any]:
    """Scores from the stored pre-norm final states through the target's norm and lm_head: no forward pass.
    The stored ids must be the tokens part's ids (the index part was built from it)."""
    started = time.monotonic()
    index_ref = PartRef(cfg.run_dir, HIDDEN_DIR, part)
    index = read_part(index_ref, columns=["sample_id", "dataset", "shard", "offset", "length"]).to_pylist()
    tokens = read_part(index_ref.with_stage("tokens"), columns=["sample_id", "input_ids", "prompt_len"]).to_pylist()
    by_id = {t["sample_id"]: t for t in tokens}
    floor = cfg.scoring.low_prob_floor
    rows: list[dict[str, Any] | None] = [None] * len(index)
    pending: list[tuple[int, torch.Tensor, list[int], int]] = []

    def flush() -> None:
        if not pending:
            return
        states = torch.cat([p[1] for p in pending]).to(head.device)
        offsets = np.cumsum([0] + [p[1].shape[0] for p in pending[:-1]]).tolist()
        seqs = [p[2] for p in pending]
        rows_t, targets, counts = plan_token_scores(seqs, [p[3] for p in pending], offsets)
        logprobs, top1 = head.score_pre_norm(states, rows_t, targets, cfg.scoring.logits_chunk_tokens)
        logprobs, top1 = logprobs.cpu(), top1.cpu()
        cursor = 0
        for (i, _, _, _), count in zip(pending, counts, strict=True):
            sample_id = str(index[i]["sample_id"])
            values, flags = _checked(sample_id, logprobs[cursor : cursor + count], top1[cursor : cursor + count], count)
            rows[i] = sample_scores(values, flags, floor)
            cursor += count
        pending.clear()

    by_shard: dict[str, list[int]] = {}
    for i, row in enumerate(index):
        by_shard.setdefault(str(row["shard"]), []).append(i)
    held = 0
    for shard, members in by_shard.items():
        path = cfg.run_dir / HIDDEN_DIR / shard
        with safe_open(str(path), framework="pt") as fh:
            check_shard_meaning(path, fh.metadata(), has_final=FINAL_KEY in set(fh.keys()))
            if FINAL_KEY not in set(fh.keys()):
                raise CaptureMismatchError(str(index[members[0]]["sample_id"]), f"{FINAL_KEY} in {path.name}", 1, 0)
            for i in members:
                row = index[i]
                sample_id = str(row["sample_id"])
                token_row = by_id.get(sample_id)
                if token_row is None:
                    raise CaptureMismatchError(sample_id, "row in the tokens part", 1, 0)
                ids: list[int] = token_row["input_ids"]
                offset, length = int(row["offset"]), int(row["length"])
                if length != len(ids):
                    raise CaptureMismatchError(sample_id, "stored states vs len(input_ids)", len(ids), length)
                check_vocabulary([sample_id], [ids], head.vocab_size)
                final = fh.get_slice(FINAL_KEY)[offset : offset + length]
                pending.append((i, final, ids, first_scored_position(int(token_row["prompt_len"]), length)))
                held += length
                if held >= RESCORE_BATCH_TOKENS:
                    flush()
                    held = 0
            flush()
            held = 0
    done = [r for r in rows if r is not None]
    if len(done) != len(index):
        missing = next(i for i, r in enumerate(rows) if r is None)
        raise CaptureMismatchError(str(index[missing]["sample_id"]), "scores of this sample", 1, 0)
    table = scores_table([str(r["sample_id"]) for r in index], [str(r["dataset"]) for r in index], done)
    return write_scores_part(cfg, part, table, "stored_final_state", head.describe(), started)


def ensure_scores(cfg: PipelineConfig, part: int, head: Callable[[], ScoreHead]) -> dict[str, Any] | None:
    """Make the scores part of a current index part current without a forward pass; None when that needs one
    (an aux-only index part without reusable scores): the caller re-extracts the part."""
    ref = PartRef(cfg.run_dir, SCORES_STAGE, part)
    if scores_current(cfg, part):
        stats: dict[str, Any] = read_marker(ref)["stats"]
        return stats
    if refloorable(cfg, part):
        return refloor_part(cfg, part)
    if stores_final_states(cfg, part):
        return rescore_part(cfg, part, head())
    return None
