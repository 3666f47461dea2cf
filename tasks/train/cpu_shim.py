"""The smallest change that lets speculators 0.9.0's own `Trainer` run on a machine without an accelerator.

Its `Trainer` assumes CUDA in three places, all of which stay untouched on a GPU:

- `self.local_rank = get_local_rank()` (an int) is the device for `model.to(...)` and every batch's `.to(...)`:
  on CPU the int 0 means `cuda:0`;
- `self.device_type` falls back to `"cuda"` when `torch.accelerator.current_accelerator()` is None, so autocast
  would be requested for a device that does not exist (torch then silently disables it, and bf16 hidden states
  meet fp32 weights);
- its step timer calls `torch.accelerator.synchronize()` on logged steps, which raises without an accelerator;
- on resume its checkpointer loads weights and optimizer state onto `get_current_device()`, which answers
  `"cuda:0"` when there is no accelerator.

`cpu_trainer()` patches exactly these: a `Trainer` subclass whose `local_rank` is `torch.device("cpu")` and whose
`device_type` is `"cpu"` (CPU autocast in the configured hidden-state dtype), installed as the class speculators'
`train.cli.main` instantiates, a no-op `synchronize` and a checkpointer device of `"cpu"`, for the duration of
the call. Two further CPU needs are
plain trainer options, not patches: `draft_attn_impl="sdpa"` (FlexAttention has no CPU backward) and
`loss_implementation="eager"` (the fused loss is a Triton kernel); `TrainOptions.for_device` picks them, and the
autocast dtype (`cpu_train_dtype`: bf16 only on a CPU with bf16 instructions, float32 elsewhere). On such a CPU
the Muon optimizer's orthogonalization also runs in float32 (`newton_schulz_float32`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch


def accelerator_available() -> bool:
    return bool(torch.accelerator.is_available())


BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
"""CPU flags (Linux `/proc/cpuinfo`) of instruction sets that compute bf16 matmuls natively."""


def cpu_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16). Without either, torch's CPU autocast to
    bf16 converts around every matmul: speculators' training step on SmolLM2 took 2.1x as long as in float32 on a
    2-core Ice Lake (3.7 s vs 1.8 s, `bench/real_demo_speed.py`). Unknown (no cpuinfo): no."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(BF16_CPU_FLAGS & set(line.partition(":")[2].split()))
    return False


def cpu_train_dtype() -> str:
    """The trainer's `hidden_states_dtype` (its autocast dtype) on CPU: bf16 where the CPU computes it natively,
    float32 elsewhere. Master weights are float32 either way; the stored states are upcast, not changed."""
    return "bfloat16" if cpu_native_bf16() else "float32"


def newton_schulz_float32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Muon orthogonalization (`torch.optim._muon._zeropower_via_newtonschulz`, the same quintic
    iteration and coefficients) computed in float32 instead of bf16. torch casts to bf16 for GPU speed; a CPU
    without bf16 instructions emulates it, and the optimizer step of speculators' default Muon took ~1.4 s of a
    ~3 s training step on a 2-core Ice Lake, ~3x the float32 time. float32 is also the more exact of the two."""
    if ns_steps >= 100 or grad.dim() != 2 or len(ns_coefficients) != 3:
        raise ValueError(f"Newton-Schulz needs a 2D gradient, 3 coefficients, < 100 steps (got {grad.shape})")
    a, b, c = ns_coefficients
    wide = grad.size(0) > grad.size(1)
    ortho = grad.float().T if wide else grad.float()
    ortho = ortho / ortho.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    return ortho.T if wide else ortho


def _cpu_trainer_class() -> type:
    from speculators.train.trainer import Trainer

    class CpuTrainer(Trainer):
        """speculators' Trainer with the CPU as its device; every method is the trainer's own."""

        @property  # type: ignore[override,unused-ignore]
        def local_rank(self) -> torch.device:
            return torch.device("cpu")

        @local_rank.setter
        def local_rank(self, value: Any) -> None:
            """Trainer.__init__ assigns get_local_rank(); on CPU the device is fixed."""

        @property
        def device_type(self) -> str:
            return "cpu"

        @device_type.setter
        def device_type(self, value: Any) -> None:
            """Trainer.__init__ assigns 'cuda' when no accelerator exists; on CPU autocast targets the CPU."""

    return CpuTrainer


@contextmanager
def cpu_trainer() -> Iterator[None]:
    """While active, `speculators.train.cli.main` trains on the CPU; a no-op where an accelerator exists."""
    if accelerator_available():
        yield
        return
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as train_cli
    import torch.optim._muon as muon

    with (
        mock.patch.object(train_cli, "Trainer", _cpu_trainer_class()),
        mock.patch.object(torch.accelerator, "synchronize", lambda *args, **kwargs: None),
        mock.patch.object(checkpointer, "get_current_device", lambda: "cpu"),
        mock.patch.object(
            muon,
            "_zeropower_via_newtonschulz",
            muon._zeropower_via_newtonschulz if cpu_native_bf16() else newton_schulz_float32,
        ),
    ):
        yield
