"""Which parts of each stage a (re)run must build: the ones missing, or stale against their inputs or recipe.

Decisions read completion markers only (fingerprints recorded at write time), never the Parquet files, so a
no-op rerun of a finished run directory costs O(parts) small JSON reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.common.config import PipelineConfig
from tasks.common.schemas import SCORES_STAGE
from tasks.common.shards import (
    PartRef,
    atomic_write_text,
    done_parts,
    expected_build,
    fingerprint,
    is_current,
    recipe_digest,
)
from tasks.reconstruct.completion_format import CompletionFormat
from tasks.reconstruct.stage import repair_table, tokens_recipe
from tasks.status.sending import parts_to_send
from tasks.validate.checks import validation_recipe


def generate_todo(cfg: PipelineConfig, parts: list[int]) -> list[int]:
    """Prompts parts the generate stage would send requests for (`tasks.status.sending`): not those whose every
    row is done or a deterministic failure the rerun policy keeps."""
    return parts_to_send(cfg, parts)


def tokens_todo(cfg: PipelineConfig, fmt: CompletionFormat, parts: list[int]) -> list[int]:
    recipe = tokens_recipe(cfg, fmt, repair_table(cfg, fmt))
    return [p for p in parts if not is_current(ref := PartRef(cfg.run_dir, "tokens", p), expected_build(ref, recipe))]


def validation_todo(cfg: PipelineConfig, fmt: CompletionFormat, parts: list[int]) -> list[int]:
    recipe = validation_recipe(cfg, fmt)
    return [
        p for p in parts if not is_current(ref := PartRef(cfg.run_dir, "validation", p), expected_build(ref, recipe))
    ]


def hidden_states_todo(cfg: PipelineConfig, parts: list[int]) -> list[int]:
    from tasks.extract.stage import hidden_states_current  # torch: imported only where extraction is planned

    return [p for p in parts if not hidden_states_current(cfg, p)]


def recipe_digests(cfg: PipelineConfig, fmt: CompletionFormat) -> dict[str, str | None]:
    """Stage -> recipe digest a current part must record, for `status` to tell config-stale parts too."""
    from tasks.extract.scores import scores_recipe
    from tasks.extract.stage import hidden_states_recipe

    return {
        "tokens": recipe_digest(tokens_recipe(cfg, fmt, repair_table(cfg, fmt))),
        "validation": recipe_digest(validation_recipe(cfg, fmt)),
        "hidden_states": recipe_digest(hidden_states_recipe(cfg)),
        SCORES_STAGE: recipe_digest(scores_recipe(cfg)),
    }


REPORT_STAMP = "_report_inputs.json"
"""In the run directory: the inputs key of the last validation report written, and where it was written."""


def report_key(run_dir: Path, settings: dict[str, Any]) -> str:
    """What the validation report is computed from: every finished responses/tokens/validation part's fingerprint
    and the settings (gates, tolerance) it reports against."""
    fps = {
        stage: [fingerprint(r) for r in done_parts(run_dir, stage)] for stage in ("responses", "tokens", "validation")
    }
    return recipe_digest({"parts": fps, "settings": settings})


def _recorded(run_dir: Path, key: str) -> dict[str, Any]:
    """The stamp's content when it was written from exactly these inputs (else empty)."""
    try:
        recorded = json.loads((run_dir / REPORT_STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) and recorded.get("key") == key else {}


def reusable_report(run_dir: Path, key: str) -> Path | None:
    """The report written from exactly these inputs, if it is still there: a no-op rerun does not redraw plots."""
    report = Path(_recorded(run_dir, key).get("report", ""))
    return report if report.is_file() else None


def recorded_summary(run_dir: Path, key: str) -> list[dict[str, Any]] | None:
    """The validation summary computed from exactly these inputs (the key covers every part it reads and the
    settings it applies), so a no-op rerun does not read every validation part again; None: compute it."""
    summary = _recorded(run_dir, key).get("summary")
    return summary if isinstance(summary, list) else None


def record_report(run_dir: Path, key: str, report: Path, summary: list[dict[str, Any]] | None = None) -> None:
    stamp = {"key": key, "report": str(report), "summary": summary}
    atomic_write_text(run_dir / REPORT_STAMP, json.dumps(stamp, default=str))
