"""The id/status rows `status` reads from each finished part, remembered by the part's content digest.

Invariant: a cached entry is used only when the part's marker still records the digest it was read under, and
an entry is stored only when the marker held that digest both before and after the Parquet read (a part being
rewritten meanwhile is read again next time). The digest is the sha256 of the table's Arrow bytes written into
the marker with the part, so a rewritten part can never be answered from an older copy. A no-op `status` (every
run ends with one) thus reads one JSON file instead of an id column per part and stage.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.common.shards import PartRef, atomic_write_text, read_marker

CACHE_FILE = "_status_ids.json"
"""In the run directory; local to this host (never pushed), rebuilt from the parts when missing or unreadable."""
_VERSION = 1


def _digest(ref: PartRef) -> str | None:
    try:
        digest = read_marker(ref).get("digest")
    except (OSError, ValueError):
        return None
    return digest if isinstance(digest, str) else None


def _read_columns(ref: PartRef, columns: list[str]) -> list[dict[str, Any]]:
    schema = pq.read_schema(ref.path)
    rows: list[dict[str, Any]] = pq.read_table(ref.path, columns=[c for c in columns if c in schema.names]).to_pylist()
    return rows


class IdCache:
    """Load once, `rows(ref, columns)` per part, `save()` at the end (writes only when an entry changed)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / CACHE_FILE
        self._old: dict[str, Any] = {}
        self._new: dict[str, Any] = {}
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            loaded = None
        if isinstance(loaded, dict) and loaded.get("version") == _VERSION and isinstance(loaded.get("parts"), dict):
            self._old = loaded["parts"]

    def rows(self, ref: PartRef, columns: list[str]) -> list[dict[str, Any]]:
        """The part's rows restricted to `columns` (those it has)."""
        key = str(ref)
        digest = _digest(ref)
        found = self._old.get(key)
        entry: dict[str, Any] = found if isinstance(found, dict) else {}
        if digest is not None and (entry.get("digest"), entry.get("columns")) == (digest, columns):
            self._new[key] = entry
            rows: list[dict[str, Any]] = entry["rows"]
            return rows
        rows = _read_columns(ref, columns)
        if digest is not None and _digest(ref) == digest:  # legacy markers (no digest) are never cached
            self._new[key] = {"digest": digest, "columns": columns, "rows": rows}
        return rows

    def save(self) -> None:
        """Keep the entries of the parts read this time (parts gone since drop out); no write when unchanged."""
        if self._new == self._old:
            return
        with contextlib.suppress(OSError):  # a read-only run directory: status answers, and reads parts next time
            atomic_write_text(self.path, json.dumps({"version": _VERSION, "parts": self._new}, default=str))
