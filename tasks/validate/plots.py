"""The validation report's pictures: what a person checks first, drawn from the run's own Parquet parts.

- token lengths per dataset (prompt, completion, reasoning): truncation walls, empty answers and a dataset
  that is nothing like the others show up as shapes before anyone reads a number;
- mismatch classes per dataset (reference match, verdict, structural issues): a BPE-artifact rate next to a
  real-difference rate tells "the tokenizer agrees, the sampler split a word oddly" from "the text changed";
- billing deltas (billed - ours, as % of ours) for completion and reasoning tokens, with the tolerance band;
- serving mix: samples per provider/quantization, per dataset.

Matplotlib's object API on an Agg canvas (no pyplot state), so plotting is safe in worker threads.
"""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tasks.common.schemas import REPORTS_DIR
from tasks.common.shards import atomic_write_bytes, done_parts, read_part

MATCH_COLORS = {"exact": "#2e7d32", "bpe_artifact": "#f9a825", "real_difference": "#c62828", "no_reference": "#9e9e9e"}
VERDICT_COLORS = {"pass": "#2e7d32", "warn": "#f9a825", "fail": "#c62828", "drop": "#757575"}
LIGHT = frozenset({"bpe_artifact", "no_reference", "warn"})
LENGTH_COLORS = {"prompt": "#1565c0", "completion": "#6a1b9a", "reasoning": "#ef6c00"}
DPI = 110


@dataclass
class ReportData:
    """Per-dataset arrays read once from the tokens and validation parts."""

    lengths: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    billing_frac: dict[str, np.ndarray] = field(default_factory=dict)
    reasoning_frac: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def datasets(self) -> list[str]:
        return sorted(set(self.lengths) | set(self.billing_frac))


