"""The generate stage: every prompt of every given part becomes exactly one `responses` row, crash-safely.

Why one window for all parts: a barrier at each part boundary would drain the pipe to zero in-flight requests
while the slowest sample of a part finishes; with thousands in flight that idles most of the capacity. So
samples of all parts flow through one bounded window and a part is written the moment its last sample ends.

Why chunks and a journal: a paid answer is training data, so a crash must lose none that reached the process.
Every row is appended to the run's journal and fsynced within `journal_group_commit_s` (off the event loop);
finished rows are also committed every `commit_every_samples` results or `commit_every_s` seconds as small
atomic Parquet chunks. On restart, finished parts, chunks and journals are merged by sample_id, "done"
samples are never sent again, and deterministic failures are not re-bought (`rerun_policy`).

Money: every attempt is in the spend ledger (`ledger`) before it is sent; the budget of each run starts from
the ledger's counted total (billed + pending at worst case), so `max_cost_usd` holds over the run directory's
life, across kills and reruns. Pending attempts are settled from the provider's records before anything is
sent and again once nothing is in flight (`settlement`). One run at a time writes a run directory (`run_lock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import shutil
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig
from tasks.common.errors import DiskFailedError, DiskFullError, EndpointUnavailableError, FatalEndpointError
from tasks.common.failures import failure_class
from tasks.common.messages import prompt_messages
from tasks.common.schemas import RESPONSES
from tasks.common.shards import (
    PartRef,
    conform,
    read_marker,
    read_part,
    stage_metadata,
    write_parquet_atomic,
)
from tasks.common.shards import write_part as write_stage_part
from tasks.estimate.prices import listed_price_factor
from tasks.generate.chunks import (
    STAGE,
    chunk_dir,
    chunk_index,
    chunk_paths,
    journal_dir,
    journal_paths,
    journal_rows,
    merge_row,
    read_chunk,
)
from tasks.generate.client import LOOKUP_DELAYS_S, AttemptTag, Budget, EndpointClient, SampleOutcome
from tasks.generate.collector import tuned_collector
from tasks.generate.disk_guard import MIB, DiskGuard, reserve_bytes
from tasks.generate.endpoints import CompletionMarkers, GenerationResult, request_seed
from tasks.generate.heap_trim import trimmed_heap
from tasks.generate.journal import AppendLog
from tasks.generate.ledger import LedgerWriter, SpendLedger, SpendTotals
from tasks.generate.progress import (
    Listener,
    ProgressSnapshot,
    RunEvent,
    RunEventKind,
    emit,
    emit_event,
    format_usd,
    plural,
)
from tasks.generate.reasoning_guard import UnexpectedReasoning
from tasks.generate.rerun_policy import RerunRules, settings_fingerprint
from tasks.generate.run_lock import run_dir_lock
from tasks.generate.settlement import Settler, pending_notice
from tasks.generate.spill import Spilled, spill_dir, spill_logs, take_back
from tasks.reconstruct.multiturn import ConversationTurn, template_messages
from tasks.reconstruct.tokenizer_loading import load_tokenizer

log = logging.getLogger(__name__)
REFUSAL_GRACE_S = 5.0
"""How long the requests in flight may take to end by themselves after a run-fatal refusal before they are
cancelled (and counted pending at worst case)."""
T = TypeVar("T")
RESULT_FIELDS = (
    "reasoning",
    "content",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_usd",
    "provider",
    "model",
    "generation_id",
    "output_ids",
    "prompt_ids",
    "quantization",
    "billed_cost_usd",
)


class CommitListener(Protocol):
    """Told when the run's logs reach a durable point (`tasks.generate.store_sync.LogMirror` copies them to a run
    store then, so a dead host loses at most one commit interval)."""

    def attach(self, logs: list[AppendLog]) -> None:
        """The run's open logs, before anything is written: each keeps what it writes in memory until told the
        store has it (`AppendLog.acknowledge`), for a spill should the disk fail."""

    def committed(self) -> None:
        """After each commit, on the event loop: must return at once."""

    def closed(self) -> None:
        """After the run closed its journal and ledger segment, before the journal may be deleted; may block."""

    def spilled(self, folder: Path) -> None:
        """The run's disk failed and what it could not take was written to `folder` (`tasks.generate.spill`),
        before `closed`; may block."""


@dataclass
class PartSummary:
    """Counts for one part in this run: done + failed + skipped_already_done + kept_failed = samples.
    `kept_failed`: committed deterministic failures this run did not re-send (`rerun_policy`), by reason in
    `kept_failed_by_reason` (the run summary's rows did not add up to `samples` without them)."""

    part: int
    samples: int = 0
    done: int = 0
    failed: int = 0
    skipped_already_done: int = 0
    kept_failed: int = 0
    kept_failed_by_reason: dict[str, int] = field(default_factory=dict)
    requests_sent: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    failures_by_class: dict[str, int] = field(default_factory=dict)
    retries_by_reason: dict[str, int] = field(default_factory=dict)
    cost_usd: float = 0.0
    pending_usd: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerateSummary:
    """`stopped` is "budget" when the cost cap ended the run early: unsent samples have no row yet, their parts
    stay unfinished (chunks only), and a rerun with a higher cap continues exactly there.

    Money comes from the spend ledger only, billed and pending apart: `billed_usd` / `pending_usd` /
    `counted_usd` (what the cap counts: billed + pending at worst case) over the run directory's life,
    `run_billed_usd` / `run_pending_usd` for this run's own attempts, `spend` the ledger's breakdown and
    `settlement` what this run settled from the provider's records."""

    parts: list[PartSummary] = field(default_factory=list)
    stopped: str | None = None
    billed_usd: float = 0.0
    pending_usd: float = 0.0
    counted_usd: float = 0.0
    run_billed_usd: float = 0.0
    run_pending_usd: float = 0.0
    spend: dict[str, Any] = field(default_factory=dict)
    settlement: dict[str, Any] = field(default_factory=dict)
    outages: int = 0
    peak_in_flight: int = 0
    window_shrinks: int = 0

    def take_spend(self, totals: SpendTotals) -> None:
        """The run directory's money, from its spend ledger."""
        self.billed_usd, self.pending_usd, self.counted_usd = totals.billed_usd, totals.pending_usd, totals.counted_usd
        self.spend = totals.to_dict()

    def total(self) -> dict[str, Any]:
        reasons: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        retries: Counter[str] = Counter()
        classes: Counter[str] = Counter()
        for p in self.parts:
            reasons.update(p.failures_by_reason)
            kept.update(p.kept_failed_by_reason)
            retries.update(p.retries_by_reason)
            classes.update(p.failures_by_class)
        return {
            "parts": len(self.parts),
            "samples": sum(p.samples for p in self.parts),
            "done": sum(p.done for p in self.parts),
            "failed": sum(p.failed for p in self.parts),
            "skipped_already_done": sum(p.skipped_already_done for p in self.parts),
            "kept_failed": sum(p.kept_failed for p in self.parts),
            "kept_failed_by_reason": dict(kept),
            "requests_sent": sum(p.requests_sent for p in self.parts),
            "failures_by_reason": dict(reasons),
            "failure_class": dict(classes),
            "retries_by_reason": dict(retries),
            "cost_usd": self.run_billed_usd,
            "pending_usd": self.run_pending_usd,
            "prompt_tokens": sum(p.prompt_tokens for p in self.parts),
            "completion_tokens": sum(p.completion_tokens for p in self.parts),
            "stopped": self.stopped,
            "run_dir_billed_usd": self.billed_usd,
            "run_dir_pending_usd": self.pending_usd,
            "run_dir_counted_usd": self.counted_usd,
            "spend": self.spend,
            "settlement": self.settlement,
            "outages": self.outages,
            "peak_in_flight": self.peak_in_flight,
            "window_shrinks": self.window_shrinks,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total(), "parts": [p.to_dict() for p in self.parts]}


def nothing_to_send_summary(run_dir: Path, parts: list[int]) -> GenerateSummary:
    """What a run that sends nothing reports (a nightly rerun of a finished run directory): each part's samples
    as already done or kept as failed, and the run directory's recorded spend from the ledger, where an empty
    summary said 0 samples and $0 billed."""
    summary = GenerateSummary()
    for part in parts:
        ref = PartRef(run_dir, "responses", part)
        statuses: dict[str, int] = read_marker(ref).get("status_counts", {}) if ref.is_done() else {}
        samples, done = sum(statuses.values()), statuses.get("done", 0)
        kept = _failure_reasons(ref) if samples > done else {}
        summary.parts.append(
            PartSummary(
                part, samples, skipped_already_done=done, kept_failed=samples - done, kept_failed_by_reason=kept
            )
        )
    summary.take_spend(SpendLedger.load(run_dir).totals())
    return summary


def _failure_reasons(ref: PartRef) -> dict[str, int]:
    """A finished responses part's failed rows by reason; read only for a part the marker says has any."""
    table = read_part(ref, ["status", "failure_reason"]).to_pylist()
    return dict(Counter(str(r["failure_reason"]) for r in table if r["status"] != "done"))


def _kept_reasons(rows: dict[str, dict[str, Any]], kept: Iterator[str]) -> dict[str, int]:
    """The failure reasons of the committed rows this run keeps as failed instead of sending again."""
    return dict(Counter(str(rows.get(sid, {}).get("failure_reason")) for sid in kept))


@dataclass
class _WorkItem:
    sample_id: str
    dataset: str
    messages: list[dict[str, Any]]
    sample_index: int


@dataclass
class _PartState:
    prompts: PartRef
    out: PartRef
    order: list[str]
    rows: dict[str, dict[str, Any]]
    todo: list[_WorkItem]
    summary: PartSummary
    next_chunk: int
    has_chunks: bool
    was_done: bool
    outstanding: int = 0
    buffer: list[dict[str, Any]] = field(default_factory=list)
    finalized: bool = False

    @property
    def chunk_dir(self) -> Path:
        return chunk_dir(self.out.run_dir, self.out.part)


@dataclass
class _Answer:
    outcome: SampleOutcome
    seed: int | None
    history: list[dict[str, Any]] | None = None
    row: dict[str, Any] | None = None
    """the responses row, built and journaled by the request's own task the moment the answer is in"""


def _empty_row(sample_id: str, dataset: str) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in RESPONSES.names}
    row.update(sample_id=sample_id, dataset=dataset)
    return row


