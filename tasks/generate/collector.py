"""The cyclic garbage collector's settings while a generate window runs.

Two costs, both measured with bench/client_throughput.py and bench/stream_throughput.py:

- the import heap (torch, transformers: ~230k objects) re-scanned by every full collection took 50-60% of the
  client's CPU at 2,000 short requests in flight. It is frozen (`gc.freeze`) for the window: objects created
  during the run are collected as usual. Only the young generations are collected before freezing: a full
  collection of that heap costs 0.2-0.5 s, and old garbage frozen with it is only held until the window ends.
- at 10,000 long streams the live per-stream state (connections, tasks, buffers) is millions of objects that
  CPython's default thresholds (700, 10, 10) promote to the old generation and rescan: ~20 full collections of
  0.5-0.6 s each in a 90-second window, pauses during which no stream is read, so streams fell behind the server
  (798 of 10,000 by more than 1 s). A young threshold of 50,000 lets the per-event objects die before a
  collection sees them (22 young collections of ~20 ms instead of ~2,700 of ~1 ms, 0.5 s in all instead of
  2.4 s); a young threshold of 10,000 still ran two full collections and left 138 streams behind.

The old generation is still collected: `OLD_THRESHOLD` middle collections (each after `MIDDLE_THRESHOLD` young
ones), and CPython's own rule that a full collection waits until a quarter of the old generation is new. Waiting
costs little memory: a finished stream leaves ~650 bytes of cyclic garbage (its closed transport, socket and their
bound method and dict; measured with `DEBUG_SAVEALL` after 300 streams with collection off). The client's RSS
growth at 10,000 streams is the C heap's fragmentation, which `tasks.generate.heap_trim` gives back.

The settings are process-wide, so concurrent windows in one process (Prefect's thread runner) share them: the
first to enter applies them, the last to leave restores what was there before.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager

from tasks.generate.shared_setting import SharedSetting

YOUNG_THRESHOLD = 50_000
MIDDLE_THRESHOLD = 20
OLD_THRESHOLD = 10

_shared = SharedSetting()
_previous: tuple[int, int, int] | None = None


def _apply() -> None:
    global _previous
    _previous = gc.get_threshold()
    gc.collect(1)
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)


def _undo() -> None:
    if _previous is not None:
        gc.set_threshold(*_previous)
    gc.unfreeze()


def tuned_collector() -> AbstractContextManager[None]:
    """Freeze the heap allocated so far and raise the collection thresholds until the last window leaves."""
    return _shared.held(_apply, _undo)
