"""The extract stage against a real tiny Llama: stored states must equal a plain transformers forward pass.

Also the helpers other extract/export test modules import (config, tokens parts, direct computation).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.common.config import DatasetConfig, EndpointConfig, ExtractConfig, PipelineConfig, TokenizerConfig
from tasks.common.errors import CaptureMismatchError, ConfigError, InsufficientSpaceError, SchemaMismatchError
from tasks.common.schemas import TOKENS, VALIDATION
from tasks.common.shards import PartRef, read_part, read_provenance, write_part
from tasks.common.state_inputs import IDS_STAT, ids_digest
from tasks.extract.capture import CapturedBatch
from tasks.extract.capture import plan_padded_batches as plan_batches
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.layers import LayerSelectionError, default_aux_layers, validate_layers
from tasks.extract.stage import extract_part, make_runner
from tasks.extract.storage import (
    DATA_DIR,
    FINAL_KEY,
    FINAL_STATE,
    FINAL_STATE_META,
    HIDDEN_DIR,
    estimate_bytes,
    load_hidden_states,
)

H = 64
LAYERS = [1, 3, 4]
LENGTHS = [17, 5, 33, 9, 24, 1]


def make_cfg(run_dir: Path, model_dir: Path, **extract: Any) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="demo", path=run_dir / "unused.jsonl")],
        endpoint=EndpointConfig(model="tiny"),
        tokenizer=TokenizerConfig(path=model_dir),
        extract=ExtractConfig(**extract),
    )


def sample_ids(lengths: Sequence[int], seed: int = 0, prefix: str = "s") -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"{prefix}{i:02d}": [rng.randrange(2, 128_000) for _ in range(n)] for i, n in enumerate(lengths)}


def loss_mask_for(ids: Sequence[int]) -> list[int]:
    """A prompt/completion split that differs per sample, so a misaligned join in an export shows."""
    cut = len(ids) // 3
    return [0] * cut + [1] * (len(ids) - cut)


def write_tokens(run_dir: Path, samples: dict[str, list[int]], part: int = 0) -> None:
    n = len(samples)
    table = pa.table(
        {
            "sample_id": list(samples),
            "dataset": ["demo"] * n,
            "input_ids": list(samples.values()),
            "loss_mask": [loss_mask_for(ids) for ids in samples.values()],
            "prompt_len": [len(ids) // 3 for ids in samples.values()],
            "completion_len": [len(ids) - len(ids) // 3 for ids in samples.values()],
            "reasoning_len": [0] * n,
            "completion_format": ["test"] * n,
            "token_source": ["reencoded"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run_dir, "tokens", part), table, {"test": True}, {IDS_STAT: ids_digest(table)})


def write_validation(run_dir: Path, verdicts: dict[str, str], part: int = 0) -> None:
    """Only the columns extraction reads are meaningful; every other nullable column is left null, so this
    helper keeps working as the validation schema grows."""
    n = len(verdicts)
    required: dict[str, list[Any]] = {
        "sample_id": list(verdicts),
        "dataset": ["demo"] * n,
        "verdict": list(verdicts.values()),
        "reference_match": ["no_reference"] * n,
        "structural_issues": [[] for _ in range(n)],
        "our_completion_tokens": [0] * n,
    }
    columns = {f.name: required.get(f.name, [None] * n) for f in VALIDATION}
    write_part(PartRef(run_dir, "validation", part), pa.table(columns, schema=VALIDATION), {"test": True})


def index_rows(run_dir: Path, part: int = 0) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = read_part(PartRef(run_dir, HIDDEN_DIR, part)).to_pylist()
    return rows


def pre_norm_forward(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(`output_hidden_states`, final pre-norm state) of one plain forward pass. transformers 5 puts the post-norm
    state at `hidden_states[-1]`, so the pre-norm one is taken from the last decoder layer's raw output."""
    raw: list[torch.Tensor] = []
    handle = model.get_decoder().layers[-1].register_forward_hook(lambda _m, _a, out: raw.append(out))
    try:
        with torch.no_grad():
            hs = model(input_ids, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    out = raw[0]
    return hs, out[0] if isinstance(out, tuple) else out


def direct_states(
    model: PreTrainedModel, ids: list[int], layers: Sequence[int] = LAYERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's inputs computed the plain way: one unpadded sample, all hidden states requested; the final
    state is the input of the final norm (`storage.FINAL_STATE`)."""
    hs, pre_norm = pre_norm_forward(model, torch.tensor([ids]))
    return torch.cat([hs[k + 1][0] for k in layers], dim=-1), pre_norm[0]


def data_files(run_dir: Path) -> list[str]:
    data_dir = run_dir / HIDDEN_DIR / DATA_DIR
    return sorted(p.name for p in data_dir.iterdir()) if data_dir.is_dir() else []


@pytest.fixture(scope="module")
def runner_f32(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=1)


@pytest.fixture(scope="module")
def runner_bf16(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner.load(tiny_model_dir, dtype="bfloat16", device="cpu", max_tokens_per_batch=96)


@pytest.fixture(scope="module")
def reference_f32(tiny_model_dir: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def reference_bf16(tiny_model_dir: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.bfloat16, local_files_only=True
    )
    return model.eval()


def assert_stored_equal_direct(
    run_dir: Path, reference: PreTrainedModel, samples: dict[str, list[int]], tol: float
) -> None:
    """Every stored sample's aux and final states equal an unbatched forward of the reference model."""
    rows = index_rows(run_dir)
    assert {r["sample_id"] for r in rows} == set(samples)
    for row in rows:
        _, aux, final = load_hidden_states(run_dir, row)
        exp_aux, exp_final = direct_states(reference, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=tol, atol=tol)
        torch.testing.assert_close(final, exp_final, rtol=tol, atol=tol)


def tamper(
    runner: HFHiddenStateRunner,
    monkeypatch: pytest.MonkeyPatch,
    edit: Callable[[CapturedBatch, list[list[int]]], CapturedBatch],
) -> None:
    """Let the real forward passes run, then change what the backend hands the stage."""
    original = runner.iter_captures

    def iter_captures(sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]) -> Iterator[CapturedBatch]:
        for batch in original(sequences, batches):
            yield edit(batch, [list(sequences[i]) for i in batch.indices])

    monkeypatch.setattr(runner, "iter_captures", iter_captures)


def rows_of(batch: CapturedBatch, position: int) -> slice:
    start = sum(batch.row_counts[:position])
    return slice(start, start + batch.row_counts[position])


def test_default_layers_and_validation() -> None:
    assert default_aux_layers(8) == LAYERS
    assert default_aux_layers(32) == [1, 15, 28]
    assert validate_layers([0, 3, 6], 8) == [0, 3, 6]
    for bad in ([1, 3, 7], [-1, 3, 4], [3, 1, 4], [1, 1, 4], [1, 3]):
        with pytest.raises(LayerSelectionError, match="8-layer model"):
            validate_layers(bad, 8)
    with pytest.raises(LayerSelectionError, match="at least 7"):
        default_aux_layers(6)


def test_runner_uses_default_layers(runner_f32: HFHiddenStateRunner) -> None:
    assert (runner_f32.num_layers, runner_f32.hidden_size, runner_f32.layers) == (8, H, LAYERS)


def test_hf_hidden_states_convention(reference_f32: PreTrainedModel) -> None:
    """transformers 5.24 Llama: hidden_states[k+1] is layer k's raw output, hidden_states[-1] is post-norm."""
    decoder = reference_f32.get_decoder()
    raw: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_hook(lambda _m, _a, out, k=k: raw.__setitem__(k, out))
        for k, layer in enumerate(decoder.layers)
    ]
    try:
        with torch.no_grad():
            hs = reference_f32(torch.tensor([[5, 900, 7000, 42]]), output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    assert len(hs) == 9
    for k in range(7):
        assert torch.equal(hs[k + 1], raw[k])
    with torch.no_grad():
        assert torch.equal(hs[-1], decoder.norm(raw[7]))
    assert not torch.allclose(hs[-1], raw[7])
    _, pre_norm = pre_norm_forward(reference_f32, torch.tensor([[5, 900, 7000, 42]]))
    assert torch.equal(pre_norm, raw[7])


def test_final_state_is_the_norm_input_and_marked_so(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, reference_f32: PreTrainedModel
) -> None:
    """The stored final state is the final norm's input: the model's own norm and lm_head over it give the model's
    logits; every shard and the index provenance say so."""
    samples = sample_ids([13, 6], seed=30)
    write_tokens(tmp_path, samples)
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert stats[FINAL_STATE_META] == FINAL_STATE == "pre_norm"
    assert read_provenance(PartRef(tmp_path, HIDDEN_DIR, 0).path)["extract_final_state"] == "pre_norm"
    for row in index_rows(tmp_path):
        with safe_open(str(tmp_path / HIDDEN_DIR / row["shard"]), framework="pt") as fh:
            assert (fh.metadata() or {})[FINAL_STATE_META] == "pre_norm"
        _, _, final = load_hidden_states(tmp_path, row)
        assert final is not None
        with torch.no_grad():
            logits = reference_f32(torch.tensor([samples[row["sample_id"]]])).logits[0]
            ours = reference_f32.lm_head(reference_f32.get_decoder().norm(final))
        torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)


