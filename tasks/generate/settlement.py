"""Settling pending attempts from the provider's own records, so the spend a run directory records converges on
what it was billed instead of staying at worst case (and eating the budget of every later run).

Two sources, in this order, at the start of every generate run (before anything is sent: what a killed run
left) and at its end (once nothing is in flight):

1. The generation record, `GET /api/v1/generation?id=` (`endpoint.settle_pending`, openai_chat with prices):
   exact per attempt. Streaming gives the id with the first chunk (OpenRouter also sends `X-Generation-Id`), so
   nearly every request cut off by a timeout, a reset or a kill has one.
2. The key's account, `GET /api/v1/key` (`endpoint.account_settlement: exclusive_key`): its `usage` is read
   when a run starts and ends. Between two *stable* readings (nothing in flight, usage unchanged for
   `account_settle_stable_s`, and covering every answer known billed), what the key was charged minus what is
   known billed is what the pending attempts of that window cost; it is apportioned over them by worst case
   (their total is exact, each attempt's share is not). A window whose difference is negative or above its
   pending worst case says the key was not this run directory's alone: nothing is settled there. With a
   shared key (`off`) pending attempts stay at worst case, and their amount is printed.
   Each reading records which key took it (a fingerprint, `key_fingerprint`): a window between readings of two
   keys (the key was rotated between runs), or one whose usage went down (no key's usage ever does), measures no
   one key's charges, so nothing is settled across it, and a reading of a new key starts a new baseline instead
   of waiting for the old key's total.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from tasks.common.config import PipelineConfig
from tasks.generate.health import UPSTREAM_TIMEOUT_STATUS
from tasks.generate.ledger import NO_USAGE_COST, AccountSnapshot, Attempt, LedgerWriter, SettledBy, SpendLedger
from tasks.generate.progress import RunEvent, RunEventKind, emit_event, format_usd, plural

if TYPE_CHECKING:
    from tasks.generate.client import Budget, EndpointClient

LOOKUP_CONCURRENCY = 256
# Before a run sends anything, what a killed run left has had time to be indexed: one retry, not a 15 s wait on
# ids the provider never recorded. At a run's end its own cut requests may still be indexing.
LOOKUP_BEFORE_RUN_S = (1.0,)
LOOKUP_AFTER_RUN_S = (0.5, 1.0, 2.0, 4.0)
ABSENT_RECORD_GRACE_S = 30.0
"""How old an error-status attempt must be before a missing generation record settles it at $0."""
NO_RECORD = -1.0
"""What a lookup returns, for a cut attempt whose generation is over, when the provider has no record of it: no
cost can be negative, so it tells an absent record (settled at $0, `no_record`) from a record of $0."""
ACCOUNT_POLL_S = 0.5
# Account usage is a float the provider rounds: differences this small (absolute, or relative to what is known
# billed in the window) are rounding, not another user of the key.
ACCOUNT_TOLERANCE_USD = 1e-6
ACCOUNT_TOLERANCE_FRAC = 1e-4


def key_url(cfg: PipelineConfig) -> str:
    """OpenRouter's current-key record: GET {base}/v1/key (base .../api for OpenRouter)."""
    base = cfg.endpoint.base_url.removesuffix("/v1")
    return f"{base}/v1/key"


def key_fingerprint(api_key: str | None) -> str:
    """Which API key took an account reading, without the key: 16 hex digits of a domain-separated SHA-256 (the
    key itself never reaches the ledger). A run directory whose key was rotated between runs had every later run
    wait `account_settle_wait_s` for the new key's usage to reach the old key's total, which it never does."""
    digest = hashlib.sha256(b"eagle3-datagen account key\0" + (api_key or "").encode()).hexdigest()
    return digest[:16]


def same_account(before: AccountSnapshot, key: str | None, usage_usd: float) -> bool:
    """Whether a reading of `usage_usd` by `key` continues the account `before` was read from: the same key (when
    both readings name one) and a usage that did not go down (a key's usage never does; a lower one is another
    key's, which also catches readings from before keys were recorded)."""
    if before.key is not None and key is not None and before.key != key:
        return False
    return usage_usd >= before.usage_usd - ACCOUNT_TOLERANCE_USD


@dataclass(frozen=True)
class KeyReading:
    usage_usd: float
    limit_remaining_usd: float | None


