"""A process-wide setting shared by overlapping windows: applied by the first to enter, undone by the last to leave,
also when a window raises."""

from __future__ import annotations

import threading

import pytest

from tasks.generate.shared_setting import SharedSetting


def test_overlapping_windows_keep_the_setting_until_the_last_leaves() -> None:
    shared = SharedSetting()
    log: list[str] = []
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with shared.held(lambda: log.append("apply"), lambda: log.append("undo")):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with shared.held(lambda: log.append("apply again"), lambda: log.append("undo by the last to leave")):
        second_in.set()
        first_out.wait(10)
        seen_after_first_left = (list(log), shared.holders)
    thread.join(10)
    assert seen_after_first_left == (["apply"], 1)
    assert log == ["apply", "undo by the last to leave"]
    assert shared.holders == 0


def test_an_exception_inside_still_undoes() -> None:
    shared = SharedSetting()
    log: list[str] = []
    with pytest.raises(RuntimeError), shared.held(lambda: log.append("apply"), lambda: log.append("undo")):
        raise RuntimeError("boom")
    assert log == ["apply", "undo"]
    assert shared.holders == 0
