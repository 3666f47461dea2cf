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
`loss_implementation="eager"` (the fused loss is a Triton kernel); `TrainOptions.for_device` picks them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch


def accelerator_available() -> bool:
    return bool(torch.accelerator.is_available())


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

    with (
        mock.patch.object(train_cli, "Trainer", _cpu_trainer_class()),
        mock.patch.object(torch.accelerator, "synchronize", lambda *args, **kwargs: None),
        mock.patch.object(checkpointer, "get_current_device", lambda: "cpu"),
    ):
        yield
