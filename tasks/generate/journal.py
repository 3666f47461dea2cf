"""Append-only record logs that survive `kill -9`: length + CRC32 framed JSON records, one segment file per run.

Invariant: a record is either read back whole or not at all. A `kill -9` can leave a torn last frame (length,
checksum or payload cut short); readers stop at the first frame that does not check out, so a torn tail costs
only that record. Each process appends to its own segment (the run directory's writer lock guarantees one
writer), so a torn frame can only be a segment's last.

Two ways in, for two durability needs:
- `write_now`: the record is in the kernel (page cache) before the call returns, so it survives the process
  being killed; used for a request's "sent" record, which must exist before the request leaves.
- `submit`: queued; a writer thread encodes and appends the queue every `WRITE_EVERY_S` (20 ms) and fsyncs it
  every `group_commit_s` (group commit), so the event loop never encodes or waits on a disk. A `kill -9` loses
  at most the last 20 ms of records (the kernel keeps what was written); a machine crash the last
  `group_commit_s`.
The writer thread sleeps while it has nothing to write or fsync (a run waiting on long streams, an outage), and
the first record after that wakes it: an idle log costs no CPU, and fsyncs only follow writes.

A write the disk cannot take (full, over quota, or failing: EIO, a read-only remount) is cut back to the last
whole frame, so records appended once there is room again still read back (a torn frame in the middle hides every
record after it). The writer then holds the encoded records and tries them again every `DISK_FULL_RETRY_S`, having
told `on_write_error` (the run's `DiskGuard`, which stops new requests and frees its reserve for them); `write_now`
raises, so the request it was to record is not sent. A write error the guard does not take ends the writer and is
raised by the next `submit`.

The frames appended since the last fsync that succeeded are kept in memory too: a disk that fails loses them with
its page cache (a `sent` record among them is a billed request the ledger no longer shows), and after a failed
fsync the kernel may mark them clean unwritten (so once one fails, no later fsync drops them). A log mirrored to
a run store (`keep_until_acknowledged`) keeps them until the store has them instead (`acknowledge`): another host
never sees this disk, fsynced or not. `spill_to` writes them, and every record held or queued, to a segment on
another disk (`tasks.generate.spill`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from json.encoder import c_make_encoder, encode_basestring, encode_basestring_ascii  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from tasks.common.shards import atomic_write_bytes

HEADER = struct.Struct("<II")  # payload length, CRC32 of the payload
MAX_RECORD_BYTES = 256 * 1024**2
PARSE_BATCH = 4096
WRITE_EVERY_S = 0.02
DISK_FULL_RETRY_S = 0.2
KEEP_MAX_BYTES = 256 * 1024**2
"""Past this, a log waiting for the run store keeps only what is not fsynced (a store that stays unreachable)."""


def _json_encoder(ascii_only: bool) -> Callable[[Any], str]:
    """`json.dumps` as one prebuilt encoder: `json.dumps` builds json's C encoder anew on every call (and a
    `JSONEncoder` first when any option is set), a quarter of a row's encoding time and half of a small record's.
    Same output as `json.dumps(record)` (`ascii_only`) or `json.dumps(record, separators=(",", ":"),
    ensure_ascii=False)`. Built without a circular-reference check: records are trees of JSON values, and a shared
    check would be state shared by the event loop and the writer thread."""
    reference = json.JSONEncoder() if ascii_only else json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
    if c_make_encoder is None:  # an interpreter without json's C accelerator
        return reference.encode
    encode = c_make_encoder(
        None,
        reference.default,
        encode_basestring_ascii if ascii_only else encode_basestring,
        None,
        reference.key_separator,
        reference.item_separator,
        False,
        False,
        True,
    )
    return lambda record: "".join(encode(record, 0))


_COMPACT = _json_encoder(ascii_only=False)
_ASCII = _json_encoder(ascii_only=True)


def encode_frame(record: Any, compact: bool = True) -> bytes:
    """`compact`: UTF-8 as is and no spaces (smaller, for rows); else ASCII escapes and json's default spacing,
    the cheaper of the two for the small records written on the event loop."""
    payload = (_COMPACT(record) if compact else _ASCII(record)).encode()
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(path: Path) -> Iterator[Any]:
    """Every whole record of one segment, in write order; stops silently at a torn or corrupt tail.

    Checked payloads are parsed `PARSE_BATCH` at a time as one JSON array: `json.loads` record by record was two
    thirds of loading a spend ledger (`bench/ledger_load.py`). A batch that does not parse (a payload that is not
    JSON although its checksum matched) is read record by record, which stops at that record as before."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    batch: list[bytes] = []
    for payload in _payloads(data):
        batch.append(payload)
        if len(batch) == PARSE_BATCH:
            if not (yield from _parsed(batch)):
                return
            batch = []
    yield from _parsed(batch)


