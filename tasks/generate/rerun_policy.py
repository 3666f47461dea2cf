"""Which committed failed samples a rerun sends again, by failure class (`tasks.common.failures`).

Invariant: a deterministic failure (length, context length, content filter, a 4xx refusal) is never bought
twice with the same request: the rerun skips it unless a setting that shapes the request or its judgement
changed since it failed (the ledger keeps the settings' fingerprint per failed sample) or the user asks
(`endpoint.retry_failed: all`, CLI `--retry-failed all`). Transient, budget and outage failures are retried.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tasks.common.config import PipelineConfig
from tasks.common.failures import failure_class


def settings_fingerprint(cfg: PipelineConfig) -> str:
    """Digest of what decides whether a request fails deterministically: model, routing, sampling, template."""
    ep, sampling = cfg.endpoint, cfg.sampling
    shaping = {
        "kind": ep.kind,
        "model": ep.model,
        "provider_routing": ep.provider_routing,
        "reasoning": ep.reasoning,
        "keep_length_truncated": ep.keep_length_truncated,
        "require_reasoning": ep.require_reasoning,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stop": sampling.stop,
        "regenerate": sampling.regenerate,
        "chat_template_kwargs": cfg.tokenizer.chat_template_kwargs,
        "completion_format": cfg.tokenizer.model_dump(mode="json")["completion_format"],
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resend(
    row: dict[str, Any] | None,
    fingerprint: str,
    failed_with: tuple[str, str] | None,
    retry_failed: str,
    max_tokens: int,
) -> bool:
    """Whether a sample with this committed row is sent on this run. `failed_with`: (reason, fingerprint) the
    ledger recorded when it failed deterministically; None for failures from before the ledger (then the
    settings are assumed unchanged: re-buying them is what this policy exists to prevent)."""
    if row is None or row.get("status") != "failed":
        return row is None or row.get("status") != "done"
    if retry_failed == "all" or failure_class(row.get("failure_reason")) != "deterministic":
        return True
    if failed_with is not None:
        return failed_with[1] != fingerprint
    used = row.get("completion_tokens")
    return row.get("failure_reason") == "length" and used is not None and max_tokens > used


@dataclass(frozen=True)
class RerunRules:
    """`resend`'s settings for one run, bound once: the generate engine, `status` (which parts a run sends) and the
    estimate (what a rerun buys) decide alike. `failed_with`: the ledger's deterministic failures
    (`SpendLedger.deterministic`)."""

    fingerprint: str
    failed_with: dict[str, tuple[str, str]]
    retry_failed: str
    max_tokens: int

    @classmethod
    def of(cls, cfg: PipelineConfig, failed_with: dict[str, tuple[str, str]]) -> RerunRules:
        return cls(settings_fingerprint(cfg), failed_with, cfg.endpoint.retry_failed, cfg.sampling.max_tokens)

    def sends(self, sample_id: str, row: dict[str, Any] | None) -> bool:
        """Whether this run sends the sample whose committed row (None: none yet) is `row`."""
        return resend(row, self.fingerprint, self.failed_with.get(sample_id), self.retry_failed, self.max_tokens)
