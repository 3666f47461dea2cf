"""The GPU worker's start check on CPU: torch's arch list and device capabilities faked at the boundary
(`torch.cuda.get_arch_list`, `get_device_capability`, plus availability, count and name), the decision real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.common.config import DatasetConfig, EndpointConfig, ExtractConfig, PipelineConfig, TokenizerConfig
from tasks.extract import gpu_check
from tasks.extract.gpu_check import GPUArchMismatchError, check_before_load, check_build, check_devices, kernel_for
from tasks.extract.stage import make_runner

# Arch lists of published torch builds (PyTorch RELEASE.md support matrix, 2.12-2.14, Linux x86).
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128_NO_PTX = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]

DEVICES = {
    "NVIDIA H200": (9, 0),
    "NVIDIA B200": (10, 0),
    "NVIDIA B300": (10, 3),
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": (12, 0),
    "NVIDIA GB10": (12, 1),
}


def fake_gpus(monkeypatch: pytest.MonkeyPatch, arch_list: list[str], *gpus: tuple[str, tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: gpus[i][1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])


@pytest.mark.parametrize(
    ("capability", "native", "ptx"),
    [
        ((9, 0), "sm_90", None),
        ((10, 0), "sm_100", None),
        ((10, 3), "sm_100", None),  # SASS runs on a newer minor of the same major
        ((12, 0), "sm_120", "compute_120"),
        ((12, 1), "sm_120", "compute_120"),
        ((8, 9), "sm_86", None),
        ((13, 0), None, "compute_120"),  # only the PTX can run: the driver JIT-compiles it
        ((7, 0), None, None),  # Volta: dropped from CUDA 13 builds
        ((11, 0), None, None),  # sm_100 SASS never runs on another major, compute_120 PTX not on an older one
    ],
)
def test_cuda_compatibility_rules(capability: tuple[int, int], native: str | None, ptx: str | None) -> None:
    assert kernel_for(CU130, capability) == (native, ptx)


def test_arch_specific_and_family_variants() -> None:
    assert kernel_for(["sm_90a"], (9, 0)) == ("sm_90a", None)
    assert kernel_for(["sm_90a", "compute_90a"], (10, 0)) == (None, None)
    assert kernel_for(["sm_100f"], (10, 3)) == ("sm_100f", None)
    assert kernel_for(["sm_100a"], (10, 3)) == (None, None)
    assert kernel_for(["compute_90"], (12, 0)) == (None, "compute_90")
    assert kernel_for(["gfx942", "gfx90a"], (9, 0)) == (None, None)


def test_every_pinned_target_gets_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU130, *DEVICES.items())
    verdicts = check_devices()
    assert [(v.name, v.native) for v in verdicts] == [
        ("NVIDIA H200", "sm_90"),
        ("NVIDIA B200", "sm_100"),
        ("NVIDIA B300", "sm_100"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "sm_120"),
        ("NVIDIA GB10", "sm_120"),
    ]
    assert verdicts[3].describe() == "cuda:3 NVIDIA RTX PRO 6000 Blackwell Server Edition (sm_120): native sm_120"


def test_hopper_only_build_refuses_blackwell_with_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU126, ("NVIDIA H200", (9, 0)), ("NVIDIA RTX PRO 6000 Blackwell", (12, 0)))
    with pytest.raises(GPUArchMismatchError) as info:
        check_devices()
    message = str(info.value)
    assert "\n" not in message
    assert "cuda:1 NVIDIA RTX PRO 6000 Blackwell (sm_120)" in message and "H200" not in message
    assert "[sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90]" in message and "lists sm_120" in message


def test_ptx_only_device_passes_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU130, ("future GPU", (13, 0)))
    (verdict,) = check_devices()
    assert (verdict.native, verdict.ptx) == (None, "compute_120")
    assert "PTX JIT from compute_120" in verdict.describe()
    fake_gpus(monkeypatch, CU128_NO_PTX, ("future GPU", (13, 0)))
    with pytest.raises(GPUArchMismatchError, match=r"cuda:0 future GPU \(sm_130\)"):
        check_devices()


def test_no_visible_gpu_is_refused_by_the_worker_check(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU130)
    with pytest.raises(GPUArchMismatchError, match="no CUDA device is visible"):
        check_devices()


def test_build_check_needs_no_gpu() -> None:
    assert check_build(["sm_90", "sm_100", "sm_120"], CU130) == CU130
    with pytest.raises(GPUArchMismatchError, match="lacks native kernels for sm_100 sm_120"):
        check_build(["sm_90", "sm_100", "sm_120"], CU126)
    with pytest.raises(GPUArchMismatchError, match="lacks native kernels for sm_130"):
        check_build(["sm_130"], CU130)  # PTX is not enough for a required arch
    with pytest.raises(GPUArchMismatchError, match="form sm_XY"):
        check_build(["compute_90"], CU130)


def test_cli_exit_codes_and_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_gpus(monkeypatch, CU130, ("NVIDIA H200", (9, 0)))
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == "cuda:0 NVIDIA H200 (sm_90): native sm_90"
    assert gpu_check.main(["--require", "sm_90,sm_100,sm_120"]) == 0
    fake_gpus(monkeypatch, CU126, ("NVIDIA B200", (10, 0)))
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "cuda:0 NVIDIA B200 (sm_100)" in err
    assert gpu_check.main(["--require", "sm_90,sm_100,sm_120"]) == 1


def test_check_before_load_only_where_the_model_goes_to_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU126, ("NVIDIA B200", (10, 0)))
    assert check_before_load("cpu", None, "hf") == []
    for device, device_map, backend in [("auto", None, "hf"), ("cuda:0", None, "hf"), ("auto", "auto", "hf")]:
        with pytest.raises(GPUArchMismatchError):
            check_before_load(device, device_map, backend)
    with pytest.raises(GPUArchMismatchError):
        check_before_load("cpu", None, "sglang")
    fake_gpus(monkeypatch, CU126)
    assert check_before_load("cuda", None, "hf") == []  # no CUDA at all: the backend's own message applies


def test_make_runner_refuses_before_loading_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The extraction flow's entry point: the model directory does not even exist, so reaching the loader
    would raise a different error."""
    fake_gpus(monkeypatch, CU126, ("NVIDIA RTX PRO 6000 Blackwell", (12, 0)))
    cfg = PipelineConfig(
        run_dir=tmp_path,
        datasets=[DatasetConfig(name="demo", path=tmp_path / "unused.jsonl")],
        endpoint=EndpointConfig(model="m"),
        tokenizer=TokenizerConfig(path=tmp_path / "no-model"),
        extract=ExtractConfig(device="auto"),
    )
    with pytest.raises(GPUArchMismatchError, match=r"sm_120"):
        make_runner(cfg)


