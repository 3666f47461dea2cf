"""Writing captured states while the model computes the next batch: one background thread, bounded queue.

The model's forward pass and the disk are the stage's two physical limits; running them one after the other
costs the sum of both. Here the main thread only launches forward passes and hands host copies of their outputs
to this writer, which checks each sample and puts its rows straight at the offsets `plan_shards` fixed, with
`os.pwrite` from the tensors' own memory: no concatenation, no intermediate bytes object. The queue holds at
most `queue_batches` batches, so host memory stays bounded when the disk is the slower side, and the model
simply waits for it. A shard is fsynced and renamed into place as soon as its last sample is written, on a
second thread: waiting for one shard to reach the disk must not stop the next shard's bytes from flowing into
the page cache (with fsync in the writing thread, the first H200 benchmark ran the stage at 0.70 of the raw
write rate, the writer busy the whole time).
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tasks.common.errors import CaptureMismatchError
from tasks.common.shards import fsync_dir, shared_file_mode
from tasks.extract.storage import (
    AUX_KEY,
    FINAL_KEY,
    HIDDEN_DIR,
    IDS_KEY,
    ShardPlan,
    StateLayout,
    check_capture,
)


@dataclass(frozen=True)
class TokenScores:
    """The target's scores of one batch's answer tokens, samples back to back in the batch's `indices` order:
    `logprobs` [S] float32, `top1` [S] bool, `counts[n]` tokens scored for the batch's n-th sample."""

    logprobs: torch.Tensor
    top1: torch.Tensor
    counts: list[int]


@dataclass
class HostBatch:
    """One batch's states on the host. `ready()` blocks until asynchronous device-to-host copies have landed.

    `indices` are positions in the part's sample list, `row_counts` the rows the backend captured for each
    (checked here against the sample's token count), `aux_nonfinite` / `final_nonfinite` per-row NaN/Inf flags
    computed on the device, `scores` the answer tokens' scores when they were computed in the same pass.
    """

    indices: list[int]
    row_counts: list[int]
    aux: torch.Tensor
    final: torch.Tensor | None
    aux_nonfinite: torch.Tensor
    final_nonfinite: torch.Tensor | None = None
    scores: TokenScores | None = None
    ready: Callable[[], None] = field(default=lambda: None)


@dataclass
class _OpenShard:
    fd: int
    tmp: Path
    remaining: int


@dataclass
class _Run:
    """Consecutive samples of one batch that also sit consecutively in one shard: written with one pwrite
    per tensor."""

    shard: int
    offset: int
    row_start: int
    row_end: int
    samples: list[int]


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.contiguous()
    return flat.numpy().data.cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)
    return written


