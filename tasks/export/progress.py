"""Resumable exports: a global sample numbering over a run's parts, per-part completion markers, a manifest.

Both trainer layouts address samples by a global index (SpecForge's `data_{i}.ckpt`, speculators' dataset row
i and `hs_{i}.safetensors`). Training samples come first, numbered part by part in part order, then the
validation samples (`split.py`: whole prompts), likewise: speculators' reader takes its validation split as the
tail of the rows, so the tail must be the held-out prompts. A part's marker records the indices and samples it
holds, the fingerprints of the hidden-states and tokens parts they were read from, and of what the export
applied to them (SpecForge's final norm), so a rerun skips a part only when the same samples, built from the
same inputs, would land at the same indices, and rewrites it otherwise. The manifest (`eagle3_export.json`) is
written last: an export directory without it is unfinished and must not be trained on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.shards import atomic_write_text, fingerprint, part_name
from tasks.export.errors import ExportError
from tasks.export.source import SourcePart

PROGRESS_DIR = "_eagle3_export"
MANIFEST = "eagle3_export.json"


@dataclass(frozen=True)
class PartSlot:
    """One source part's place in the export: `indices[n]` is the global index of the part's n-th index row,
    `validation[n]` whether that row is held out."""

    part: SourcePart
    indices: list[int]
    validation: list[bool]

    @property
    def count(self) -> int:
        return len(self.part.rows)

    def marker_content(
        self, fmt: str, layout: str | None = None, applied: dict[str, str] | None = None
    ) -> dict[str, Any]:
        ref = self.part.ref
        inputs = {stage: fingerprint(ref.with_stage(stage)) for stage in (ref.stage, "tokens")}
        return {
            "format": fmt,
            **({"layout": layout} if layout else {}),
            "indices": self.indices,
            "sample_ids": self.part.sample_ids,
            "validation": self.validation,
            "inputs": inputs,
            **({"applied": applied} if applied else {}),
        }


def assign_slots(parts: list[SourcePart], held_out: Callable[[str], bool]) -> list[PartSlot]:
    """Train samples get 0..n_train-1 part by part, validation samples n_train.. part by part."""
    flags = [[held_out(sid) for sid in part.sample_ids] for part in parts]
    next_index = [0, sum(not f for fs in flags for f in fs)]
    slots = []
    for part, part_flags in zip(parts, flags, strict=True):
        indices = []
        for flag in part_flags:
            indices.append(next_index[flag])
            next_index[flag] += 1
        slots.append(PartSlot(part, indices, part_flags))
    return slots


class ExportProgress:
    """Markers under `<out>/_eagle3_export/`; refuses an output directory some other tool wrote."""

    def __init__(
        self,
        out_dir: Path,
        fmt: str,
        run_dir: Path,
        layout: str | None = None,
        applied: dict[str, str] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.fmt = fmt
        self.layout = layout
        """the format's file naming, when it has had more than one (a part marked under another is rewritten)"""
        self.applied = applied
        """what the export applied beyond the run's parts (SpecForge: the target's final norm), by fingerprint"""
        self.run_dir = Path(run_dir).resolve()
        self.dir = self.out_dir / PROGRESS_DIR
        manifest = self.out_dir / MANIFEST
        if manifest.exists():
            previous = json.loads(manifest.read_text())
            if previous.get("format") != fmt or previous.get("run_dir") != str(self.run_dir):
                raise ExportError(
                    f"{self.out_dir} holds a {previous.get('format')} export of {previous.get('run_dir')}; "
                    f"choose another --out for a {fmt} export of {self.run_dir}"
                )
        elif self.out_dir.exists() and any(self.out_dir.iterdir()) and not self.dir.is_dir():
            raise ExportError(f"{self.out_dir} is not empty and holds no eagle3-datagen export; choose another --out")
        self.dir.mkdir(parents=True, exist_ok=True)

    def _marker(self, slot: PartSlot) -> Path:
        return self.dir / f"{part_name(slot.part.ref.part)}.json"

    def is_done(self, slot: PartSlot) -> bool:
        marker = self._marker(slot)
        expected = slot.marker_content(self.fmt, self.layout, self.applied)
        return marker.exists() and json.loads(marker.read_text()) == expected

    def mark_done(self, slot: PartSlot) -> None:
        atomic_write_text(self._marker(slot), json.dumps(slot.marker_content(self.fmt, self.layout, self.applied)))

    def start(self) -> None:
        """A run of the export is starting: the old manifest no longer describes the directory."""
        (self.out_dir / MANIFEST).unlink(missing_ok=True)

    def finish(self, slots: list[PartSlot], extra: dict[str, Any]) -> dict[str, Any]:
        manifest = {
            "format": self.fmt,
            "run_dir": str(self.run_dir),
            "samples": sum(s.count for s in slots),
            "parts": [
                {
                    "part": s.part.ref.part,
                    "count": s.count,
                    "sample_ids": s.part.sample_ids,
                    "indices": s.indices,
                    "validation": s.validation,
                }
                for s in slots
            ],
            **extra,
        }
        atomic_write_text(self.out_dir / MANIFEST, json.dumps(manifest, indent=1))
        return manifest
