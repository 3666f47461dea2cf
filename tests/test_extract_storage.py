"""Shard planning and the streaming writer, without a model: files must be plain safetensors and independent
of the order in which batches arrive."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.common.errors import CaptureMismatchError
from tasks.extract.capture import (
    PASS_COST_FRACTION,
    CapturedBatch,
    HostStager,
    plan_padded_batches,
    plan_ragged_batches,
)
from tasks.extract.storage import (
    AUX_KEY,
    DATA_DIR,
    FINAL_KEY,
    HEADER_ALIGN,
    HIDDEN_DIR,
    IDS_KEY,
    StateLayout,
    plan_shards,
    safetensors_header,
)
from tasks.extract.writer import HostBatch, ShardStreamWriter

H = 8
LAYOUT = StateLayout((1, 3, 4), H, torch.bfloat16)


def make_batch(indices: list[int], lengths: list[int], seed: int, layout: StateLayout = LAYOUT) -> HostBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths[i] for i in indices)
    aux = torch.randn(rows, layout.aux_width, generator=gen).to(layout.dtype)
    final = torch.randn(rows, H, generator=gen).to(layout.dtype) if layout.store_final_state else None
    return HostBatch(
        indices,
        [lengths[i] for i in indices],
        aux,
        final,
        torch.zeros(rows, dtype=torch.bool),
        torch.zeros(rows, dtype=torch.bool) if final is not None else None,
    )


def write_all(run_dir: Path, batches: list[HostBatch], lengths: list[int], order: list[int], budget: int) -> None:
    plan = plan_shards(3, order, lengths, LAYOUT, budget)
    ids = [[1000 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    writer = ShardStreamWriter(run_dir, plan, LAYOUT, [f"x{i}" for i in range(len(lengths))], ids, queue_batches=1)
    for batch in batches:
        writer.submit(batch)
    writer.close()


def test_header_matches_the_safetensors_format() -> None:
    tensors = [(IDS_KEY, torch.int32, (5,)), (AUX_KEY, torch.bfloat16, (5, 24)), (FINAL_KEY, torch.float32, (5, 8))]
    header, starts = safetensors_header(tensors, {"k": "v"})
    body_len = int.from_bytes(header[:8], "little")
    assert len(header) == 8 + body_len and body_len % HEADER_ALIGN == 0
    meta = json.loads(header[8:])
    assert meta["__metadata__"] == {"k": "v"}
    assert meta[AUX_KEY] == {"dtype": "BF16", "shape": [5, 24], "data_offsets": [20, 260]}
    assert starts == {IDS_KEY: len(header), AUX_KEY: len(header) + 20, FINAL_KEY: len(header) + 260}


def test_plan_shards_bounds_and_oversize() -> None:
    lengths = [10, 3, 40, 7, 7, 1]
    order = [2, 0, 3, 4, 1, 5]
    budget = 1024 + 12 * LAYOUT.token_bytes()
    plan = plan_shards(0, order, lengths, LAYOUT, budget)
    assert [plan.members(s) for s in range(len(plan.shards))] == [[2], [0], [3], [1, 4, 5]]
    flat = [
        i for s in range(len(plan.shards)) for i in sorted(plan.members(s), key=lambda i: plan.placements[i].offset)
    ]
    assert flat == order
    assert plan.oversize_shards == 1
    for spec in plan.shards:
        assert spec.size <= budget or spec.tokens == 40
        assert spec.size == len(spec.header) + spec.tokens * LAYOUT.token_bytes()
    with pytest.raises(ValueError, match="permutation"):
        plan_shards(0, [0, 1], lengths, LAYOUT, budget)


def test_streamed_shards_load_with_safetensors_and_ignore_arrival_order(tmp_path: Path) -> None:
    lengths = [5, 9, 2, 7, 4, 6, 3]
    batches_idx = [[1, 3], [5, 0], [4, 6, 2]]
    order = [i for b in batches_idx for i in b]
    budget = 1024 + 16 * LAYOUT.token_bytes()
    batches = [make_batch(b, lengths, seed=n) for n, b in enumerate(batches_idx)]
    write_all(tmp_path / "forward", batches, lengths, order, budget)
    write_all(tmp_path / "reverse", list(reversed(batches)), lengths, order, budget)
    plan = plan_shards(3, order, lengths, LAYOUT, budget)
    assert len(plan.shards) > 1
    by_sample = {}
    for batch in batches:
        row = 0
        for i, n in zip(batch.indices, batch.row_counts, strict=True):
            assert batch.final is not None
            by_sample[i] = (batch.aux[row : row + n], batch.final[row : row + n])
            row += n
    for spec in plan.shards:
        forward = tmp_path / "forward" / HIDDEN_DIR / spec.name
        assert forward.read_bytes() == (tmp_path / "reverse" / HIDDEN_DIR / spec.name).read_bytes()
        tensors = load_file(forward)
        with safe_open(str(forward), framework="pt") as fh:
            assert json.loads(fh.metadata()["layers"]) == [1, 3, 4]
        for i in plan.members(spec_index := plan.shards.index(spec)):
            p = plan.placements[i]
            assert p.shard == spec_index
            rows = slice(p.offset, p.offset + lengths[i])
            assert tensors[IDS_KEY][rows].tolist() == [1000 * i + j for j in range(lengths[i])]
            assert torch.equal(tensors[AUX_KEY][rows], by_sample[i][0])
            assert torch.equal(tensors[FINAL_KEY][rows], by_sample[i][1])
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "forward" / HIDDEN_DIR / DATA_DIR).iterdir())


def test_writer_error_stops_writing_and_abort_removes_temp_files(tmp_path: Path) -> None:
    lengths = [4, 4, 4]
    plan = plan_shards(0, [0, 1, 2], lengths, LAYOUT, 10**6)
    ids = [[7] * n for n in lengths]
    writer = ShardStreamWriter(tmp_path, plan, LAYOUT, ["a", "b", "c"], ids, queue_batches=1)
    writer.submit(make_batch([0], lengths, seed=1))
    bad = make_batch([1], lengths, seed=2)
    bad.aux_nonfinite[2] = True
    writer.submit(bad)
    with pytest.raises(CaptureMismatchError, match="first at token 2") as err:
        writer.close()
    assert err.value.sample_id == "b"
    writer.abort()
    assert list((tmp_path / HIDDEN_DIR / DATA_DIR).iterdir()) == []


def test_stager_flags_rows_on_cpu() -> None:
    aux = torch.zeros(4, LAYOUT.aux_width, dtype=torch.bfloat16)
    final = torch.zeros(4, H, dtype=torch.bfloat16)
    aux[1, 5] = float("nan")
    final[3, 0] = float("inf")
    host = HostStager().stage(CapturedBatch([0, 1], [2, 2], aux, final, 4))
    assert host.aux_nonfinite.tolist() == [False, True, False, False]
    assert host.final_nonfinite is not None and host.final_nonfinite.tolist() == [False, False, False, True]


def test_plan_ragged_batches_limits_tokens_and_requests() -> None:
    lengths = [5, 50, 10, 10, 9, 200, 1, 3]
    batches = plan_ragged_batches(lengths, 60, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [5]
    for batch in batches:
        assert len(batch) <= 3
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= 60


def greedy_fill(lengths: list[int], budget: int) -> list[list[int]]:
    """The simple alternative: fill each batch to the budget in length order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def plan_cost(lengths: list[int], batches: list[list[int]], per_pass: int) -> int:
    return sum(len(b) * max(lengths[i] for i in b) + per_pass for b in batches)


@pytest.mark.parametrize("seed", range(5))
def test_padded_plan_is_never_worse_than_greedy_filling(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [max(16, min(4096, int(rng.lognormvariate(math.log(600), 0.8)))) for _ in range(150)]
    budget = 8192
    planned = plan_padded_batches(lengths, budget)
    greedy = greedy_fill(lengths, budget)
    assert sorted(i for b in planned for i in b) == list(range(len(lengths)))
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget for b in planned)
    per_pass = budget // PASS_COST_FRACTION
    assert plan_cost(lengths, planned, per_pass) <= plan_cost(lengths, greedy, per_pass)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in planned)
    greedy_padded = sum(len(b) * max(lengths[i] for i in b) for b in greedy)
    assert padded <= greedy_padded
    assert [max(lengths[i] for i in b) for b in planned] == sorted(
        (max(lengths[i] for i in b) for b in planned), reverse=True
    )
