"""A process-wide setting that overlapping windows share: the first to enter applies it, the last to leave undoes
it. Why: the generate window's memory settings (`collector`, `heap_trim`) belong to the process, and Prefect's
thread runner can run two generate windows in one process; the first to leave must not undo them for the other."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class SharedSetting:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    @contextlib.contextmanager
    def held(self, apply: Callable[[], None], undo: Callable[[], None]) -> Iterator[None]:
        """`apply` when no window holds the setting yet, `undo` when the last one leaves (both under the lock)."""
        with self._lock:
            if self._holders == 0:
                apply()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    undo()

    @property
    def holders(self) -> int:
        return self._holders
