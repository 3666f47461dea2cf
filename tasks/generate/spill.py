"""Where generate puts what a failed run-directory disk could not take, and how the next run takes it back.

Why: when the disk holding the run directory fails mid-run (EIO from a dying device, a read-only remount after
file-system errors, a network file system gone stale), the requests in flight are billed whatever happens, and
their answers and spend records exist only in this process. Measured before this existed (3,000 prompts, 200 in
flight, an ext4 file system shut down mid-run): the run ended as an internal error, 209 paid answers were bought
again by the rerun, and 27 billed requests were in no ledger (their `sent` records died in the page cache), so the
run directory counted less than the bill.

So the logs of such a run are written, once the answers in flight are in, to `endpoint.spill_dir` (default: a
folder in the system's temporary directory, another disk than the run directory's on most machines) as ordinary
log segments: the frames since each log's last fsync that succeeded (with a run store, since its last push: the
segments are uploaded too, for a next run on another host), and every record held or queued. A segment
is named after its log with `.spill` added, so it sorts after the log it continues. The next generate run of that
run directory (on this machine, or wherever the folder is copied to) moves them into the run directory before it
reads anything: the ledger then holds every billed request, and the journal's answers go into their parts instead
of being bought again. Records that reached the failed disk as well are read twice, which the ledger and the
journal's merge allow for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tasks.common.config import PipelineConfig
from tasks.common.shards import atomic_write_bytes
from tasks.generate.chunks import JOURNAL_DIR, STAGE
from tasks.generate.journal import AppendLog
from tasks.generate.ledger import LEDGER_DIR

DEFAULT_FOLDER = "eagle3-datagen-spill"
RUN_DIR_NOTE = "run_dir.txt"
SEGMENT_GLOBS = (f"{LEDGER_DIR}/ledger-*.log", f"{STAGE}/{JOURNAL_DIR}/journal-*.log")


def spill_root(setting: Path | None) -> Path:
    """`endpoint.spill_dir`, or the default folder in the system's temporary directory, one per user (another
    user's folder there would refuse this one's spill)."""
    return setting or Path(tempfile.gettempdir()) / f"{DEFAULT_FOLDER}-{os.getuid()}"


def spill_folder(run_dir: Path, root: Path) -> Path:
    """A run directory's folder in a spill root: named by a digest of its absolute path, and naming it."""
    return root / hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def spill_dir(cfg: PipelineConfig) -> Path:
    return spill_folder(cfg.run_dir, spill_root(cfg.endpoint.spill_dir))


def waiting_segments(folder: Path) -> list[Path]:
    """The spilled segments in a run directory's spill `folder` not taken back yet."""
    return [path for pattern in SEGMENT_GLOBS for path in sorted(folder.glob(pattern))] if folder.is_dir() else []


@dataclass
class Spilled:
    folder: Path
    records: int
    error: OSError | None = None
    """Set when the spill directory refused too: the records are lost (their count is `records`)."""


def spill_logs(cfg: PipelineConfig, logs: list[AppendLog]) -> Spilled:
    """Stop every log and write what its disk may not hold to this run directory's spill folder."""
    folder = spill_dir(cfg)
    records = 0
    error: OSError | None = None
    for log in logs:
        target = folder / log.path.relative_to(cfg.run_dir)
        target = target.with_name(f"{target.stem}.spill{target.suffix}")
        try:
            if not (folder / RUN_DIR_NOTE).exists():
                atomic_write_bytes(folder / RUN_DIR_NOTE, f"{os.path.abspath(cfg.run_dir)}\n".encode())
            records += log.spill_to(target)
        except OSError as exc:
            error = error or exc
    return Spilled(folder, records, error)


@dataclass
class TakenBack:
    folder: Path
    segments: int
    bytes: int


def take_back(cfg: PipelineConfig) -> TakenBack | None:
    """Move a failed disk's spilled segments into the run directory (each written whole and fsynced before its
    spill copy is deleted, so a kill in between leaves a copy in both places, which reads the same); None when
    there are none."""
    folder = spill_dir(cfg)
    if not folder.is_dir():
        return None
    segments = waiting_segments(folder)
    moved = 0
    for path in segments:
        data = path.read_bytes()
        atomic_write_bytes(cfg.run_dir / path.relative_to(folder), data)
        path.unlink()
        moved += len(data)
    shutil.rmtree(folder, ignore_errors=True)
    return TakenBack(folder, len(segments), moved) if segments else None
