"""The provider-parity section of the validation report, its gate, and the provider-routing hint.

Runs after extraction (the scores exist only then), over every finished scores part joined by sample id with
the responses' serving provider and quantization. Writes `reports/scores.json` (the summary, keyed by the
scores and responses parts it read and the settings it applied, so a no-op rerun reads no part again) and the
`provider-parity` section of `reports/report.md` / `report.html` (`tasks.validate.sections`, kept across
re-validations). The gate (`scoring.parity_gate`) is applied by the caller after everything is written, like the
validation gates: `check_parity_gate` raises `ProviderParityError` (exit 5) under `fail`.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.config import ScoringConfig
from tasks.common.errors import ValidationGateError
from tasks.common.schemas import REPORTS_DIR, SCORES_STAGE
from tasks.common.shards import atomic_write_text, done_parts, fingerprint, read_part, recipe_digest
from tasks.scoring.parity import METRICS, Comparison, compare, quantiles
from tasks.scoring.policy import REASONS, out_of_bounds
from tasks.validate.checks import serving_key
from tasks.validate.report import markdown_table

SECTION = "provider-parity"
SUMMARY_FILE = "scores.json"
SCORE_COLUMNS = [
    "sample_id",
    "dataset",
    "scored_tokens",
    "mean_nll",
    "top1_rate",
    "longest_low_prob_run",
    "end_logprob",
]
NOTE = (
    "The target model scores every answer it will be trained on: per answer token its own log-probability "
    "and whether the token was its top-1 choice. A provider serving other weights (a quantization, a broken "
    "conversion) or sampling differently gives answers the target finds less likely. Each provider is compared "
    "with the other providers within each dataset (stratified, Welch standard errors, normal approximation); "
    "'worse' is a higher mean NLL per token or a lower top-1 rate."
)


class ProviderParityError(ValidationGateError):
    """`scoring.parity_gate: fail` and a provider's answers score worse than the others' beyond the margin."""


@dataclass(frozen=True)
class ScoreReport:
    summary: dict[str, Any]
    markdown: str
    html: str
    path: Path


def serving_of(run_dir: Path) -> dict[str, tuple[str, str | None, str | None]]:
    """sample_id -> (serving key, provider, quantization) from the responses parts."""
    out: dict[str, tuple[str, str | None, str | None]] = {}
    for ref in done_parts(run_dir, "responses"):
        table = read_part(ref, columns=["sample_id", "provider", "quantization"])
        for sid, provider, quant in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
            out[sid] = (serving_key(provider, quant), provider, quant)
    return out


def scored_samples(run_dir: Path, scfg: ScoringConfig) -> list[dict[str, Any]]:
    """Every scored sample with its serving provider and the bounds it crosses (per-token values not read)."""
    serving = serving_of(run_dir)
    rows = []
    for ref in done_parts(run_dir, SCORES_STAGE):
        for row in read_part(ref, columns=SCORE_COLUMNS).to_pylist():
            key, provider, quant = serving.get(row["sample_id"], (serving_key(None, None), None, None))
            rows.append({**row, "serving": key, "provider": provider, "quantization": quant})
            rows[-1]["reasons"] = out_of_bounds(row, scfg)
    return rows


def report_key(run_dir: Path, scfg: ScoringConfig) -> str:
    parts = {s: [fingerprint(r) for r in done_parts(run_dir, s)] for s in (SCORES_STAGE, "responses")}
    return recipe_digest({"parts": parts, "settings": scfg.model_dump(mode="json")})


def _values(samples: Sequence[Mapping[str, Any]], metric: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        if s[metric] is not None:
            out[s["dataset"]].append(float(s[metric]))
    return out


def _named_line(serving: str, comparisons: Mapping[str, Comparison], scfg: ScoringConfig) -> str:
    parts = []
    for metric, c in comparisons.items():
        if not c.beyond_margin(scfg.parity_confidence, scfg.parity_min_samples):
            continue
        label, unit = ("mean NLL", " nats/token") if metric == "mean_nll" else ("top-1 rate", "")
        shown = c.difference if metric == "mean_nll" else -(c.difference or 0.0)
        low, high = (c.ci95_low, c.ci95_high) if metric == "mean_nll" else (-(c.ci95_high or 0), -(c.ci95_low or 0))
        parts.append(
            f"{label} {shown:+.4f}{unit} vs the other providers (95% CI {low:+.4f}..{high:+.4f}; margin "
            f"{c.margin}; p(worse by more than the margin) = {c.p_worse_beyond_margin:.2g})"
        )
    first = next(iter(comparisons.values()))
    return (
        f"provider {serving!r} scores worse than the other providers on {first.samples} vs {first.rest_samples} "
        f"samples over {first.datasets} datasets: " + "; ".join(parts)
    )


def routing_hint(providers: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """OpenRouter's `provider` object keeping the run at parity: the providers at parity in order of the target's
    mean NLL of their answers (best first), the named ones ignored, the quantizations the ones at parity served."""
    named = [p for p in providers if p["beyond_margin"] and p["provider"]]
    parity = [p for p in providers if not p["beyond_margin"] and p["provider"] and p["judged"]]
    if not named and len(parity) < 2:
        return None
    order = sorted(parity, key=lambda p: p["mean_nll"] if p["mean_nll"] is not None else float("inf"))
    hint: dict[str, Any] = {"order": list(dict.fromkeys(p["provider"] for p in order))}
    ignore = sorted({p["provider"] for p in named} - set(hint["order"]))
    if ignore:
        hint["ignore"] = ignore
    quants = sorted({p["quantization"] for p in parity if p["quantization"]})
    if quants:
        hint["quantizations"] = quants
    return hint


def summarize_scores(run_dir: Path, scfg: ScoringConfig) -> dict[str, Any]:
    samples = scored_samples(run_dir, scfg)
    scored = [s for s in samples if s["scored_tokens"]]
    by_serving: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in scored:
        by_serving[s["serving"]].append(s)
    providers = []
    named_lines = []
    for key in sorted(by_serving):
        mine, rest = by_serving[key], [s for s in scored if s["serving"] != key]
        comparisons = {
            m: compare(m, _values(mine, m), _values(rest, m), _margin(m, scfg))
            for m in METRICS
            if rest or m == "mean_nll"
        }
        judged = bool(rest) and all(
            c.samples >= scfg.parity_min_samples and c.rest_samples >= scfg.parity_min_samples
            for c in comparisons.values()
        )
        beyond = any(c.beyond_margin(scfg.parity_confidence, scfg.parity_min_samples) for c in comparisons.values())
        named = beyond and scfg.parity_gate != "off"
        if named:
            named_lines.append(_named_line(key, comparisons, scfg))
        providers.append(
            {
                "serving": key,
                "provider": mine[0]["provider"],
                "quantization": mine[0]["quantization"],
                "samples": len(mine),
                "mean_nll": _mean([s["mean_nll"] for s in mine]),
                "top1_rate": _mean([s["top1_rate"] for s in mine]),
                "judged": judged,
                "beyond_margin": beyond,
                "named": named,
                "comparisons": {m: c.to_dict() for m, c in comparisons.items()} if rest else {},
            }
        )
    datasets = sorted({s["dataset"] for s in samples})
    rows = []
    for dataset in datasets:
        in_dataset = [s for s in scored if s["dataset"] == dataset]
        for key in sorted({s["serving"] for s in in_dataset}):
            mine = [s for s in in_dataset if s["serving"] == key]
            rest = [s for s in in_dataset if s["serving"] != key]
            nll = [s["mean_nll"] for s in mine]
            others = {dataset: [s["mean_nll"] for s in rest]}
            c = compare("mean_nll", {dataset: nll}, others, scfg.parity_margin_nll_nats)
            runs = [s["longest_low_prob_run"] for s in mine]
            rows.append(
                {
                    "dataset": dataset,
                    "serving": key,
                    "samples": len(mine),
                    "mean_nll": _mean(nll),
                    "nll_p10_p50_p90": quantiles(nll),
                    "top1_rate": _mean([s["top1_rate"] for s in mine]),
                    "low_prob_run_mean": _mean(runs),
                    "low_prob_run_max": max(runs),
                    "out_of_bounds": sum(bool(s["reasons"]) for s in mine),
                    "nll_vs_others": c.difference,
                    "p_worse": c.p_worse,
                }
            )
    reasons: list[dict[str, Any]] = []
    for dataset in datasets:
        in_dataset = [s for s in samples if s["dataset"] == dataset]
        counts = Counter(r for s in in_dataset for r in s["reasons"])
        reasons.append(
            {
                "dataset": dataset,
                "samples": len(in_dataset),
                "unscored": sum(not s["scored_tokens"] for s in in_dataset),
                **{r: counts.get(r, 0) for r in REASONS},
                "out_of_bounds": sum(bool(s["reasons"]) for s in in_dataset),
                "policy": scfg.sample_policy,
            }
        )
    return {
        "samples": len(samples),
        "scored_samples": len(scored),
        "settings": scfg.model_dump(mode="json"),
        "providers": providers,
        "datasets": rows,
        "out_of_bounds": reasons,
        "named": [p["serving"] for p in providers if p["named"]],
        "named_lines": named_lines,
        "routing_hint": routing_hint(providers),
    }


def _margin(metric: str, scfg: ScoringConfig) -> float:
    return scfg.parity_margin_nll_nats if metric == "mean_nll" else scfg.parity_margin_top1_rate


def _mean(values: Sequence[float | int | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value != 0 else f"{value:.{digits}f}"
    if isinstance(value, list):
        return " / ".join(_fmt(v, 3) for v in value)
    return str(value)


def provider_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per serving provider, all datasets: the table of the report, the artifact and the terminal."""
    rows = []
    for p in summary["providers"]:
        nll, top1 = p["comparisons"].get("mean_nll", {}), p["comparisons"].get("top1_rate", {})
        verdict = "at parity" if p["judged"] else "too few samples to judge"
        if p["beyond_margin"]:
            verdict = "NAMED (worse beyond the margin)" if p["named"] else "worse beyond the margin (gate off)"
        if not p["comparisons"]:
            verdict = "only provider: nothing to compare"
        rows.append(
            {
                "serving": p["serving"],
                "samples": str(p["samples"]),
                "mean NLL": _fmt(p["mean_nll"]),
                "NLL vs others": _signed(nll.get("difference")),
                "NLL 95% CI": _ci(nll),
                "p(NLL worse > margin)": _fmt(nll.get("p_worse_beyond_margin"), 2),
                "top-1 rate": _fmt(p["top1_rate"]),
                "top-1 vs others": _signed(None if top1.get("difference") is None else -top1["difference"]),
                "p(top-1 worse > margin)": _fmt(top1.get("p_worse_beyond_margin"), 2),
                "verdict": verdict,
            }
        )
    return rows


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def _ci(c: Mapping[str, Any]) -> str:
    low, high = c.get("ci95_low"), c.get("ci95_high")
    return "-" if low is None or high is None else f"{low:+.4f}..{high:+.4f}"