def _parsed(payloads: list[bytes]) -> Generator[Any, None, bool]:
    """Yields the records of `payloads` in order; returns False where one is not JSON (reading stops there)."""
    if not payloads:
        return True
    try:
        records = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        records = None
    if isinstance(records, list) and len(records) == len(payloads):
        yield from records
        return True
    for payload in payloads:
        try:
            record = json.loads(payload)
        except ValueError:
            return False
        yield record
    return True


def _payloads(data: bytes) -> Iterator[bytes]:
    """The payload of each whole, checked frame from the start of `data`, up to the first that is not."""
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos + HEADER.size <= end:
        length, crc = HEADER.unpack_from(data, pos)
        start = pos + HEADER.size
        if length > MAX_RECORD_BYTES or start + length > end:
            return
        payload = view[start : start + length]
        if zlib.crc32(payload) != crc:
            return
        yield payload.tobytes()
        pos = start + length


def whole_frames_length(data: bytes) -> int:
    """How many leading bytes of `data` (a segment's bytes from a frame boundary on) are whole, checked frames: a
    copy cut there never ends in a torn record, so more bytes appended after it still read back."""
    view, pos, end = memoryview(data), 0, len(data)
    while pos + HEADER.size <= end:
        length, crc = HEADER.unpack_from(view, pos)
        stop = pos + HEADER.size + length
        if length > MAX_RECORD_BYTES or stop > end or zlib.crc32(view[pos + HEADER.size : stop]) != crc:
            break
        pos = stop
    return pos


def segment_token() -> str:
    """A name that sorts by creation time and is unique per process: `<ns since epoch>-<pid>`."""
    return f"{time.time_ns():020d}-{os.getpid()}"