def test_parts_with_the_old_post_norm_meaning_are_refused_and_redone(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, reference_f32: PreTrainedModel
) -> None:
    """A run extracted before the meaning was recorded (post-norm final state, no `final_state` in shard headers
    or marker) is refused by the reader, and extract redoes the part instead of skipping it."""
    samples = sample_ids([9, 4], seed=31)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    extract_part(cfg, 0, runner_f32)
    ref = PartRef(tmp_path, HIDDEN_DIR, 0)
    for name in data_files(tmp_path):
        path = tmp_path / HIDDEN_DIR / DATA_DIR / name
        with safe_open(str(path), framework="pt") as fh:
            meta = {k: v for k, v in (fh.metadata() or {}).items() if k != FINAL_STATE_META}
        save_file(load_file(path), path, metadata=meta)
    marker = json.loads(ref.marker.read_text())
    del marker["stats"][FINAL_STATE_META]
    ref.marker.write_text(json.dumps(marker))
    with pytest.raises(SchemaMismatchError, match="final hidden state is post_norm"):
        load_hidden_states(tmp_path, index_rows(tmp_path)[0])
    passes = runner_f32.forward_passes
    stats = extract_part(cfg, 0, runner_f32)
    assert runner_f32.forward_passes > passes and stats[FINAL_STATE_META] == "pre_norm"
    assert_stored_equal_direct(tmp_path, reference_f32, samples, tol=1e-5)


