"""Run directories shared between hosts (CPU workers here, the GPU worker there) through any fsspec URL.

Stages always read and write a *local* run directory (atomic renames, memory-mapped safetensors); a RunStore
mirrors it to `<url>/<run name>`. A part is pushed data first and completion marker last, and pulled the same
way, so a host sees a part only once it is complete: the invariant of `tasks/common/shards.py`, carried across hosts.
A plain shared filesystem (NFS, a Docker volume) needs no store at all: point `run_dir` at it.

Append-only logs (the spend ledger, the answer journal) are mirrored while they grow, as *pieces*: each push
uploads only the bytes appended since the last one, as one object `<folder>/_pieces/<name>/<start>-<end>` whose
name states the byte range it holds, so a piece cut short by a non-atomic upload is seen for what it is and
ignored. A log's writer may later replace its pieces by one whole object `<folder>/<name>`. Readers join the whole
object and the pieces that continue it without a gap: what they get is always a prefix of the log.
"""

from __future__ import annotations

import fnmatch
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pyarrow.parquet as pq

from tasks.common.errors import ConfigError
from tasks.common.shards import PART_RE, PartRef

PIECES_DIR = "_pieces"
FETCH_BATCH = 64
COPY_BLOCK = 8 * 1024**2
_PIECE_RE = re.compile(r"^([0-9]{20})-([0-9]{20})$")


@dataclass
class RemoteLog:
    """One append-only log as the store holds it: a whole copy of its first `whole_bytes` bytes, and pieces
    (start, end) holding bytes [start, end), each listed only when the object has exactly that many bytes."""

    whole_bytes: int = 0
    pieces: list[tuple[int, int]] = field(default_factory=list)

    def chain(self) -> list[tuple[int, int]]:
        """The pieces that extend the whole copy without a gap, in order (overlaps allowed, each adds bytes)."""
        end, out = self.whole_bytes, []
        for start, stop in sorted(self.pieces):
            if start > end:
                break
            if stop > end:
                out.append((start, stop))
                end = stop
        return out

    @property
    def size(self) -> int:
        """Bytes a reader can have from the start: the whole copy joined with its chain of pieces."""
        chain = self.chain()
        return chain[-1][1] if chain else self.whole_bytes