def dataset_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    return [
        {
            "dataset": r["dataset"],
            "serving": r["serving"],
            "samples": str(r["samples"]),
            "mean NLL": _fmt(r["mean_nll"]),
            "NLL p10 / p50 / p90": _fmt(r["nll_p10_p50_p90"]),
            "top-1 rate": _fmt(r["top1_rate"]),
            "longest low-prob run (mean / max)": f"{_fmt(r['low_prob_run_mean'], 3)} / {r['low_prob_run_max']}",
            "out of bounds": str(r["out_of_bounds"]),
            "NLL vs others": _signed(r["nll_vs_others"]),
            "p(worse)": _fmt(r["p_worse"], 2),
        }
        for r in summary["datasets"]
    ]


def hint_yaml(hint: Mapping[str, Any] | None) -> str:
    if hint is None:
        return "No suggestion: fewer than two providers could be judged."
    fields = ", ".join(f"{k}: {json.dumps(v)}" for k, v in hint.items())
    return f"endpoint:\n  provider_routing: {{{fields}}}"


def _status(summary: Mapping[str, Any], scfg: ScoringConfig) -> str:
    n = summary["scored_samples"]
    if summary["named"]:
        return f"**{len(summary['named'])} provider(s) named** (parity_gate: {scfg.parity_gate}, {n} scored samples)"
    judged = sum(p["judged"] for p in summary["providers"])
    return f"no provider named ({judged} of {len(summary['providers'])} judged, {n} scored samples)"