def test_float32_unbatched_is_bit_exact(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, reference_f32: PreTrainedModel
) -> None:
    samples = sample_ids(LENGTHS)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=1)
    stats = extract_part(cfg, 0, runner_f32)
    assert stats["samples"] == len(LENGTHS) and stats["tokens"] == sum(LENGTHS)
    assert stats["batches"] == len(LENGTHS) and stats["padding_waste_frac"] == 0.0
    assert stats["bytes"] == sum((tmp_path / HIDDEN_DIR / DATA_DIR / f).stat().st_size for f in data_files(tmp_path))
    rows = index_rows(tmp_path)
    assert [r["sample_id"] for r in rows] == list(samples)
    for row in rows:
        assert (row["layers"], row["hidden_size"], row["dtype"]) == (LAYERS, H, "float32")
        ids, aux, final = load_hidden_states(tmp_path, row)
        expected = samples[row["sample_id"]]
        assert ids.dtype == torch.int32 and ids.tolist() == expected
        assert final is not None
        assert aux.shape == (len(expected), 3 * H) and final.shape == (len(expected), H)
        exp_aux, exp_final = direct_states(reference_f32, expected)
        assert torch.equal(aux, exp_aux)
        assert torch.equal(final, exp_final)
    prov = read_provenance(PartRef(tmp_path, HIDDEN_DIR, 0).path)
    assert prov["model"] == "tiny" and prov["extract_layers"] == LAYERS
    assert prov["extract_dtype"] == "float32" and prov["extract_backend"] == "hf"
    assert prov["extract_model_path"] == str(tiny_model_dir) and prov["extract_store_final_state"] is True
    assert prov["extract_final_state"] == "pre_norm"


def test_float32_padded_batches_match(
    tmp_path: Path,
    tiny_model_dir: Path,
    runner_f32: HFHiddenStateRunner,
    reference_f32: PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner_f32, "max_tokens_per_batch", 80)
    samples = sample_ids(LENGTHS, seed=1)
    write_tokens(tmp_path, samples)
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=80), 0, runner_f32)
    assert stats["batches"] < len(LENGTHS)
    assert 0.0 < stats["padding_waste_frac"] < 1.0
    assert_stored_equal_direct(tmp_path, reference_f32, samples, tol=1e-5)


