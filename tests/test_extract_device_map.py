"""A target split by accelerate's `device_map` captures exactly what the unsplit model captures.

No second GPU here, so the split is the one a CPU allows: the first half of the decoder layers on "cpu", the
second half and the final norm offloaded to "disk" (accelerate keeps their parameters on `meta` and loads them
for each forward, as it does for "cpu" entries next to GPUs when a model is larger than them). That exercises
what multi-GPU placement changes for the hooks: the layers are wrapped by accelerate's hooks, and where the
norm computes cannot be read from its parameters.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.common.config import DatasetConfig, EndpointConfig, ExtractConfig, PipelineConfig, TokenizerConfig
from tasks.common.schemas import TOKENS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part
from tasks.extract.storage import load_hidden_states

SEQUENCES = [[random.Random(i).randrange(2, 1000) for _ in range(n)] for i, n in enumerate([13, 5, 29, 1, 8, 21])]


def load_f32(model_dir: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True
    )
    return model


def split_device_map(num_layers: int) -> dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "cpu"}
    for k in range(num_layers):
        device_map[f"model.layers.{k}"] = "cpu" if k < num_layers // 2 else "disk"
    return device_map


@pytest.fixture(scope="module")
def unsplit(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner(load_f32(tiny_model_dir), model_path=tiny_model_dir, max_tokens_per_batch=64)


@pytest.fixture(scope="module")
def split(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> HFHiddenStateRunner:
    model = load_f32(tiny_model_dir)
    device_map = split_device_map(model.config.num_hidden_layers)
    offload = tmp_path_factory.mktemp("offload")
    dispatched = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(offload))
    return HFHiddenStateRunner(dispatched, model_path=tiny_model_dir, max_tokens_per_batch=64, device_map="split")


def test_split_model_really_is_offloaded_and_hooked_by_name(split: HFHiddenStateRunner) -> None:
    model = split._model
    last = split.layers[-1]
    assert last >= split.num_layers // 2  # the high aux layer sits in the offloaded half
    assert model.get_submodule(f"model.layers.{last}.mlp.up_proj").weight.device.type == "meta"
    assert model.get_submodule("model.norm").weight.device.type == "meta"
    # where the norm computes comes from accelerate's hook, not from its (meta) parameters
    assert split.capture_device == split.input_device == torch.device("cpu")
    for k in split.layers:
        module = model.get_submodule(f"model.layers.{k}")
        assert hasattr(module, "_hf_hook") and len(module._forward_hooks) == 1
    hooked = {name for name, m in model.named_modules() if m._forward_hooks}
    assert {f"model.layers.{k}" for k in split.layers} <= hooked


def test_split_model_captures_equal_the_unsplit_models(
    unsplit: HFHiddenStateRunner, split: HFHiddenStateRunner
) -> None:
    lengths = [len(s) for s in SEQUENCES]
    batches = split.plan_batches(lengths)
    assert batches == unsplit.plan_batches(lengths) and max(len(b) for b in batches) > 1  # padded batches
    for want, got in zip(
        unsplit.iter_captures(SEQUENCES, batches), split.iter_captures(SEQUENCES, batches), strict=True
    ):
        assert got.aux.device == torch.device("cpu") and got.row_counts == want.row_counts
        torch.testing.assert_close(got.aux, want.aux, rtol=0, atol=0)
        assert got.final is not None and want.final is not None
        torch.testing.assert_close(got.final, want.final, rtol=0, atol=0)


def test_stage_writes_the_same_states_from_a_split_model(
    tmp_path: Path, tiny_model_dir: Path, unsplit: HFHiddenStateRunner, split: HFHiddenStateRunner
) -> None:
    loaded = {}
    for name, runner in (("unsplit", unsplit), ("split", split)):
        run_dir = tmp_path / name
        n = len(SEQUENCES)
        table = pa.table(
            {
                "sample_id": [f"s{i}" for i in range(n)],
                "dataset": ["demo"] * n,
                "input_ids": SEQUENCES,
                "loss_mask": [[1] * len(s) for s in SEQUENCES],
                "prompt_len": [0] * n,
                "completion_len": [len(s) for s in SEQUENCES],
                "reasoning_len": [0] * n,
                "completion_format": ["test"] * n,
                "token_source": ["reencoded"] * n,
            },
            schema=TOKENS,
        )
        write_part(PartRef(run_dir, "tokens", 0), table, {"test": True})
        cfg = PipelineConfig(
            run_dir=run_dir,
            datasets=[DatasetConfig(name="demo", path=run_dir / "unused.jsonl")],
            endpoint=EndpointConfig(model="tiny"),
            tokenizer=TokenizerConfig(path=tiny_model_dir),
            extract=ExtractConfig(dtype="float32", device="cpu", max_tokens_per_batch=64),
        )
        stats = extract_part(cfg, 0, runner)
        assert stats["samples"] == n
        index = read_part(PartRef(run_dir, "hidden_states", 0)).to_pylist()
        loaded[name] = {row["sample_id"]: load_hidden_states(run_dir, row) for row in index}
    assert loaded["split"].keys() == loaded["unsplit"].keys()
    for sample_id, want in loaded["unsplit"].items():
        got = loaded["split"][sample_id]
        for got_tensor, want_tensor in zip(got, want, strict=True):
            assert got_tensor is not None and want_tensor is not None
            assert torch.equal(got_tensor, want_tensor), sample_id


def test_load_with_device_map_auto(tiny_model_dir: Path, unsplit: HFHiddenStateRunner) -> None:
    """The config path (`extract.device_map: auto`): accelerate places the model on what this machine has."""
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device_map="auto", max_tokens_per_batch=64)
    assert runner.provenance()["extract_device_map"] == "auto"
    got = runner.run_batch(SEQUENCES[:3], [0, 1, 2])
    want = unsplit.run_batch(SEQUENCES[:3], [0, 1, 2])
    assert torch.equal(got.aux.cpu(), want.aux) and got.final is not None and want.final is not None
    assert torch.equal(got.final.cpu(), want.final)


def test_execution_device_from_accelerate_hooks_on_gpus() -> None:
    """On GPUs accelerate names execution devices by index, and stacks hooks in a SequentialHook."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    from tasks.extract.devices import module_device

    norm = torch.nn.LayerNorm(4, device="meta")
    norm._hf_hook = AlignDevicesHook(execution_device=1, offload=True)  # type: ignore[assignment]
    assert module_device(norm, torch.device("cpu")) == torch.device("cuda", 1)
    norm._hf_hook = SequentialHook(AlignDevicesHook(execution_device="cuda:2"))  # type: ignore[assignment]
    assert module_device(norm, torch.device("cpu")) == torch.device("cuda", 2)
    del norm._hf_hook
    assert module_device(norm, torch.device("cpu")) == torch.device("cpu")  # meta parameters never count


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_gpu_plus_cpu_offload_matches_the_model_on_the_gpu(tiny_model_dir: Path) -> None:
    """What `device_map: auto` does with a target larger than the GPU: the rest stays in host memory and is
    streamed to the GPU per forward (parameters on meta, execution on cuda:0)."""
    on_gpu = HFHiddenStateRunner(load_f32(tiny_model_dir).to("cuda"), model_path=tiny_model_dir)
    model = load_f32(tiny_model_dir)
    device_map = {k: (0 if v == "cpu" else "cpu") for k, v in split_device_map(model.config.num_hidden_layers).items()}
    device_map["model.embed_tokens"] = 0
    split = HFHiddenStateRunner(dispatch_model(model, device_map=device_map, main_device=0), model_path=tiny_model_dir)
    assert split.capture_device == torch.device("cuda", 0)
    want = on_gpu.run_batch(SEQUENCES, list(range(len(SEQUENCES))))
    got = split.run_batch(SEQUENCES, list(range(len(SEQUENCES))))
    torch.testing.assert_close(got.aux, want.aux)
    assert got.final is not None and want.final is not None
    torch.testing.assert_close(got.final, want.final)


def test_unpadded_batch_runs_without_a_mask_and_captures_the_same(unsplit: HFHiddenStateRunner) -> None:
    """pad_batch passes no mask when nothing is padded (no host wait on the mask's values); the states are
    those of each sequence alone."""
    same = [SEQUENCES[0], SEQUENCES[0][::-1], [7] * len(SEQUENCES[0])]
    assert unsplit.pad_batch(same)[1] is None
    ids, mask = unsplit.pad_batch(SEQUENCES[:2])
    assert mask is not None and mask.sum().item() == len(SEQUENCES[0]) + len(SEQUENCES[1]) and ids.shape == mask.shape
    batched = unsplit.run_batch(same, [0, 1, 2])
    width = len(SEQUENCES[0])
    for i, seq in enumerate(same):
        alone = unsplit.run_batch([seq], [0])
        torch.testing.assert_close(batched.aux[i * width : (i + 1) * width], alone.aux)
        assert batched.final is not None and alone.final is not None
        torch.testing.assert_close(batched.final[i * width : (i + 1) * width], alone.final)