def section_markdown(summary: Mapping[str, Any], scfg: ScoringConfig) -> str:
    settings = (
        f"margins: {scfg.parity_margin_nll_nats} nats/token mean NLL, {scfg.parity_margin_top1_rate} top-1 rate; "
        f"confidence {scfg.parity_confidence}; at least {scfg.parity_min_samples} samples a side; low-probability "
        f"floor {scfg.low_prob_floor}"
    )
    lines = ["## Provider parity (the target's scores of its training data)", "", NOTE, "", _status(summary, scfg), ""]
    if summary["named_lines"]:
        lines += [*[f"- {line}" for line in summary["named_lines"]], ""]
    lines += [settings, ""]
    lines += ["### Per provider, all datasets", "", markdown_table(provider_rows(summary))]
    lines += ["### Per dataset and provider", "", markdown_table(dataset_rows(summary))]
    lines += ["### Samples outside the score bounds, by reason", "", markdown_table(summary["out_of_bounds"])]
    lines += ["### Suggested provider routing", ""]
    hint = summary["routing_hint"]
    lines += ["```yaml", hint_yaml(hint), "```", ""] if hint is not None else [hint_yaml(hint), ""]
    return "\n".join(lines)


def _html_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def section_html(summary: Mapping[str, Any], scfg: ScoringConfig) -> str:
    named = "".join(f"<li>{html.escape(line)}</li>" for line in summary["named_lines"])
    css = "status bad" if summary["named"] else "status ok"
    status = html.escape(_status(summary, scfg).replace("**", ""))
    return (
        "<h2>Provider parity (the target's scores of its training data)</h2>"
        f"<p>{html.escape(NOTE)}</p><div class='{css}'>{status}<ul>{named}</ul></div>"
        + "<h3>Per provider, all datasets</h3>"
        + _html_table(provider_rows(summary))
        + "<h3>Per dataset and provider</h3>"
        + _html_table(dataset_rows(summary))
        + "<h3>Samples outside the score bounds, by reason</h3>"
        + _html_table(summary["out_of_bounds"])
        + f"<h3>Suggested provider routing</h3><pre>{html.escape(hint_yaml(summary['routing_hint']))}</pre>"
    )