def _load_part(prompts: PartRef, journaled: list[dict[str, Any]], rules: RerunRules) -> _PartState:
    """The part's state from its finished part, chunks and journal rows; `todo` is what this run sends."""
    out = prompts.with_stage(STAGE)
    table = read_part(prompts, columns=["sample_id", "dataset", "messages", "sample_index"])
    items: dict[str, _WorkItem] = {}
    for rec in table.to_pylist():
        item = _WorkItem(rec["sample_id"], rec["dataset"], rec["messages"], rec["sample_index"])
        items.setdefault(rec["sample_id"], item)
    rows: dict[str, dict[str, Any]] = {}
    was_done = out.is_done()
    if was_done:
        for row in read_part(out, columns=list(RESPONSES.names)).to_pylist():
            if row["sample_id"] in items:
                merge_row(rows, row)
    cdir = chunk_dir(out.run_dir, out.part)
    chunks = chunk_paths(out.run_dir, out.part)
    stale = [*out.path.parent.glob(f".{out.path.name}.*.tmp"), *out.marker.parent.glob(f".{out.marker.name}.*.tmp")]
    for path in [*stale, *(cdir.glob(".chunk-*.tmp") if cdir.is_dir() else [])]:
        path.unlink(missing_ok=True)
    for path in chunks:
        for row in read_chunk(path):
            if row["sample_id"] in items:
                merge_row(rows, row)
    buffer: list[dict[str, Any]] = []
    for row in journaled:  # a killed run's answers: into the next chunk, so the journal can go
        if row["sample_id"] in items and not _same_outcome(rows.get(row["sample_id"]), row):
            merge_row(rows, row)
            buffer.append(row)
    next_chunk = max((chunk_index(p) for p in chunks), default=-1) + 1
    todo = [item for sid, item in items.items() if rules.sends(sid, rows.get(sid))]
    done = sum(1 for sid in items if rows.get(sid, {}).get("status") == "done")
    sent = {item.sample_id for item in todo}
    kept = (sid for sid in items if sid not in sent and rows.get(sid, {}).get("status") != "done")
    summary = PartSummary(
        part=prompts.part,
        samples=len(items),
        skipped_already_done=done,
        kept_failed=len(items) - len(todo) - done,
        kept_failed_by_reason=_kept_reasons(rows, kept),
    )
    return _PartState(
        prompts=prompts,
        out=out,
        order=list(items),
        rows=rows,
        todo=todo,
        summary=summary,
        next_chunk=next_chunk,
        has_chunks=bool(chunks),
        was_done=was_done,
        outstanding=len(todo),
        buffer=buffer,
    )


