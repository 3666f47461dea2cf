"""Crash-safe Parquet shards in a run directory: `<run_dir>/<stage>/part-NNNNN.parquet` + `_done/part-NNNNN.json`.

Invariant: a part counts as done only when its completion marker exists, and the marker is written after the
Parquet file has been fsynced and renamed into place. A crash at any point leaves either no part, or a part
without a marker (rewritten on resume), never a half-written file under the final name.

Lineage: a marker also records what the part was built from (`Build`): the fingerprint of each input part (read
from that part's own marker, never by rehashing its file) and the digest of the recipe (the config and code
version that shape the output). A part is *current* when its marker exists and both still match; a part whose
inputs or recipe changed is *stale* and is rebuilt like a build system would, the old file staying in place
until the new one is renamed over it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.common.errors import CorruptPartError, SchemaMismatchError
from tasks.common.schemas import SCHEMA_VERSION, SCHEMAS

PART_RE = re.compile(r"^part-(\d{5})\.parquet$")
META_VERSION = b"eagle3.schema_version"
META_STAGE = b"eagle3.stage"
META_PROVENANCE = b"eagle3.provenance"


UPSTREAM: dict[str, tuple[str, ...]] = {
    "prompts": (),
    "responses": ("prompts",),
    "tokens": ("prompts", "responses"),
    "validation": ("tokens", "responses"),
    "hidden_states": ("tokens", "validation"),
    "hidden_states/_scores": ("hidden_states",),
}
"""The parts (same index, other stage) each stage's part is built from: the DAG's edges at part granularity."""

PartState = Literal["current", "stale", "missing"]


def part_name(part: int) -> str:
    return f"part-{part:05d}"


@dataclass(frozen=True)
class PartRef:
    """A reference to one shard of one stage: what tasks pass to each other instead of data."""

    run_dir: Path
    stage: str
    part: int

    @property
    def path(self) -> Path:
        return self.run_dir / self.stage / f"{part_name(self.part)}.parquet"

    @property
    def marker(self) -> Path:
        return self.run_dir / self.stage / "_done" / f"{part_name(self.part)}.json"

    def with_stage(self, stage: str) -> PartRef:
        return PartRef(self.run_dir, stage, self.part)

    def is_done(self) -> bool:
        return self.marker.exists() and self.path.exists()

    def __str__(self) -> str:
        return f"{self.stage}/{part_name(self.part)}"


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry, not only the file, must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shared_file_mode() -> int:
    """0o666 less the process umask: what `open()` would give. `tempfile.mkstemp` always creates 0o600, which
    would lock every other user (and group) out of a shared run directory."""
    try:  # Linux: read it without changing it (os.umask would briefly change it for every thread)
        with open("/proc/self/status") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, shared_file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def conform(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """Select and cast to the stage schema; a missing column or a lossy cast is a SchemaMismatchError."""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise SchemaMismatchError(f"{what}: missing columns {missing}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaMismatchError(f"{what}: cannot cast to the stage schema: {exc}") from exc


def write_parquet_atomic(path: Path, table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> int:
    """Write a Parquet file under a temporary name, fsync, then rename. Returns the file size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, shared_file_mode())
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def stage_metadata(stage: str, provenance: dict[str, Any]) -> dict[bytes, bytes]:
    return {
        META_VERSION: str(SCHEMA_VERSION).encode(),
        META_STAGE: stage.encode(),
        META_PROVENANCE: json.dumps(provenance, sort_keys=True, default=str).encode(),
    }


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def recipe_digest(recipe: Mapping[str, Any]) -> str:
    """Digest of what shapes a stage's output besides its input parts (config subset, code version)."""
    return _sha256_json({"schema_version": SCHEMA_VERSION, **recipe})


def table_digest(table: pa.Table) -> str:
    """Content digest of a table's rows and columns (schema metadata excluded, chunking normalised)."""
    table = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


@dataclass(frozen=True)
class Build:
    """What a part is built from: fingerprints of its input parts (None: absent) and its recipe's digest.

    `recipe` None means "not known to this caller" (e.g. `status` without a config): only the inputs compare.
    """

    inputs: dict[str, str | None]
    recipe: str | None = None

    def matches(self, marker: Mapping[str, Any]) -> bool:
        if marker.get("inputs") != self.inputs:
            return False
        return self.recipe is None or marker.get("recipe") == self.recipe


