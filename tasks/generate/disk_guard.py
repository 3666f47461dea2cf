"""What generate does when the run directory's disk fills: stop buying, and keep every answer already paid for.

Why: the requests in flight when the disk fills are billed whatever happens to the process. Raised where the
write failed, the error cancelled them all: with 200 in flight the simulator billed 200 cut answers that no run
kept, and the rerun bought them again (2,000 answers of 8,000 tokens at $2.50 per million are $40 per fill; the
disk a GPU worker's hidden states fill is the run directory's). So a full disk stops new requests at once, releases a
file of space claimed when the run started (`endpoint.disk_reserve_mib`), lets the answers in flight arrive, and
journals them into that space; the run then stops with one line (exit 2), and a rerun after space is freed sends
only what was never answered.

The reserve is a real allocation (`posix_fallocate`): on a file system that does not reserve blocks for it
(copy-on-write or compressing ones, such as ZFS) it still guards against running out, but not reliably.

A disk that fails instead (EIO from a dying device, a read-only remount after file-system errors, a network file
system gone stale) stops new requests the same way, for the same reason: an answer bought then has nowhere to go.
The answers in flight are still awaited, and what the run directory could not take is written to the spill
directory on another disk (`tasks.generate.spill`), which the next run takes back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tasks.common.config import PipelineConfig
from tasks.common.errors import DiskFullError

RESERVE_NAME = ".generate-disk-reserve"
MIB = 1024**2
AUTO_MIN_MIB = 16
AUTO_MAX_MIB = 256
AUTO_TOKENS = 8192
BYTES_PER_TOKEN = 8
"""What one completion token takes in a journaled row: ~6 bytes without ids (measured: 1,087 bytes for a row of
180 tokens), ~13 with them (their JSON). Sized for answers of `AUTO_TOKENS` at most: a larger reserve would refuse
runs on disks a small one serves, and answers the reserve cannot hold are kept in memory until there is room."""
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FAILED_DISK_ERRNOS = (errno.EIO, errno.EROFS, errno.ESTALE, errno.ENXIO, errno.ENODEV, errno.EREMOTEIO)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def reserve_bytes(cfg: PipelineConfig) -> int:
    """`endpoint.disk_reserve_mib`, or by default room for every request in flight to journal a long answer,
    bounded to 16-256 MiB."""
    ep = cfg.endpoint
    if ep.disk_reserve_mib is not None:
        return int(ep.disk_reserve_mib * MIB)
    tokens = min(cfg.sampling.max_tokens, AUTO_TOKENS)
    auto = ep.max_in_flight * tokens * BYTES_PER_TOKEN
    return min(max(auto, AUTO_MIN_MIB * MIB), AUTO_MAX_MIB * MIB)


class DiskGuard:
    """One generate run's reserve, and whether its disk has stopped taking writes (filled, or failed).
    Thread-safe: the journal's and the spend ledger's writer threads report a failed write as well as the event
    loop's commits."""

    def __init__(self, run_dir: Path, size_bytes: int) -> None:
        self.path = run_dir / RESERVE_NAME
        self.size_bytes = size_bytes
        self.error: OSError | None = None
        self.in_flight: Callable[[], int] = lambda: 0
        """How many requests are in flight now (the engine's window); read once, when the disk stops."""
        self.in_flight_at_stop = 0
        self._lock = threading.Lock()
        self._held = False

    @property
    def stopped(self) -> bool:
        """A write to the run directory failed: nothing more is sent."""
        return self.error is not None

    @property
    def cause(self) -> Literal["full", "failed"] | None:
        """`full`: there will be room once space is freed (the logs hold their records until then); `failed`:
        the disk itself refuses (its records go to the spill directory)."""
        if self.error is None:
            return None
        return "full" if is_disk_full(self.error) else "failed"

    def claim(self) -> None:
        """Allocate the reserve before anything is sent. Raises `DiskFullError` when the disk lacks even that:
        a run on a full disk then buys nothing."""
        if self.size_bytes <= 0:
            self.path.unlink(missing_ok=True)  # a killed run's
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)  # a killed run's is taken over
        try:
            if os.fstat(fd).st_size > self.size_bytes:
                os.ftruncate(fd, self.size_bytes)
            os.posix_fallocate(fd, 0, self.size_bytes)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if not is_disk_full(exc):
                raise
            free = shutil.disk_usage(self.path.parent).free
            raise DiskFullError(
                f"the disk holding {self.path.parent} has {free / MIB:.1f} MiB free, less than the "
                f"{self.size_bytes / MIB:g} MiB generate reserves for journaling the answers in flight should the "
                "disk fill (endpoint.disk_reserve_mib): free space, choose a run_dir on a larger disk, or lower "
                "endpoint.disk_reserve_mib; nothing was sent"
            ) from exc
        os.close(fd)
        self._held = True

    def what_failed(self, run_dir: Path) -> str:
        """The subject of the failed-disk line: the disk for the errnos a failing disk gives, else the write (the
        run stops the same way whatever the errno: an answer bought then could not be kept)."""
        if self.error is not None and self.error.errno in FAILED_DISK_ERRNOS:
            return f"the disk holding {run_dir} failed"
        return f"a write to {run_dir} failed"

    def write_failed(self, exc: OSError) -> bool:
        """Report a write to the run directory that failed: from now on nothing is sent, and the reserve is freed
        for the answers in flight. Always True: whatever the errno, an answer bought now could not be kept, and the
        writer keeps its records (for the room a full disk regains, or the spill directory)."""
        with self._lock:
            if self.error is None:
                self.error = exc
                self.in_flight_at_stop = self.in_flight()
            elif is_disk_full(self.error) and not is_disk_full(exc):
                self.error = exc  # a disk that filled and then failed: freeing space no longer helps
            self._free()
        return True

    def close(self) -> None:
        with self._lock:
            self._free()

    def _free(self) -> None:
        if self._held:
            self._held = False
            with contextlib.suppress(OSError):  # a failed disk: the reserve goes with it
                self.path.unlink(missing_ok=True)