class AppendLog:
    """One segment opened for appending, with a group-commit writer thread (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        group_commit_s: float = 0.2,
        on_write_error: Callable[[OSError], bool] | None = None,
        keep_until_acknowledged: bool = False,
    ) -> None:
        """`on_write_error(error)`: told of a write that failed; True keeps the records (written again every
        `DISK_FULL_RETRY_S`, or spilled), False ends the writer."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.group_commit_s = group_commit_s
        self.on_write_error = on_write_error
        self.bytes_written = 0
        self.records_written = 0
        self.cpu_s = 0.0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._queue: list[Any] = []
        self._queue_lock = threading.Lock()
        self._held: list[tuple[bytes, int]] = []  # encoded batches the disk had no room for, and their counts
        self.keep_until_acknowledged = keep_until_acknowledged
        self._kept: list[tuple[bytes, int, int]] = []  # (frames, count, end offset) not yet safe elsewhere
        self._kept_bytes = 0
        self._fsync_failed = False
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = False
        self._dirty = False  # written since the last fsync
        self._closed = False
        self._error: BaseException | None = None
        self._last_fsync = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"journal-{path.name}", daemon=True)
        self._thread.start()

    def write_now(self, record: Any) -> None:
        """Append synchronously (to the kernel; fsync follows on the writer's cadence)."""
        frame = encode_frame(record, compact=False)
        with self._lock:
            try:
                self._append(frame)
            except OSError as exc:
                if self.on_write_error is not None:
                    self.on_write_error(exc)
                raise
            self.records_written += 1
        if self._idle:
            self._wake.set()

    def _append(self, data: bytes, count: int = 1) -> None:
        """All of `data`, or none of it: a short write (the disk filling mid-frame) is written on, and a failure
        cuts the segment back to where it was. Called with `_lock` held."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):  # a failed disk refuses this too; `spill_to` still holds the frame
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)
        self.bytes_written += len(data)
        self._dirty = True
        self._kept.append((data, count, self._size))
        self._kept_bytes += len(data)

    def submit(self, record: Any) -> None:
        """Queue for the next group commit; never blocks on I/O."""
        if self._error is not None:
            raise RuntimeError(f"journal {self.path} writer failed: {self._error}") from self._error
        with self._queue_lock:  # the writer swaps the list: an append racing the swap was lost with the old one
            self._queue.append(record)
        if self._idle:
            self._wake.set()

    @property
    def unwritten(self) -> int:
        """Records submitted and not yet written (held for room on a full disk, or queued)."""
        return len(self._queue) + sum(count for _, count in self._held)

    def _loop(self) -> None:
        while not self._closed:
            if self._queue or self._dirty or self._held:
                self._wake.wait(min(WRITE_EVERY_S, self.group_commit_s))
            else:
                self._idle = True  # before the second look: a record queued after it sees _idle and wakes us
                if not (self._queue or self._dirty or self._held or self._closed):
                    self._wake.wait()
                self._idle = False
            self._wake.clear()
            try:
                self._flush(sync=time.monotonic() - self._last_fsync >= self.group_commit_s)
            except OSError as exc:
                if self.on_write_error is None or not self.on_write_error(exc):
                    self._error = exc
                    return
                self._wake.wait(DISK_FULL_RETRY_S)  # the records are held: written once there is room
            except BaseException as exc:  # reported to the next submit(): a lost journal must not go unnoticed
                self._error = exc
                return

    def _flush(self, sync: bool = True) -> None:
        with self._flush_lock:  # one batch at a time, so records keep their submission order
            started = time.thread_time()
            with self._queue_lock:
                batch, self._queue = self._queue, []
            if batch:  # encoded once: a full disk retries the bytes, not the encoding
                self._held.append((b"".join(encode_frame(record) for record in batch), len(batch)))
            while self._held:
                data, count = self._held[0]
                with self._lock:
                    self._append(data, count)
                self._held.pop(0)
                self.records_written += count
            if sync and self._dirty:
                with self._lock:
                    self._dirty = False  # before the fsync: a write racing it stays dirty for the next one
                    synced = self._size
                try:
                    os.fsync(self._fd)
                except OSError:
                    self._fsync_failed = True  # its pages may be marked clean unwritten: no later fsync covers them
                    raise
                if not self._fsync_failed and (not self.keep_until_acknowledged or self._kept_bytes > KEEP_MAX_BYTES):
                    self.acknowledge(synced)
                self._last_fsync = time.monotonic()
            self.cpu_s += time.thread_time() - started

    def flush(self) -> None:
        """Everything submitted so far is written and fsynced when this returns (caller's thread)."""
        self._flush()

    def acknowledge(self, end: int) -> None:
        """The segment's first `end` bytes are safe (fsynced, or in the run store): its frames there are dropped."""
        with self._lock:
            drop = 0
            while drop < len(self._kept) and self._kept[drop][2] <= end:
                self._kept_bytes -= len(self._kept[drop][0])
                drop += 1
            del self._kept[:drop]

    def spill_to(self, path: Path) -> int:
        """Stop this log and write what its disk may not hold (the frames not yet safe elsewhere: since its last
        fsync that succeeded, or its last push to the run store; and every record held or queued) to a new segment
        at `path`, fsynced; returns how many records that is. For a
        disk that failed: a segment read after this log's (segment names sort by start) replays them, and records
        that did reach the disk as well are applied twice, which readers allow for."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self._flush_lock, self._lock:
            with self._queue_lock:
                batch, self._queue = self._queue, []
            if batch:
                self._held.append((b"".join(encode_frame(record) for record in batch), len(batch)))
            pieces = [*((data, count) for data, count, _ in self._kept), *self._held]
            self._kept, self._held, self._kept_bytes = [], [], 0
            with contextlib.suppress(OSError):
                os.close(self._fd)
        count = sum(n for _, n in pieces)
        if count:
            atomic_write_bytes(path, b"".join(data for data, _ in pieces))
        return count

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()
        try:
            self._flush()
        except OSError as exc:  # still no room: what is left unwritten is `unwritten`, for the caller to report
            if self.on_write_error is None or not self.on_write_error(exc):
                raise
        finally:
            os.close(self._fd)
