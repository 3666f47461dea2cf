"""Trainer interop: a run's hidden states in SpecForge's and speculators' offline layouts.

`export_run` walks the finished hidden-states parts of a run directory, re-checks every sample against its
tokens (ids, loss mask length, shapes, finite values) and writes the chosen layout part by part, resumably;
`eagle3_export.json` in the output directory marks a finished export.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from tasks.export import specforge, speculators
from tasks.export.errors import ExportError
from tasks.export.progress import ExportProgress, assign_slots
from tasks.export.source import source_parts
from tasks.extract.storage import dtype_name

ExportFormat = Literal["specforge", "speculators"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("specforge", "speculators")

__all__ = ["EXPORT_FORMATS", "ExportError", "ExportFormat", "export_run"]


def export_run(run_dir: Path, fmt: str, out_dir: Path) -> dict[str, Any]:
    """Export every finished hidden-states part of `run_dir` to `out_dir`; returns the export's stats."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"export format {fmt!r} not one of {list(EXPORT_FORMATS)}")
    started = time.monotonic()
    parts = source_parts(Path(run_dir))
    progress = ExportProgress(Path(out_dir), fmt, Path(run_dir))
    progress.start()
    slots = assign_slots(parts)
    written = 0
    skipped = 0
    for slot in slots:
        if progress.is_done(slot):
            skipped += 1
            continue
        if fmt == "specforge":
            written += specforge.write_part(Path(out_dir), slot)
        else:
            written += speculators.write_part(Path(out_dir), slot, len(slots))
        progress.mark_done(slot)
    total = sum(s.count for s in slots)
    if fmt == "specforge":
        stale = specforge.remove_stale(Path(out_dir), total)
    else:
        stale = speculators.remove_stale(Path(out_dir), total, len(slots))
        speculators.finish(Path(out_dir), len(slots))
    layouts = sorted(
        {
            (tuple(layout.layers), layout.hidden_size, dtype_name(layout.dtype))
            for layout in (s.part.layout for s in slots)
            if layout is not None
        }
    )
    manifest = progress.finish(
        slots, {"layouts": [{"layers": list(k), "hidden_size": h, "dtype": d} for k, h, d in layouts]}
    )
    return {
        "format": fmt,
        "out": str(out_dir),
        "samples": manifest["samples"],
        "parts": len(slots),
        "parts_skipped": skipped,
        "bytes_written": written,
        "stale_files_removed": stale,
        "wall_s": round(time.monotonic() - started, 3),
    }