def test_bfloat16_batched_matches_within_tolerance(
    tmp_path: Path, tiny_model_dir: Path, runner_bf16: HFHiddenStateRunner, reference_bf16: PreTrainedModel
) -> None:
    samples = sample_ids(LENGTHS, seed=2)
    write_tokens(tmp_path, samples)
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, max_tokens_per_batch=96), 0, runner_bf16)
    assert stats["batches"] < len(LENGTHS)
    for row in index_rows(tmp_path):
        assert row["dtype"] == "bfloat16"
        _, aux, final = load_hidden_states(tmp_path, row)
        assert final is not None
        assert aux.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
        exp_aux, exp_final = direct_states(reference_bf16, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(final, exp_final, rtol=2e-2, atol=2e-2)


def test_aux_only_layout_stores_three_layers(
    tmp_path: Path, tiny_model_dir: Path, reference_f32: PreTrainedModel
) -> None:
    runner = HFHiddenStateRunner.load(
        tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=64, store_final_state=False
    )
    samples = sample_ids(LENGTHS, seed=9)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=64, store_final_state=False)
    stats = extract_part(cfg, 0, runner)
    assert stats["estimated_bytes"] == estimate_bytes(sum(LENGTHS), H, "float32", store_final_state=False)
    assert stats["estimated_bytes"] == sum(LENGTHS) * 3 * H * 4
    for name in data_files(tmp_path):
        assert FINAL_KEY not in load_file(tmp_path / HIDDEN_DIR / DATA_DIR / name)
    for row in index_rows(tmp_path):
        ids, aux, final = load_hidden_states(tmp_path, row)
        assert final is None and ids.tolist() == samples[row["sample_id"]]
        exp_aux, _ = direct_states(reference_f32, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="store_final_state"):
        extract_part(make_cfg(tmp_path / "other", tiny_model_dir, dtype="float32"), 0, runner)


def test_device_map_placement_matches_direct_computation(
    tmp_path: Path, tiny_model_dir: Path, reference_f32: PreTrainedModel
) -> None:
    """accelerate's device_map path (on this CPU-only machine every layer lands on the CPU)."""
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device_map="auto", max_tokens_per_batch=64)
    assert runner.provenance()["extract_device_map"] == "auto"
    samples = sample_ids(LENGTHS, seed=10)
    write_tokens(tmp_path, samples)
    extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", device_map="auto"), 0, runner)
    assert_stored_equal_direct(tmp_path, reference_f32, samples, tol=1e-5)
    with pytest.raises(ConfigError, match="device_map"):
        HFHiddenStateRunner.load(tiny_model_dir, device="cpu", device_map="auto")


def set_value(
    position: int, token: int, column: int, value: float, *, final: bool = False
) -> Callable[[CapturedBatch, list[list[int]]], CapturedBatch]:
    def edit(batch: CapturedBatch, _seqs: list[list[int]]) -> CapturedBatch:
        if position >= len(batch.indices):
            return batch
        target = batch.final if final else batch.aux
        assert target is not None
        changed = target.clone()
        changed[rows_of(batch, position).start + token, column] = value
        if final:
            return CapturedBatch(batch.indices, batch.row_counts, batch.aux, changed, batch.padded_tokens)
        return CapturedBatch(batch.indices, batch.row_counts, changed, batch.final, batch.padded_tokens)

    return edit


def only_for(
    sample: list[int], edit: Callable[[CapturedBatch, list[list[int]]], CapturedBatch]
) -> Callable[[CapturedBatch, list[list[int]]], CapturedBatch]:
    def wrapped(batch: CapturedBatch, seqs: list[list[int]]) -> CapturedBatch:
        return edit(batch, seqs) if sample in seqs else batch

    return wrapped


@pytest.mark.parametrize(
    ("final", "value", "token"), [(False, float("nan"), 2), (True, float("inf"), 0), (False, float("-inf"), 3)]
)
def test_nonfinite_capture_is_refused_naming_the_sample(
    tmp_path: Path,
    tiny_model_dir: Path,
    runner_f32: HFHiddenStateRunner,
    monkeypatch: pytest.MonkeyPatch,
    final: bool,
    value: float,
    token: int,
) -> None:
    samples = sample_ids(LENGTHS, seed=3)
    write_tokens(tmp_path, samples)
    tamper(runner_f32, monkeypatch, only_for(samples["s04"], set_value(0, token, 7, value, final=final)))
    with pytest.raises(CaptureMismatchError, match="NaN/Inf") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert err.value.sample_id == "s04"
    assert f"first at token {token}" in str(err.value)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()
    assert not any(name.endswith(".tmp") for name in data_files(tmp_path))


