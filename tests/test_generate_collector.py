"""The generate window's collector settings: applied inside, restored after (sharing between overlapping windows
is `SharedSetting`'s, tested in test_generate_shared_setting.py)."""

from __future__ import annotations

import gc

import pytest

from tasks.generate import collector
from tasks.generate.collector import tuned_collector


def test_thresholds_raised_inside_and_restored_after() -> None:
    before = gc.get_threshold()
    with tuned_collector():
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, collector.MIDDLE_THRESHOLD, collector.OLD_THRESHOLD)
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_nested_windows_restore_only_when_the_outer_leaves() -> None:
    before = gc.get_threshold()
    with tuned_collector():
        with tuned_collector():
            pass
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_an_exception_inside_still_restores() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), tuned_collector():
        raise RuntimeError("boom")
    assert gc.get_threshold() == before
