"""The SGLang names `tasks/extract/sglang_engine.py` calls exist, with those parameters, in the pinned wheel.

SGLang cannot run on these CPU machines (CUDA kernels), so this reads the source of `sglang==0.5.23` (fetched
with `pip download --no-deps`, never imported) and checks every class, function, keyword argument, attribute
and `ServerArgs` field the engine relies on, plus the "+1" in `set_eagle3_layers_to_capture` that the layer
convention depends on. It proves the call sites match the pinned API; it does not prove the forward pass runs.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

from tasks.extract.sglang_contract import SGLANG_VERSION, SGLangEngineSpec

pytestmark = [pytest.mark.slow, pytest.mark.interop]

CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", Path.home() / ".cache" / "eagle3-datagen"))


@cache
def wheel() -> zipfile.ZipFile:
    target = CACHE / f"sglang-{SGLANG_VERSION}"
    found = sorted(target.glob("sglang-*.whl")) if target.is_dir() else []
    if not found:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                f"sglang=={SGLANG_VERSION}",
                "-d",
                str(target),
            ],
            check=True,
        )
        found = sorted(target.glob("sglang-*.whl"))
    return zipfile.ZipFile(found[0])


def source(path: str) -> str:
    return wheel().read(f"sglang/{path}").decode()


def tree(path: str) -> ast.Module:
    return ast.parse(source(path))


def top_level(path: str, name: str) -> ast.AST:
    for node in tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise AssertionError(f"{name} not defined at top level of sglang/{path}")


def method(path: str, cls: str, name: str) -> ast.FunctionDef:
    node = top_level(path, cls)
    assert isinstance(node, ast.ClassDef)
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            return item
    raise AssertionError(f"{cls}.{name} not in sglang/{path}")


def params(fn: ast.AST) -> set[str]:
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def class_fields(path: str, cls: str) -> set[str]:
    node = top_level(path, cls)
    assert isinstance(node, ast.ClassDef)
    return {
        item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def test_one_batch_harness() -> None:
    path = "benchmark/one_batch.py"
    assert params(top_level(path, "load_model")) == {"server_args", "port_args", "gpu_id", "tp_rank"}
    assert {"batch", "model_runner"} <= params(top_level(path, "_maybe_prepare_mlp_sync_batch"))
    top_level(path, "_init_process_global_configs")
    top_level(path, "TreeCacheNamespace")
    assert "self.torch_runner = model_runner" in source(path)


def test_requests_batches_and_forward() -> None:
    assert {"rid", "origin_input_text", "origin_input_ids", "sampling_params", "return_hidden_states"} <= params(
        method("srt/managers/schedule_batch.py", "Req", "__init__")
    )
    init_new = method("srt/managers/schedule_batch.py", "ScheduleBatch", "init_new")
    assert {
        "reqs",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "model_config",
        "enable_overlap",
        "spec_algorithm",
    } <= params(init_new)
    method("srt/managers/schedule_batch.py", "ScheduleBatch", "prepare_for_extend")
    assert "extend_lens" in class_fields("srt/managers/schedule_batch.py", "ScheduleBatch")
    forward_init = method("srt/model_executor/forward_batch_info.py", "ForwardBatch", "init_new")
    assert {"capture_hidden_mode", "return_hidden_states_before_norm"} <= {a.arg for a in forward_init.args.kwonlyargs}
    assert "FULL" in class_fields("srt/model_executor/forward_batch_info.py", "CaptureHiddenMode") | {
        t.id
        for n in ast.walk(top_level("srt/model_executor/forward_batch_info.py", "CaptureHiddenMode"))
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert {"hidden_states", "last_hidden_states"} <= class_fields(
        "srt/layers/logits_processor.py", "LogitsProcessorOutput"
    )
    assert "logits_output" in class_fields("srt/model_executor/model_runner.py", "ModelRunnerOutput")
    method("srt/model_executor/model_runner.py", "ModelRunner", "forward")
    assert "self.max_total_num_tokens" in source("srt/model_executor/model_runner.py")


def test_process_setup() -> None:
    assert {"role", "ranks"} <= params(top_level("srt/runtime_context.py", "publish"))
    assert {"tp_rank", "pp_rank"} <= params(top_level("srt/runtime_context.py", "spawn_world_rank"))
    assert {"world_rank", "gpu_id"} <= class_fields("srt/runtime_context.py", "SpawnRanks")
    top_level("srt/runtime_context.py", "get_schedule")
    top_level("srt/entrypoints/engine.py", "_set_envs_and_config")
    method("srt/server_args.py", "ServerArgs", "resolve_once")
    method("srt/server_args.py", "PortArgs", "init_new")
    top_level("srt/utils/common.py", "configure_logger")
    assert "from sglang.srt.utils.common import *" in source("srt/utils/__init__.py")


def test_server_args_fields_exist() -> None:
    fields: set[str] = set()
    for name in wheel().namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for node in ast.walk(ast.parse(wheel().read(name))):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    fields.add(node.target.id)
    kwargs = SGLangEngineSpec(model_path="/m", layers=(1, 3, 4)).server_kwargs()
    assert set(kwargs) - fields == set()
    assert "EAGLE3" in source("srt/arg_groups/validation_hook.py")


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("llama.py", "[val + 1 for val in layer_ids]"),
        ("deepseek_v2.py", "[val + 1 for val in layer_ids]"),
        ("qwen3_moe.py", "[val + 1 for val in layer_ids]"),
        ("kimi_k25.py", "self.language_model.set_eagle3_layers_to_capture(layer_ids)"),
    ],
)
def test_eagle3_capture_adds_one(model: str, expected: str) -> None:
    """Kimi-K2.5 hands the ids to its DeepSeek-V3 language model, which adds the 1."""
    assert expected in ast.unparse(method(f"srt/models/{model}", *_capture_owner(model)))


def _capture_owner(model: str) -> tuple[str, str]:
    for node in tree(f"srt/models/{model}").body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(i, ast.FunctionDef) and i.name == "set_eagle3_layers_to_capture" for i in node.body
        ):
            return node.name, "set_eagle3_layers_to_capture"
    raise AssertionError(f"no set_eagle3_layers_to_capture in {model}")


@pytest.mark.parametrize("model", ["llama.py", "deepseek_v2.py", "qwen2_moe.py"])
def test_final_norm_is_a_module_called_on_the_residual_stream(model: str) -> None:
    """`FinalNormCapture` hooks `<decoder>.norm`: the decoder owns an RMSNorm `norm` and hands it to
    `residual_batch.final_norm`, which calls it as `norm(hidden_states)` or `norm(hidden_states, residual)` ->
    (normed, updated residual) through `nn.Module.__call__`, so hooks fire. (Qwen3-MoE's decoder is
    Qwen2-MoE's.)"""
    assert "from sglang.srt.models.qwen2_moe import Qwen2MoeModel" in source("srt/models/qwen3_moe.py")
    text = source(f"srt/models/{model}")
    assert "self.norm = RMSNorm(" in text
    assert "residual_batch.final_norm(" in text and "self.norm" in text
    pair = ast.unparse(top_level("srt/layers/layer_boundary/residual/access.py", "final_norm_pair"))
    assert "return norm(hidden_states)" in pair
    assert "hidden_states, residual = norm(hidden_states, residual, **read_kwargs)" in pair
    assert "class BaseFusedOp(nn.Module, ABC)" in wheel().read("sglang/kernels/fused_op.py").decode()


def test_sglang_returns_no_pre_norm_state_beside_the_aux_states() -> None:
    """Why the engine hooks the norm: `last_hidden_states` is the normed `hidden_states`, and a
    `hidden_states_before_norm` (only some models pass one) replaces the packed aux states in `hidden_states`."""
    store = ast.unparse(method("srt/layers/logits_processor.py", "LogitsProcessor", "_get_hidden_states_to_store"))
    assert "hidden_states_to_store = hidden_states_to_store_before_norm" in store
    last = ast.unparse(method("srt/layers/logits_processor.py", "LogitsProcessor", "_get_last_hidden_states_to_store"))
    assert "return hidden_states" in last
    for model in ("llama.py", "deepseek_v2.py", "qwen3_moe.py", "kimi_k25.py"):
        assert "hidden_states_before_norm" not in source(f"srt/models/{model}")
