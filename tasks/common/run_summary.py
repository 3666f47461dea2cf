"""What a run directory holds, per stage, counted from its completion markers: the run summary every surface
shows (the `run` command, the `run-summary` artifact). Markers are the truth whichever worker, host or
deployment wrote the parts, so a GPU deployment's five parts count as five here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common.schemas import STAGES
from tasks.common.shards import done_parts, read_marker

GENERATE_TOTALS = (
    ("samples", "samples"),
    ("done", "done"),
    ("failed", "failed"),
    ("already done before this run", "skipped_already_done"),
    ("failed before this run, kept (not sent again)", "kept_failed"),
    ("kept failures by reason", "kept_failed_by_reason"),
    ("failures by reason", "failures_by_reason"),
    ("requests sent", "requests_sent"),
    ("prompt tokens", "prompt_tokens"),
    ("completion tokens", "completion_tokens"),
    ("billed this run (USD)", "cost_usd"),
    ("pending this run (USD, worst case until settled)", "pending_usd"),
    ("run directory billed (USD)", "run_dir_billed_usd"),
    ("run directory pending (USD, worst case until settled)", "run_dir_pending_usd"),
    ("stopped", "stopped"),
)


def stage_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per stage: finished parts, rows in them, bytes on disk (Parquet; hidden states add shards)."""
    rows = []
    for stage in STAGES:
        parts = rows_total = bytes_total = 0
        for ref in done_parts(run_dir, stage):
            marker = read_marker(ref)
            parts += 1
            rows_total += int(marker.get("rows") or 0)
            bytes_total += int(marker.get("bytes") or 0)
            if stage == "hidden_states":
                bytes_total += int((marker.get("stats") or {}).get("bytes") or 0)
        rows.append({"stage": stage, "parts": parts, "rows": rows_total, "bytes": bytes_total})
    return rows


def generate_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Amounts to 1e-10 USD, the ledger's own precision (a float sum showed as 0.020358600000000004)."""
    total = (stats.get("generate") or {}).get("total") or {}
    return [{"metric": label, "value": _shown(total.get(key))} for label, key in GENERATE_TOTALS if key in total]


def _shown(value: Any) -> Any:
    """A count per reason as `context_length 7, http_400 2` (the artifact showed a Python dict), most first."""
    if isinstance(value, float):
        return round(value, 10)
    if isinstance(value, dict):
        ranked = sorted(value.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(f"{reason} {count}" for reason, count in ranked) or "-"
    return value


def _markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row[k] is None else str(row[k]) for k in header) + " |")
    return lines


def run_summary_markdown(stats: dict[str, Any]) -> str:
    run_dir = Path(stats["run_dir"])
    prep = stats.get("prepare") or {}
    kept = sum(d.get("kept", 0) for d in (prep.get("datasets") or {}).values())
    lines = [f"# eagle3-datagen run `{run_dir}`", ""]
    if "wall_s" in stats:
        lines.append(f"wall time {stats['wall_s']} s; prompts kept {kept}, quarantined {prep.get('quarantined', 0)}")
        lines.append("")
    lines += ["## Finished parts per stage (from the completion markers)", "", *_markdown_table(stage_rows(run_dir))]
    gen = generate_rows(stats)
    if gen:
        lines += ["", "## Generate", "", *_markdown_table(gen)]
    if stats.get("dry_run"):
        lines += ["", "**dry run**: nothing was sent; see the `estimate` artifact."]
    if stats.get("stopped") == "budget":
        lines += ["", "**stopped at the cost cap** after generate; later stages did not run. Rerun to continue."]
    return "\n".join(lines)