def read_marker(ref: PartRef) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ref.marker.read_text())
    return result


def fingerprint(ref: PartRef) -> str | None:
    """The part's identity for the parts built from it: recorded in its marker at write time (None: not done).

    It covers the part's content digest and its own lineage, so a change anywhere upstream reaches every stage
    below (hidden-state data files change with their tokens even when the index rows do not). A marker from
    before lineage was recorded is identified by its size and completion time.
    """
    if not ref.is_done():
        return None
    try:
        marker = read_marker(ref)
    except (OSError, ValueError):
        return None
    fp = marker.get("fingerprint")
    if isinstance(fp, str):
        return fp
    return f"legacy:{marker.get('bytes')}:{marker.get('finished_at')}"


def input_fingerprints(ref: PartRef, stages: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """Current fingerprints of the parts `ref` is built from (by default its stage's UPSTREAM)."""
    return {stage: fingerprint(ref.with_stage(stage)) for stage in (UPSTREAM[ref.stage] if stages is None else stages)}


def expected_build(ref: PartRef, recipe: Mapping[str, Any] | None = None) -> Build:
    """What `ref` would be built from now: its inputs' fingerprints and (when given) the recipe's digest."""
    return Build(input_fingerprints(ref), None if recipe is None else recipe_digest(recipe))


def part_intact(ref: PartRef, marker: Mapping[str, Any] | None = None) -> bool:
    """The finished part's file is the size its marker recorded and its Parquet footer reads: a stat and a read
    of the footer (O(parts), never the rows), which catches a file cut short, replaced or overwritten (a copy that
    broke off, a disk that lost blocks, a hand edit)."""
    try:
        marker = read_marker(ref) if marker is None else marker
        recorded = marker.get("bytes")
        if isinstance(recorded, int) and ref.path.stat().st_size != recorded:
            return False
        pq.read_metadata(ref.path)
    except (OSError, ValueError, pa.ArrowException):
        return False
    return True


def part_state(ref: PartRef, build: Build) -> PartState:
    """missing: no finished part, or one whose file is damaged (`part_intact`): rebuilt like a missing one;
    stale: finished from other inputs or another recipe; current: reusable."""
    if not ref.is_done():
        return "missing"
    try:
        marker = read_marker(ref)
    except (OSError, ValueError):
        return "missing"
    if not part_intact(ref, marker):
        return "missing"
    if "inputs" not in marker:
        return "current" if _legacy_current(ref, marker, build) else "stale"
    return "current" if build.matches(marker) else "stale"


def _legacy_current(ref: PartRef, marker: Mapping[str, Any], build: Build) -> bool:
    """A marker from before lineage was recorded is judged like `make` judges files: current when every input
    part present now finished before it did. A run directory from an older version is thus not rebuilt (nor
    re-extracted) wholesale on upgrade, while a responses part retried after its tokens part still counts."""
    finished = float(marker.get("finished_at") or 0.0)
    for stage, fp in build.inputs.items():
        if fp is None:
            continue
        try:
            upstream = read_marker(ref.with_stage(stage))
        except (OSError, ValueError):
            return False
        if float(upstream.get("finished_at") or 0.0) > finished:
            return False
    return True


def is_current(ref: PartRef, build: Build) -> bool:
    return part_state(ref, build) == "current"


def _status_counts(table: pa.Table) -> dict[str, int]:
    if "status" not in table.column_names:
        return {}
    counts = table.column("status").value_counts().to_pylist()
    return {str(c["values"]): int(c["counts"]) for c in counts}


def write_part(
    ref: PartRef,
    table: pa.Table,
    provenance: dict[str, Any],
    stats: dict[str, Any] | None = None,
    build: Build | None = None,
) -> dict[str, Any]:
    """Conform, write atomically, then mark done. Returns the marker's content.

    The marker records `build` (default: the current fingerprints of the stage's UPSTREAM parts, no recipe),
    the table's content digest and the resulting fingerprint, so later stages compare markers, not files.
    """
    table = conform(table, SCHEMAS[ref.stage], str(ref))
    if build is None:
        build = Build(input_fingerprints(ref))
    digest = table_digest(table)
    ref.marker.unlink(missing_ok=True)
    size = write_parquet_atomic(ref.path, table, stage_metadata(ref.stage, provenance))
    marker = {
        "stage": ref.stage,
        "part": ref.part,
        "rows": table.num_rows,
        "bytes": size,
        "schema_version": SCHEMA_VERSION,
        "finished_at": time.time(),
        "stats": stats or {},
        "digest": digest,
        "inputs": build.inputs,
        "recipe": build.recipe,
        "fingerprint": _sha256_json({"digest": digest, "inputs": build.inputs, "recipe": build.recipe}),
        "status_counts": _status_counts(table),
    }
    atomic_write_text(ref.marker, json.dumps(marker, sort_keys=True, default=str))
    return marker


def corrupt_part(path: Path, exc: Exception) -> CorruptPartError:
    """The one line for a finished part that cannot be read: which file, what its marker says, what to do."""
    marker_path = path.parent / "_done" / f"{path.stem}.json"
    recorded = ""
    with contextlib.suppress(OSError, ValueError, TypeError):
        recorded = f"; its marker recorded {json.loads(marker_path.read_text()).get('bytes'):,} bytes"
    size = path.stat().st_size if path.exists() else 0
    return CorruptPartError(
        f"{path} is not a readable part ({type(exc).__name__}: {str(exc)[:200]}; {size:,} bytes on disk{recorded}): "
        f"delete it and {marker_path} and rerun to rebuild it"
        + (" (its answers are bought again)" if path.parent.name == "responses" else "")
    )


@contextlib.contextmanager
def reading_part(path: Path) -> Iterator[None]:
    """Around a read of a finished part's file: what the Parquet reader raises on a damaged file becomes
    `corrupt_part`'s typed error (a missing file stays FileNotFoundError)."""
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise corrupt_part(path, exc) from exc


def _read_schema(path: Path) -> pa.Schema:
    with reading_part(path):
        return pq.read_schema(path)


def check_schema(path: Path, schema: pa.Schema, stage: str) -> None:
    file_schema = _read_schema(path)
    meta = file_schema.metadata or {}
    version = meta.get(META_VERSION, b"<none>").decode()
    if version != str(SCHEMA_VERSION):
        raise SchemaMismatchError(f"{path}: schema_version {version}, this code reads {SCHEMA_VERSION}")
    if meta.get(META_STAGE, b"").decode() != stage:
        raise SchemaMismatchError(f"{path}: written by stage {meta.get(META_STAGE)!r}, expected {stage!r}")
    for field in schema:
        if field.name not in file_schema.names:
            raise SchemaMismatchError(f"{path}: missing column {field.name!r}")
        actual = file_schema.field(field.name).type
        if actual != field.type:
            raise SchemaMismatchError(f"{path}: column {field.name!r} is {actual}, expected {field.type}")


def read_part(ref: PartRef, columns: list[str] | None = None) -> pa.Table:
    if not ref.is_done():
        raise FileNotFoundError(f"{ref} is not complete (no marker at {ref.marker})")
    return read_part_file(ref, columns)


def read_part_file(ref: PartRef, columns: list[str] | None = None) -> pa.Table:
    """The part's file, schema-checked, marker or not (`read_part` requires the marker)."""
    check_schema(ref.path, SCHEMAS[ref.stage], ref.stage)
    with reading_part(ref.path):
        return pq.read_table(ref.path, columns=columns)


def read_provenance(path: Path) -> dict[str, Any]:
    meta = _read_schema(path).metadata or {}
    result: dict[str, Any] = json.loads(meta.get(META_PROVENANCE, b"{}"))
    return result


def done_parts(run_dir: Path, stage: str) -> list[PartRef]:
    stage_dir = run_dir / stage
    if not stage_dir.is_dir():
        return []
    refs = []
    for entry in sorted(stage_dir.iterdir()):
        m = PART_RE.match(entry.name)
        if m:
            ref = PartRef(run_dir, stage, int(m.group(1)))
            if ref.is_done():
                refs.append(ref)
    return refs


def iter_rows(refs: list[PartRef], columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    for ref in refs:
        yield from read_part(ref, columns).to_pylist()
