"""The SGLang backend without SGLang: everything around the engine call, against fakes that follow SGLang
0.5.23's shapes and conventions with the tiny transformers model underneath.

The fake model follows what SGLang does (read from its 0.5.23 source, `models/llama.py`,
`layers/logits_processor.py`): `set_eagle3_layers_to_capture(ids)` stores `ids + 1` in `layers_to_capture`; a
layer in that list records the residual stream *entering* it (= HF `output_hidden_states[i]`); the packed aux
states are [T_total, 3H] in request order; `last_hidden_states` is the post-norm state of every token, which
this project does not store: the engine hooks the decoder's `norm` for its input (`FinalNormCapture`). If the
runner's translation of layer ids were off by one, the stored states would not equal the direct computation.
`tests/test_extract_sglang_api.py` (slow) checks the names this code calls against the real 0.5.23 wheel.
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.common.errors import CaptureMismatchError, ConfigError
from tasks.common.shards import PartRef
from tasks.extract import sglang_engine
from tasks.extract.layers import default_aux_layers
from tasks.extract.sglang_backend import SGLangHiddenStateRunner
from tasks.extract.sglang_contract import ExtendOutput, SGLangEngineSpec, sglang_capture_ids
from tasks.extract.stage import extract_part
from tasks.extract.storage import HIDDEN_DIR, load_hidden_states
from tests.test_extract import (
    LAYERS,
    LENGTHS,
    direct_states,
    index_rows,
    make_cfg,
    pre_norm_forward,
    sample_ids,
    write_tokens,
)


class FakeSGLangModel:
    """SGLang's capture semantics over a transformers model; `cached_prefix` emulates a prefix-cache hit."""

    def __init__(self, model: PreTrainedModel, *, plus_one: bool = True) -> None:
        self.hf = model
        self.model = types.SimpleNamespace(layers_to_capture=[], norm=model.get_decoder().norm)
        self.plus_one = plus_one
        self.capture_aux_hidden_states = False
        self.cached_prefix: dict[tuple[int, ...], int] = {}

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None) -> None:
        n = self.hf.config.num_hidden_layers
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            self.model.layers_to_capture = [2, n // 2, n - 3]
        else:
            self.model.layers_to_capture = [k + 1 if self.plus_one else k for k in layer_ids]

    def run(self, sequences: Sequence[Sequence[int]]) -> ExtendOutput:
        """Aux states and the final norm's input (what `FinalNormCapture` keeps on the real engine)."""
        aux, final, lens = [], [], []
        for seq in sequences:
            hs, pre_norm = pre_norm_forward(self.hf, torch.tensor([list(seq)]))
            skip = self.cached_prefix.get(tuple(seq), 0)
            aux.append(torch.cat([hs[i][0] for i in self.model.layers_to_capture], dim=-1)[skip:])
            final.append(pre_norm[0][skip:])
            lens.append(len(seq) - skip)
        return ExtendOutput(torch.cat(aux), torch.cat(final), lens)


class FakeEngine:
    """An `SGLangEngine` the way `InProcessSGLangEngine` builds one: from `SGLangEngineSpec.server_kwargs()`."""

    def __init__(
        self, model: FakeSGLangModel, spec: SGLangEngineSpec, *, max_tokens: int = 4096, max_requests: int = 64
    ):
        kwargs = spec.server_kwargs()
        assert kwargs["disable_radix_cache"] is True and kwargs["enable_return_aux_hidden_states"] is True
        model.set_eagle3_layers_to_capture(kwargs["return_aux_hidden_state_layer_ids"])
        self.fake = model
        self.num_layers = model.hf.config.num_hidden_layers
        self.hidden_size = model.hf.config.hidden_size
        self.max_batch_tokens = max_tokens
        self.max_batch_requests = max_requests
        self.batches: list[int] = []

    def captured_layer_ids(self) -> list[int]:
        return list(self.fake.model.layers_to_capture)

    def extend(self, sequences: Sequence[Sequence[int]]) -> ExtendOutput:
        self.batches.append(len(sequences))
        return self.fake.run(sequences)

    def close(self) -> None:
        self.batches.clear()


@pytest.fixture(scope="module")
def hf_f32(tiny_model_dir: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def make_runner(
    hf: PreTrainedModel, model_dir: Path, *, plus_one: bool = True, dtype: str = "float32", **engine: Any
) -> tuple[SGLangHiddenStateRunner, FakeEngine, FakeSGLangModel]:
    fake = FakeSGLangModel(hf, plus_one=plus_one)
    spec = SGLangEngineSpec(model_path=str(model_dir), layers=tuple(LAYERS), dtype=dtype)
    eng = FakeEngine(fake, spec, **engine)
    runner = SGLangHiddenStateRunner(eng, model_path=model_dir, layers=LAYERS, dtype=dtype, max_tokens_per_batch=48)
    return runner, eng, fake


def test_layer_ids_translate_by_one() -> None:
    for n in (8, 32, 61):
        ours = default_aux_layers(n)
        assert sglang_capture_ids(ours) == [2, n // 2, n - 3]
    assert sglang_capture_ids([1, 29, 57]) == [2, 30, 58]


def test_server_kwargs_turn_prefix_caching_off_and_capture_eagle3_layers() -> None:
    kwargs = SGLangEngineSpec(model_path="/m", layers=(1, 29, 57), tp_size=8, max_tokens_per_batch=4096).server_kwargs()
    assert kwargs["disable_radix_cache"] is True and kwargs["chunked_prefill_size"] == -1
    assert kwargs["enable_return_aux_hidden_states"] is True and kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["return_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert (kwargs["tp_size"], kwargs["max_prefill_tokens"], kwargs["model_path"]) == (8, 4096, "/m")


def test_stage_over_fake_engine_stores_our_layer_convention(
    tmp_path: Path, tiny_model_dir: Path, hf_f32: PreTrainedModel
) -> None:
    runner, eng, _ = make_runner(hf_f32, tiny_model_dir)
    samples = sample_ids(LENGTHS, seed=21)
    write_tokens(tmp_path, samples)
    stats = extract_part(
        make_cfg(tmp_path, tiny_model_dir, backend="sglang", dtype="float32", max_tokens_per_batch=48), 0, runner
    )
    assert stats["padding_waste_frac"] == 0.0 and stats["batches"] == len(eng.batches) > 1
    for row in index_rows(tmp_path):
        ids, aux, final = load_hidden_states(tmp_path, row)
        exp_aux, exp_final = direct_states(hf_f32, samples[row["sample_id"]])
        assert ids.tolist() == samples[row["sample_id"]]
        torch.testing.assert_close(aux, exp_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, exp_final, rtol=1e-5, atol=1e-5)
    assert runner.provenance()["extract_sglang_capture_ids"] == [2, 4, 5]


def test_a_changed_capture_convention_is_refused(tiny_model_dir: Path, hf_f32: PreTrainedModel) -> None:
    with pytest.raises(ConfigError, match=r"inputs of layers \[1, 3, 4\], expected \[2, 4, 5\]"):
        make_runner(hf_f32, tiny_model_dir, plus_one=False)


def test_prefix_cache_hit_is_caught_naming_the_sample(
    tmp_path: Path, tiny_model_dir: Path, hf_f32: PreTrainedModel
) -> None:
    runner, _, fake = make_runner(hf_f32, tiny_model_dir)
    samples = sample_ids(LENGTHS, seed=22)
    fake.cached_prefix[tuple(samples["s02"])] = 4
    write_tokens(tmp_path, samples)
    with pytest.raises(CaptureMismatchError, match="length vs len") as err:
        extract_part(make_cfg(tmp_path, tiny_model_dir, backend="sglang", dtype="float32"), 0, runner)
    assert (err.value.sample_id, err.value.expected, err.value.actual) == ("s02", 33, 29)
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done()


def test_engine_dtype_other_than_configured_is_refused(
    tmp_path: Path, tiny_model_dir: Path, hf_f32: PreTrainedModel
) -> None:
    runner, _, _ = make_runner(hf_f32, tiny_model_dir, dtype="bfloat16")
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=23))
    with pytest.raises(CaptureMismatchError, match="dtype"):
        extract_part(make_cfg(tmp_path, tiny_model_dir, backend="sglang"), 0, runner)


def test_batches_respect_engine_limits(tiny_model_dir: Path, hf_f32: PreTrainedModel) -> None:
    runner, _, _ = make_runner(hf_f32, tiny_model_dir, max_tokens=40, max_requests=2)
    batches = runner.plan_batches([30, 5, 5, 5, 20, 40])
    assert all(len(b) <= 2 for b in batches)
    assert all(sum([30, 5, 5, 5, 20, 40][i] for i in b) <= 40 for b in batches)
    with pytest.raises(ConfigError, match="sample 1 of the part has 41 tokens"):
        runner.plan_batches([3, 41])


def test_aux_only_runs_drop_the_final_state(tmp_path: Path, tiny_model_dir: Path, hf_f32: PreTrainedModel) -> None:
    fake = FakeSGLangModel(hf_f32)
    eng = FakeEngine(fake, SGLangEngineSpec(model_path=str(tiny_model_dir), layers=tuple(LAYERS), dtype="float32"))
    runner = SGLangHiddenStateRunner(
        eng, model_path=tiny_model_dir, layers=LAYERS, dtype="float32", max_tokens_per_batch=64, store_final_state=False
    )
    samples = sample_ids(LENGTHS, seed=24)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, backend="sglang", dtype="float32", store_final_state=False)
    extract_part(cfg, 0, runner)
    for row in index_rows(tmp_path):
        _, aux, final = load_hidden_states(tmp_path, row)
        assert final is None
        torch.testing.assert_close(aux, direct_states(hf_f32, samples[row["sample_id"]])[0], rtol=1e-5, atol=1e-5)


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class FakeReq:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.origin_input_ids = kwargs["origin_input_ids"]


class FakeScheduleBatch:
    """`ScheduleBatch.init_new(...)` + `prepare_for_extend()`: extend lengths from each request's fill range."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.reqs: list[FakeReq] = kwargs["reqs"]
        self.input_ids: Any = None
        self.prefill_input_ids_cpu: Any = None
        self.device = "cpu"
        self.extend_lens: list[int] = []

    @classmethod
    def init_new(cls, **kwargs: Any) -> FakeScheduleBatch:
        return cls(**kwargs)

    def prepare_for_extend(self) -> None:
        self.extend_lens = [r.extend_end for r in self.reqs]
        self.prefill_input_ids_cpu = torch.tensor([t for r in self.reqs for t in r.full_untruncated_fill_ids])


class FakePool:
    def __init__(self) -> None:
        self.cleared = 0
        self.size = 16

    def clear(self) -> None:
        self.cleared += 1


class FakeModelRunner:
    """The `ModelRunner` attributes `_extend` and `InProcessSGLangEngine` read, with the fake model inside."""

    def __init__(self, fake: FakeSGLangModel) -> None:
        self.model = fake
        self.device = "cpu"
        self.req_to_token_pool = FakePool()
        self.token_to_kv_pool_allocator = FakePool()
        config = fake.hf.config
        self.model_config = types.SimpleNamespace(
            hf_text_config=types.SimpleNamespace(num_hidden_layers=config.num_hidden_layers),
            hidden_size=config.hidden_size,
        )
        self.max_total_num_tokens = 4096
        self.forward_calls: list[dict[str, Any]] = []

    def forward(self, forward_batch: types.SimpleNamespace) -> types.SimpleNamespace:
        self.forward_calls.append(dict(forward_batch.kwargs))
        assert forward_batch.kwargs["capture_hidden_mode"] == CaptureHiddenMode.FULL
        seqs = [list(r.origin_input_ids) for r in forward_batch.batch.reqs]
        assert forward_batch.batch.input_ids.tolist() == [t for s in seqs for t in s]
        out = self.model.run(seqs)
        lengths = forward_batch.batch.extend_lens
        assert lengths == [len(s) for s in seqs]
        assert out.final is not None
        with torch.no_grad():  # SGLang's last_hidden_states: post-norm (`forward` bypasses the engine's hooks)
            post_norm = self.model.model.norm.forward(out.final)
        return types.SimpleNamespace(
            logits_output=types.SimpleNamespace(hidden_states=out.aux, last_hidden_states=post_norm)
        )


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, hf_f32: PreTrainedModel) -> dict[str, Any]:
    """sglang 0.5.23's modules as `sglang_engine` imports them, holding fakes; records what was called."""
    calls: dict[str, Any] = {"server_kwargs": None, "resolved": False, "published": [], "mlp_sync": 0}
    runner = FakeModelRunner(FakeSGLangModel(hf_f32))
    calls["runner"] = runner

    class ServerArgs:
        def __init__(self, **kwargs: Any) -> None:
            calls["server_kwargs"] = kwargs
            self.kwargs = kwargs

        def resolve_once(self) -> None:
            calls["resolved"] = True
            runner.model.set_eagle3_layers_to_capture(self.kwargs["return_aux_hidden_state_layer_ids"])

    def load_model(server_args: Any, port_args: Any, gpu_id: int, tp_rank: int) -> tuple[Any, None]:
        calls["load"] = (gpu_id, tp_rank)
        return types.SimpleNamespace(torch_runner=runner), None

    def init_new_forward_batch(batch: FakeScheduleBatch, model_runner: Any, **kwargs: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(batch=batch, kwargs=kwargs)

    modules = {
        "sglang": {},
        "sglang.benchmark": {},
        "sglang.benchmark.one_batch": {
            "TreeCacheNamespace": types.SimpleNamespace,
            "_maybe_prepare_mlp_sync_batch": lambda batch, mr: calls.__setitem__("mlp_sync", calls["mlp_sync"] + 1),
            "load_model": load_model,
            "_init_process_global_configs": lambda: None,
        },
        "sglang.srt": {},
        "sglang.srt.managers": {},
        "sglang.srt.managers.schedule_batch": {"Req": FakeReq, "ScheduleBatch": FakeScheduleBatch},
        "sglang.srt.model_executor": {},
        "sglang.srt.model_executor.forward_batch_info": {
            "CaptureHiddenMode": CaptureHiddenMode,
            "ForwardBatch": types.SimpleNamespace(init_new=init_new_forward_batch),
        },
        "sglang.srt.runtime_context": {
            "get_schedule": lambda: types.SimpleNamespace(page_size=1),
            "publish": lambda server_args, role, ranks: calls["published"].append((role, ranks)),
            "SpawnRanks": types.SimpleNamespace,
            "spawn_world_rank": lambda server_args, tp_rank, pp_rank: tp_rank,
        },
        "sglang.srt.sampling": {},
        "sglang.srt.sampling.sampling_params": {"SamplingParams": lambda **kw: kw},
        "sglang.srt.speculative": {},
        "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": types.SimpleNamespace(NONE="none")},
        "sglang.srt.server_args": {
            "ServerArgs": ServerArgs,
            "PortArgs": types.SimpleNamespace(init_new=lambda server_args: "ports"),
        },
        "sglang.srt.entrypoints": {},
        "sglang.srt.entrypoints.engine": {"_set_envs_and_config": lambda server_args: None},
        "sglang.srt.utils": {"configure_logger": lambda server_args, prefix: None},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    for name in modules:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    monkeypatch.setattr(sglang_engine, "require_sglang", lambda: None)
    return calls


def test_build_requests_prepare_one_full_extend() -> None:
    reqs = sglang_engine.build_requests([[5, 6, 7], [8]], FakeReq, {"max_new_tokens": 1})
    assert [r.kwargs["rid"] for r in reqs] == ["0", "1"]
    assert all(r.kwargs["return_hidden_states"] is True for r in reqs)
    assert [(list(r.full_untruncated_fill_ids), r.extend_end, r.logprob_start_len) for r in reqs] == [
        ([5, 6, 7], 3, -1),
        ([8], 1, -1),
    ]
    assert reqs[0].origin_input_ids.typecode == "q"


def test_in_process_engine_over_fake_sglang_modules(
    tmp_path: Path, tiny_model_dir: Path, hf_f32: PreTrainedModel, fake_sglang: dict[str, Any]
) -> None:
    spec = SGLangEngineSpec(model_path=str(tiny_model_dir), layers=tuple(LAYERS), dtype="float32")
    engine = sglang_engine.InProcessSGLangEngine(spec)
    assert fake_sglang["resolved"] and fake_sglang["server_kwargs"] == spec.server_kwargs()
    assert fake_sglang["load"] == (0, 0) and fake_sglang["published"][0][0] == "scheduler"
    assert (engine.num_layers, engine.hidden_size, engine.max_batch_requests) == (8, 64, 16)
    runner = SGLangHiddenStateRunner(
        engine, model_path=tiny_model_dir, layers=LAYERS, dtype="float32", max_tokens_per_batch=40
    )
    samples = sample_ids(LENGTHS, seed=25)
    write_tokens(tmp_path, samples)
    stats = extract_part(make_cfg(tmp_path, tiny_model_dir, backend="sglang", dtype="float32"), 0, runner)
    mr: FakeModelRunner = fake_sglang["runner"]
    assert len(mr.forward_calls) == stats["batches"] == fake_sglang["mlp_sync"] > 1
    assert mr.forward_calls[0] == {
        "capture_hidden_mode": CaptureHiddenMode.FULL,
        "return_hidden_states_before_norm": False,
    }
    assert mr.req_to_token_pool.cleared == mr.token_to_kv_pool_allocator.cleared == stats["batches"]
    for row in index_rows(tmp_path):
        _, aux, final = load_hidden_states(tmp_path, row)
        exp_aux, exp_final = direct_states(hf_f32, samples[row["sample_id"]])
        torch.testing.assert_close(aux, exp_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, exp_final, rtol=1e-5, atol=1e-5)
    engine.close()


def test_missing_aux_or_final_states_are_clear_errors_and_pools_are_cleared(
    tiny_model_dir: Path, fake_sglang: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No aux states from SGLang, or a pass in which the final norm never ran (its hook saw nothing)."""
    mr: FakeModelRunner = fake_sglang["runner"]
    for aux in (None, torch.zeros(3, 192)):
        monkeypatch.setattr(
            mr,
            "forward",
            lambda fb, aux=aux: types.SimpleNamespace(
                logits_output=types.SimpleNamespace(hidden_states=aux, last_hidden_states=torch.zeros(3, 64))
            ),
        )
        capture = sglang_engine.FinalNormCapture(FusedAddRMSNorm(64))
        with pytest.raises(ConfigError, match="no aux hidden states" if aux is None else "hook did not fire"):
            sglang_engine._extend(mr, [[1, 2, 3]], capture)
    assert mr.req_to_token_pool.cleared == mr.token_to_kv_pool_allocator.cleared == 2


class FusedAddRMSNorm(torch.nn.Module):
    """SGLang 0.5.23's RMSNorm call forms: `norm(x)` -> normed; `norm(x, residual)` -> (normed, x + residual),
    with x and residual overwritten in place as the fused CUDA kernel does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, width))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        residual.add_(x)
        x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight)
        return x, residual


