"""Live progress of a generate run, as plain snapshots pushed to listeners (CLI display, Prefect artifact).

Why listeners instead of the engine drawing anything: the engine runs inside a Prefect task, a plain CLI, or a
benchmark; each wants its own view, and none of them may slow the event loop that keeps 2,000 requests in flight.
The engine builds a snapshot every `endpoint.progress_every_s` and hands it to listeners on a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Literal


@dataclass(frozen=True)
class ProgressSnapshot:
    """Counts cover the samples this run set out to finish (`total`); costs are USD."""

    elapsed_s: float
    total: int
    done: int
    failed: int
    in_flight: int
    window: int
    requests_sent: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    prior_cost_usd: float
    reserved_usd: float
    max_cost_usd: float | None
    budget_stopped: bool
    final: bool
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    retries_by_reason: dict[str, int] = field(default_factory=dict)
    pending_usd: float = 0.0
    """Worst case of this directory's attempts that were sent and got no answer (timeouts, resets after sending,
    kills), not yet settled from the provider's records: counted against the cap, never shown as spent."""
    pending_attempts: int = 0
    unsent_attempts: int = 0
    """Attempts that never left (connection refused, DNS/TLS failure before the request was written): $0."""
    endpoint_down_since_s: float | None = None
    """`elapsed_s` at which the current outage began (the circuit breaker is open); None while it answers."""
    outages: int = 0
    stopped: str | None = None
    """On a final snapshot of a run that ended before its samples did: why, in a few words ("cancelled", an
    outage outlasting `endpoint.outage_abort_s`, the error that ended it); None for one that ran to its end or
    stopped at the budget cap (`budget_stopped`). A cancelled run's card said "final ... ETA finished in 17s" at
    16%."""

    @property
    def finished(self) -> int:
        return self.done + self.failed

    @property
    def retries(self) -> int:
        """The sum of `retries_by_reason`, never a count of its own: a live card read "10 retries" beside
        "http_503 12" when one counted the retries of recorded samples and the other those of samples still in
        flight too."""
        return sum(self.retries_by_reason.values())

    @property
    def percent(self) -> float:
        return 100.0 * self.finished / self.total if self.total > 0 else 100.0

    @property
    def req_per_s(self) -> float:
        return self.requests_sent / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tok_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def spent_usd(self) -> float:
        """Billed spend of the run directory so far, earlier runs plus this one (pending amounts apart)."""
        return self.prior_cost_usd + self.cost_usd

    @property
    def projected_cost_usd(self) -> float | None:
        """Run-directory total if every remaining sample costs what finished ones cost on average."""
        if self.finished == 0:
            return None
        return self.spent_usd + self.cost_usd / self.finished * (self.total - self.finished)

    @property
    def eta_s(self) -> float | None:
        if self.finished == 0 or self.elapsed_s <= 0:
            return None
        return (self.total - self.finished) / (self.finished / self.elapsed_s)


Listener = Callable[[ProgressSnapshot], None]

RunEventKind = Literal[
    "outage_start",
    "outage_end",
    "budget_stop",
    "settled",
    "price_drift",
    "unreconciled",
    "account_wait",
    "no_cap",
    "disk_full",
    "disk_failed",
]


@dataclass(frozen=True)
class RunEvent:
    """Something a user reading the run's log must see the moment it happens, not at the next snapshot:
    an outage starting or ending, the budget stopping the run, pending spend settled from the provider."""

    kind: RunEventKind
    message: str
    elapsed_s: float


EventListener = Callable[[RunEvent], None]

EVENT_LABELS: dict[str, str] = {
    "outage_start": "endpoint outage started",
    "outage_end": "endpoint outage ended",
    "budget_stop": "stopped at the budget cap",
    "settled": "pending spend settled",
    "price_drift": "billed above the configured prices",
    "unreconciled": "costs not reconciled",
    "account_wait": "key's account",
    "no_cap": "no cost cap",
    "disk_full": "the disk is full",
    "disk_failed": "the disk failed",
}


def event_line(event: RunEvent) -> str:
    """The one line a run event is told by, the same in a Prefect task's log and on the CLI's stderr."""
    return f"{EVENT_LABELS.get(event.kind, event.kind)} at {format_duration(event.elapsed_s)}: {event.message}"


_event_listeners: list[EventListener] = []

_listeners: list[Listener] = []
_lock = threading.Lock()


def add_listener(listener: Listener) -> Callable[[], None]:
    """Register a process-wide listener; returns the function that removes it."""
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


def add_event_listener(listener: EventListener) -> Callable[[], None]:
    """Register a process-wide run-event listener; returns the function that removes it."""
    with _lock:
        _event_listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _event_listeners:
                _event_listeners.remove(listener)

    return remove


def emit_event(event: RunEvent) -> None:
    """Call every event listener (from any thread); a failing listener never stops generation."""
    with _lock:
        targets = list(_event_listeners)
    for listener in targets:
        try:
            listener(event)
        except Exception:
            continue


def emit(snapshot: ProgressSnapshot, extra: list[Listener] | None = None) -> None:
    """Call every listener; one listener's failure must never stop generation or the others."""
    with _lock:
        targets = [*_listeners, *(extra or [])]
    for listener in targets:
        try:
            listener(snapshot)
        except Exception:  # a display or artifact hiccup is not a reason to lose a run
            continue


