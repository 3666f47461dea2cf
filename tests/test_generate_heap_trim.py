"""The generate window's heap trimming: free pages inside the C heap go back to the system while the window runs
(sharing between overlapping windows is `SharedSetting`'s, tested in test_generate_shared_setting.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tasks.generate import heap_trim
from tasks.generate.heap_trim import trim_now, trimmed_heap, trimming

pytestmark = pytest.mark.skipif(not heap_trim.available(), reason="needs glibc's malloc_trim")

PAGE = 4096


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def fragmented_heap(mib: int) -> list[bytes]:
    """`mib` MiB of 64 KiB blocks (below glibc's mmap threshold, so on the heap) each followed by a small block
    that stays alive, then the big ones freed: the heap keeps its size, full of free holes glibc does not return
    on its own (only free space at the heap's top is)."""
    keep: list[bytes] = []
    big: list[bytes] = []
    for i in range(mib * 16):
        big.append(bytes(64 * 1024 - 64) + i.to_bytes(4, "little"))
        keep.append(bytes(1024) + i.to_bytes(4, "little"))
    del big
    return keep


def test_a_trim_gives_back_the_free_pages_inside_the_heap() -> None:
    trim_now()
    keep = fragmented_heap(128)
    before = rss_bytes()
    assert trim_now()
    released = before - rss_bytes()
    assert released > 64 * 1024 * 1024, f"a trim gave back {released / 2**20:.1f} MiB of a 128 MiB hole"
    assert len(keep) == 128 * 16


def test_the_window_trims_every_interval_and_stops_when_it_leaves() -> None:
    calls = heap_trim.TrimStats.calls
    keep = fragmented_heap(32)  # the hole exists before the window: its thread must not trim it before `before`
    before = rss_bytes()
    with trimmed_heap(interval_s=0.01):
        assert trimming()
        for _ in range(500):
            if before - rss_bytes() > 16 * 1024 * 1024:
                break
            time.sleep(0.01)
        released = before - rss_bytes()
    assert released > 16 * 1024 * 1024, f"the window's thread gave back {released / 2**20:.1f} MiB of a 32 MiB hole"
    assert not trimming()
    assert heap_trim.TrimStats.calls > calls + 1
    assert len(keep) == 32 * 16
