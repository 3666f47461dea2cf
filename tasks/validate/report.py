"""The standalone validation report: written next to the validation parts so it survives without Prefect.

`validation/summary.json` (machine-readable), `validation/report.md` and `validation/report.html` (one
self-contained file: plots embedded, so it can be mailed or opened from an object store), and the plots as
PNGs under `validation/plots/`. The gate verdict is at the top: the report is written before the gates fail
the flow, so a failed run always has the page that explains it.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from tasks.common.shards import atomic_write_text, done_parts, read_part, read_provenance
from tasks.validate.plots import Plot, render_plots

OVERVIEW_COLUMNS = (
    ("dataset", "dataset"),
    ("responses", "responses"),
    ("failed_rate", "failed"),
    ("samples", "validated"),
    ("pass", "pass"),
    ("warn", "warn"),
    ("fail", "fail"),
    ("referenced", "with reference"),
    ("exact_rate", "exact"),
    ("bpe_artifact_rate", "BPE artifact"),
    ("real_difference_rate", "real difference"),
    ("mean_completion_tokens", "mean completion tokens"),
)
RATE_KEYS = frozenset({"failed_rate", "exact_rate", "bpe_artifact_rate", "real_difference_rate", "fail_rate"})
EXAMPLES = 5


def _cell(key: str, value: Any) -> str:
    if key in RATE_KEYS and isinstance(value, float):
        return f"{value:.2%}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_no rows_\n"
    columns = list(rows[0])
    for row in rows[1:]:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c, r.get(c, "")).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def overview_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in summary:
        row = {label: _cell(key, s[key]) for key, label in OVERVIEW_COLUMNS}
        billing = s["billing"]
        row["billing delta"] = f"{billing['delta_frac']:+.3%}" if billing["has_billing"] else "n/a"
        row["reasoning billing delta"] = (
            f"{billing['reasoning_delta_frac']:+.3%}" if billing["billed_reasoning_tokens"] else "n/a"
        )
        row["billing flagged"] = str(billing["flagged_samples"])
        row["serving"] = ("MIXED: " if s["mixed_serving"] else "") + ", ".join(
            f"{k} ({v})" for k, v in s["providers"].items()
        )
        rows.append(row)
    return rows


def _serving_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("responses", "samples", "fail_rate", "real_difference_rate", "bpe_artifact_rate", "billing_delta_frac")
    return [
        {"dataset": s["dataset"], "serving": r["serving"], **{k: _cell(k, r[k]) for k in keys}}
        for s in summary
        for r in s["serving"]
    ]


def real_difference_examples(run_dir: Path, limit: int = EXAMPLES) -> list[dict[str, Any]]:
    """The first real differences per dataset, with the tokens on each side of the first divergence."""
    cols = ["dataset", "sample_id", "reference_match", "first_divergence", "divergence_ours", "divergence_reference"]
    out: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for ref in done_parts(run_dir, "validation"):
        for row in read_part(ref, columns=cols).to_pylist():
            if row["reference_match"] != "real_difference" or seen.get(row["dataset"], 0) >= limit:
                continue
            seen[row["dataset"]] = seen.get(row["dataset"], 0) + 1
            out.append({k: row[k] for k in cols if k != "reference_match"})
    return out


def format_provenance(run_dir: Path) -> dict[str, Any]:
    """Completion format, its template check and the tokenizer identity, from the first tokens part."""
    parts = done_parts(run_dir, "tokens")
    if not parts:
        return {}
    p = read_provenance(parts[0].path)
    keys = ("completion_format", "tokenizer_path", "tokenizer_hash", "tokenizer_revision", "tokenizer_backend")
    out = {k: p.get(k) for k in keys}
    check = p.get("completion_format_check") or {}
    out["format_notes"] = check.get("notes", [])
    out["reasoning_visible_in_template"] = check.get("reasoning_visible")
    return out


def _markdown(
    run_dir: Path, summary: list[dict[str, Any]], violations: list[str], plots: list[Plot], extra: dict[str, Any]
) -> str:
    status = "**GATES CROSSED**" if violations else "all gates passed"
    lines = [f"# Validation report: `{run_dir}`", "", f"Gate status: {status}", ""]
    lines += [f"- {v}" for v in violations]
    lines += ["", "## Overview", "", markdown_table(overview_rows(summary))]
    for plot in plots:
        lines += [f"## {plot.title}", "", plot.caption, "", f"![{plot.title}](plots/{plot.path.name})", ""]
    lines += ["## Serving providers", "", markdown_table(_serving_rows(summary))]
    if extra["examples"]:
        lines += ["## First real differences", "", markdown_table(extra["examples"])]
    if extra["format"]:
        lines += ["## Completion format and tokenizer", "", markdown_table([extra["format"]])]
    lines += ["## Full summary", "", markdown_table(summary)]
    return "\n".join(lines)


def _html_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c, r.get(c, '')))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1300px;
       color: #212121; }
h1 { font-size: 1.5em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #e0e0e0; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #e0e0e0; padding: 4px 8px; text-align: right; }
th { background: #f5f5f5; } td:first-child, th:first-child { text-align: left; }
.status { padding: 0.8em 1em; border-radius: 6px; font-weight: 600; }
.ok { background: #e8f5e9; color: #1b5e20; } .bad { background: #ffebee; color: #b71c1c; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eeeeee; }
figcaption { color: #616161; font-size: 0.9em; }
"""


