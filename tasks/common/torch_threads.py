"""A scoped intra-op thread count for torch, for loops that step a tiny model one token at a time.

Such loops are dispatch-bound: extra intra-op threads only contend (one thread decodes ~10x faster than two on a
loaded 2-core machine), so the acceptance walk and the model-backed simulator pin the count while they run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
