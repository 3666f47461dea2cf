"""Which prompts parts a generate run would send requests for: what decides whether a run waits for the endpoint
at all, and whether the generate task runs.

Invariant: a part is left out only when the engine would send nothing for it either: its responses part is
current (built from the current prompts part) and each of its rows is done, or failed deterministically and is
not re-sent under `tasks.generate.rerun_policy` (same settings fingerprint, `endpoint.retry_failed: transient`).
A part still in progress (chunks, a journal, no marker) is always sent. Reads markers, and the failed rows and
the spend ledger only for parts holding failures; no tokenizer, no network, so `run` decides in well under a
second, before it starts Prefect.
"""

from __future__ import annotations

from typing import Any

from tasks.common.config import PipelineConfig
from tasks.common.failures import failure_class
from tasks.common.shards import PartRef, expected_build, is_current, read_marker, read_part


def _failed_rows(ref: PartRef) -> list[dict[str, Any]]:
    columns = ["sample_id", "status", "failure_reason", "completion_tokens"]
    return [r for r in read_part(ref, columns=columns).to_pylist() if r["status"] != "done"]


def parts_to_send(cfg: PipelineConfig, parts: list[int]) -> list[int]:
    """Prompts parts whose responses part is missing, stale, unfinished, or holds a row the next run sends again."""
    from tasks.generate.rerun_policy import RerunRules

    todo: list[int] = []
    rules: RerunRules | None = None
    for part in parts:
        ref = PartRef(cfg.run_dir, "responses", part)
        if not is_current(ref, expected_build(ref)):
            todo.append(part)
            continue
        counts = read_marker(ref).get("status_counts")
        if not isinstance(counts, dict):  # a marker from before status counts were recorded
            todo.append(part)
            continue
        if set(counts) <= {"done"}:
            continue
        failed = _failed_rows(ref)
        if cfg.endpoint.retry_failed == "all" or any(
            failure_class(r["failure_reason"]) != "deterministic" for r in failed
        ):
            todo.append(part)
            continue
        if rules is None:
            from tasks.generate.ledger import SpendLedger

            rules = RerunRules.of(cfg, SpendLedger.load(cfg.run_dir).deterministic)
        if any(rules.sends(r["sample_id"], r) for r in failed):
            todo.append(part)
    return todo