@dataclass
class SettlementReport:
    """What one run settled, by source, and why anything was left pending."""

    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, src: str, worst_usd: float, cost_usd: float) -> None:
        entry = self.by_source.setdefault(src, {"attempts": 0, "worst_usd": 0.0, "cost_usd": 0.0})
        entry["attempts"] += 1
        entry["worst_usd"] += worst_usd
        entry["cost_usd"] += cost_usd

    def to_dict(self) -> dict[str, Any]:
        by_source = {
            src: {
                "attempts": int(e["attempts"]),
                "worst_usd": round(e["worst_usd"], 6),
                "cost_usd": round(e["cost_usd"], 6),
            }
            for src, e in self.by_source.items()
        }
        return {"by_source": by_source, "problems": list(self.problems)}


def account_settlements(
    ledger: SpendLedger, records_settle_ids: bool = False, request_timeout_s: float = 0.0
) -> tuple[list[tuple[str, float]], list[str]]:
    """(uid, cost) for every pending attempt that a pair of stable account readings settles, and one line per
    window that cannot be settled. Pure: reads the ledger view only.

    With `records_settle_ids` (generation records are looked up), a pending attempt with a generation id may be a
    cut stream that a provider unable to cancel it bills when the model finishes, after the key's usage looked
    stable: a window closed before then read $0 for it (7 cut streams settled at $0 against a $0.81 bill, and the
    cap was crossed). So its window is widened to the first stable reading taken once that generation is over
    (`generation_over`): the key's usage there holds its bill, if any. Until such a reading exists the window
    waits (for its records, or for a later run's reading); held back for good, 1,499 requests a dead endpoint
    never billed stayed at worst case forever and stopped every later run at its cap."""
    snaps = ledger.stable_accounts()
    if len(snaps) < 2:
        return [], []
    times = [s.t for s in snaps]
    windows: dict[int, list[tuple[str, Attempt]]] = {}
    for uid, attempt in ledger.attempts.items():
        if attempt.sent_at is None:
            continue
        i = bisect.bisect_right(times, attempt.sent_at)
        if 0 < i < len(times):
            windows.setdefault(i, []).append((uid, attempt))
    out: list[tuple[str, float]] = []
    problems: list[str] = []
    for first, last, members in _window_groups(windows, times, records_settle_ids, request_timeout_s):
        pending = [(uid, a) for uid, a in members if a.state == "pending"]
        if last is None:
            problems.append(_awaiting_records(pending, request_timeout_s))
            continue
        if not all(same_account(snaps[j - 1], snaps[j].key, snaps[j].usage_usd) for j in range(first, last + 1)):
            problems.append(
                f"{plural(len(pending), 'pending attempt')} sent between account readings of two different keys "
                "(the API key changed, or its usage went down): no one key's usage measures them, so they stay "
                "at worst case unless their generation records settle them"
            )
            continue
        settled, problem = _settle_window(snaps[first - 1].usage_usd, snaps[last].usage_usd, members, pending)
        out.extend(settled)
        if problem:
            problems.append(problem)
    return out, problems


def _window_groups(
    windows: dict[int, list[tuple[str, Attempt]]], times: list[float], records_settle_ids: bool, timeout_s: float
) -> list[tuple[int, int | None, list[tuple[str, Attempt]]]]:
    """(first window, last window or None while no stable reading closes it, members) of every run of consecutive
    account windows holding pending attempts: a window is merged into the next while a pending attempt of it with
    a generation id (`records_settle_ids`) was still generating at its closing reading."""
    groups: list[tuple[int, int | None, list[tuple[str, Attempt]]]] = []
    first, due = 0, 0.0
    members: list[tuple[str, Attempt]] = []
    for i in range(1, len(times)):
        if not members:
            first = i
        members = members + windows.get(i, [])
        pending = [a for _, a in members if a.state == "pending"]
        if not pending:
            members = []
            continue
        if records_settle_ids:
            due = max([due, *(_generation_end(a, timeout_s) for a in pending if a.generation_id)])
        if times[i] >= due:
            groups.append((first, i, members))
            members, due = [], 0.0
    if members:
        groups.append((first, None, members))
    return groups


