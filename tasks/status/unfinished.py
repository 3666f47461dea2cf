"""What `status` shows beside the stage counts: answers already paid for that sit in committed chunks of a
responses part that has not finished (a budget stop or a kill ends a run mid-part), and the run directory's spend
ledger. The stage counts read finished parts only, so without these a budget-stopped directory showed every
answer it had bought as missing, and nothing outside a run said what the directory had spent."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tasks.common.shards import done_parts
from tasks.generate.chunks import STAGE, unfinished_answer_rows
from tasks.generate.ledger import SpendLedger
from tasks.generate.progress import format_usd
from tasks.generate.spill import spill_folder, spill_root, waiting_segments


def answers_in_unfinished_parts(run_dir: Path) -> dict[str, int]:
    """dataset -> samples answered (`done`, a later row of a sample replacing an earlier one) in the committed
    chunks, or the answer journal, of responses parts that have no finished part yet (a `kill -9` leaves its
    last answers in the journal only: the next run replays them)."""
    finished = {ref.part for ref in done_parts(run_dir, STAGE)}
    rows = unfinished_answer_rows(run_dir, finished, ["sample_id", "dataset", "status"])
    return dict(Counter(r["dataset"] for r in rows if r["status"] == "done"))


def spend_summary(run_dir: Path) -> dict[str, Any]:
    return SpendLedger.load(run_dir).totals().to_dict()


def status_notes(run_dir: Path, spill_dir_setting: Path | None = None) -> list[str]:
    """One line for the spend ledger, one for answers in unfinished parts and one for a failed disk's spilled
    answers (when there are any). `spill_dir_setting`: the config's `endpoint.spill_dir`, when status has one."""
    spend = spend_summary(run_dir)
    lines = [
        f"spend ledger: {format_usd(spend['billed_usd'])} billed, {format_usd(spend['pending_usd'])} pending at "
        f"worst case, {spend['attempts']} attempts"
    ]
    waiting = answers_in_unfinished_parts(run_dir)
    if waiting:
        by = ", ".join(f"{d} {n}" for d, n in sorted(waiting.items()))
        lines.append(
            f"responses: {sum(waiting.values())} answers ({by}) are committed in unfinished parts "
            "(responses/_chunks, or journaled in responses/_journal by a run killed or stopped by a full disk) and "
            "counted as missing until their part finishes; they are kept, and the next run does not buy them again"
        )
    folder = spill_folder(run_dir, spill_root(spill_dir_setting))
    spilled = waiting_segments(folder)
    if spilled:
        lines.append(
            f"spilled: {len(spilled)} log segments with answers and spend records that generate wrote to "
            f"{folder} when this run directory's disk failed wait there (not counted above): "
            "the next generate run takes them back before it sends anything"
        )
    return lines