def _same_outcome(known: dict[str, Any] | None, row: dict[str, Any]) -> bool:
    """A journal row already committed (a kill after the commit, before the journal was dropped): nothing new."""
    keys = ("status", "failure_reason", "attempts", "generation_id")
    return known is not None and all(known.get(k) == row.get(k) for k in keys)


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return conform(pa.Table.from_pylist(rows, schema=RESPONSES), RESPONSES, STAGE)


def _write_chunk(state: _PartState, rows: list[dict[str, Any]], provenance: dict[str, Any]) -> None:
    path = state.chunk_dir / f"chunk-{state.next_chunk:06d}.parquet"
    state.next_chunk += 1
    write_parquet_atomic(path, _table(rows), stage_metadata(STAGE, provenance))
    state.has_chunks = True


def _finalize(state: _PartState, provenance: dict[str, Any]) -> None:
    """Write the merged part (prompt order), then drop its chunks: they are now redundant."""
    missing = [sid for sid in state.order if sid not in state.rows]
    if missing:
        raise RuntimeError(f"{state.out}: cannot finalize, {len(missing)} samples lack a row (first {missing[0]})")
    rows = [state.rows[sid] for sid in state.order]
    write_stage_part(state.out, _table(rows), provenance, stats=state.summary.to_dict())
    shutil.rmtree(state.chunk_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        state.chunk_dir.parent.rmdir()
    state.buffer.clear()
    state.has_chunks = False
    state.finalized = True


class _Run:
    """State of one generate run across all its parts (event-loop confined)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        states: list[_PartState],
        client: EndpointClient,
        journal: AppendLog | None = None,
        ledger: LedgerWriter | None = None,
        listener: CommitListener | None = None,
        prior: SpendTotals | None = None,
        settler: Settler | None = None,
    ) -> None:
        self.cfg = cfg
        self.listener = listener
        self.states = states
        self.client = client
        self.journal = journal
        self.ledger = ledger
        self.prior = prior or SpendTotals()
        self.settler = settler
        self.fingerprint = settings_fingerprint(cfg)
        self.provenance = cfg.provenance()
        self.uncommitted = 0
        self.complete_parts = 0
        self.last_commit = time.monotonic()
        self.started = time.monotonic()
        self.total = sum(len(s.todo) for s in states)
        self._write_lock = asyncio.Lock()
        self.unexpected_reasoning = UnexpectedReasoning(
            bool(client.markers.reasoning_close), cfg.tokenizer.completion_format_name
        )
        self._told_disk_stopped = False

    @property
    def disk_stopped(self) -> bool:
        return self.client.disk is not None and self.client.disk.stopped

    def tell_disk_stopped(self) -> None:
        """Once, when the engine first sees the disk stop taking writes: what it does about it."""
        guard = self.client.disk
        if self._told_disk_stopped or guard is None or not guard.stopped:
            return
        self._told_disk_stopped = True
        in_flight = self.client.window.in_flight
        if guard.cause == "full":
            kind: RunEventKind = "disk_full"
            message = (
                f"the disk holding {self.cfg.run_dir} filled ({guard.error}): no new request is sent; the "
                f"{in_flight} still in flight are awaited and every answer is journaled into the space generate "
                "reserved at its start, then the run stops (exit 2)"
            )
        else:
            kind = "disk_failed"
            message = (
                f"{guard.what_failed(self.cfg.run_dir)} ({guard.error}): no new request is sent; the "
                f"{in_flight} still in flight are awaited, then every answer not in a Parquet file is written to "
                f"{spill_dir(self.cfg)} (endpoint.spill_dir) and the run stops (exit 2)"
            )
        emit_event(RunEvent(kind, message, time.monotonic() - self.started))

    def work(self) -> Iterator[tuple[_PartState, _WorkItem]]:
        for state in self.states:
            for item in state.todo:
                if self.client.budget.stopped or self.disk_stopped:
                    return
                yield state, item

    async def process(self, state: _PartState, item: _WorkItem) -> tuple[_PartState, _WorkItem, _Answer]:
        """One sample's requests; its row goes to the journal here, as soon as the answer is in, not when the
        engine's loop gets to `record` it: at 2,000 in flight that loop trails the answers (a part commit holds
        it), and a `kill -9` then lost answers the spend ledger already showed as paid (34 and 116 in two kills
        of an independent probe), bought again by the rerun."""
        answer = await self._answer(state, item)
        answer.row = self.row_of(item, answer)
        if answer.row is not None and self.journal is not None:
            self.journal.submit({"p": state.prompts.part, "r": answer.row})
        return state, item, answer

    async def _answer(self, state: _PartState, item: _WorkItem) -> _Answer:
        seed = request_seed(self.cfg, item.sample_index)
        tag = AttemptTag(item.sample_id, item.dataset, state.prompts.part)
        if self.cfg.sampling.regenerate == "every_turn":
            return await self._every_turn(item, seed, tag)
        messages = prompt_messages(item.messages)
        if not any(m["role"] == "user" for m in messages):
            return _Answer(SampleOutcome(None, "empty_prompt", "prompt has no user turn", 0, None), seed)
        return _Answer(await self.client.generate(messages, item.sample_index, tag), seed)

    async def _every_turn(self, item: _WorkItem, seed: int | None, tag: AttemptTag) -> _Answer:
        """Answer each user turn in order, feeding the target's own answers back as history; the dataset's
        assistant turns are dropped. The row holds the final turn and, in `history`, what the last request sent."""
        msgs = item.messages
        answer_at = [
            i
            for i, m in enumerate(msgs)
            if m["role"] == "user" and (i + 1 == len(msgs) or msgs[i + 1]["role"] == "assistant")
        ]
        if not answer_at:
            return _Answer(SampleOutcome(None, "empty_prompt", "prompt has no user turn", 0, None), seed)
        turns: list[ConversationTurn] = []
        attempts, cost, retries = 0, 0.0, []
        taken = 0
        outcome: SampleOutcome | None = None
        for turn_no, at in enumerate(answer_at):
            for m in msgs[taken : at + 1]:
                if m["role"] != "assistant":
                    turns.append(ConversationTurn(role=m["role"], content=m["content"] or "", generated=False))
            taken = at + 1
            outcome = await self.client.generate(template_messages(turns), item.sample_index, tag)
            attempts += outcome.attempts
            cost += outcome.cost_usd
            retries += outcome.retry_reasons
            res = outcome.result
            if res is None:
                outcome.error = f"turn {turn_no + 1} of {len(answer_at)}: {outcome.error}"
                break
            if turn_no + 1 < len(answer_at) and res.finish_reason == "length":
                cut = _length_error(res, self.cfg.sampling.max_tokens, EARLIER_TURN_CUT)
                error = f"turn {turn_no + 1} of {len(answer_at)}: {cut}"
                outcome = SampleOutcome(None, "length", error, outcome.attempts, None, [], outcome.cost_usd)
                break
            if turn_no + 1 < len(answer_at):
                turn = ConversationTurn(role="assistant", content=res.content or "", reasoning=res.reasoning)
                turn["generated"] = True
                turns.append(turn)
        assert outcome is not None
        outcome.attempts, outcome.cost_usd, outcome.retry_reasons = attempts, cost, retries
        return _Answer(outcome, seed, [dict(t) for t in turns])

    def row_of(self, item: _WorkItem, answer: _Answer) -> dict[str, Any] | None:
        """The sample's responses row; None for a request the budget or a full disk stopped before sending (no
        row, so the sample stays pending and a rerun sends it)."""
        outcome = answer.outcome
        if outcome.halted or (outcome.budget_stopped and outcome.attempts == 0):
            return None
        row = _empty_row(item.sample_id, item.dataset)
        row.update(attempts=outcome.attempts, latency_s=outcome.latency_s, request_seed=answer.seed)
        reason, error = outcome.reason, outcome.error
        result = outcome.result
        if result is not None:
            row.update({name: getattr(result, name) for name in RESULT_FIELDS})
            if answer.history is not None:
                row["history"] = answer.history
            if result.finish_reason == "length" and not self.cfg.endpoint.keep_length_truncated:
                reason = "length"
                error = _length_error(result, self.cfg.sampling.max_tokens)
        row["cost_usd"] = outcome.cost_usd if (result is not None or outcome.cost_usd) else None
        if reason is None:
            row["status"] = "done"
        else:
            row.update(status="failed", error=self.client.redact(error or reason), failure_reason=reason)
        return row

    def record(self, state: _PartState, item: _WorkItem, answer: _Answer) -> None:
        """Counts the answer `process` journaled and buffers its row for the part's next commit."""
        outcome = answer.outcome
        summary = state.summary
        summary.requests_sent += outcome.attempts
        for retry in outcome.retry_reasons:
            summary.retries_by_reason[retry] = summary.retries_by_reason.get(retry, 0) + 1
        summary.cost_usd += outcome.cost_usd
        row = answer.row
        if row is None:
            return
        result = outcome.result
        if result is not None:
            summary.prompt_tokens += result.prompt_tokens or 0
            summary.completion_tokens += result.completion_tokens or 0
        reason = row["failure_reason"]
        if row["status"] == "done":
            summary.done += 1
        else:
            summary.failed += 1
            summary.failures_by_reason[reason] = summary.failures_by_reason.get(reason, 0) + 1
            kind = failure_class(reason)
            summary.failures_by_class[kind] = summary.failures_by_class.get(kind, 0) + 1
            if kind == "deterministic" and self.ledger is not None:
                self.ledger.deterministic_failure(item.sample_id, reason, self.fingerprint)
        merge_row(state.rows, row)
        state.buffer.append(row)
        state.outstanding -= 1
        self.complete_parts += state.outstanding == 0
        self.uncommitted += 1
        if result is not None:
            self.unexpected_reasoning.see(result.reasoning)  # raises once the row above is recorded

    def snapshot(self, final: bool = False, stopped: str | None = None) -> ProgressSnapshot:
        reasons: Counter[str] = Counter()
        for st in self.states:
            reasons.update(st.summary.failures_by_reason)
        client = self.client
        budget, window, breaker = client.budget, client.window, client.breaker
        settled_worst = settled_cost = 0.0
        settled = 0
        if self.settler is not None:
            settled_worst, settled_cost = self.settler.settled_worst_usd, self.settler.settled_cost_usd
            settled = self.settler.settled_attempts
        down_since = breaker.down_since if breaker.state in ("open", "trial") else None
        return ProgressSnapshot(
            elapsed_s=time.monotonic() - self.started,
            total=self.total,
            done=sum(st.summary.done for st in self.states),
            failed=sum(st.summary.failed for st in self.states),
            in_flight=window.in_flight,
            window=int(window.limit),
            requests_sent=self.client.requests_sent,
            prompt_tokens=sum(st.summary.prompt_tokens for st in self.states),
            completion_tokens=sum(st.summary.completion_tokens for st in self.states),
            cost_usd=client.billed_usd + settled_cost,
            prior_cost_usd=self.prior.billed_usd,
            reserved_usd=budget.reserved_usd,
            max_cost_usd=budget.cap_usd,
            budget_stopped=budget.stopped,
            final=final,
            stopped=stopped,
            failures_by_reason=dict(reasons),
            retries_by_reason=dict(client.retries_by_reason),
            pending_usd=max(0.0, self.prior.pending_usd + client.pending_usd - settled_worst),
            pending_attempts=max(0, self.prior.pending_attempts + client.pending_attempts - settled),
            unsent_attempts=self.prior.unsent_attempts + client.unsent_attempts,
            endpoint_down_since_s=None if down_since is None else down_since - self.started,
            outages=breaker.outages,
        )

    def commit_due(self) -> bool:
        if self.uncommitted == 0 or self.disk_stopped:
            return False
        ep = self.cfg.endpoint
        return self.uncommitted >= ep.commit_every_samples or time.monotonic() - self.last_commit >= ep.commit_every_s

    def seconds_to_commit(self) -> float | None:
        """How long to wait for results before a time-based commit; None when there is nothing to commit."""
        if self.uncommitted == 0 or self.disk_stopped:
            return None
        return max(0.0, self.last_commit + self.cfg.endpoint.commit_every_s - time.monotonic())

    async def commit(self) -> None:
        """Finalize complete parts, write the other buffers as chunks; file I/O runs off the event loop. A
        disk that fills here is the run's `DiskGuard`'s to handle (rows stay buffered, and journaled)."""
        if self.disk_stopped:
            return
        async with self._write_lock:
            try:
                for state in self.states:
                    if state.finalized:
                        continue
                    if state.outstanding == 0:
                        await asyncio.to_thread(_finalize, state, self.provenance)
                        self.complete_parts -= 1
                    elif state.buffer:
                        rows = state.buffer
                        await asyncio.to_thread(_write_chunk, state, rows, self.provenance)
                        del state.buffer[: len(rows)]
            except OSError as exc:
                if self.client.disk is None or not self.client.disk.write_failed(exc):
                    raise
                return
            self.uncommitted = 0
            self.last_commit = time.monotonic()
            if self.listener is not None:
                self.listener.committed()

    def commit_now(self) -> None:
        """Synchronous commit for the failure path, where awaiting is no longer safe."""
        if self.disk_stopped:
            return
        for state in self.states:
            if state.finalized:
                continue
            if state.outstanding == 0:
                _finalize(state, self.provenance)
                self.complete_parts -= 1
            elif state.buffer:
                _write_chunk(state, state.buffer, self.provenance)
                state.buffer = []
        self.uncommitted = 0

    async def disk_stopped_error(self) -> DiskFullError | DiskFailedError:
        """Once the answers in flight have arrived: on a full disk, wait for their journal records (and spend
        records) to be written, up to `endpoint.outage_abort_s` while there is no room even after the reserve; on a
        failed disk, or a full one that never made room, write them to the spill directory. Then say what was
        kept, and where."""
        guard = self.client.disk
        assert guard is not None
        logs = [log for log in (self.journal, self.ledger.log if self.ledger else None) if log is not None]
        deadline = time.monotonic() + self.cfg.endpoint.outage_abort_s
        told = False
        while guard.cause == "full" and any(log.unwritten for log in logs) and time.monotonic() < deadline:
            if not told:
                unwritten = self.journal.unwritten if self.journal else 0
                emit_event(
                    RunEvent(
                        "disk_full",
                        f"the disk holding {self.cfg.run_dir} is full even with generate's reserve freed: "
                        f"{unwritten} answers are held in memory until there is room to journal them (up to "
                        f"{self.cfg.endpoint.outage_abort_s:g} s, endpoint.outage_abort_s); free space now",
                        time.monotonic() - self.started,
                    )
                )
                told = True
            await asyncio.sleep(0.5)
        held = sum(len(state.buffer) for state in self.states)
        if guard.cause == "full" and not any(log.unwritten for log in logs):
            return DiskFullError(_disk_full_line(self.cfg.run_dir, guard, held))
        if self.journal is not None:  # every answer not in a chunk or part, whatever reached the disk's journal
            for state in self.states:
                for row in state.buffer:
                    self.journal.submit({"p": state.prompts.part, "r": row})
        spilled = await asyncio.to_thread(spill_logs, self.cfg, logs)
        if guard.cause == "full":
            return DiskFullError(_disk_full_line(self.cfg.run_dir, guard, held, spilled))
        return DiskFailedError(_disk_failed_line(self.cfg.run_dir, guard, held, spilled))


