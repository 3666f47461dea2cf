"""Which class a failed sample's `failure_reason` belongs to, in one place for generate, `status` and the report.

A rerun retries *transient* failures (the endpoint may answer next time), never re-buys *deterministic* ones
(the same request fails the same way and is billed again) unless the setting that caused them changed or the
user asks, and leaves *budget* and *outage* stops to be picked up as soon as money or the endpoint is back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FailureClass = Literal["transient", "deterministic", "budget", "outage"]

FAILURE_CLASSES: tuple[FailureClass, ...] = ("transient", "deterministic", "budget", "outage")

RERUN_FIXABLE: frozenset[str] = frozenset({"transient", "budget", "outage"})
"""Classes the next run sends again by itself: they count against `validation.max_failed_rate`, while
deterministic failures have a gate of their own (`validation.max_deterministic_failed_rate`)."""

DETERMINISTIC_REASONS = frozenset({"length", "context_length", "content_filter", "finish_content_filter"})
"""Reasons that a resend of the identical request reproduces: the model's answer or the prompt is the cause."""

BUDGET_REASONS = frozenset({"budget"})
OUTAGE_REASONS = frozenset({"outage", "endpoint_unavailable"})

TRANSIENT_4XX = frozenset({408, 409, 425, 429})
"""4xx statuses that say "try again" rather than "this request is wrong"."""


def failure_class(reason: str | None) -> FailureClass:
    """The class of one `failure_reason`; unknown reasons count as transient, so a rerun retries them."""
    if not reason:
        return "transient"
    if reason in DETERMINISTIC_REASONS:
        return "deterministic"
    if reason in BUDGET_REASONS:
        return "budget"
    if reason in OUTAGE_REASONS:
        return "outage"
    if reason.startswith("http_4"):
        code = reason.removeprefix("http_")
        if code.isdigit() and int(code) not in TRANSIENT_4XX:
            return "deterministic"
    return "transient"


FAILURE_COLUMNS: tuple[str, ...] = (
    "sample_id",
    "dataset",
    "stage",
    "reason",
    "class",
    "attempts",
    "last_error",
    "rerun",
)
"""The columns of a failed sample wherever a user sees one, in this order: `failed_samples.jsonl`, `status`,
the Prefect failed-samples table artifact. `class` is a `FailureClass`, or "validation" / "quarantined"."""

LAST_ERROR_CHARS = 300


RETRY_ALL_HINT = (
    'or with endpoint.retry_failed set to all (Prefect run form: overrides {"endpoint.retry_failed": "all"}; '
    "CLI: --retry-failed all)"
)
"""How to ask for deterministic failures to be sent again, on every surface that says so: the Prefect UI's
failure-summary, run-status and failed-samples artifacts and the run's state message (whose readers trigger runs
from the run form, where a CLI flag means nothing) as well as the CLI's own output."""


RESENT_BY_ALL = "resent only by a run with endpoint.retry_failed: all (as this one had)"
"""A deterministic failure under a run that had `retry_failed: all`: the plain Run and the nightly rerun do not
carry that override, so "retried by the next run" was untrue for them."""


def rerun_action(stage: str, klass: str, reason: str, retry_failed: str = "transient") -> str:
    """What the next run does about one failed sample, in words a user acts on: the one answer to "will a rerun
    fix this?", shared by the failure record, the gate messages and the failure summary."""
    if stage == "prepare" or klass == "quarantined":
        return "never: fix the row in the dataset (prompts/_quarantine.jsonl says why), then rerun"
    if stage == "validation" or klass == "validation":
        return "never with the same answer: change validation.*, or delete the response to buy it again"
    if klass in ("transient", "outage", "budget"):
        return "retried by the next run"
    if reason == "context_length":  # resent under retry_failed: all too, and refused again
        return "never as sent: the prompt exceeds the context; only after the model or the prompt changes"
    if retry_failed == "all":
        return RESENT_BY_ALL
    if reason == "length":
        return (
            "only after sampling.max_tokens is raised (a cut final answer is also kept by "
            f"endpoint.keep_length_truncated; a cut earlier turn never is), {RETRY_ALL_HINT}"
        )
    return (
        f"never with the same settings: only after the model, routing, sampling or template changes, {RETRY_ALL_HINT}"
    )


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """One failed sample as every surface shows it (`FAILURE_COLUMNS`); `last_error` is already redacted.
    `sample_id` is None for a quarantined input row: it never became a sample."""

    sample_id: str | None
    dataset: str
    stage: str
    reason: str
    failure_class: str
    attempts: int | None
    last_error: str | None
    rerun: str

    def to_dict(self) -> dict[str, Any]:
        error = None if self.last_error is None else " ".join(self.last_error.split())
        if error is not None and len(error) > LAST_ERROR_CHARS:
            error = error[: LAST_ERROR_CHARS - 3] + "..."
        values = (
            self.sample_id,
            self.dataset,
            self.stage,
            self.reason,
            self.failure_class,
            self.attempts,
            error,
            self.rerun,
        )
        return dict(zip(FAILURE_COLUMNS, values, strict=True))
