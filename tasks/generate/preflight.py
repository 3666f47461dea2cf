"""What must hold before the first paid request, for `generate` and `run` alike: the completion format's special
tokens map to their own single ids, and the endpoint answers at all.

The endpoint wait honours the same window as the generate stage: an endpoint that is down is waited for up to
`endpoint.outage_abort_s`, then the run stops resumably with `OutageAbortError` (never retried again by
Prefect: the window is used up), having spent nothing.
"""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from tasks.common.config import EndpointConfig, PipelineConfig
from tasks.common.errors import EndpointUnavailableError
from tasks.generate.health import probe_endpoint
from tasks.reconstruct.completion_format import CompletionFormat, format_for
from tasks.reconstruct.special_tokens import SpecialTokenCheck, verify_special_tokens

PROBE_EVERY_S = (0.5, 1.0, 2.0, 5.0, 10.0)


class OutageAbortError(EndpointUnavailableError):
    """The endpoint answered nothing for `outage_abort_s`: the outage window is used up, so retrying the task
    would only wait it out again. Resumable: nothing was marked failed."""


def wait_for_endpoint(cfg: EndpointConfig) -> int:
    """Probe until the endpoint answers (returns the status) or `outage_abort_s` passes (OutageAbortError)."""
    started = time.monotonic()
    tries = 0
    while True:
        try:
            return probe_endpoint(cfg, timeout_s=min(10.0, cfg.outage_abort_s))
        except EndpointUnavailableError as exc:
            waited = time.monotonic() - started
            if waited >= cfg.outage_abort_s:
                raise OutageAbortError(
                    f"{exc}; no answer for {waited:.0f} s (endpoint.outage_abort_s={cfg.outage_abort_s:g}). "
                    "Nothing was sent or marked failed; rerun when the endpoint is up."
                ) from exc
            delay = PROBE_EVERY_S[min(tries, len(PROBE_EVERY_S) - 1)]
            tries += 1
            time.sleep(max(0.0, min(delay, cfg.outage_abort_s - waited)))


def preflight(
    cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[CompletionFormat, list[SpecialTokenCheck]]:
    """Special tokens first (no network), then the endpoint; raises before anything is paid for."""
    fmt = format_for(cfg, tokenizer)
    rows = verify_special_tokens(tokenizer, fmt)
    wait_for_endpoint(cfg.endpoint)
    return fmt, rows
