"""The training step's autocast dtype on CPU: bf16 only where the CPU has bf16 instructions (see `cpu_shim`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.train import TrainOptions
from tasks.train.cpu_shim import accelerator_available, cpu_native_bf16, cpu_train_dtype

ICE_LAKE = "flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512vl\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"


@pytest.mark.parametrize(("text", "native"), [(ICE_LAKE, False), (SAPPHIRE_RAPIDS, True), (ZEN4, True), ("", False)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, text: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert cpu_native_bf16(cpuinfo) is native


def test_no_cpuinfo_means_no_native_bf16(tmp_path: Path) -> None:
    assert cpu_native_bf16(tmp_path / "missing") is False


@pytest.mark.skipif(accelerator_available(), reason="the CPU choice applies without an accelerator")
def test_cpu_training_takes_this_machines_dtype_unless_told() -> None:
    assert TrainOptions().for_device().hidden_states_dtype == cpu_train_dtype()
    assert cpu_train_dtype() == ("bfloat16" if cpu_native_bf16() else "float32")
    assert TrainOptions(hidden_states_dtype="bfloat16").for_device().hidden_states_dtype == "bfloat16"


def test_the_dtype_reaches_speculators_config(tmp_path: Path) -> None:
    pytest.importorskip("speculators")
    from tasks.train.stage import build_train_config

    args = {"target_layer_ids": [2, 3, 4], "train_data_ratio": 0.9}
    for dtype in ("float32", "bfloat16"):
        opts = TrainOptions(hidden_states_dtype=dtype, draft_attn_impl="sdpa", loss_implementation="eager")
        cfg = build_train_config(tmp_path / "data", tmp_path / "ckpt", tmp_path / "verifier", args, opts)
        assert cfg.data.hidden_states_dtype == dtype


def test_float32_newton_schulz_is_torchs_iteration_without_the_bf16_rounding() -> None:
    import torch
    import torch.optim._muon as muon

    from tasks.train.cpu_shim import newton_schulz_float32

    coefficients = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    generator = torch.Generator().manual_seed(0)
    for shape in ((96, 40), (40, 96)):
        grad = torch.randn(*shape, generator=generator)
        ours = newton_schulz_float32(grad, coefficients, 5, muon.EPS)
        theirs = muon._zeropower_via_newtonschulz(grad, coefficients, 5, muon.EPS).float()
        assert ours.dtype == torch.float32 and ours.shape == grad.shape
        assert float((ours - theirs).norm() / theirs.norm()) < 0.03  # bf16 rounding apart
        fewer = newton_schulz_float32(grad, coefficients, 2, muon.EPS)
        assert float((fewer - theirs).norm() / theirs.norm()) > 0.1  # another iteration is told apart


@pytest.mark.skipif(accelerator_available(), reason="the CPU trainer patches apply without an accelerator")
def test_the_cpu_trainer_runs_muon_in_float32_only_without_bf16_instructions() -> None:
    pytest.importorskip("speculators")
    import torch.optim._muon as muon

    from tasks.train.cpu_shim import cpu_trainer, newton_schulz_float32

    torchs = muon._zeropower_via_newtonschulz
    with cpu_trainer():
        inside = muon._zeropower_via_newtonschulz
    assert inside is (torchs if cpu_native_bf16() else newton_schulz_float32)
    assert muon._zeropower_via_newtonschulz is torchs