def _settle_window(
    usage_before: float, usage_after: float, members: list[tuple[str, Attempt]], pending: list[tuple[str, Attempt]]
) -> tuple[list[tuple[str, float]], str | None]:
    """What the key was charged between two readings minus what its attempts are known billed, apportioned over
    its pending attempts by worst case; nothing, and why, when the key cannot have been this directory's alone."""
    known = sum(a.billed_usd for _, a in members)
    charged = usage_after - usage_before
    remainder = charged - known
    worst = sum(a.worst_usd for _, a in pending)
    tolerance = ACCOUNT_TOLERANCE_USD + ACCOUNT_TOLERANCE_FRAC * known
    if remainder < -tolerance or remainder > worst + tolerance:
        return [], (
            f"the key was charged {format_usd(charged)} while known answers cost {format_usd(known)} and "
            f"{len(pending)} pending attempts at most {format_usd(worst)}: something else used the key, so "
            "nothing was settled from its account there"
        )
    remainder = min(max(remainder, 0.0), worst)
    return [(uid, remainder * a.worst_usd / worst if worst > 0 else 0.0) for uid, a in pending], None


def _awaiting_records(pending: list[tuple[str, Attempt]], timeout_s: float) -> str:
    with_ids = [a for _, a in pending if a.generation_id]
    due = max(_generation_end(a, timeout_s) for a in with_ids)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(due))
    return (
        f"{len(with_ids)} of {len(pending)} pending attempts in an account window have a generation id whose "
        "record is not in yet (a cut stream may be billed when the model finishes): their records settle them, or "
        f"a run started after {when} (endpoint.request_timeout_s after they were sent, plus "
        f"{ABSENT_RECORD_GRACE_S:g} s) settles the window from the key's usage"
    )


def billed_since(ledger: SpendLedger, t: float) -> float:
    return sum(a.billed_usd for a in ledger.attempts.values() if a.sent_at is not None and a.sent_at > t)


