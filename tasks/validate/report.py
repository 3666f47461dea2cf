"""The standalone validation report: written into the run directory so it survives without Prefect.

`reports/summary.json` (machine-readable), `reports/report.md` and `reports/report.html` (one
self-contained file: plots embedded, so it can be mailed or opened from an object store), and the plots as
PNGs under `reports/plots/` (beside `validation/`, which holds only parts and markers). The gate verdict is at
the top: the report is written before the gates fail the flow, so a failed run always has the page that
explains it.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from tasks.common.schemas import REPORTS_DIR
from tasks.common.shards import atomic_write_text, done_parts, read_part, read_provenance
from tasks.validate.plots import Plot, render_plots

OVERVIEW_COLUMNS = (
    ("dataset", "dataset"),
    ("responses", "responses"),
    ("failed_rate", "failed, retried by the next run"),
    ("deterministic_failed_rate", "failed, deterministic"),
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
RATE_KEYS = frozenset(
    {"failed_rate", "deterministic_failed_rate", "exact_rate", "bpe_artifact_rate", "real_difference_rate", "fail_rate"}
)
EXAMPLES = 5
PROMPT_NOTE = (
    "usage.prompt_tokens against the length of the prompt rebuilt with the chat template: drift means the provider "
    "rendered another prompt (a default system prompt, an injected date, another template revision), so the "
    "hidden states would be computed on a context the model did not see."
)
EXCLUDED_NOTE = (
    "Samples extraction and exports leave out: verdict fail (with extract.skip_failed_validation) or drop "
    "(validation.tool_call_policy: drop), by the reason codes that decided it."
)
WHITESPACE_NOTE = (
    "Answers with leading/trailing whitespace on reasoning or content, per provider. 'stripped': reference ids "
    "differ from ours only in whitespace; 'suspect': none of the provider's answers has any while another "
    "provider's do; 'unverified': none has any and there are no reference ids to tell."
)


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
    """One row per dataset (18 columns); `overview_table` turns it for narrow displays."""
    rows = []
    for s in summary:
        row = {label: _cell(key, s.get(key, 0.0)) for key, label in OVERVIEW_COLUMNS}
        billing = s["billing"]
        row["billing delta"] = f"{billing['delta_frac']:+.3%}" if billing["has_billing"] else "n/a"
        row["reasoning billing delta"] = (
            f"{billing['reasoning_delta_frac']:+.3%}" if billing["billed_reasoning_tokens"] else "n/a"
        )
        row["billing flagged"] = str(billing["flagged_samples"])
        prompt = s.get("prompt_tokens")
        if prompt:
            row["prompt tokens exact/tol/drift"] = f"{prompt['exact']}/{prompt['within_tolerance']}/{prompt['drift']}"
        row["excluded"] = str(s.get("excluded", s["fail"]))
        sources = s.get("token_sources")
        if sources:
            counts = f"{sources.get('model', 0)}/{sources.get('reencoded', 0)}"
            if sources.get("repaired"):
                row["ids model-exact/re-encoded/repaired"] = f"{counts}/{sources['repaired']}"
            else:
                row["ids model-exact/re-encoded"] = counts
        row["serving"] = ("MIXED: " if s["mixed_serving"] else "") + ", ".join(
            f"{k} ({v})" for k, v in s["providers"].items()
        )
        rows.append(row)
    return rows


def overview_table(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The overview with metrics as rows and datasets as columns: what fits a Prefect table artifact (and a
    terminal) without being cut off on the right, however many metrics there are."""
    rows = overview_rows(summary)
    metrics = [m for m in (rows[0] if rows else {}) if m != "dataset"]
    return [{"metric": m, **{str(r["dataset"]): r[m] for r in rows}} for m in metrics]


def _serving_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("responses", "samples", "fail_rate", "real_difference_rate", "bpe_artifact_rate", "billing_delta_frac")
    return [
        {"dataset": s["dataset"], "serving": r["serving"], **{k: _cell(k, r[k]) for k in keys}}
        for s in summary
        for r in s["serving"]
    ]


def prompt_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompt-token reconciliation per dataset and serving provider (usage.prompt_tokens vs the rebuilt prompt)."""
    rows = []
    for s in summary:
        tolerance = s.get("prompt_tolerance_tokens")
        for serving, p in [
            ("all", s.get("prompt_tokens")),
            *((r["serving"], r.get("prompt_tokens")) for r in s["serving"]),
        ]:
            if not p:
                continue
            rows.append(
                {
                    "dataset": s["dataset"],
                    "serving": serving,
                    "exact": p["exact"],
                    f"within ±{tolerance}": p["within_tolerance"],
                    "drift": p["drift"],
                    "no usage": p["no_usage"],
                    "drift rate": f"{p['drift_rate']:.2%}",
                    "mean delta tokens": f"{p['mean_delta_tokens']:+.2f}",
                }
            )
    return rows


def exclusion_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples left out of extraction per dataset (verdict fail or drop) and the reasons (a sample may have
    several)."""
    return [
        {
            "dataset": s["dataset"],
            "excluded": s.get("excluded", s["fail"]),
            "fail": s["fail"],
            "drop": s.get("drop", 0),
            "reasons": ", ".join(f"{k}: {v}" for k, v in s.get("exclusion_reasons", {}).items()) or "none",
        }
        for s in summary
    ]


def whitespace_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the boundary-whitespace check found per dataset and serving provider."""
    return [
        {
            "dataset": s["dataset"],
            "serving": w["serving"],
            "answers": w["answers"],
            "with boundary whitespace": f"{w['boundary_whitespace_rate']:.1%}",
            "whitespace-only reference differences": w["whitespace_stripped"],
            "finding": w["finding"],
            "detail": w["detail"],
        }
        for s in summary
        for w in s.get("whitespace", [])
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
    lines += ["## Prompt-token reconciliation", "", PROMPT_NOTE, "", markdown_table(prompt_rows(summary))]
    lines += ["## Excluded samples", "", EXCLUDED_NOTE, "", markdown_table(exclusion_rows(summary))]
    lines += ["## Whitespace", "", WHITESPACE_NOTE, "", markdown_table(whitespace_rows(summary))]
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
        f"<h2>Prompt-token reconciliation</h2><p>{html.escape(PROMPT_NOTE)}</p>" + _html_table(prompt_rows(summary)),
        f"<h2>Excluded samples</h2><p>{html.escape(EXCLUDED_NOTE)}</p>" + _html_table(exclusion_rows(summary)),
        f"<h2>Whitespace</h2><p>{html.escape(WHITESPACE_NOTE)}</p>" + _html_table(whitespace_rows(summary)),
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
    lines += [markdown_table(overview_table(summary))]
    lines += ["## Prompt-token reconciliation", "", markdown_table(prompt_rows(summary))]
    lines += ["## Excluded samples", "", markdown_table(exclusion_rows(summary))]
    lines += [f"Full report with plots: `{report}`"]
    return "\n".join(lines)


def write_validation_report(
    run_dir: Path,
    summary: list[dict[str, Any]],
    violations: list[str] | None = None,
    billing_tolerance_frac: float = 0.02,
) -> Path:
    """Write summary.json, the plots, report.md and report.html; returns the HTML report's path."""
    out = run_dir / REPORTS_DIR
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