def budget_stop_message(
    counted_usd: float, cap_usd: float | None, pending_usd: float = 0.0, account_settlement: str = "off"
) -> str:
    """The one explanation of a budget stop, for the CLI, the Prefect state message and the task log. Prices are
    blamed only when what was billed crossed the cap: counted spend over it by pending worst cases alone (a $0.68
    bill under a $5 cap, $7.75 counted) had been put on the provider's prices."""
    billed_usd = counted_usd - pending_usd
    pending = (
        f" ({format_usd(billed_usd)} billed + {format_usd(pending_usd)} pending at worst case until the provider's "
        "records settle it)"
        if pending_usd > 0
        else ""
    )
    return (
        f"stopped at the budget cap: {format_usd(counted_usd)} counted{pending} of endpoint.max_cost_usd="
        f"{format_usd(cap_usd)} ({_why_at_cap(counted_usd, cap_usd, pending_usd)}). Finished samples are committed "
        f"and will not be sent again; {_how_to_continue(pending_usd, account_settlement)}"
    )


def _crossed(usd: float, cap_usd: float | None) -> bool:
    return cap_usd is not None and usd > cap_usd * (1 + 1e-9)


def _why_at_cap(counted_usd: float, cap_usd: float | None, pending_usd: float) -> str:
    """Whose figure holds the cap: the provider's bill above the configured prices, or pending worst cases."""
    billed_usd = counted_usd - pending_usd
    if cap_usd is not None and _crossed(billed_usd, cap_usd):
        return (
            f"{format_usd(billed_usd - cap_usd)} billed over it: the endpoint billed above the configured "
            "endpoint.price_*_usd_per_mtok, which the requests already in flight had reserved at; set the prices "
            "it bills"
        )
    if cap_usd is not None and _crossed(counted_usd, cap_usd):
        return (
            f"{format_usd(counted_usd - cap_usd)} over it only by the pending attempts' worst case: the bill, "
            f"{format_usd(billed_usd)}, is under it"
        )
    how = (
        "each request reserves its worst case, max_tokens at the configured prices or the higher ones the endpoint "
        "lists or has billed, before it is sent, so the spend never crosses the cap"
    )
    return f"{how}; unsettled pending attempts hold part of it at worst case" if pending_usd > 0 else how


