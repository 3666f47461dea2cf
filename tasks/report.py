"""The standalone validation report: written next to the validation parts so it survives without Prefect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.shards import atomic_write_text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_no rows_\n"
    columns = list(rows[0])
    for row in rows[1:]:
        columns += [c for c in row if c not in columns]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, dict | list):
            return json.dumps(value, sort_keys=True).replace("|", "\\|")
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_validation_report(run_dir: Path, summary: list[dict[str, Any]]) -> Path:
    out = run_dir / "validation"
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str))
    report = out / "report.md"
    atomic_write_text(report, f"# Validation report: `{run_dir}`\n\n" + markdown_table(summary))
    return report
