"""The failed-responses gates: what a rerun can fix is gated apart from what it cannot.

Invariant: a failure the next run sends again by itself (transient, outage, budget: `RERUN_FIXABLE`) counts
against `validation.max_failed_rate`; a deterministic one (context length, content filter, other 4xx, length)
is never re-bought with the same settings, so it has its own gate, `validation.max_deterministic_failed_rate`,
and its message names the samples and the setting to change. A gate a rerun cannot pass never tells the user to
rerun. `generate` (CLI) and the validation report apply the same rules, so they fail or pass together.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common.config import ValidationConfig
from tasks.common.failures import RERUN_FIXABLE, failure_class, rerun_action
from tasks.common.shards import PartRef, read_part

EXAMPLES = 5
"""Sample ids a gate message names; every failed id is in failed_samples.jsonl."""

RETRIED_GATE = "> max_failed_rate "
"""In the message of the one gate whose samples the next run sends again (`rerun_may_pass`)."""


def rerun_may_pass(gate: str) -> bool:
    """Whether a crossed gate's message (as `gate_violations` wrote it) is about failures the next run retries:
    rerunning may pass it; every other gate stops a rerun with the same settings again."""
    return RETRIED_GATE in gate


@dataclass
class FailedResponses:
    """One dataset's responses: how many, and the failed ones by gate (`retryable` / `deterministic`)."""

    responses: int = 0
    reasons: dict[str, Counter[str]] = field(
        default_factory=lambda: {"retryable": Counter(), "deterministic": Counter()}
    )
    examples: dict[str, list[str]] = field(default_factory=lambda: {"retryable": [], "deterministic": []})

    def add(self, sample_id: str, status: str, reason: str | None) -> None:
        self.responses += 1
        if status == "done":
            return
        gate = "retryable" if failure_class(reason) in RERUN_FIXABLE else "deterministic"
        self.reasons[gate][reason or "unknown"] += 1
        if len(self.examples[gate]) < EXAMPLES:
            self.examples[gate].append(sample_id)

    def to_dict(self) -> dict[str, Any]:
        """The summary keys: counts, rates over all responses, reasons and example ids per gate."""
        retryable = sum(self.reasons["retryable"].values())
        deterministic = sum(self.reasons["deterministic"].values())
        return {
            "failed_retryable": retryable,
            "failed_deterministic": deterministic,
            "failed_rate": retryable / self.responses if self.responses else 0.0,
            "deterministic_failed_rate": deterministic / self.responses if self.responses else 0.0,
            "failed_reasons": {gate: dict(c.most_common()) for gate, c in self.reasons.items()},
            "failed_examples": {gate: list(ids) for gate, ids in self.examples.items()},
        }


def _listed(reasons: dict[str, int], examples: list[str], total: int) -> str:
    why = ", ".join(f"{r} {n}" for r, n in reasons.items())
    more = f" and {total - len(examples)} more" if total > len(examples) else ""
    return f"{why}; samples {', '.join(examples)}{more}"


def failed_gate_violations(
    dataset: str, stats: dict[str, Any], vcfg: ValidationConfig, retry_failed: str = "transient"
) -> list[str]:
    """Sentences for the failed-responses gates `stats` (a `FailedResponses.to_dict()` plus `responses`) crosses,
    each ending with what the next run does about those samples."""
    crossed = []
    responses = stats["responses"]
    name = f"dataset {dataset!r}"
    reasons, examples = stats["failed_reasons"], stats["failed_examples"]
    if stats["failed_rate"] > vcfg.max_failed_rate:
        n = stats["failed_retryable"]
        crossed.append(
            f"{name}: failed_rate {stats['failed_rate']:.4f} ({n}/{responses} responses failed after their retries: "
            f"{_listed(reasons['retryable'], examples['retryable'], n)}) > max_failed_rate {vcfg.max_failed_rate}; "
            "these are retried by the next run (transient or outage failures): rerun once the endpoint is healthy"
        )
    if stats["deterministic_failed_rate"] > vcfg.max_deterministic_failed_rate:
        n = stats["failed_deterministic"]
        needed = min(1.0, int(n / responses * 100 + 1) / 100) if responses else 1.0
        accept = f"to accept them set validation.max_deterministic_failed_rate={needed}"
        reruns = {rerun_action("responses", "deterministic", r, retry_failed) for r in reasons["deterministic"]}
        actions = "; ".join(sorted(reruns))
        if retry_failed == "all":
            outlook = f"{actions}; or {accept}"
        else:
            outlook = f"a rerun with the same settings does not send them again ({actions}): {accept}"
        crossed.append(
            f"{name}: deterministic_failed_rate {stats['deterministic_failed_rate']:.4f} ({n}/{responses} responses: "
            f"{_listed(reasons['deterministic'], examples['deterministic'], n)}) > max_deterministic_failed_rate "
            f"{vcfg.max_deterministic_failed_rate}; {outlook}"
        )
    return crossed


def responses_gate_violations(
    run_dir: Path, parts: list[int], vcfg: ValidationConfig, retry_failed: str = "transient"
) -> list[str]:
    """The failed-responses gates over the finished `responses` parts among `parts` (what `generate` checks)."""
    per: dict[str, FailedResponses] = {}
    columns = ["sample_id", "dataset", "status", "failure_reason"]
    for part in parts:
        ref = PartRef(run_dir, "responses", part)
        if not ref.is_done():
            continue
        table = read_part(ref, columns=columns)
        for sid, dataset, status, reason in zip(*(table[c].to_pylist() for c in columns), strict=True):
            per.setdefault(dataset, FailedResponses()).add(sid, status, reason)
    crossed = []
    for dataset in sorted(per):
        stats = {"responses": per[dataset].responses, **per[dataset].to_dict()}
        crossed += failed_gate_violations(dataset, stats, vcfg, retry_failed)
    return crossed