def _how_to_continue(pending_usd: float, account_settlement: str) -> str:
    """The ways on; exclusive_key is suggested only where it is not already set."""
    if pending_usd <= 0:
        return "to continue, raise endpoint.max_cost_usd and rerun."
    rerun = (
        "to continue, rerun later (each run settles the pending attempts the provider's generation records can: a "
        "request cut mid-generation once endpoint.request_timeout_s + 30 s have passed since it was sent"
    )
    without_id = "settles those without a generation id too"
    raise_cap = "or raise endpoint.max_cost_usd."
    if account_settlement == "exclusive_key":
        return f"{rerun}; the key's usage then {without_id}), {raise_cap}"
    return (
        f"{rerun}), set endpoint.account_settlement: exclusive_key if only this run directory uses the key (its usage "
        f"{without_id}), {raise_cap}"
    )


FINAL_ANSWER_CUT = "endpoint.keep_length_truncated keeps such samples"
EARLIER_TURN_CUT = (
    "an earlier turn cut by length is never kept (the next turn's history would be an answer the model did not "
    "finish): raise sampling.max_tokens"
)


def _length_error(result: GenerationResult, max_tokens: int, hint: str = FINAL_ANSWER_CUT) -> str:
    return (
        f"finish_reason=length: completion hit the token limit (max_tokens={max_tokens}, "
        f"completion_tokens={result.completion_tokens}); {hint}"
    )