class ShardStreamWriter:
    """Writes the shards of one `ShardPlan` from `HostBatch`es submitted in any order."""

    def __init__(
        self,
        run_dir: Path,
        plan: ShardPlan,
        layout: StateLayout,
        sample_ids: Sequence[str],
        input_ids: Sequence[Sequence[int]],
        *,
        queue_batches: int = 2,
        on_ready: Callable[[HostBatch], None] | None = None,
    ) -> None:
        """`on_ready(batch)`, when given, runs on the writer thread once a batch's copies have landed and its
        states passed their checks, before its bytes are written (the scores collector); what it raises fails
        the part like a failed check."""
        if len(plan.placements) != len(sample_ids) or len(sample_ids) != len(input_ids):
            raise ValueError("plan, sample ids and input ids must describe the same samples")
        self.root = Path(run_dir) / HIDDEN_DIR
        self.plan = plan
        self.layout = layout
        self.sample_ids = list(sample_ids)
        self.input_ids = input_ids
        self.on_ready = on_ready
        self.bytes_written = 0
        self.busy_s = 0.0
        self.ready_wait_s = 0.0
        self.submit_wait_s = 0.0
        self._written = [False] * len(sample_ids)
        self._open: dict[int, _OpenShard] = {}
        self._finishing: list[Future[None]] = []
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hidden-state-fsync")
        self._error: BaseException | None = None
        self._queue: queue.Queue[HostBatch | None] = queue.Queue(maxsize=max(1, queue_batches))
        self._thread = threading.Thread(target=self._run, name="hidden-state-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: HostBatch) -> None:
        """Queue a batch; blocks while the queue is full. Raises the writer's first error, if any."""
        self._raise_if_failed()
        started = time.monotonic()
        self._queue.put(batch)
        self.submit_wait_s += time.monotonic() - started

    def close(self) -> None:
        """Wait for every queued batch and shard, raise the first error, and check every planned sample arrived."""
        self._stop()
        self._raise_if_failed()
        missing = [i for i, done in enumerate(self._written) if not done]
        if missing:
            self._discard_open()
            raise CaptureMismatchError(self.sample_ids[missing[0]], "captures of this sample", 1, 0)

    def abort(self) -> None:
        """Stop both threads and delete unfinished shards; already renamed ones stay for the stale-file sweep."""
        self._stop()
        self._discard_open()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        for future in self._finishing:
            exc = future.exception()
            if exc is not None and self._error is None:
                self._error = exc
        self._finishing.clear()
        self._finisher.shutdown(wait=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                self._write_batch(item)
            except BaseException as exc:
                self._error = exc

    def _discard_open(self) -> None:
        for shard in self._open.values():
            os.close(shard.fd)
            shard.tmp.unlink(missing_ok=True)
        self._open.clear()

    def _check_batch(self, batch: HostBatch) -> list[_Run]:
        """Checks every sample of the batch (before any of its bytes are written) and groups it into runs."""
        first = self.sample_ids[batch.indices[0]] if batch.indices else "<empty batch>"
        if len(batch.row_counts) != len(batch.indices):
            raise CaptureMismatchError(
                first, "per-sample row counts in batch", len(batch.indices), len(batch.row_counts)
            )
        total = sum(batch.row_counts)
        checked = (
            (AUX_KEY, batch.aux),
            (FINAL_KEY, batch.final),
            ("aux NaN/Inf flags", batch.aux_nonfinite),
            ("final NaN/Inf flags", batch.final_nonfinite),
        )
        for key, tensor in checked:
            if tensor is not None and tensor.shape[0] != total:
                raise CaptureMismatchError(first, f"{key} rows in batch vs summed row counts", total, tensor.shape[0])
        runs: list[_Run] = []
        row = 0
        for i, count in zip(batch.indices, batch.row_counts, strict=True):
            sample_id = self.sample_ids[i]
            if self._written[i]:
                raise CaptureMismatchError(sample_id, "captures of this sample", 1, 2)
            final = batch.final[row : row + count] if batch.final is not None else None
            nonfinite = batch.aux_nonfinite[row : row + count]
            if batch.final_nonfinite is not None:
                nonfinite = nonfinite | batch.final_nonfinite[row : row + count]
            check_capture(
                sample_id,
                len(self.input_ids[i]),
                batch.aux[row : row + count],
                final,
                self.layout,
                nonfinite_rows=nonfinite,
            )
            placement = self.plan.placements[i]
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.shard == placement.shard
                and last.offset + (last.row_end - last.row_start) == placement.offset
            ):
                last.row_end += count
                last.samples.append(i)
            else:
                runs.append(_Run(placement.shard, placement.offset, row, row + count, [i]))
            row += count
        return runs

    def _shard(self, index: int) -> _OpenShard:
        shard = self._open.get(index)
        if shard is None:
            spec = self.plan.shards[index]
            path = self.root / spec.name
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.fchmod(fd, shared_file_mode())
            shard = _OpenShard(fd, Path(tmp), spec.samples)
            self._open[index] = shard
            _pwrite_all(fd, memoryview(spec.header), 0)
            os.ftruncate(fd, spec.size)
        return shard

    def _write_batch(self, batch: HostBatch) -> None:
        started = time.monotonic()
        batch.ready()
        ready = time.monotonic()
        self.ready_wait_s += ready - started
        runs = self._check_batch(batch)
        if self.on_ready is not None:
            self.on_ready(batch)
        aux_row = self.layout.aux_width * self.layout.dtype.itemsize
        final_row = self.layout.hidden_size * self.layout.dtype.itemsize
        for run in runs:
            spec = self.plan.shards[run.shard]
            shard = self._shard(run.shard)
            ids = np.concatenate([np.asarray(self.input_ids[i], dtype=np.int32) for i in run.samples])
            _pwrite_all(shard.fd, ids.data.cast("B"), spec.data_start[IDS_KEY] + run.offset * 4)
            aux = batch.aux[run.row_start : run.row_end]
            _pwrite_all(shard.fd, _bytes_view(aux), spec.data_start[AUX_KEY] + run.offset * aux_row)
            if batch.final is not None:
                final = batch.final[run.row_start : run.row_end]
                _pwrite_all(shard.fd, _bytes_view(final), spec.data_start[FINAL_KEY] + run.offset * final_row)
            for i in run.samples:
                self._written[i] = True
            shard.remaining -= len(run.samples)
            if shard.remaining == 0:
                self._finish(run.shard)
        self.busy_s += time.monotonic() - ready

    def _finish(self, index: int) -> None:
        shard = self._open.pop(index)
        spec = self.plan.shards[index]
        self._finishing.append(self._finisher.submit(self._sync_and_rename, shard, self.root / spec.name, spec.size))

    def _sync_and_rename(self, shard: _OpenShard, path: Path, size: int) -> None:
        try:
            os.fsync(shard.fd)
        finally:
            os.close(shard.fd)
        os.replace(shard.tmp, path)
        fsync_dir(path.parent)
        self.bytes_written += size