def test_length_mismatch_is_refused(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefix-cache bug class: a backend returns fewer states than the sample has tokens."""
    samples = sample_ids(LENGTHS, seed=4)
    write_tokens(tmp_path, samples)

    def drop_last_row(batch: CapturedBatch, _seqs: list[list[int]]) -> CapturedBatch:
        keep = torch.ones(batch.aux.shape[0], dtype=torch.bool)
        keep[rows_of(batch, 0).stop - 1] = False
        counts = [batch.row_counts[0] - 1, *batch.row_counts[1:]]
        final = batch.final[keep] if batch.final is not None else None
        return CapturedBatch(batch.indices, counts, batch.aux[keep], final, batch.padded_tokens)

    tamper(runner_f32, monkeypatch, only_for(samples["s02"], drop_last_row))
    with pytest.raises(CaptureMismatchError, match="length") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert (err.value.sample_id, err.value.expected, err.value.actual) == ("s02", 33, 32)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (
            lambda b, _s: CapturedBatch(b.indices, b.row_counts, b.aux.to(torch.float16), b.final, b.padded_tokens),
            "dtype",
        ),
        (
            lambda b, _s: CapturedBatch(b.indices, b.row_counts, b.aux[:, : 2 * H], b.final, b.padded_tokens),
            "width",
        ),
        (lambda b, _s: CapturedBatch(b.indices, b.row_counts, b.aux, None, b.padded_tokens), "presence"),
        (
            lambda b, _s: CapturedBatch(b.indices, b.row_counts, b.aux[:-1], b.final, b.padded_tokens),
            "rows in batch",
        ),
    ],
)
def test_shape_and_dtype_mismatches_are_refused(
    tmp_path: Path,
    tiny_model_dir: Path,
    runner_f32: HFHiddenStateRunner,
    monkeypatch: pytest.MonkeyPatch,
    edit: Callable[[CapturedBatch, list[list[int]]], CapturedBatch],
    what: str,
) -> None:
    samples = sample_ids(LENGTHS, seed=11)
    write_tokens(tmp_path, samples)
    tamper(runner_f32, monkeypatch, only_for(samples["s03"], edit))
    with pytest.raises(CaptureMismatchError, match=what) as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert err.value.sample_id == "s03"
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()


def test_missing_and_duplicated_captures_are_refused(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids(LENGTHS, seed=12)
    write_tokens(tmp_path, samples)
    original = runner_f32.iter_captures

    def skip_s01(sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]) -> Iterator[CapturedBatch]:
        yield from (
            b for b in original(sequences, batches) if samples["s01"] not in [list(sequences[i]) for i in b.indices]
        )

    monkeypatch.setattr(runner_f32, "iter_captures", skip_s01)
    with pytest.raises(CaptureMismatchError, match="captures of this sample") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert (err.value.sample_id, err.value.expected, err.value.actual) == ("s01", 1, 0)

    def twice(sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]) -> Iterator[CapturedBatch]:
        for batch in original(sequences, batches):
            yield batch
            yield batch

    monkeypatch.setattr(runner_f32, "iter_captures", twice)
    with pytest.raises(CaptureMismatchError, match="captures of this sample") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert (err.value.expected, err.value.actual) == (1, 2)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()
    assert not any(name.endswith(".tmp") for name in data_files(tmp_path))


def test_rerun_of_done_part_does_no_forward_pass(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=5))
    data_dir = tmp_path / HIDDEN_DIR / DATA_DIR
    data_dir.mkdir(parents=True)
    (data_dir / "part-00000-0007.safetensors").write_bytes(b"stale")
    (data_dir / ".part-00000-0000.safetensors.abc.tmp").write_bytes(b"stale")
    (data_dir / "part-00001-0000.safetensors").write_bytes(b"other part")
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    first = extract_part(cfg, 0, runner_f32)
    assert first["stale_files_removed"] == 2
    assert data_files(tmp_path) == ["part-00000-0000.safetensors", "part-00001-0000.safetensors"]
    passes = runner_f32.forward_passes

    def refuse(sequences: Sequence[Sequence[int]], indices: Sequence[int]) -> CapturedBatch:
        raise AssertionError("a done part must not run the model")

    monkeypatch.setattr(runner_f32, "run_batch", refuse)
    assert extract_part(cfg, 0, runner_f32) == first
    assert runner_f32.forward_passes == passes


def test_a_host_without_the_model_tells_a_current_part_from_a_stale_one(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    """The CPU worker hands extraction to the GPU pool and cannot read the model: a nightly rerun of a finished
    run directory sent a GPU run anyway (failing with no GPU worker online, waiting behind a busy pool). It judges
    from the recipe recorded with the part, less the model's path and config digest."""
    from tasks.extract.stage import current_for_another_host

    write_tokens(tmp_path, sample_ids(LENGTHS, seed=6))
    extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    elsewhere = tmp_path / "model-on-the-gpu-host"
    assert current_for_another_host(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0)
    assert current_for_another_host(make_cfg(tmp_path, tiny_model_dir, dtype="float32", model_path=elsewhere), 0)
    assert not current_for_another_host(make_cfg(tmp_path, tiny_model_dir, dtype="bfloat16", model_path=elsewhere), 0)
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=7))
    assert not current_for_another_host(make_cfg(tmp_path, tiny_model_dir, dtype="float32", model_path=elsewhere), 0)