def format_usd(value: float | None) -> str:
    """Cents for ordinary amounts; four decimals below a dollar, where a demo or a small test run lives. Halves
    round up after rounding to 1e-10: the same spend summed in another order (0.03525 as 0.0352499999 or
    0.0352500001) printed $0.0352 in one place and $0.0353 in another."""
    if value is None:
        return "-"
    exact = Decimal(f"{value:.10f}")
    places = Decimal("0.01") if abs(exact) >= 1 else Decimal("0.0001")
    rounded = exact.quantize(places, rounding=ROUND_HALF_UP)
    return f"${rounded:,.2f}" if abs(exact) >= 1 else f"${rounded:.4f}"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def plural(n: int, noun: str) -> str:
    """`1 attempt`, `3 attempts`: a card read "over 1 attempts"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def format_counts(counts: Mapping[str, int], top: int | None = None) -> str:
    """`http_500 3, length 2`: most frequent first, so a truncated list keeps what matters."""
    ranked = sorted(((n, k) for k, n in counts.items() if n), key=lambda item: (-item[0], item[1]))
    shown = ranked if top is None else ranked[:top]
    text = ", ".join(f"{k} {n:,}" for n, k in shown)
    if len(shown) < len(ranked):
        text += f", +{len(ranked) - len(shown)} more"
    return text or "-"


def heading(s: ProgressSnapshot) -> str:
    """What a snapshot is, as the progress card's heading: "in progress", "final" for a run that ran to its end, or
    "stopped at 32/200: cancelled" for one that ended first (cancelled, aborted, failed, or at the budget cap
    with samples left), so no card calls a cut-short run final."""
    if not s.final:
        return "in progress"
    if s.stopped is not None:
        return f"stopped at {s.finished:,}/{s.total:,}: {s.stopped}"
    if s.budget_stopped and s.finished < s.total:
        return f"stopped at {s.finished:,}/{s.total:,}: the budget cap"
    return "final"


def _eta(s: ProgressSnapshot) -> str:
    if s.final and s.stopped is not None:
        return f"none: stopped after {format_duration(s.elapsed_s)} ({s.stopped})"
    if s.budget_stopped:
        return "stopped at the budget cap"
    if s.final:
        return f"finished in {format_duration(s.elapsed_s)}"
    return format_duration(s.eta_s)


def _budget(s: ProgressSnapshot) -> str:
    if s.max_cost_usd is None:
        return f"no cap, {format_usd(s.reserved_usd)} reserved in flight"
    left = max(0.0, s.max_cost_usd - s.spent_usd - s.pending_usd - s.reserved_usd)
    used = 100.0 * s.spent_usd / s.max_cost_usd
    stopped = " (STOPPED)" if s.budget_stopped else ""
    pending = f", {format_usd(s.pending_usd)} pending" if s.pending_usd > 0 else ""
    return (
        f"cap {format_usd(s.max_cost_usd)}: {used:.0f}% spent{pending}, {format_usd(s.reserved_usd)} reserved, "
        f"{format_usd(left)} left{stopped}"
    )


def _projected(s: ProgressSnapshot) -> str:
    projected = s.projected_cost_usd
    if projected is None:
        return "-"
    text = f"{format_usd(projected)} run-dir total"
    if s.max_cost_usd is not None and projected > s.max_cost_usd and not s.final:
        text += ", over the cap: the run will stop at the cap"
    return text


def _cost(s: ProgressSnapshot) -> str:
    """Billed, and pending apart: a pending amount (worst case until settled) is never shown as spent."""
    text = f"{format_usd(s.cost_usd)} this run, {format_usd(s.spent_usd)} run-dir total"
    if s.pending_usd > 0:
        attempts = plural(s.pending_attempts, "attempt")
        text += f", {format_usd(s.pending_usd)} pending over {attempts} (worst case until settled)"
    return text


def status_fields(s: ProgressSnapshot, top_reasons: int = 3) -> list[tuple[str, str]]:
    """(label, value) pairs shared by the terminal display and the Prefect status artifact."""
    return [
        ("samples", f"{s.finished:,} / {s.total:,} ({s.percent:.1f}%): {s.done:,} done, {s.failed:,} failed"),
        ("in flight", f"{s.in_flight:,} (window {s.window:,})"),
        ("throughput", f"{s.req_per_s:,.1f} req/s, {s.tok_per_s:,.0f} completion tok/s"),
        ("requests", f"{s.requests_sent:,} sent, {s.retries:,} retries"),
        ("tokens", f"{s.prompt_tokens:,} prompt, {s.completion_tokens:,} completion"),
        ("cost", _cost(s)),
        ("projected", _projected(s)),
        ("budget", _budget(s)),
        ("elapsed", format_duration(s.elapsed_s)),
        ("ETA", _eta(s)),
        ("failures", format_counts(s.failures_by_reason, top_reasons)),
    ]


def status_line(s: ProgressSnapshot) -> str:
    """One compact line for logs and non-terminal output."""
    cap = f", cap {format_usd(s.max_cost_usd)}" if s.max_cost_usd is not None else ""
    parts = [
        f"generate {s.finished:,}/{s.total:,} ({s.percent:.1f}%)",
        f"done {s.done:,} failed {s.failed:,}",
        f"in flight {s.in_flight:,}/{s.window:,}",
        f"{s.req_per_s:,.1f} req/s {s.tok_per_s:,.0f} tok/s",
        f"{format_usd(s.cost_usd)} run ({format_usd(s.spent_usd)} total{cap})"
        + (f" + {format_usd(s.pending_usd)} pending" if s.pending_usd > 0 else ""),
        f"ETA {_eta(s)}",
    ]
    if s.failures_by_reason:
        parts.append(f"failures: {format_counts(s.failures_by_reason, 3)}")
    return " | ".join(parts)