def _disk_full_line(run_dir: Path, guard: DiskGuard, held: int, spilled: Spilled | None = None) -> str:
    """The one line of a run a full disk stopped: what filled, what was kept, what to do. `held`: answers not in a
    Parquet part or chunk (commits stop when the disk fills), so in the journal, or in the spill directory when
    the disk never made room for them (`spilled`)."""
    try:
        free = f"{shutil.disk_usage(run_dir).free / MIB:.1f} MiB free now"
    except OSError:
        free = "free space unknown"
    reserve = f"the {guard.size_bytes / MIB:g} MiB reserved at its start (endpoint.disk_reserve_mib) freed for them"
    if not guard.size_bytes:
        reserve = "no space reserved: endpoint.disk_reserve_mib is 0"
    kept = f"kept every answer: the {held} not yet in a Parquet file are in the journal ({reserve})"
    if spilled is not None:
        kept = (
            f"found no room for them ({reserve}): the {held} answers not yet in a Parquet file {_spill_words(spilled)}"
        )
    return (
        f"the disk holding {run_dir} filled ({free}; {guard.error}): generate stopped sending, waited for the "
        f"{guard.in_flight_at_stop} requests in flight then (billed whatever happens) and {kept}; free space and "
        "rerun: no answered sample is sent again"
    )


def _disk_failed_line(run_dir: Path, guard: DiskGuard, held: int, spilled: Spilled) -> str:
    """The one line of a run whose disk failed: what failed, where the answers went, what to do."""
    return (
        f"{guard.what_failed(run_dir)} ({guard.error}): generate stopped sending, waited for the "
        f"{guard.in_flight_at_stop} requests in flight then (billed whatever happens), and the {held} answers not "
        f"yet in a Parquet file {_spill_words(spilled)}; once {run_dir} can be written again, rerun: no answered "
        "sample is sent again"
    )


def _spill_words(spilled: Spilled) -> str:
    if spilled.error is not None:
        return (
            f"could not be written to the spill directory either ({spilled.error}; endpoint.spill_dir): they are "
            "lost, and the spend records of their requests may be too (a key only this run directory uses counts "
            "them: endpoint.account_settlement: exclusive_key)"
        )
    return (
        f"were written with this run's last spend records to {spilled.folder} (endpoint.spill_dir), which the "
        "next generate run of this run directory takes back before anything else"
    )


def stop_reason(failure: BaseException) -> str:
    """Why a generate run ended before its samples did, as its final progress snapshot says it. Anything not an
    `Exception` is the run being stopped from outside: the CancelledError `asyncio.run` hands the coroutine when
    a Prefect cancellation's SIGTERM (Prefect's TerminationSignal) or a Ctrl-C unwinds its loop, or that signal
    itself when it lands inside the coroutine."""
    if not isinstance(failure, Exception):
        return "cancelled"
    if isinstance(failure, EndpointUnavailableError):
        return "aborted: the endpoint did not answer for endpoint.outage_abort_s (a rerun resumes)"
    if isinstance(failure, FatalEndpointError):
        return "the endpoint refused the run"
    if isinstance(failure, DiskFullError):
        return "the disk is full (a rerun resumes once there is room)"
    if isinstance(failure, DiskFailedError):
        return "the disk failed (a rerun resumes once it can be written)"
    return f"failed ({type(failure).__name__})"