def test_check_passes_then_execs_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, CU130, ("NVIDIA RTX PRO 6000 Blackwell", (12, 0)))
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(gpu_check.os, "execvp", lambda file, args: execs.append((file, list(args))))
    assert gpu_check.main(["--", "prefect", "worker", "start", "--pool", "eagle3-gpu"]) == 0
    assert execs == [("prefect", ["prefect", "worker", "start", "--pool", "eagle3-gpu"])]
    fake_gpus(monkeypatch, CU126, ("NVIDIA RTX PRO 6000 Blackwell", (12, 0)))
    assert gpu_check.main(["--", "prefect", "worker", "start"]) == 1
    assert len(execs) == 1  # refused: the worker never starts


def test_gpu_image_checks_the_build_and_wraps_the_worker_command() -> None:
    """The Dockerfile's build-time arch check and CMD go through this module with the pinned arches."""
    dockerfile = (Path(__file__).resolve().parents[1] / "docker" / "Dockerfile.gpu").read_text()
    assert "ARG REQUIRED_ARCHES=sm_90,sm_100,sm_120" in dockerfile
    assert 'python3 -m tasks.extract.gpu_check --require "${REQUIRED_ARCHES}"' in dockerfile
    cmd = next(line for line in dockerfile.splitlines() if line.startswith("CMD "))
    assert cmd.startswith('CMD ["python3", "-m", "tasks.extract.gpu_check", "--", "prefect", "worker", "start"')


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_this_machines_gpus_get_kernels_from_its_torch() -> None:
    verdicts = check_devices()
    assert len(verdicts) == torch.cuda.device_count() and all(v.ok for v in verdicts)
    assert all(v.capability == torch.cuda.get_device_capability(v.index) for v in verdicts)