def publish_score_report(run_dir: Path, scfg: ScoringConfig) -> ScoreReport:
    """Summary (reused while its key holds), `reports/scores.json` and the report section; no gate applied."""
    from tasks.validate.sections import add_report_section

    path = Path(run_dir) / REPORTS_DIR / SUMMARY_FILE
    key = report_key(run_dir, scfg)
    summary: dict[str, Any] | None = None
    try:
        stored = json.loads(path.read_text())
        if isinstance(stored, dict) and stored.get("key") == key:
            summary = stored["summary"]
    except (OSError, ValueError, KeyError):
        summary = None
    markdown = ""
    if summary is None:
        summary = summarize_scores(run_dir, scfg)
        atomic_write_text(path, json.dumps({"key": key, "summary": summary}, indent=1, default=str))
    markdown = section_markdown(summary, scfg)
    add_report_section(Path(run_dir), SECTION, markdown, section_html(summary, scfg))
    return ScoreReport(summary, markdown, section_html(summary, scfg), path)


def parity_violations(summary: Mapping[str, Any]) -> list[str]:
    return list(summary["named_lines"])


def check_parity_gate(summary: Mapping[str, Any], scfg: ScoringConfig) -> None:
    """Raise ProviderParityError under `parity_gate: fail` when a provider is named."""
    crossed = parity_violations(summary)
    if crossed and scfg.parity_gate == "fail":
        raise ProviderParityError("provider parity gate crossed:\n  " + "\n  ".join(crossed))