def test_crash_mid_part_then_resume_gives_the_clean_result(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids([40, 30, 20, 10, 8, 6, 4], seed=13)
    cfg_kwargs: dict[str, Any] = {"dtype": "float32", "max_shard_bytes": 40_000}
    clean_dir, crash_dir = tmp_path / "clean", tmp_path / "crash"
    for run_dir in (clean_dir, crash_dir):
        write_tokens(run_dir, samples)
    extract_part(make_cfg(clean_dir, tiny_model_dir, **cfg_kwargs), 0, runner_f32)
    assert len(data_files(clean_dir)) > 2

    original = runner_f32.iter_captures

    def crash_after_three(
        sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]
    ) -> Iterator[CapturedBatch]:
        for n, batch in enumerate(original(sequences, batches)):
            if n == 3:
                raise RuntimeError("worker lost")
            yield batch

    with monkeypatch.context() as m:
        m.setattr(runner_f32, "iter_captures", crash_after_three)
        with pytest.raises(RuntimeError, match="worker lost"):
            extract_part(make_cfg(crash_dir, tiny_model_dir, **cfg_kwargs), 0, runner_f32)
    assert not PartRef(crash_dir, HIDDEN_DIR, 0).is_done()
    leftovers = data_files(crash_dir)
    assert leftovers and not any(name.endswith(".tmp") for name in leftovers)
    stats = extract_part(make_cfg(crash_dir, tiny_model_dir, **cfg_kwargs), 0, runner_f32)
    assert stats["stale_files_removed"] == len(leftovers)
    assert index_rows(crash_dir) == index_rows(clean_dir)
    for name in data_files(clean_dir):
        assert (crash_dir / HIDDEN_DIR / DATA_DIR / name).read_bytes() == (
            clean_dir / HIDDEN_DIR / DATA_DIR / name
        ).read_bytes()


def test_shards_respect_max_shard_bytes(tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner) -> None:
    lengths = [10, 14, 20, 7, 25, 12, 80, 9]
    samples = sample_ids(lengths, seed=6)
    write_tokens(tmp_path, samples)
    max_bytes = 64 * 1024
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_shard_bytes=max_bytes), 0, runner_f32)
    rows = index_rows(tmp_path)
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_shard.setdefault(row["shard"], []).append(row)
    assert stats["shards"] == len(by_shard) > 2
    assert stats["oversize_shards"] == 1
    assert stats["bytes"] == sum((tmp_path / HIDDEN_DIR / s).stat().st_size for s in by_shard)
    for shard, members in by_shard.items():
        size = (tmp_path / HIDDEN_DIR / shard).stat().st_size
        assert size <= max_bytes or [m["length"] for m in members] == [80]
        offsets = sorted((m["offset"], m["length"]) for m in members)
        assert offsets[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(offsets))
        tensors = load_file(tmp_path / HIDDEN_DIR / shard)
        assert tensors["input_ids"].shape[0] == sum(m["length"] for m in members)
    for row in rows:
        ids, aux, _ = load_hidden_states(tmp_path, row)
        assert ids.tolist() == samples[row["sample_id"]] and aux.shape == (row["length"], 3 * H)