class Settler:
    """Settles pending attempts through `client`'s session and records each settlement in `writer`; keeps the
    run's ledger view, budget and counters in step. Event-loop confined."""

    def __init__(self, cfg: PipelineConfig, client: EndpointClient, writer: LedgerWriter, ledger: SpendLedger) -> None:
        self.cfg = cfg
        self.client = client
        self.writer = writer
        self.ledger = ledger
        self.report = SettlementReport()
        self.budget: Budget | None = None
        self.settled_worst_usd = 0.0
        self.settled_cost_usd = 0.0
        self.settled_attempts = 0
        self._account_started = False
        self._not_found: set[str] = set()
        self._window_problems: list[str] = []
        self.key_fp = key_fingerprint(cfg.endpoint.resolved_api_key())
        self._new_key_told = False

    def count_from_here(self) -> None:
        """The settled_* counters start over: what was settled before the run's budget is in its prior totals."""
        self.settled_worst_usd = self.settled_cost_usd = 0.0
        self.settled_attempts = 0

    @property
    def by_generation(self) -> bool:
        ep = self.cfg.endpoint
        return ep.settle_pending and ep.kind == "openai_chat"

    @property
    def by_account(self) -> bool:
        return self.cfg.endpoint.account_settlement == "exclusive_key"

    async def before_run(self, sending: bool) -> None:
        """What earlier (killed) runs left pending, then this run's opening account reading."""
        await self._settle_by_generation(LOOKUP_BEFORE_RUN_S)
        if self.by_account and (sending or self.ledger.totals().pending_attempts):
            self._account_started = await self._account_reading("start")
            await self._settle_by_account()

    async def after_run(self, run_dir: Path) -> None:
        """Once nothing is in flight: this run's pending attempts (read back from its flushed segment). With
        nothing pending there is nothing to settle, and the closing account reading (a wait of
        `account_settle_stable_s` at least) is skipped: the next run's opening reading covers this run's answers."""
        await self.client.drain_bills()
        self.writer.flush()
        self.ledger = SpendLedger.load(run_dir)
        await self._settle_by_generation(LOOKUP_AFTER_RUN_S)
        if self.by_account and self._account_started and self.ledger.totals().pending_attempts:
            await self._account_reading("end")
            await self._settle_by_account()

    async def mid_run(self) -> None:
        """Before the budget stops a run (`Budget.reclaim`), nothing in flight: this run's pending attempts so far,
        read back from its flushed segment, settled from their generation records."""
        await self.client.drain_bills()
        self.writer.flush()
        self.ledger = SpendLedger.load(self.cfg.run_dir)
        await self._settle_by_generation(LOOKUP_AFTER_RUN_S, remember_misses=False)

    def _record(self, uid: str, cost: float, src: SettledBy) -> None:
        attempt = self.ledger.attempts[uid]
        worst = attempt.worst_usd
        self.ledger.apply(self.writer.settled(uid, cost, src))
        self.report.add(src, worst, cost)
        self.settled_worst_usd += worst
        self.settled_cost_usd += cost
        self.settled_attempts += 1
        if self.budget is not None:
            self.budget.spent_usd -= worst - cost

    async def _settle_by_generation(self, delays_s: tuple[float, ...], remember_misses: bool = True) -> None:
        """Every pending attempt with a generation id not already looked up in vain by this run. A miss mid-run
        (`remember_misses=False`) is looked up again at the run's end: a record may take longer to appear than a
        pass waits, and remembered, it was never looked up again by that run."""
        if not self.by_generation:
            return
        pending = [p for p in self.ledger.pending_with_ids() if p[0] not in self._not_found]
        if not pending:
            return
        gate = asyncio.Semaphore(LOOKUP_CONCURRENCY)
        now = time.time()
        timeout_s = self.cfg.endpoint.request_timeout_s
        over = {uid: generation_over(self.ledger.attempts[uid], now, timeout_s) for uid, _, _ in pending}
        records_kept = any(over.values()) and await self._records_kept()

        async def one(uid: str, generation_id: str) -> tuple[float | None, SettledBy]:
            attempt = self.ledger.attempts[uid]
            priced = priced_unless_recorded(attempt, now)
            unbilled = records_kept and over[uid]
            async with gate:
                ended = ended_long_ago(attempt, now) or unbilled
                absent = priced if priced is not None else (NO_RECORD if unbilled else 0.0 if ended else None)
                cost = await self.client.lookup_cost(generation_id, delays_s, absent, ended)
            if cost == NO_RECORD:
                return 0.0, "no_record"
            return cost, ("configured_prices" if priced is not None and cost is priced else "generation")

        found = await asyncio.gather(*(one(uid, gid) for uid, gid, _ in pending))
        settled = [(uid, c, src) for (uid, _, _), (c, src) in zip(pending, found, strict=True) if c is not None]
        if remember_misses:  # a generation over while records were unproven is looked up again once they are
            self._not_found.update(
                uid
                for (uid, _, _), (c, _) in zip(pending, found, strict=True)
                if c is None and (records_kept or not over[uid])
            )
        worst = sum(self.ledger.attempts[uid].worst_usd for uid, _, _ in settled)
        for uid, cost, src in settled:
            self._record(uid, cost, src)
        missing = len(pending) - len(settled)
        if missing and remember_misses:
            self.report.problems.append(
                f"{missing} pending attempts have a generation id the provider has no record of (yet)"
            )
        if any(src == "generation" for _, _, src in settled):
            self.client.saw_record()
        if settled:
            self._event(
                f"settled {len(settled)} pending attempts from the provider's generation records: "
                f"{format_usd(worst)} at worst case -> {format_usd(sum(c for _, c, _ in settled))} billed"
            )

    async def _records_kept(self) -> bool:
        """Whether this endpoint keeps generation records, so that a record still missing once its generation is
        over means it was not billed. An endpoint that keeps none (a vendor billing per token, a local server)
        404s every id, and $0 there would under-count its bill: only a record read back proves it. Evidence: an
        attempt already settled from a paid record, else one lookup of this directory's oldest paid answer
        (indexed long since). Unknown (nothing paid with an id, the lookup failed): no, for this pass. What the
        client learned from this run's answers (`EndpointClient.keeps_records`) comes first."""
        known = self.client.keeps_records()
        if known is None and await self._find_a_record():
            self.client.saw_record()
            return True
        return bool(known)

    async def _find_a_record(self) -> bool:
        paid = [a for a in self.ledger.attempts.values() if a.generation_id and (a.cost_usd or 0.0) > 0]
        if any(a.settled_by == "generation" for a in paid):
            return True
        answered = [a for a in paid if a.state == "answered" and a.sent_at is not None]
        if not answered:
            return False
        oldest = min(answered, key=lambda a: a.sent_at or 0.0)
        return await self.client.lookup_cost(oldest.generation_id or "", ()) is not None

    async def _settle_by_account(self) -> None:
        settlements, problems = account_settlements(
            self.ledger, self.by_generation, self.cfg.endpoint.request_timeout_s
        )
        self._replace_window_problems(problems)
        if not settlements:
            return
        worst = sum(self.ledger.attempts[uid].worst_usd for uid, _ in settlements)
        for uid, cost in settlements:
            self._record(uid, cost, "account")
        self._event(
            f"settled {len(settlements)} pending attempts from the key's account usage: {format_usd(worst)} at "
            f"worst case -> {format_usd(sum(c for _, c in settlements))} billed"
        )

    def _replace_window_problems(self, problems: list[str]) -> None:
        """Each pass judges every account window again: its lines replace the previous pass's, which the run's
        opening and closing passes had both left in the report (the same line twice)."""
        self.report.problems = [p for p in self.report.problems if p not in self._window_problems] + problems
        self._window_problems = problems

    async def _account_reading(self, at: Literal["start", "end"]) -> bool:
        """Poll the key until its usage is stable and covers every known answer since the last stable reading, or
        `account_settle_wait_s` passes; record the reading (stable or not). False when the key cannot be read."""
        ep = self.cfg.endpoint
        stable_snaps = self.ledger.stable_accounts()
        last = stable_snaps[-1] if stable_snaps else None
        known_since = billed_since(self.ledger, last.t) if last else 0.0
        deadline = time.monotonic() + ep.account_settle_wait_s
        last_usage: float | None = None
        changed_at = time.monotonic()
        told = False
        while True:
            reading = await self._read_key()
            if isinstance(reading, str):
                self.report.problems.append(reading)
                return False
            now = time.monotonic()
            if reading.usage_usd != last_usage:
                last_usage, changed_at = reading.usage_usd, now
            expected = self._expected_usage(last, known_since, reading.usage_usd)
            covers = expected is None or reading.usage_usd >= expected - ACCOUNT_TOLERANCE_USD
            stable = covers and now - changed_at >= ep.account_settle_stable_s
            if stable or now >= deadline:
                break
            if not covers and not told:
                told = True
                self._event(
                    f"waiting up to {ep.account_settle_wait_s:g} s (endpoint.account_settle_wait_s) for the key's "
                    f"usage, {format_usd(reading.usage_usd)}, to cover the {format_usd(expected)} its answers known "
                    f"billed add up to ({'before anything is sent' if at == 'start' else 'at the run end'})",
                    "account_wait",
                )
            await asyncio.sleep(min(ACCOUNT_POLL_S, max(0.0, deadline - now)))
        if not stable:
            problem = (
                f"the key's usage did not settle within endpoint.account_settle_wait_s="
                f"{ep.account_settle_wait_s:g} s ({'still moving' if covers else 'behind the answers known billed'}); "
                f"the {at} reading settles nothing"
            )
            self.report.problems.append(problem)
            self._event(problem, "account_wait")
        self.ledger.apply(self.writer.account(at, reading.usage_usd, reading.limit_remaining_usd, stable, self.key_fp))
        return True

    def _expected_usage(self, last: AccountSnapshot | None, known_since: float, usage_usd: float) -> float | None:
        """What the key's usage must reach before a reading is stable: the last stable reading plus every answer
        known billed since (`known_since`). None (a new baseline) when there is none, or when this reading is
        another key's (rotated between runs; said once)."""
        if last is None:
            return None
        if same_account(last, self.key_fp, usage_usd):
            return last.usage_usd + known_since
        if not self._new_key_told:
            self._new_key_told = True
            self._event(
                f"the key's account is not the one read before ({format_usd(last.usage_usd)} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(last.t))}, now {format_usd(usage_usd)}: "
                "another API key, or its usage went down): its usage starts a new baseline",
                "account_wait",
            )
        return None

    async def _read_key(self) -> KeyReading | str:
        session = self.client.session
        url = key_url(self.cfg)
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    text = self.client.redact((await resp.text())[:200])
                    return f"GET {url} answered HTTP {resp.status} ({text!r}): no account settlement"
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return f"GET {url} failed ({type(exc).__name__}): no account settlement"
        data = body.get("data") if isinstance(body, dict) else None
        usage = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(usage, int | float) or isinstance(usage, bool):
            return f"GET {url} has no numeric data.usage: no account settlement"
        remaining = data.get("limit_remaining") if isinstance(data, dict) else None
        return KeyReading(float(usage), float(remaining) if isinstance(remaining, int | float) else None)

    def _event(self, message: str, kind: RunEventKind = "settled") -> None:
        emit_event(RunEvent(kind, message, time.monotonic() - self.client.started))


