"""One writer per run directory: an OS file lock (`flock`) on <run_dir>/.writer.lock.

Invariant: while one generate run writes a run directory, no other (another process, or another flow run in
the same process) sends a request for it. The lock belongs to the open file description, so the kernel drops
it when its process dies, `kill -9` included: a stale lock cannot block a rerun.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tasks.common.errors import DatagenError

LOCK_NAME = ".writer.lock"
POLL_S = 0.2


class RunDirBusyError(DatagenError):
    """Another generate run is writing this run directory; nothing was sent."""


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return ""
    return text


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the run directory's writer lock; waits up to `wait_s`, then raises `RunDirBusyError`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder(path)
                    raise RunDirBusyError(
                        f"run directory {run_dir} is being written by another generate run"
                        f"{f' ({holder})' if holder else ''}; nothing was sent. Let it finish (or stop it), "
                        "then rerun."
                    ) from None
                time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
