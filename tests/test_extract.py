"""The extract stage against a real tiny Llama: stored states must equal a plain transformers forward pass."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.config import DatasetConfig, EndpointConfig, ExtractConfig, PipelineConfig, TokenizerConfig
from tasks.errors import CaptureMismatchError, ConfigError, InsufficientSpaceError
from tasks.extract.hf_backend import CapturedStates, HFHiddenStateRunner, plan_batches
from tasks.extract.layers import LayerSelectionError, default_aux_layers, validate_layers
from tasks.extract.stage import extract_part, make_runner
from tasks.extract.storage import HIDDEN_DIR, estimate_bytes, load_hidden_states
from tasks.schemas import TOKENS, VALIDATION
from tasks.shards import PartRef, read_part, read_provenance, write_part

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


def sample_ids(lengths: Sequence[int], seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{i:02d}": [rng.randrange(2, 128_000) for _ in range(n)] for i, n in enumerate(lengths)}


def write_tokens(run_dir: Path, samples: dict[str, list[int]], part: int = 0) -> None:
    n = len(samples)
    table = pa.table(
        {
            "sample_id": list(samples),
            "dataset": ["demo"] * n,
            "input_ids": list(samples.values()),
            "loss_mask": [[1] * len(ids) for ids in samples.values()],
            "prompt_len": [0] * n,
            "completion_len": [len(ids) for ids in samples.values()],
            "reasoning_len": [0] * n,
            "completion_format": ["test"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run_dir, "tokens", part), table, {"test": True})


def write_validation(run_dir: Path, verdicts: dict[str, str], part: int = 0) -> None:
    n = len(verdicts)
    nulls: list[Any] = [None] * n
    table = pa.table(
        {
            "sample_id": list(verdicts),
            "dataset": ["demo"] * n,
            "verdict": list(verdicts.values()),
            "reference_match": ["no_reference"] * n,
            "first_divergence": nulls,
            "divergence_ours": nulls,
            "divergence_reference": nulls,
            "structural_issues": [[] for _ in range(n)],
            "finish_reason": ["stop"] * n,
            "provider": nulls,
            "billed_completion_tokens": nulls,
            "our_completion_tokens": [0] * n,
            "billing_delta_tokens": nulls,
            "billing_delta_frac": nulls,
        },
        schema=VALIDATION,
    )
    write_part(PartRef(run_dir, "validation", part), table, {"test": True})


def index_rows(run_dir: Path, part: int = 0) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = read_part(PartRef(run_dir, HIDDEN_DIR, part)).to_pylist()
    return rows


@pytest.fixture(scope="module")
def runner_f32(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner(tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=1)


@pytest.fixture(scope="module")
def runner_bf16(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner(tiny_model_dir, dtype="bfloat16", device="cpu", max_tokens_per_batch=96)


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


def direct_states(model: PreTrainedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's inputs computed the plain way: one unpadded sample, all hidden states requested."""
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[k + 1][0] for k in LAYERS], dim=-1), hs[-1][0]


def poison(
    runner: HFHiddenStateRunner,
    monkeypatch: pytest.MonkeyPatch,
    target: list[int],
    edit: Callable[[CapturedStates], CapturedStates],
) -> None:
    original = runner.run_batch

    def run_batch(sequences: Sequence[Sequence[int]]) -> list[CapturedStates]:
        states = original(sequences)
        return [edit(s) if list(seq) == target else s for seq, s in zip(sequences, states, strict=True)]

    monkeypatch.setattr(runner, "run_batch", run_batch)


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


