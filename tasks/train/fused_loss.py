"""speculators 0.9.0's fused Triton loss, compiled, on a GPU: the one change it needs to train at all.

`speculators.losses.fused` builds one `triton.autotune(configs=..., key=..., prune_configs_by=...)` decorator and
applies it to both of its kernels, so the forward and the backward autotuner hold the very same `configs` and
`key` lists. The trainer compiles the drafter's forward, which computes the loss through an autograd Function whose
backward launches the second kernel; Dynamo traces both and meets one list under two sources. Every training step
then stops with `AssertionError: ListVariable(length=21) is already tracked for mutation ... Source of new object:
...loss_backward_kernel.configs ... previously tracked object: ...loss_forward_kernel.configs` (seen on an H200,
torch 2.11.0+cu130, triton from the same image, with `loss_implementation: fused`, speculators' own default and
ours on a GPU; `bench/gpu_extract.sh` runs `tests/test_train.py` there).

`fused_loss_compilable()` gives the backward autotuner its own copies of every list and dict it shares with the
forward one, for the duration of the training call: the same configurations, the same keys, separate objects.
Nothing changes where the kernels share nothing (a fixed speculators) or where Triton is absent (CPU training
uses the eager loss).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any
from unittest import mock


def _fused_module() -> ModuleType | None:
    try:
        from speculators.losses import fused
    except ImportError:  # no Triton (a CPU build of torch): the eager loss is used there
        return None
    return fused


def shared_containers(first: Any, second: Any) -> list[str]:
    """Names of the list/dict attributes `second` holds as the very objects `first` holds."""
    mine = vars(first)
    return sorted(
        name
        for name, value in vars(second).items()
        if isinstance(value, list | dict) and name in mine and mine[name] is value
    )


@contextmanager
def fused_loss_compilable(fused: ModuleType | None = None) -> Iterator[list[str]]:
    """While active, the fused loss's two autotuners share no mutable container; yields the names unshared."""
    module = fused if fused is not None else _fused_module()
    forward = getattr(module, "loss_forward_kernel", None)
    backward = getattr(module, "loss_backward_kernel", None)
    if forward is None or backward is None:
        yield []
        return
    names = shared_containers(forward, backward)
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(backward, name, copy.copy(getattr(backward, name))))
        yield names
