"""Give the C heap's free pages back to the system while a generate window runs (glibc's `malloc_trim`).

Why: at 10,000 long streams the client's peak RSS grew ~725 MiB over its imports while the Python objects alive
at any moment (tracemalloc, at 2,000 streams: 53 MiB at the peak against 183 MiB of RSS growth) and the cyclic
garbage a finished stream leaves (~650 bytes) were a small part of it. The rest is the allocator's: every socket
read is a 256 KiB buffer shrunk to what arrived, and each stream's text buffer grows by `realloc` between them,
so the heap fills with free holes that glibc only returns when they sit at its top. `malloc_trim(0)` returns the
whole free pages inside the heap too (madvise), whatever their place.

Measured with `bench/stream_throughput.py` (10,000 streams of 2,000-3,000 tokens over 90 s, idle cores): the
project client's peak RSS 1,177 MiB without (457 of it imports), 757 MiB with a trim every second (417 imports);
94 trims took 0.99 s of the 94.5 s window. At the benchmark's default shape (2,000-30,000 tokens over 600 s) the
peak was 976 MiB (412 imports), 599 trims 4.2 s. A call takes ~1-10 ms; it runs in its own thread and ctypes releases
the GIL, so the event loop only waits when it allocates during one.

Not glibc (musl, macOS): `malloc_trim` is missing and this does nothing. Process-wide, like the collector
settings, so overlapping windows in one process share one trimming thread; the last to leave stops it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from tasks.generate.shared_setting import SharedSetting

TRIM_INTERVAL_S = 1.0

_shared = SharedSetting()
_stop: threading.Event | None = None
_thread: threading.Thread | None = None


def _load_malloc_trim() -> Callable[[int], int] | None:
    """From the symbols already loaded into the process (the C library the interpreter runs on): no search for a
    library file, no subprocess at import."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


class TrimStats:
    """Calls made and seconds spent in them, over the process's life (the benchmarks report them)."""

    calls = 0
    seconds = 0.0


def available() -> bool:
    return _malloc_trim is not None


def trim_now() -> bool:
    """One trim: True when pages were given back."""
    if _malloc_trim is None:
        return False
    started = time.perf_counter()
    released = bool(_malloc_trim(0))
    TrimStats.seconds += time.perf_counter() - started
    TrimStats.calls += 1
    return released


def _trim_every(interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        trim_now()


def trimmed_heap(interval_s: float = TRIM_INTERVAL_S) -> AbstractContextManager[None]:
    """A thread trims the heap every `interval_s` until the last overlapping window leaves, and once more then."""
    return _shared.held(lambda: _start(interval_s), _finish)


def _start(interval_s: float) -> None:
    global _stop, _thread
    if _malloc_trim is None:
        return
    _stop = threading.Event()
    _thread = threading.Thread(target=_trim_every, args=(interval_s, _stop), name="heap-trim", daemon=True)
    _thread.start()


def _finish() -> None:
    global _stop, _thread
    if _thread is None or _stop is None:
        return
    _stop.set()
    _thread.join()
    _thread, _stop = None, None
    trim_now()


def trimming() -> bool:
    """Whether a trimming thread is running (for tests)."""
    return _thread is not None and _thread.is_alive()
