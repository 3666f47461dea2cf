"""Which class a failed sample's `failure_reason` belongs to, in one place for generate, `status` and the report.

A rerun retries *transient* failures (the endpoint may answer next time), never re-buys *deterministic* ones
(the same request fails the same way and is billed again) unless the setting that caused them changed or the
user asks, and leaves *budget* and *outage* stops to be picked up as soon as money or the endpoint is back.
"""

from __future__ import annotations

from typing import Literal

FailureClass = Literal["transient", "deterministic", "budget", "outage"]

FAILURE_CLASSES: tuple[FailureClass, ...] = ("transient", "deterministic", "budget", "outage")

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
