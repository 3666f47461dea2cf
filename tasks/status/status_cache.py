"""The last `status` result of a run directory, reused while nothing it was computed from has changed.

Invariant: a stored result is returned only for the same key, and the key covers everything the reconciliation
reads: the exact bytes of every part's completion marker (a rewritten part gets a new marker: new digest, inputs
or completion time), which parts exist without a marker, the quarantine file's bytes, the recipes and extraction
settings asked about, and the source of the code that reconciles. A part's Parquet file is replaced before its
marker is written (and the old marker removed first), so the marker bytes stand for the rows. A no-op rerun's
status pass thus reads O(parts) small markers and one small file instead of an id column per part and stage;
any change recomputes everything, as without the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from tasks.common.shards import PartRef, atomic_write_text

CACHE_FILE = "_status.json"
"""In the run directory; local to this host (never pushed); removed or unreadable, it is simply recomputed."""


@cache
def _code_digest() -> str:
    """The reconciliation code itself: a changed rule (a new failure class, a new state) invalidates results."""
    import tasks.common.failures
    import tasks.common.shards
    import tasks.common.state_inputs

    digest = hashlib.sha256()
    sources = [Path(__file__).with_name("report.py")]  # read, not imported: report imports this module
    modules = (tasks.common.failures, tasks.common.shards, tasks.common.state_inputs)
    sources += [Path(str(module.__file__)) for module in modules]
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _marker_digest(ref: PartRef) -> str | None:
    if not ref.is_done():
        return None
    try:
        return hashlib.sha256(ref.marker.read_bytes()).hexdigest()
    except OSError:
        return None


def status_key(
    run_dir: Path,
    parts: Mapping[str, list[int]],
    quarantine: bytes | None,
    settings: Mapping[str, Any],
) -> str:
    """`parts`: stage -> part numbers present (finished or not); `settings`: recipes and extraction flags."""
    markers = {
        stage: {str(p): _marker_digest(PartRef(run_dir, stage, p)) for p in numbers} for stage, numbers in parts.items()
    }
    key = {
        "code": _code_digest(),
        "markers": markers,
        "quarantine": None if quarantine is None else hashlib.sha256(quarantine).hexdigest(),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cached(run_dir: Path, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The stored result for `key`, else `compute()` (stored for next time; a read-only directory just recomputes)."""
    path = Path(run_dir) / CACHE_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = None
    if isinstance(stored, dict) and stored.get("key") == key and isinstance(stored.get("result"), dict):
        result: dict[str, Any] = stored["result"]
        return result
    result = compute()
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps({"key": key, "result": result}, default=str))
    return result