def collect_report_data(run_dir: Path) -> ReportData:
    data = ReportData()
    lengths: dict[str, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for ref in done_parts(run_dir, "tokens"):
        t = read_part(ref, columns=["dataset", "prompt_len", "completion_len", "reasoning_len"])
        datasets = np.asarray(t.column("dataset").to_pylist(), dtype=object)
        for name in np.unique(datasets):
            rows = datasets == name
            for kind in ("prompt", "completion", "reasoning"):
                lengths[str(name)][kind].append(t.column(f"{kind}_len").to_numpy()[rows])
    data.lengths = {d: {k: np.concatenate(v) for k, v in kinds.items()} for d, kinds in lengths.items()}
    billing: dict[str, list[float]] = defaultdict(list)
    reasoning: dict[str, list[float]] = defaultdict(list)
    for ref in done_parts(run_dir, "validation"):
        cols = ["dataset", "billing_delta_frac", "reasoning_delta_tokens", "our_reasoning_tokens"]
        for row in read_part(ref, columns=cols).to_pylist():
            if row["billing_delta_frac"] is not None:
                billing[row["dataset"]].append(row["billing_delta_frac"])
            if row["reasoning_delta_tokens"] is not None:
                reasoning[row["dataset"]].append(row["reasoning_delta_tokens"] / max(row["our_reasoning_tokens"], 1))
    data.billing_frac = {d: np.asarray(v) for d, v in billing.items()}
    data.reasoning_frac = {d: np.asarray(v) for d, v in reasoning.items()}
    return data


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="#616161", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_token_lengths(data: ReportData, path: Path) -> Path:
    datasets = sorted(data.lengths)
    fig = _figure(11, 2.6 * max(len(datasets), 1) + 0.6)
    fig.suptitle("Token lengths per dataset", fontsize=13, fontweight="bold")
    if not datasets:
        _empty(fig.add_subplot(), "no tokens parts yet")
        return _save(fig, path)
    axes = fig.subplots(len(datasets), 2, squeeze=False)
    for row, dataset in enumerate(datasets):
        lengths = data.lengths[dataset]
        panels = ((axes[row][0], ("prompt",)), (axes[row][1], ("completion", "reasoning")))
        for ax, kinds in panels:
            values = np.concatenate([lengths[k] for k in kinds])
            bins = np.histogram_bin_edges(values, bins=min(40, max(5, len(values) // 2))).tolist()
            for kind in kinds:
                v = lengths[kind]
                label = f"{kind}: median {np.median(v):.0f}, p95 {np.percentile(v, 95):.0f}, max {v.max()}"
                ax.hist(v, bins=bins, color=LENGTH_COLORS[kind], alpha=0.55, label=label)
            ax.set_title(f"{dataset}: {' / '.join(kinds)} tokens (n={len(lengths[kinds[0]])})", fontsize=10)
            ax.set_xlabel("tokens")
            ax.set_ylabel("samples")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=8, loc="upper right")
            ax.grid(alpha=0.3)
    return _save(fig, path)


def _stacked(ax: Axes, datasets: list[str], counts: list[dict[str, int]], colors: dict[str, str], title: str) -> None:
    y = np.arange(len(datasets))
    left = np.zeros(len(datasets))
    totals = np.asarray([max(sum(c.values()), 1) for c in counts], dtype=float)
    for key, color in colors.items():
        n = np.asarray([c.get(key, 0) for c in counts], dtype=float)
        frac = n / totals
        ax.barh(y, frac, left=left, color=color, label=key, edgecolor="white")
        ink = "black" if key in LIGHT else "white"
        for i, (f, k) in enumerate(zip(frac, n, strict=True)):
            if k:
                text = f"{int(k)}\n{f:.1%}" if f > 0.06 else f"{int(k)}"
                ax.text(left[i] + f / 2, y[i], text, ha="center", va="center", fontsize=8, color=ink)
        left += frac
    ax.set_yticks(y, datasets)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=len(colors), frameon=False)


def plot_mismatch_classes(summary: list[dict[str, Any]], path: Path) -> Path:
    datasets = [s["dataset"] for s in summary]
    fig = _figure(12, 1.2 * max(len(datasets), 1) + 2.4)
    fig.suptitle("Mismatch classes per dataset", fontsize=13, fontweight="bold")
    if not datasets:
        _empty(fig.add_subplot(), "no validation parts yet")
        return _save(fig, path)
    match_ax, verdict_ax, issue_ax = fig.subplots(1, 3, width_ratios=(1.2, 1, 1.2))
    _stacked(match_ax, datasets, [{k: s[k] for k in MATCH_COLORS} for s in summary], MATCH_COLORS, "reference match")
    _stacked(
        verdict_ax, datasets, [{k: s.get(k, 0) for k in VERDICT_COLORS} for s in summary], VERDICT_COLORS, "verdict"
    )
    codes = sorted({c for s in summary for c in s["structural_issues"]})
    if codes:
        y = np.arange(len(codes))
        height = 0.8 / len(datasets)
        for i, s in enumerate(summary):
            counts = [s["structural_issues"].get(c, 0) for c in codes]
            ax_bars = issue_ax.barh(y + i * height, counts, height=height, label=s["dataset"])
            issue_ax.bar_label(ax_bars, fontsize=7, padding=2)
        issue_ax.set_yticks(y + height * (len(datasets) - 1) / 2, codes, fontsize=8)
        issue_ax.invert_yaxis()
        issue_ax.set_xlabel("samples")
        issue_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        issue_ax.legend(fontsize=7)
        issue_ax.set_title("structural issues", fontsize=10)
    else:
        _empty(issue_ax, "no structural issues")
        issue_ax.set_title("structural issues", fontsize=10)
    return _save(fig, path)


def _delta_hist(ax: Axes, fracs: dict[str, np.ndarray], tolerance: float, what: str) -> None:
    present = {d: v for d, v in fracs.items() if len(v)}
    if not present:
        _empty(ax, f"no billed {what} tokens (the endpoint reported none)")
        ax.set_title(f"{what} tokens: billed - ours", fontsize=10)
        return
    values = np.concatenate(list(present.values())) * 100
    span = max(float(np.abs(values).max()), tolerance * 100 * 2, 0.5)
    width = span / 20
    bins = (np.arange(-20.5, 21.5) * width).tolist()  # 41 bins, one centred on zero (exact agreement)
    for dataset, v in sorted(present.items()):
        beyond = float(np.mean(np.abs(v) > tolerance))
        label = f"{dataset} (n={len(v)}, {beyond:.1%} beyond)"
        ax.hist(v * 100, bins=bins, histtype="step", linewidth=1.8, label=label)
    ax.axvspan(-tolerance * 100, tolerance * 100, color="#a5d6a7", alpha=0.35, label=f"tolerance ±{tolerance:.1%}")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel(f"(billed - ours) / ours, % ({what} tokens)")
    ax.set_ylabel("samples")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{what} tokens: billed - ours", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_billing_deltas(data: ReportData, tolerance: float, path: Path) -> Path:
    fig = _figure(12, 4)
    fig.suptitle("Billing reconciliation", fontsize=13, fontweight="bold")
    completion_ax, reasoning_ax = fig.subplots(1, 2)
    _delta_hist(completion_ax, data.billing_frac, tolerance, "completion")
    _delta_hist(reasoning_ax, data.reasoning_frac, tolerance, "reasoning")
    return _save(fig, path)


def plot_serving(summary: list[dict[str, Any]], path: Path) -> Path:
    fig = _figure(11, 3.6)
    fig.suptitle("Serving providers / quantizations per dataset", fontsize=13, fontweight="bold")
    ax = fig.add_subplot()
    keys = sorted({row["serving"] for s in summary for row in s["serving"]})
    if not keys:
        _empty(ax, "no responses yet")
        return _save(fig, path)
    x = np.arange(len(summary))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        rows = [next((r for r in s["serving"] if r["serving"] == key), None) for s in summary]
        counts = [r["responses"] if r else 0 for r in rows]
        bars = ax.bar(x + i * width, counts, width=width, label=key)
        labels = [f"real diff {r['real_difference_rate']:.1%}" if r and r["referenced"] else "" for r in rows]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    names = [f"{s['dataset']}\n(MIXED)" if s["mixed_serving"] else s["dataset"] for s in summary]
    ax.set_xticks(x + width * (len(keys) - 1) / 2, names)
    ax.set_ylabel("responses")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


@dataclass(frozen=True)
class Plot:
    title: str
    path: Path
    caption: str


def render_plots(run_dir: Path, summary: list[dict[str, Any]], tolerance: float) -> list[Plot]:
    """Write the report's PNGs under `<run_dir>/reports/plots/` and say what each shows."""
    out = run_dir / REPORTS_DIR / "plots"
    out.mkdir(parents=True, exist_ok=True)
    data = collect_report_data(run_dir)
    return [
        Plot(
            "Token lengths",
            plot_token_lengths(data, out / "token_lengths.png"),
            "Prompt and completion (with its reasoning section) lengths per dataset.",
        ),
        Plot(
            "Mismatch classes",
            plot_mismatch_classes(summary, out / "mismatch_classes.png"),
            "Reference comparison, verdicts and structural issues per dataset.",
        ),
        Plot(
            "Billing deltas",
            plot_billing_deltas(data, tolerance, out / "billing_deltas.png"),
            f"Billed minus our token counts, as % of ours; the band is the ±{tolerance:.1%} tolerance.",
        ),
        Plot(
            "Serving mix",
            plot_serving(summary, out / "serving.png"),
            "Responses per serving provider/quantization; a dataset served by several is marked MIXED.",
        ),
    ]