ENDED_WITH_ERROR_REASONS = frozenset({"error_body", "stream_error"})
"""The provider ended the generation and said so (an HTTP 200 error body, an error chunk): nothing more is
generated, so its record, once written, does not change."""


def ended_long_ago(attempt: Attempt, now: float) -> bool:
    """A generation the provider ended with an error (a status that named it, an HTTP 200 error body, an error
    chunk) at least `ABSENT_RECORD_GRACE_S` ago: its record is written by then (records appear seconds after),
    so a record of $0 with no token is its bill, not one still being written, and no record at all means it was
    not billed ($0). Such attempts stayed pending at worst case for good and stopped every later run at its cap
    (21 unbilled 503s; a billing probe's error bodies, $4.13 pending against $0 billed). Timeouts the server
    reported (408, 499, 524) and cut streams are not ended: the upstream may finish and bill, possibly minutes
    later."""
    code = "400" if attempt.reason == "context_length" else (attempt.reason or "").removeprefix("http_")
    errored = attempt.reason in ENDED_WITH_ERROR_REASONS or (
        code.isdigit() and int(code) not in UPSTREAM_TIMEOUT_STATUS
    )
    return errored and _record_due(attempt, now)


def priced_unless_recorded(attempt: Attempt, now: float) -> float | None:
    """An answer without usage.cost whose record was still being looked up when its run was killed: at least
    `ABSENT_RECORD_GRACE_S` old and the provider has no record of it, its configured prices' figure is the best
    there is (an endpoint that keeps no records), not its worst case for good."""
    return attempt.estimate_usd if attempt.reason == NO_USAGE_COST and _record_due(attempt, now) else None


