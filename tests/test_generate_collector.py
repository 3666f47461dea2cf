"""The generate window's collector settings: applied once for overlapping windows, restored by the last to leave."""

from __future__ import annotations

import gc
import threading

from tasks.generate import collector
from tasks.generate.collector import tuned_collector


def test_thresholds_raised_inside_and_restored_after() -> None:
    before = gc.get_threshold()
    with tuned_collector():
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, collector.MIDDLE_THRESHOLD, collector.OLD_THRESHOLD)
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_overlapping_windows_keep_the_settings_until_the_last_leaves() -> None:
    before = gc.get_threshold()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, tuple[int, int, int]] = {}

    def first() -> None:
        with tuned_collector():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with tuned_collector():
        second_in.set()
        first_out.wait(10)
        seen["after_first_left"] = gc.get_threshold()
    thread.join(10)
    assert seen["after_first_left"][0] == collector.YOUNG_THRESHOLD
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_an_exception_inside_still_restores() -> None:
    before = gc.get_threshold()
    try:
        with tuned_collector():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before
