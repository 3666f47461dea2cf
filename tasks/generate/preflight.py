"""What must hold before the first paid request, for `generate` and `run` alike: the completion format's special
tokens map to their own single ids, `reconstruct.repair_from` (when set) teaches repair rules, and the endpoint
answers at all.

The endpoint wait honours the same window as the generate stage: an endpoint that is down is waited for up to
`endpoint.outage_abort_s`, then the run stops resumably with `OutageAbortError` (never retried again by
Prefect: the window is used up), having spent nothing.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig
from tasks.generate.endpoint_wait import Announce, OutageAbortError, wait_for_endpoint
from tasks.reconstruct.completion_format import CompletionFormat, format_for
from tasks.reconstruct.special_tokens import SpecialTokenCheck, verify_special_tokens
from tasks.reconstruct.stage import repair_table

__all__ = ["OutageAbortError", "preflight", "wait_for_endpoint"]


def preflight(
    cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase, probe: bool = True, announce: Announce | None = None
) -> tuple[CompletionFormat, list[SpecialTokenCheck]]:
    """Special tokens and the repair source (no network), then the endpoint (`probe`: only when something is left
    to send); raises before anything is paid for."""
    fmt = format_for(cfg, tokenizer)
    rows = verify_special_tokens(tokenizer, fmt)
    repair_table(cfg, fmt)
    if probe:
        wait_for_endpoint(cfg.endpoint, announce)
    return fmt, rows