def _record_due(attempt: Attempt, now: float) -> bool:
    """Sent at least `ABSENT_RECORD_GRACE_S` ago: a record the provider keeps is written by then."""
    return attempt.sent_at is not None and now - attempt.sent_at >= ABSENT_RECORD_GRACE_S


def generation_over(attempt: Attempt, now: float, timeout_s: float) -> bool:
    """A request cut mid-generation (a kill, a reset, a dead endpoint) whose generation has ended by `now`: a
    provider that cannot cancel a stream bills it when the model finishes, but a full answer takes at most
    `endpoint.request_timeout_s` (a longer one the client would have cut anyway), and its record is written
    `ABSENT_RECORD_GRACE_S` after. From then on a lookup that finds no record means none will come."""
    return attempt.sent_at is not None and now >= _generation_end(attempt, timeout_s)


def _generation_end(attempt: Attempt, timeout_s: float) -> float:
    """When the generation of an attempt has surely ended and its record, if any, is written. The longer of the
    timeout it was sent under and today's: a rerun with a lower `endpoint.request_timeout_s` must not declare a
    generation over that may still be running, and settle it at $0 before the provider bills it."""
    return (attempt.sent_at or 0.0) + max(attempt.timeout_s or 0.0, timeout_s) + ABSENT_RECORD_GRACE_S


def pending_notice(spend: dict[str, Any], account_settlement: str) -> str | None:
    """The line every surface prints while anything is pending: the amount, what it is, what settles it."""
    count = spend.get("pending_attempts") or 0
    if not count:
        return None
    how = (
        "the key's account (endpoint.account_settlement: exclusive_key) could not settle them yet; a later run "
        "tries again"
        if account_settlement == "exclusive_key"
        else "the key may be shared, so its account cannot tell what they cost; if only this run directory uses "
        "it, endpoint.account_settlement: exclusive_key settles them from the key's usage"
    )
    return (
        f"pending: {format_usd(spend.get('pending_usd'))} over {plural(count, 'attempt')} in this run directory sent "
        "without a bill a process could read (timeouts, resets, kills, errors that name a generation), counted at "
        f"their worst case against endpoint.max_cost_usd beside {format_usd(spend.get('billed_usd'))} billed; {how}."
    )
