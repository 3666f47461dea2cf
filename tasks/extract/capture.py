"""What a backend hands the stage per forward pass, how batches are planned, and the copy to the host.

Both backends return one `CapturedBatch` per forward pass: the batch's unpadded rows, samples back to back in
`indices` order, still on the device that computed them, plus how many rows the backend attributes to each
sample. The stage never trusts those counts: the writer compares each with the sample's own token count.

`HostStager` moves a batch to the host without stalling the GPU: per-row NaN/Inf flags are reduced on the
device, then a side CUDA stream copies rows and flags into pinned host buffers while the default stream
already runs the next forward pass; the writer thread waits on the copy's event, not the main thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tasks.common.errors import ConfigError
from tasks.extract.writer import HostBatch, TokenScores


@dataclass(frozen=True)
class CapturedBatch:
    """`aux` [rows, n_aux*H] and `final` [rows, H] (None when only aux states are stored) of one forward pass;
    `padded_tokens` is what the pass computed, padding included, for the padding-waste figure; `scores` the
    target's scores of the batch's answer tokens, when the backend computed them in the same pass."""

    indices: list[int]
    row_counts: list[int]
    aux: torch.Tensor
    final: torch.Tensor | None
    padded_tokens: int
    scores: TokenScores | None = None


PASS_COST_FRACTION = 16
"""A forward pass costs about max_tokens / 16 tokens of fixed work (kernel launches, one read of every weight)
on top of its tokens; the planner trades that against padding."""


def plan_padded_batches(
    lengths: Sequence[int], max_tokens: int, pass_cost_tokens: int | None = None
) -> list[list[int]]:
    """Batches for right-padded forward passes, longest first, each with batch_size x longest <= max_tokens.

    Sorting by length is the bucketing; where to cut the sorted list is chosen by dynamic programming to
    minimise padded tokens + `pass_cost_tokens` per batch (default max_tokens / 16): filling every batch to
    the budget greedily pads a lot at batch boundaries in small parts or sparse length ranges, while one batch
    per length pads nothing but runs many small passes. The optimum among cuts of the sorted list is exact:
    an optimal plan never interleaves lengths, so contiguous ranges suffice.

    A sample longer than the budget still runs, alone: it cannot be split without changing its states.
    """
    if max_tokens < 1:
        raise ConfigError(f"extract.max_tokens_per_batch must be >= 1, got {max_tokens}")
    per_pass = max_tokens // PASS_COST_FRACTION if pass_cost_tokens is None else pass_cost_tokens
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    widths = [lengths[i] for i in order]
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            size = end - start
            if size > 1 and size * widths[start] > max_tokens:
                break
            cost = best[start] + size * widths[start] + per_pass
            if cost < best[end]:
                best[end], cut[end] = cost, start
    batches: list[list[int]] = []
    end = n
    while end > 0:
        batches.append(order[cut[end] : end])
        end = cut[end]
    return batches[::-1]


def plan_ragged_batches(lengths: Sequence[int], max_tokens: int, max_requests: int) -> list[list[int]]:
    """Batches for engines that run sequences back to back without padding (SGLang's extend): longest first,
    a batch growing while its summed tokens stay <= max_tokens and it holds <= max_requests sequences."""
    if max_tokens < 1 or max_requests < 1:
        raise ConfigError(f"batch limits must be >= 1, got max_tokens={max_tokens}, max_requests={max_requests}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in order:
        if current and (total + lengths[i] > max_tokens or len(current) >= max_requests):
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    if current:
        batches.append(current)
    return batches


def nonfinite_rows(states: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the row holds a NaN or Inf (a malformed rank-1 tensor is flagged whole, for the writer)."""
    if states.ndim != 2:
        return torch.ones(states.shape[:1], dtype=torch.bool, device=states.device)
    return ~torch.isfinite(states).all(dim=1)


class HostStager:
    """Copies captured batches to the host: synchronously for CPU tensors (nothing to copy), asynchronously
    through pinned memory and a side stream for CUDA tensors."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, batch: CapturedBatch) -> HostBatch:
        tensors = [t for t in (batch.aux, batch.final) if t is not None]
        device = batch.aux.device
        if any(t.device != device for t in tensors):
            raise ConfigError(f"captured aux and final states live on different devices: {[t.device for t in tensors]}")
        aux_flags = nonfinite_rows(batch.aux)
        final_flags = nonfinite_rows(batch.final) if batch.final is not None else None
        scores = batch.scores
        if scores is not None and {scores.logprobs.device, scores.top1.device} != {device}:
            raise ConfigError(f"token scores live on {scores.logprobs.device}, the captured states on {device}")
        if device.type != "cuda":
            return HostBatch(batch.indices, batch.row_counts, batch.aux, batch.final, aux_flags, final_flags, scores)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        sources = [
            batch.aux,
            batch.final,
            aux_flags,
            final_flags,
            scores.logprobs if scores is not None else None,
            scores.top1 if scores is not None else None,
        ]
        hosts: list[torch.Tensor | None] = []
        with torch.cuda.stream(stream):
            for source in sources:
                if source is None:
                    hosts.append(None)
                    continue
                host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                host.copy_(source, non_blocking=True)
                source.record_stream(stream)
                hosts.append(host)
            event = torch.cuda.Event()
            event.record(stream)
        aux_host, final_host, aux_flags_host, final_flags_host, logprobs_host, top1_host = hosts
        if aux_host is None or aux_flags_host is None:
            raise ConfigError("staging lost the aux states or their flags")
        host_scores = None
        if scores is not None:
            if logprobs_host is None or top1_host is None:
                raise ConfigError("staging lost the token scores")
            host_scores = TokenScores(logprobs_host, top1_host, scores.counts)
        return HostBatch(
            batch.indices,
            batch.row_counts,
            aux_host,
            final_host,
            aux_flags_host,
            final_flags_host,
            host_scores,
            ready=event.synchronize,
        )
