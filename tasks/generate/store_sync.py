"""The generate stage's append-only logs (spend-ledger segments, answer journals) mirrored to the run store while they
grow, so a host that dies loses at most one commit interval of paid answers and of spend records, and its spend
counts against the cap on whichever host runs next.

Invariants:
- A push happens at every commit of the engine and every `every_s` (endpoint.commit_every_s) between commits, on
  a thread of its own, one at a time. It uploads only what each log gained since the last push, cut at its last
  whole frame, as one piece (`RunStore.put_piece`): an interval costs the bytes it added, never the log's size.
  The store's copy of a log is therefore always a prefix of it that reads back whole.
- Before a run, every host's logs are pulled: ledger segments, so every attempt any host made counts against the
  cap here; journals, so a dead host's answers go into their parts (the engine's journal recovery) instead of
  being bought again. A local copy is only ever replaced by a longer copy of the same log.
- A journal leaves the store only after its rows are in finished parts this host pushed, and this host never pulls
  again a journal it already held (`HELD`): the engine deletes a journal once its rows are in chunks or parts,
  and chunks stay local. Ledger segments stay in the store forever; the writer joins its pieces into one object
  when it closes a segment.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.common.artifact_store import RemoteLog, RunStore
from tasks.common.shards import fsync_dir, shared_file_mode
from tasks.generate.chunks import CHUNKS_DIR, JOURNAL_DIR, STAGE
from tasks.generate.journal import AppendLog, whole_frames_length
from tasks.generate.ledger import LEDGER_DIR
from tasks.generate.spill import waiting_segments

LEDGERS = (LEDGER_DIR, "ledger-*.log")
JOURNALS = (f"{STAGE}/{JOURNAL_DIR}", "journal-*.log")
HELD = ".store-journals-held"  # in the run directory: store journals this host has had locally

log = logging.getLogger(__name__)


@dataclass
class PushStats:
    """What mirroring cost this process: pushes that uploaded something, pieces, bytes, and wall time."""

    pushes: int = 0
    pieces: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LogMirror:
    """One run directory's logs and their copy in a RunStore; `committed` and `closed` are the engine's hooks."""

    def __init__(self, store: RunStore, every_s: float) -> None:
        self.store = store
        self.run_dir = store.local_run_dir
        self.every_s = every_s
        self.stats = PushStats()
        self._stored: dict[tuple[str, str], int] = {}  # (folder, name) -> bytes the store holds
        self._mine: dict[tuple[str, str], list[tuple[int, int]]] = {}  # pieces this process uploaded
        self._live: dict[str, AppendLog] = {}  # by file name: this run's open logs
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pull(self, with_journals: bool = True) -> dict[str, int]:
        """Every host's ledger segments and journals this host lacks (or holds shorter), before a run; with
        `with_journals=False` the ledger alone (what a host that only reconstructs needs of it: the send times)."""
        held = self._held()
        pulled = {"ledgers": 0, "journals": 0}
        logs = ((LEDGERS, "ledgers"), (JOURNALS, "journals")) if with_journals else ((LEDGERS, "ledgers"),)
        for (folder, pattern), kind in logs:
            for name, remote in sorted(self.store.list_logs(folder, pattern).items()):
                self._stored[(folder, name)] = remote.size
                local = self.run_dir / folder / name
                if not local.exists() and kind == "journals" and name in held:
                    continue  # replayed into this host's chunks or parts already
                if (local.stat().st_size if local.exists() else -1) >= remote.size:
                    continue
                self._download(folder, name, remote, local)
                pulled[kind] += 1
        journals = self.run_dir / JOURNALS[0]
        self._hold([name for folder, name in self._stored if folder == JOURNALS[0] and (journals / name).exists()])
        return pulled

    def _download(self, folder: str, name: str, remote: RemoteLog, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{name}.", suffix=".tmp")
        try:
            os.fchmod(fd, shared_file_mode())
            with os.fdopen(fd, "wb") as fh:
                self.store.read_log(folder, name, remote, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, local)
            fsync_dir(local.parent)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def start(self) -> None:
        """Push every `every_s` from now on (spend records accrue between commits: requests still in flight)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="store-log-mirror", daemon=True)
            self._thread.start()

    def attach(self, logs: list[AppendLog]) -> None:
        """Logs to tell when a push has put their bytes in the store (`AppendLog.acknowledge`)."""
        with self._lock:
            self._live = {log.path.name: log for log in logs}

    def committed(self) -> None:
        """The engine committed: push soon, off the event loop (a push under way is followed by one more)."""
        self._wake.set()

    def push(self) -> None:
        """Upload what every log here gained since the last push, now (the pusher thread does this)."""
        with self._lock:
            self._push_locked()

    def closed(self) -> None:
        """The engine closed its journal and ledger segment: push what is left, then join each ledger segment's
        pieces into one object. Blocks; raises if the store cannot be written (the journal then stays local)."""
        with self._lock:
            self._push_locked()
            for (folder, name), pieces in self._mine.items():
                path = self.run_dir / folder / name
                try:
                    whole = path.stat().st_size == self._stored[(folder, name)]
                except OSError:  # a failed disk: the pieces stay pieces, which read the same
                    continue
                if folder == LEDGERS[0] and len(pieces) > 1 and whole:
                    self.store.put_whole(folder, name, path, pieces)
                    pieces.clear()

    def spilled(self, folder: Path) -> None:
        """The engine wrote a failed disk's records to the spill `folder` (`tasks.generate.spill`): upload each
        segment as a log of its own, so the next run pulls it into its run directory on whichever host it runs."""
        with self._lock:
            for path in waiting_segments(folder):
                remote, data = path.parent.relative_to(folder).as_posix(), path.read_bytes()
                self.store.put_piece(remote, path.name, 0, data)
                self._stored[(remote, path.name)] = len(data)
                self._mine.setdefault((remote, path.name), []).append((0, len(data)))

    def close(self) -> None:
        """Stop the pusher after one last push (the run is over, or never started the engine)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join()
        self.push()

    def drop_replayed_journals(self) -> list[str]:
        """Delete from the store the journals this host held whose rows are now in finished parts: those gone
        from the local run directory (the engine deletes a journal once its rows are in chunks or parts), when
        no chunk is left here. Call it after the finished parts were pushed."""
        folder = JOURNALS[0]
        chunks = self.run_dir / STAGE / CHUNKS_DIR
        if chunks.is_dir() and any(chunks.glob("part-*/chunk-*.parquet")):
            return []
        held = self._held()
        replayed = sorted(n for n in held if not (self.run_dir / folder / n).exists())
        for name in replayed:
            self.store.delete_log(folder, name)
            self._stored.pop((folder, name), None)
        self._write_held(held - set(replayed))
        return replayed

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.push()
            except Exception as exc:  # the next push retries from the same byte; `closed` reports for good
                self.stats.failures += 1
                log.warning("could not mirror the spend ledger and journal to %s: %s", self.store.url, exc)

    def _push_locked(self) -> None:
        started = time.monotonic()
        pieces, sent = 0, 0
        journals: list[str] = []
        for folder, pattern in (LEDGERS, JOURNALS):
            local = self.run_dir / folder
            try:
                paths = sorted(local.glob(pattern)) if local.is_dir() else []
            except OSError as exc:  # a failed disk, as below
                self.stats.failures += 1
                log.warning("could not list %s to mirror it to %s: %s", local, self.store.url, exc)
                continue
            for path in paths:
                key = (folder, path.name)
                start = self._stored.get(key, 0)
                try:
                    size = path.stat().st_size
                    if size <= start:
                        continue
                    with path.open("rb") as fh:
                        fh.seek(start)
                        data = fh.read(size - start)
                except FileNotFoundError:  # a journal the engine just compacted
                    continue
                except OSError as exc:  # a failed disk: the engine reports it, and spills what it held
                    self.stats.failures += 1
                    log.warning("could not read %s to mirror it to %s: %s", path, self.store.url, exc)
                    continue
                end = start + whole_frames_length(data)
                if end == start:
                    continue
                if folder == JOURNALS[0] and key not in self._stored:
                    journals.append(path.name)
                self.store.put_piece(folder, path.name, start, data[: end - start])
                self._stored[key] = end
                if path.name in self._live:
                    self._live[path.name].acknowledge(end)
                self._mine.setdefault(key, []).append((start, end))
                pieces += 1
                sent += end - start
        if journals:
            self._hold(journals)
        if pieces:
            took = time.monotonic() - started
            self.stats.pushes += 1
            self.stats.pieces += pieces
            self.stats.bytes += sent
            self.stats.seconds += took
            self.stats.max_seconds = max(self.stats.max_seconds, took)

    def _held(self) -> set[str]:
        path = self.run_dir / HELD
        return set(path.read_text().split()) if path.exists() else set()

    def _hold(self, names: list[str]) -> None:
        held = self._held()
        if not set(names) <= held:
            self._write_held(held | set(names))

    def _write_held(self, names: set[str]) -> None:
        path = self.run_dir / HELD
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{HELD}.tmp")
        tmp.write_text("".join(f"{n}\n" for n in sorted(names)))
        tmp.replace(path)