def test_insufficient_space_is_refused_before_writing(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    assert estimate_bytes(10, H, "bfloat16") == 10 * 4 * H * 2
    assert estimate_bytes(10, H, torch.float32) == 10 * 4 * H * 4
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=7))
    passes = runner_f32.forward_passes
    needed = estimate_bytes(sum(LENGTHS), H, "float32")
    with pytest.raises(InsufficientSpaceError, match=f"needs ~{needed} bytes but .* has 1000 bytes free"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32, free_bytes=lambda _p: 1000)
    assert runner_f32.forward_passes == passes
    assert data_files(tmp_path) == []
    stats = extract_part(
        make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32, free_bytes=lambda _p: needed
    )
    assert stats["estimated_bytes"] == needed <= stats["bytes"]


def test_validation_failed_samples_are_skipped(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    samples = sample_ids(LENGTHS, seed=8)
    verdicts = {sid: "pass" for sid in samples} | {"s01": "fail", "s03": "warn"}
    for sub, skip in (("skip", True), ("keep", False)):
        run_dir = tmp_path / sub
        write_tokens(run_dir, samples)
        write_validation(run_dir, verdicts)
        cfg = make_cfg(run_dir, tiny_model_dir, dtype="float32", skip_failed_validation=skip)
        stats = extract_part(cfg, 0, runner_f32)
        kept = [r["sample_id"] for r in index_rows(run_dir)]
        if skip:
            assert stats["skipped_failed_validation"] == 1
            assert kept == [s for s in samples if s != "s01"]
        else:
            assert stats["skipped_failed_validation"] == 0 and kept == list(samples)


def test_empty_part_writes_an_empty_index(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    write_tokens(tmp_path, {})
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert (stats["samples"], stats["shards"], stats["bytes"]) == (0, 0, 0)
    assert index_rows(tmp_path) == [] and data_files(tmp_path) == []


def test_backend_switch_and_runner_config_mismatch(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    with pytest.raises(ConfigError, match=r"sglang==0\.5\.23"):
        make_runner(make_cfg(tmp_path, tiny_model_dir, backend="sglang"))
    write_tokens(tmp_path, sample_ids([4]))
    with pytest.raises(ConfigError, match="dtype"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="bfloat16"), 0, runner_f32)
    with pytest.raises(ConfigError, match="layers"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", layers=[0, 2, 5]), 0, runner_f32)
    with pytest.raises(ConfigError, match="backend"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", backend="sglang"), 0, runner_f32)


def test_plan_batches_packs_by_padded_tokens() -> None:
    lengths = [3, 50, 10, 10, 9, 200, 1]
    batches = plan_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [5] and batches[1] == [1]
    for batch in batches:
        width = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * width <= 40
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
    with pytest.raises(ConfigError, match="max_tokens_per_batch"):
        plan_batches(lengths, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_matches_unbatched_cuda_forward(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The GPU path (side-stream copies into pinned memory, writer thread) stores what a plain unbatched CUDA
    forward computes; a copy racing its kernels would store zeros or another batch's rows."""
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="bfloat16", device="cuda", max_tokens_per_batch=256)
    reference: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.bfloat16, local_files_only=True
    )
    reference = reference.to("cuda").eval()
    samples = sample_ids([300, 17, 5, 33, 9, 24, 1, 128, 64, 90, 90, 200, 7, 45], seed=14)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, device="cuda", max_tokens_per_batch=256, max_shard_bytes=200_000)
    stats = extract_part(cfg, 0, runner)
    assert stats["batches"] > 3 and stats["shards"] > 1
    for row in index_rows(tmp_path):
        ids = samples[row["sample_id"]]
        _, aux, final = load_hidden_states(tmp_path, row)
        hs, pre_norm = pre_norm_forward(reference, torch.tensor([ids], device="cuda"))
        exp_aux = torch.cat([hs[k + 1][0] for k in LAYERS], dim=-1).cpu()
        torch.testing.assert_close(aux, exp_aux, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(final, pre_norm[0].cpu(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_map_over_two_gpus(tmp_path: Path, tiny_model_dir: Path, reference_f32: PreTrainedModel) -> None:
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device_map="balanced", max_tokens_per_batch=64)
    assert runner.input_device != runner.capture_device
    samples = sample_ids(LENGTHS, seed=15)
    write_tokens(tmp_path, samples)
    extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", device_map="balanced"), 0, runner)
    assert_stored_equal_direct(tmp_path, reference_f32, samples, tol=1e-4)