def test_float32_unbatched_is_bit_exact(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, reference_f32: PreTrainedModel
) -> None:
    samples = sample_ids(LENGTHS)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=1)
    stats = extract_part(cfg, 0, runner_f32)
    assert stats["samples"] == len(LENGTHS) and stats["tokens"] == sum(LENGTHS)
    assert stats["batches"] == len(LENGTHS) and stats["padding_waste_frac"] == 0.0
    rows = index_rows(tmp_path)
    assert [r["sample_id"] for r in rows] == list(samples)
    for row in rows:
        assert (row["layers"], row["hidden_size"], row["dtype"]) == (LAYERS, H, "float32")
        ids, aux, final = load_hidden_states(tmp_path, row)
        expected = samples[row["sample_id"]]
        assert ids.dtype == torch.int32 and ids.tolist() == expected
        assert aux.shape == (len(expected), 3 * H) and final.shape == (len(expected), H)
        exp_aux, exp_final = direct_states(reference_f32, expected)
        assert torch.equal(aux, exp_aux)
        assert torch.equal(final, exp_final)
    prov = read_provenance(PartRef(tmp_path, HIDDEN_DIR, 0).path)
    assert prov["model"] == "tiny" and prov["extract_layers"] == LAYERS
    assert prov["extract_dtype"] == "float32" and prov["extract_backend"] == "hf"
    assert prov["extract_model_path"] == str(tiny_model_dir)


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
    for row in index_rows(tmp_path):
        _, aux, final = load_hidden_states(tmp_path, row)
        exp_aux, exp_final = direct_states(reference_f32, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, exp_final, rtol=1e-5, atol=1e-5)


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
        assert aux.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
        exp_aux, exp_final = direct_states(reference_bf16, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(final, exp_final, rtol=2e-2, atol=2e-2)


def test_nan_capture_is_refused_naming_the_sample(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids(LENGTHS, seed=3)
    write_tokens(tmp_path, samples)

    def add_nan(s: CapturedStates) -> CapturedStates:
        aux = s.aux.clone()
        aux[2, 7] = float("nan")
        return CapturedStates(aux=aux, final=s.final)

    poison(runner_f32, monkeypatch, samples["s04"], add_nan)
    with pytest.raises(CaptureMismatchError, match="NaN/Inf") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert err.value.sample_id == "s04"
    assert "first at token 2" in str(err.value)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()


def test_length_mismatch_is_refused(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids(LENGTHS, seed=4)
    write_tokens(tmp_path, samples)
    poison(runner_f32, monkeypatch, samples["s02"], lambda s: CapturedStates(aux=s.aux[:-1], final=s.final[:-1]))
    with pytest.raises(CaptureMismatchError, match="length") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32)
    assert (err.value.sample_id, err.value.expected, err.value.actual) == ("s02", 33, 32)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()


def test_rerun_of_done_part_does_no_forward_pass(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=5))
    data_dir = tmp_path / HIDDEN_DIR / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "part-00000-0007.safetensors").write_bytes(b"stale")
    (data_dir / ".part-00000-0000.safetensors.abc.tmp").write_bytes(b"stale")
    (data_dir / "part-00001-0000.safetensors").write_bytes(b"other part")
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    first = extract_part(cfg, 0, runner_f32)
    assert first["stale_files_removed"] == 2
    assert sorted(p.name for p in data_dir.iterdir()) == [
        "part-00000-0000.safetensors",
        "part-00001-0000.safetensors",
    ]
    passes = runner_f32.forward_passes

    def refuse(sequences: Sequence[Sequence[int]]) -> list[CapturedStates]:
        raise AssertionError("a done part must not run the model")

    monkeypatch.setattr(runner_f32, "run_batch", refuse)
    assert extract_part(cfg, 0, runner_f32) == first
    assert runner_f32.forward_passes == passes


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
    with pytest.raises(InsufficientSpaceError, match=f"needs ~{estimate_bytes(sum(LENGTHS), H, 'float32')} bytes"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32"), 0, runner_f32, free_bytes=lambda _p: 1000)
    assert runner_f32.forward_passes == passes
    assert not any((tmp_path / HIDDEN_DIR / "data").iterdir())


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


def test_backend_switch_and_runner_config_mismatch(
    tmp_path: Path, tiny_model_dir: Path, runner_f32: HFHiddenStateRunner
) -> None:
    with pytest.raises(ConfigError, match="sglang"):
        make_runner(make_cfg(tmp_path, tiny_model_dir, backend="sglang"))
    write_tokens(tmp_path, sample_ids([4]))
    with pytest.raises(ConfigError, match="dtype"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="bfloat16"), 0, runner_f32)
    with pytest.raises(ConfigError, match="layers"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, dtype="float32", layers=[0, 2, 5]), 0, runner_f32)


def test_plan_batches_packs_by_padded_tokens() -> None:
    lengths = [3, 50, 10, 10, 9, 200, 1]
    batches = plan_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [5] and batches[1] == [1]
    for batch in batches:
        width = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * width <= 40
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