async def _report_progress(run: _Run, listeners: list[Listener] | None, every_s: float) -> None:
    """Snapshots on a worker thread: a slow listener (an artifact upload) must never stall the window."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(emit, run.snapshot(), listeners)


def on_this_network(cfg: PipelineConfig) -> bool:
    """Whether the endpoint is a server of one's own (loopback or a private address: a local SGLang or vLLM,
    costing nothing per token), where a run without `max_cost_usd` is expected rather than an oversight."""
    host = urlsplit(cfg.endpoint.base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


async def _generate_async(
    cfg: PipelineConfig,
    states: list[_PartState],
    markers: CompletionMarkers,
    tokenizer: PreTrainedTokenizerBase | None,
    listeners: list[Listener] | None,
    journal: AppendLog | None,
    ledger: LedgerWriter,
    spend: SpendLedger,
    listener: CommitListener | None = None,
    disk: DiskGuard | None = None,
) -> _Run:
    """Settle what earlier runs left pending, send every state's work through one window, settle this run's."""
    window = 2 * cfg.endpoint.max_in_flight
    async with EndpointClient(cfg, markers, tokenizer, ledger=ledger) as client:
        client.disk = disk
        if disk is not None:
            disk.in_flight = lambda: client.window.in_flight
        settler = Settler(cfg, client, ledger, spend)
        sending = any(s.todo for s in states)
        await settler.before_run(sending=sending)
        prior = settler.ledger.totals()
        # a self-hosted server's cost is the configured prices by definition
        seen = cfg.endpoint.kind == "sglang_generate"
        client.budget = settler.budget = Budget(cfg.endpoint.max_cost_usd, prior.counted_usd, prices_seen=seen)
        if settler.by_generation:
            client.budget.reclaim = settler.mid_run
        buying = sending and cfg.endpoint.kind == "openai_chat"
        if buying and cfg.endpoint.max_cost_usd is not None:
            listed = await asyncio.to_thread(listed_price_factor, cfg.endpoint)
            if listed is not None:
                client.budget.raise_prices(*listed)
        if buying and cfg.endpoint.max_cost_usd is None and not on_this_network(cfg):
            emit_event(
                RunEvent(
                    "no_cap",
                    f"endpoint.max_cost_usd is unset: nothing stops this run's spend at {cfg.endpoint.base_url}; "
                    "to cap a paid endpoint set it with endpoint.price_prompt_usd_per_mtok and "
                    "price_completion_usd_per_mtok (the model's prices)",
                    0.0,
                )
            )
        settler.count_from_here()
        run = _Run(cfg, states, client, journal, ledger, listener, prior, settler)
        reporter = asyncio.create_task(_report_progress(run, listeners, cfg.endpoint.progress_every_s))
        work = run.work()
        running: set[asyncio.Task[tuple[_PartState, _WorkItem, _Answer]]] = set()
        # Finished tasks are queued by their own done-callback: `asyncio.wait` over the whole running set would
        # re-register thousands of callbacks on every wake-up (measured: 750 per request at 2,000 in flight).
        finished: asyncio.Queue[asyncio.Task[tuple[_PartState, _WorkItem, _Answer]]] = asyncio.Queue()
        exhausted = False
        stopped: str | None = None
        try:
            while True:
                while not exhausted and len(running) < window:
                    nxt = next(work, None)
                    if nxt is None:
                        exhausted = True
                    else:
                        task = asyncio.create_task(run.process(*nxt))
                        task.add_done_callback(finished.put_nowait)
                        running.add(task)
                if not running:
                    break
                batch = await _next_finished(finished, run.seconds_to_commit())
                error: Exception | None = None
                for task in batch:
                    running.discard(task)
                    try:
                        run.record(*task.result())
                    except Exception as exc:  # FatalEndpointError above all: record the rest, then raise
                        error = error or exc
                if error is not None:
                    raise error
                if run.commit_due() or run.complete_parts:
                    await run.commit()
                run.tell_disk_stopped()
            await run.commit()
            if run.disk_stopped:
                raise await run.disk_stopped_error()
            await settler.after_run(cfg.run_dir)
            if client.unreconciled:
                emit_event(
                    RunEvent(
                        "unreconciled",
                        f"{client.unreconciled} answers are recorded at their own usage.cost (or the configured "
                        "prices): endpoint.reconcile_cost found no generation record with a cost for them "
                        f"(GET /api/v1/generation, {sum(LOOKUP_DELAYS_S):g} s of lookups each), so their recorded "
                        "cost is the answer's, not the bill's",
                        time.monotonic() - client.started,
                    )
                )
            if client.priced_not_billed:
                emit_event(
                    RunEvent(
                        "unreconciled",
                        f"{client.priced_not_billed} answers carried no usage.cost and the endpoint keeps no "
                        "generation record for them (GET .../generation?id=): recorded at the configured prices "
                        "(endpoint.price_*_usd_per_mtok), an estimate, not the bill",
                        time.monotonic() - client.started,
                    )
                )
        except BaseException as failure:
            stopped = stop_reason(failure)
            if isinstance(failure, FatalEndpointError) and running:
                # The requests in flight were sent with the same key to the same endpoint: most get the same
                # refusal within a moment, which proves them unbilled ($0), or finish (kept). Cancelled at
                # once, each was pending at its worst case for the life of the run directory (a mistyped key:
                # 21 of 32 requests, 94% of a small cap, with no generation id to ever settle them).
                await asyncio.wait(running, timeout=REFUSAL_GRACE_S)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for task in running:  # answers that arrived beside the error are paid for: keep them
                if not task.cancelled() and task.exception() is None:
                    with contextlib.suppress(Exception):
                        run.record(*task.result())
            run.commit_now()
            if isinstance(failure, FatalEndpointError):
                raise await _settled_refusal(failure, settler, cfg) from failure
            raise
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
            emit(run.snapshot(final=True, stopped=stopped), listeners)
        return run


async def _settled_refusal(exc: FatalEndpointError, settler: Settler, cfg: PipelineConfig) -> FatalEndpointError:
    """A refusal (402 out of credit, a revoked key) cancels the streams in flight: they were billed for what
    they generated, and their generation records already say how much. Settled now, the run directory's spend is
    the bill when the command exits, and the one line it prints says what is still pending (read after the
    settlement's records are written: the group commit had not yet written them, and the line named as pending
    what had just been settled)."""
    try:
        await settler.after_run(cfg.run_dir)
    except Exception as settle_exc:  # the refusal is the error to report; settlement is retried by the next run
        log.warning("settling after the endpoint's refusal failed: %s", settle_exc)
    settler.writer.flush()
    totals = SpendLedger.load(cfg.run_dir).totals()
    notice = pending_notice(totals.to_dict(), cfg.endpoint.account_settlement)
    spent = f" This run directory's recorded spend: {format_usd(totals.billed_usd)} billed."
    return FatalEndpointError(f"{exc}{spent}" + (f" {notice}" if notice else ""))


async def _next_finished(queue: asyncio.Queue[T], timeout_s: float | None) -> list[T]:
    """Everything finished so far, waiting up to `timeout_s` (None: forever) for the first; [] on timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            first = await queue.get()
    except TimeoutError:
        return []
    batch = [first]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch


def _run_blocking(coro: Coroutine[Any, Any, _Run]) -> _Run:
    """`asyncio.run`, or the same on a worker thread when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False  # asyncio.run outside the except block: its errors must not chain "no running event loop"
    else:
        running = True
    if not running:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate") as pool:
        return pool.submit(asyncio.run, coro).result()


def generate_parts(
    cfg: PipelineConfig,
    prompt_refs: list[PartRef],
    markers: CompletionMarkers,
    tokenizer: PreTrainedTokenizerBase | None = None,
    listeners: list[Listener] | None = None,
    on_commit: CommitListener | None = None,
) -> GenerateSummary:
    """Generate responses for `prompt_refs` (prompts parts); resumes from finished parts, chunks and journals.

    A part that already has a row for every sample it should not re-send sends nothing. Raises
    `FatalEndpointError` (after committing every finished result) when the endpoint refuses the whole run, and
    `RunDirBusyError` (having sent nothing) when another run writes the directory. With `endpoint.max_cost_usd`,
    the ledger's total over the directory's life counts against the cap; reaching it returns `stopped="budget"`.
    `on_commit` hears of every commit and of the run's logs being closed (a store mirror pushes them then).
    """
    with run_dir_lock(cfg.run_dir):
        return _generate_locked(cfg, prompt_refs, markers, tokenizer, listeners, on_commit)


def _has_settleable(cfg: PipelineConfig, ledger: SpendLedger) -> bool:
    """Whether a run with nothing to send still has pending attempts the provider's records may settle."""
    ep = cfg.endpoint
    if ep.account_settlement == "exclusive_key" and ledger.totals().pending_attempts:
        return True
    return ep.settle_pending and ep.kind == "openai_chat" and bool(ledger.pending_with_ids())


def _generate_locked(
    cfg: PipelineConfig,
    prompt_refs: list[PartRef],
    markers: CompletionMarkers,
    tokenizer: PreTrainedTokenizerBase | None,
    listeners: list[Listener] | None,
    on_commit: CommitListener | None,
) -> GenerateSummary:
    ep = cfg.endpoint
    taken = take_back(cfg)
    if taken is not None:
        emit_event(
            RunEvent(
                "disk_failed",
                f"took back {plural(taken.segments, 'log segment')} ({taken.bytes / 1024:.0f} KiB of answers and "
                f"spend records) that an earlier run wrote to {taken.folder} when this run directory's disk failed",
                0.0,
            )
        )
    ledger = SpendLedger.load(cfg.run_dir)
    rules = RerunRules.of(cfg, ledger.deterministic)
    parts = {ref.part for ref in prompt_refs}
    old_journals = journal_paths(cfg.run_dir)
    journaled: dict[int, list[dict[str, Any]]] = {}
    compactable: list[Path] = []
    for path in old_journals:
        rows = journal_rows(cfg.run_dir, [path])
        if set(rows) <= parts:
            compactable.append(path)
        for part, part_rows in rows.items():
            journaled.setdefault(part, []).extend(part_rows)
    states = [_load_part(ref, journaled.get(ref.part, []), rules) for ref in prompt_refs]
    provenance = cfg.provenance()
    for state in states:
        if not state.todo and (state.has_chunks or state.buffer or not state.was_done):
            _finalize(state, provenance)
        elif not state.todo:
            shutil.rmtree(state.chunk_dir, ignore_errors=True)  # a kill during the last cleanup left it
            state.finalized = True
        elif state.buffer:
            recovered, state.buffer = state.buffer, []
            _write_chunk(state, recovered, provenance)
    for path in compactable:  # their rows are in chunks or parts now
        path.unlink(missing_ok=True)
    summary = GenerateSummary(parts=[s.summary for s in states])
    pending = [s for s in states if not s.finalized]
    stopped = False
    writer: LedgerWriter | None = None
    if pending or _has_settleable(cfg, ledger):
        if pending and (ep.kind == "sglang_generate" or ep.logprobs or ep.return_token_ids) and tokenizer is None:
            tokenizer = load_tokenizer(cfg.tokenizer)
        disk = DiskGuard(cfg.run_dir, reserve_bytes(cfg) if pending else 0)
        disk.claim()
        mirrored = on_commit is not None
        writer = LedgerWriter(cfg.run_dir, ep.journal_group_commit_s, disk.write_failed, mirrored)
        journal = None
        if pending:
            path = journal_dir(cfg.run_dir) / f"journal-{writer.token}.log"
            journal = AppendLog(path, ep.journal_group_commit_s, disk.write_failed, mirrored)
        if on_commit is not None:
            on_commit.attach([log for log in (writer.log, journal) if log is not None])
        try:
            with tuned_collector(), trimmed_heap():
                run = _run_blocking(
                    _generate_async(
                        cfg, pending, markers, tokenizer, listeners, journal, writer, ledger, on_commit, disk
                    )
                )
        finally:
            if journal is not None:
                journal.close()
            writer.close()
            disk.close()
            if on_commit is not None:
                spilled = spill_dir(cfg)
                if disk.stopped and spilled.is_dir():
                    try:
                        on_commit.spilled(spilled)
                    except Exception as exc:  # the local spill stays, and the error the run ends with is the disk's
                        log.warning("could not upload the spill folder %s to the run store: %s", spilled, exc)
                on_commit.closed()
            if journal is not None and not disk.stopped and all(not s.buffer for s in pending):
                journal.path.unlink(missing_ok=True)  # every row is in a chunk or a part
        stopped = run.client.budget.stopped
        summary.peak_in_flight = run.client.window.peak_in_flight
        summary.window_shrinks = run.client.window.shrinks
        summary.outages = run.client.breaker.outages
        if run.settler is not None:
            summary.settlement = run.settler.report.to_dict()
    ledger = SpendLedger.load(cfg.run_dir)
    after = ledger.totals()
    if writer is not None:
        by_part = ledger.totals_by_part(writer.token)
        for state in pending:
            mine = by_part.get(state.prompts.part, SpendTotals())
            state.summary.cost_usd, state.summary.pending_usd = mine.billed_usd, mine.pending_usd
        this_run = ledger.totals_of_run(writer.token)
        summary.run_billed_usd, summary.run_pending_usd = this_run.billed_usd, this_run.pending_usd
    summary.take_spend(after)
    summary.stopped = "budget" if stopped and any(s.outstanding for s in states) else None
    return summary