def test_final_norm_capture_keeps_the_norm_input_in_both_call_forms() -> None:
    norm = FusedAddRMSNorm(8)
    capture = sglang_engine.FinalNormCapture(norm)
    x, residual = torch.randn(5, 8), torch.randn(5, 8)
    expected = x + residual
    with torch.no_grad():
        normed, updated = norm(x.clone(), residual.clone())
        plain = torch.randn(3, 8)
        norm(plain)
    captured = capture.take()
    assert torch.equal(captured, torch.cat([expected, plain]))
    updated.zero_()  # SGLang reuses the residual's storage: the capture must own its rows
    assert torch.equal(captured[:5], expected)
    assert not torch.allclose(normed, expected)
    with pytest.raises(ConfigError, match="hook did not fire"):
        capture.take()
    capture.remove()
    norm(torch.randn(2, 8))
    with pytest.raises(ConfigError, match="hook did not fire"):
        capture.take()


def test_engine_without_a_final_norm_is_refused(fake_sglang: dict[str, Any], tiny_model_dir: Path) -> None:
    del fake_sglang["runner"].model.model.norm
    spec = SGLangEngineSpec(model_path=str(tiny_model_dir), layers=tuple(LAYERS), dtype="float32")
    with pytest.raises(ConfigError, match="no final `norm` module"):
        sglang_engine.InProcessSGLangEngine(spec)


def test_layers_to_capture_is_found_on_text_and_multimodal_models() -> None:
    text = types.SimpleNamespace(model=types.SimpleNamespace(layers_to_capture=[2, 4, 5]))
    vlm = types.SimpleNamespace(
        language_model=types.SimpleNamespace(model=types.SimpleNamespace(layers_to_capture=[3, 6, 9]))
    )
    assert sglang_engine._layers_to_capture(text) == [2, 4, 5]
    assert sglang_engine._layers_to_capture(vlm) == [3, 6, 9]
    with pytest.raises(ConfigError, match="no layers_to_capture"):
        sglang_engine._layers_to_capture(types.SimpleNamespace())


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


@pytest.mark.skipif(_sglang_installed(), reason="sglang is installed in this environment")
def test_without_sglang_installed_the_backend_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"sglang==0\.5\.23"):
        sglang_engine.require_sglang()
