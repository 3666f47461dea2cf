"""The estimate as text: one table, datasets as columns, then the totals the user decides on."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from tasks.estimate.estimate import RunEstimate


def _usd(value: float | None) -> str:
    return "unknown" if value is None else f"${value:,.4f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


NO_LATENCY_CLI = "pass --observed RUN_DIR of a finished run"
NO_LATENCY_RUN = "this run directory holds no answers yet; a later run of it estimates from them"
"""What the estimate says in a Prefect run, whose form has no --observed (a CLI option)."""


def estimate_text(est: RunEstimate, width: int = 160, no_latency: str = NO_LATENCY_CLI) -> str:
    table = Table(title="estimate (nothing sent)")
    table.add_column("metric")
    for d in est.datasets:
        table.add_column(d.dataset, justify="right")
    metrics = [
        ("samples (total)", "samples_total"),
        ("already done", "samples_done"),
        ("failed, not sent again", "samples_failed_kept"),
        ("quarantined rows", "quarantined"),
        ("requests to send", "requests"),
        ("prompt tokens (exact)", "prompt_tokens"),
        ("completion tokens low", "completion_tokens_low"),
        ("completion tokens expected", "completion_tokens_expected"),
        ("completion tokens high", "completion_tokens_high"),
    ]
    for label, attr in metrics:
        table.add_row(label, *(f"{getattr(d, attr):,}" for d in est.datasets))
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, no_color=True, force_terminal=False)
    console.print(table)
    p = est.prices
    cost = {w: est.cost_usd(w) for w in ("low", "expected", "high")}
    wall = {w: est.wall_s(w) for w in ("low", "expected", "high")}
    sources = sorted({d.completion_source for d in est.datasets if d.requests})
    lines = [
        f"model: {est.model}; requests to send: {est.requests:,}",
        f"prices: ${p.prompt_usd_per_mtok:g} prompt / ${p.completion_usd_per_mtok:g} completion per Mtok ({p.source})",
        *([f"warning: {p.disagreement}"] if p.disagreement else []),
        f"completion lengths: {'; '.join(sources) or 'nothing left to send'}",
        f"cost: low {_usd(cost['low'])}, expected {_usd(cost['expected'])}, high {_usd(cost['high'])}"
        + (f"; already spent {_usd(est.spent_usd)}" if est.spent_usd else "")
        + (f" (+ {_usd(est.pending_usd)} pending at worst case)" if est.pending_usd else "")
        + (f"; cap endpoint.max_cost_usd {_usd(est.max_cost_usd)}" if est.max_cost_usd is not None else ""),
        f"wall time at max_in_flight={est.max_in_flight}: "
        + (
            f"low {_duration(wall['low'])}, expected {_duration(wall['expected'])}, high {_duration(wall['high'])} "
            f"(mean latency {est.latency_s_mean:.2f} s observed)"
            if est.latency_s_mean is not None
            else f"unknown (no observed latencies: {no_latency})"
            if est.requests
            else "0 s"
        ),
    ]
    return buffer.getvalue() + "\n".join(lines)