class RunStore:
    def __init__(self, url: str, local_run_dir: Path) -> None:
        self.url = url.rstrip("/")
        self.local_run_dir = local_run_dir
        fs, root = fsspec.core.url_to_fs(self.url)
        self.fs: Any = fs
        self.root = f"{root.rstrip('/')}/{local_run_dir.name}"
        self._made_dirs: set[str] = set()

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def push_file(self, path: Path, rel: str | None = None) -> None:
        """Upload under a temporary name, then move: an interrupted upload never shows under the final name."""
        rel = path.relative_to(self.local_run_dir).as_posix() if rel is None else rel
        remote = self._remote(rel)
        tmp = f"{remote}.uploading-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(self._remote(str(Path(rel).parent.as_posix())), exist_ok=True)
        self.fs.put_file(str(path), tmp)
        self.fs.mv(tmp, remote)

    def push_part(self, ref: PartRef) -> int:
        """Push a finished part with the data files it references, marker last. Returns files pushed."""
        if not ref.is_done():
            raise ConfigError(f"cannot push {ref}: it has no completion marker")
        files = [*self._data_files(ref), ref.path]
        for path in files:
            self.push_file(path)
        self.push_file(ref.marker)
        return len(files) + 1

    def _data_files(self, ref: PartRef) -> list[Path]:
        if ref.stage != "hidden_states":
            return []
        shards = sorted(set(pq.read_table(ref.path, columns=["shard"])["shard"].to_pylist()))
        return [ref.run_dir / "hidden_states" / s for s in shards]

    def remote_parts(self, stage: str) -> list[int]:
        self.fs.invalidate_cache()  # object stores cache listings; another host may have pushed since
        pattern = self._remote(f"{stage}/_done/part-*.json")
        names = [Path(p).name.replace(".json", ".parquet") for p in self.fs.glob(pattern)]
        return sorted(int(m.group(1)) for n in names if (m := PART_RE.match(n)))

    def pull_file(self, rel: str) -> Path:
        local = self.local_run_dir / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp")
        self.fs.get_file(self._remote(rel), str(tmp))
        tmp.replace(local)
        return local

    def pull_stage(self, stage: str, parts: Iterable[int] | None = None) -> list[int]:
        """Fetch the remote finished parts this host lacks or holds in another build (data files, then the marker).

        A local part counts as the same only when its marker is byte-identical to the remote one: a part rebuilt
        on another host (new inputs, new recipe) replaces the local copy, whose marker goes first."""
        wanted = set(parts) if parts is not None else None
        pulled = []
        for part in self.remote_parts(stage):
            if wanted is not None and part not in wanted:
                continue
            ref = PartRef(self.local_run_dir, stage, part)
            rel_marker = ref.marker.relative_to(self.local_run_dir).as_posix()
            if ref.is_done() and ref.marker.read_bytes() == self.fs.cat_file(self._remote(rel_marker)):
                continue
            ref.marker.unlink(missing_ok=True)
            rel_part = ref.path.relative_to(self.local_run_dir).as_posix()
            self.pull_file(rel_part)
            if stage == "hidden_states":
                for shard in self._data_files(ref):
                    self.pull_file(shard.relative_to(self.local_run_dir).as_posix())
            self.pull_file(rel_marker)
            pulled.append(part)
        return pulled

    def pull_optional(self, rel: str) -> Path | None:
        self.fs.invalidate_cache(self._remote(rel))
        return self.pull_file(rel) if self.fs.exists(self._remote(rel)) else None

    def _piece(self, folder: str, name: str, start: int, end: int) -> str:
        return self._remote(f"{folder}/{PIECES_DIR}/{name}/{start:020d}-{end:020d}")

    def list_logs(self, folder: str, pattern: str) -> dict[str, RemoteLog]:
        """Every log in `folder` whose name matches `pattern`, whole copies and pieces, from one listing."""
        self.fs.invalidate_cache()
        base = self._remote(folder).rstrip("/")
        logs: dict[str, RemoteLog] = {}
        for path, info in self.fs.find(base, detail=True).items():
            rel = path[len(base) :].lstrip("/").split("/")
            if len(rel) == 1 and fnmatch.fnmatchcase(rel[0], pattern):
                logs.setdefault(rel[0], RemoteLog()).whole_bytes = int(info["size"])
            elif len(rel) == 3 and rel[0] == PIECES_DIR and fnmatch.fnmatchcase(rel[1], pattern):
                m = _PIECE_RE.match(rel[2])
                if m and int(info["size"]) == int(m.group(2)) - int(m.group(1)):
                    logs.setdefault(rel[1], RemoteLog()).pieces.append((int(m.group(1)), int(m.group(2))))
        return logs

    def read_log(self, folder: str, name: str, log: RemoteLog, out: BinaryIO) -> int:
        """Write the log's bytes from the start to `out`: its whole copy, then its chain of pieces (fetched
        FETCH_BATCH at a time, concurrently on an object store). Returns the bytes written."""
        written = 0
        if log.whole_bytes:
            with self.fs.open(self._remote(f"{folder}/{name}"), "rb") as fh:
                while written < log.whole_bytes and (block := fh.read(min(COPY_BLOCK, log.whole_bytes - written))):
                    out.write(block)
                    written += len(block)
        chain = log.chain()
        for at in range(0, len(chain), FETCH_BATCH):
            batch = chain[at : at + FETCH_BATCH]
            paths = [self._piece(folder, name, start, end) for start, end in batch]
            data: dict[str, bytes] = self.fs.cat(paths)
            for (start, end), path in zip(batch, paths, strict=True):
                piece = data[path]
                if len(piece) != end - start or start > written:
                    raise ConfigError(f"{self.url}: {path} is not the piece it was listed as; pull again")
                out.write(memoryview(piece)[written - start :])
                written = end
        return written

    def put_piece(self, folder: str, name: str, start: int, data: bytes) -> None:
        """One object holding bytes [start, start + len(data)) of the log; a single PUT on an object store."""
        path = self._piece(folder, name, start, start + len(data))
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:  # on S3 each call asks whether the bucket exists: once per log
            self.fs.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        self.fs.pipe_file(path, data)

    def put_whole(self, folder: str, name: str, path: Path, pieces: list[tuple[int, int]]) -> None:
        """Replace a log's pieces by the whole local file (which holds exactly the bytes they hold): uploaded under
        a temporary name and moved, then the pieces are deleted (a reader in between joins the overlap)."""
        self.push_file(path, f"{folder}/{name}")
        self.fs.rm([self._piece(folder, name, a, b) for a, b in pieces])

    def delete_log(self, folder: str, name: str) -> None:
        """The whole copy and every piece of a log, listed or not (a piece cut short is deleted too)."""
        whole = self._remote(f"{folder}/{name}")
        if self.fs.exists(whole):
            self.fs.rm(whole)
        pieces = self._remote(f"{folder}/{PIECES_DIR}/{name}")
        if self.fs.find(pieces):
            self.fs.rm(pieces, recursive=True)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "local_run_dir": str(self.local_run_dir)}

    def __repr__(self) -> str:
        return f"RunStore({json.dumps(self.describe())})"
