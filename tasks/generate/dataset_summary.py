"""Per-dataset overview of a run directory's `responses`: counts, failure reasons, tokens, spend, providers.

It reads what is on disk, not what one run did, so it is right after a crash, a budget stop or several
resumed runs: finished parts, plus the committed chunks and journals of parts still in progress (merged as the
engine merges them on resume). Samples of a prompts part with no row yet count as pending. Money comes from
the spend ledger alone, billed and pending apart: `billed_usd` is every attempt billed for the dataset (failed
ones and replaced rows included), `pending_usd` the worst case of attempts sent with no answer read back yet
(settled later from the provider's records).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common.failures import failure_class
from tasks.common.shards import PartRef, read_part
from tasks.generate.chunks import STAGE, journal_rows, part_answer_rows
from tasks.generate.ledger import SpendLedger, SpendTotals
from tasks.generate.progress import format_counts

COLUMNS = [
    "sample_id",
    "dataset",
    "status",
    "failure_reason",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_usd",
    "billed_cost_usd",
    "provider",
    "quantization",
]


@dataclass
class _Totals:
    samples: int = 0
    done: int = 0
    failed: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    classes: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    billed_cost_usd: float | None = None
    providers: Counter[str] = field(default_factory=Counter)
    quantizations: Counter[str] = field(default_factory=Counter)

    def add(self, row: dict[str, Any]) -> None:
        if row["status"] == "done":
            self.done += 1
        else:
            self.failed += 1
            self.reasons[row["failure_reason"] or "unknown"] += 1
            self.classes[failure_class(row["failure_reason"])] += 1
        self.prompt_tokens += row["prompt_tokens"] or 0
        self.completion_tokens += row["completion_tokens"] or 0
        self.reasoning_tokens += row["reasoning_tokens"] or 0
        if row["billed_cost_usd"] is not None:
            self.billed_cost_usd = (self.billed_cost_usd or 0.0) + row["billed_cost_usd"]
        if row["provider"]:
            self.providers[row["provider"]] += 1
        if row["quantization"]:
            self.quantizations[row["quantization"]] += 1

    def row(self, dataset: str, spend: SpendTotals) -> dict[str, Any]:
        return {
            "dataset": dataset,
            "samples": self.samples,
            "done": self.done,
            "failed": self.failed,
            "pending": self.samples - self.done - self.failed,
            "failures": format_counts(self.reasons),
            "failure_class": format_counts(self.classes),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "billed_usd": round(spend.billed_usd, 6),
            "pending_usd": round(spend.pending_usd, 6),
            "billed_cost_usd": None if self.billed_cost_usd is None else round(self.billed_cost_usd, 6),
            "providers": format_mix(self.providers),
            "quantizations": format_mix(self.quantizations),
        }


def format_mix(counts: Counter[str]) -> str:
    """`A 62%, B 38%`: the share of rows each value served."""
    total = sum(counts.values())
    if not total:
        return "-"
    return ", ".join(
        f"{name} {100 * n / total:.0f}%" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )


def _part_rows(
    run_dir: Path, part: int, journaled: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(response rows, pending sample_id -> dataset) of one part, finished or not.

    Chunk rows of samples no longer in the prompts part are ignored, as the engine ignores them. A part being
    finalized while we read loses its chunks; reading once more then finds the finished part.
    """
    ref = PartRef(run_dir, STAGE, part)
    for _ in range(2):
        if ref.is_done():
            return read_part(ref, columns=COLUMNS).to_pylist(), {}
        try:
            rows = part_answer_rows(run_dir, part, COLUMNS, journaled)
        except FileNotFoundError:
            continue
        prompts = ref.with_stage("prompts")
        if not prompts.is_done():
            return list(rows.values()), {}
        wanted = {r["sample_id"]: r["dataset"] for r in read_part(prompts, ["sample_id", "dataset"]).to_pylist()}
        pending = {sid: dataset for sid, dataset in wanted.items() if sid not in rows}
        return [row for sid, row in rows.items() if sid in wanted], pending
    return read_part(ref, columns=COLUMNS).to_pylist(), {}


def dataset_rows(run_dir: Path, parts: list[int]) -> list[dict[str, Any]]:
    """One row per dataset (sorted by name) over the given parts."""
    totals: dict[str, _Totals] = {}
    journaled = journal_rows(run_dir)
    for part in parts:
        rows, pending = _part_rows(run_dir, part, journaled.get(part, []))
        for row in rows:
            t = totals.setdefault(row["dataset"], _Totals())
            t.samples += 1
            t.add(row)
        for dataset in pending.values():
            totals.setdefault(dataset, _Totals()).samples += 1
    spend = SpendLedger.load(run_dir).totals_by_dataset(set(parts))
    return [totals[name].row(name, spend.get(name, SpendTotals())) for name in sorted(totals)]