def _html(
    run_dir: Path, summary: list[dict[str, Any]], violations: list[str], plots: list[Plot], extra: dict[str, Any]
) -> str:
    if violations:
        items = "".join(f"<li>{html.escape(v)}</li>" for v in violations)
        status = f'<div class="status bad">Validation gates crossed<ul>{items}</ul></div>'
    else:
        status = '<div class="status ok">All validation gates passed</div>'
    figures = []
    for plot in plots:
        encoded = base64.b64encode(plot.path.read_bytes()).decode()
        figures.append(
            f"<h2>{html.escape(plot.title)}</h2><figure><img alt='{html.escape(plot.title)}' "
            f"src='data:image/png;base64,{encoded}'><figcaption>{html.escape(plot.caption)}</figcaption></figure>"
        )
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    sections = [
        f"<h1>Validation report</h1><p><code>{html.escape(str(run_dir))}</code>, generated {generated}</p>",
        status,
        "<h2>Overview</h2>" + _html_table(overview_rows(summary)),
        *figures,
        "<h2>Serving providers</h2>" + _html_table(_serving_rows(summary)),
        "<h2>First real differences</h2>" + _html_table(extra["examples"]),
        "<h2>Completion format and tokenizer</h2>" + _html_table([extra["format"]] if extra["format"] else []),
    ]
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Validation report: {html.escape(run_dir.name)}"
        f"</title><style>{STYLE}</style></head><body>{''.join(sections)}</body></html>"
    )


def artifact_markdown(report: Path, summary: list[dict[str, Any]], violations: list[str]) -> str:
    """The short form for the Prefect UI: gate status, the overview table, and where the full report is."""
    status = "**Validation gates crossed**" if violations else "All validation gates passed"
    lines = [f"# Validation: {status}", "", *[f"- {v}" for v in violations], ""]
    lines += [markdown_table(overview_rows(summary)), f"Full report with plots: `{report}`"]
    return "\n".join(lines)


def write_validation_report(
    run_dir: Path,
    summary: list[dict[str, Any]],
    violations: list[str] | None = None,
    billing_tolerance_frac: float = 0.02,
) -> Path:
    """Write summary.json, the plots, report.md and report.html; returns the HTML report's path."""
    out = run_dir / "validation"
    violations = list(violations or [])
    payload = {"gates_crossed": violations, "datasets": summary}
    atomic_write_text(out / "summary.json", json.dumps(payload, indent=2, sort_keys=True, default=str))
    plots = render_plots(run_dir, summary, billing_tolerance_frac)
    extra = {"examples": real_difference_examples(run_dir), "format": format_provenance(run_dir)}
    atomic_write_text(out / "report.md", _markdown(run_dir, summary, violations, plots, extra))
    report = out / "report.html"
    atomic_write_text(report, _html(run_dir, summary, violations, plots, extra))
    from tasks.validate.sections import reapply_sections  # sections later stages added (e.g. evaluate)

    reapply_sections(run_dir)
    return report
