"""The HTTP side of generation: one pooled aiohttp session, one adaptive global window, typed retry decisions.

Why aiohttp and not httpx (which the design card names): at 2,000 requests in flight on 2 cores, a plain
`httpx.AsyncClient` reached 0.03 of the ideal request rate while burning a full core in its connection pool,
and httpx over an aiohttp transport reached 0.90 of raw aiohttp; raw aiohttp is the only transport that keeps
the window full. `bench/client_throughput.py` measures this client against raw aiohttp side by side.

Every answer is sorted into exactly one of three classes, because each needs a different reaction:
- retryable (rate limits, overload, server errors, timeouts, broken or empty bodies): back off and try again;
- sample-fatal (400 context length and other 4xx): this prompt can never succeed as sent; record why, move on;
- run-fatal (401/403/404, 402 without Retry-After): no request can succeed, so stop the run with
  `FatalEndpointError` instead of burning through every sample.
No message, row or exception produced here contains the API key (`redact`).

Money: each attempt ends in one spend-ledger state (`tasks.generate.ledger`). The line between `unsent` ($0) and
`pending` (worst case until settled) is drawn by where the failure happened, never by guessing:
- `aiohttp.ClientConnectorError` (and its DNS, proxy, TLS and certificate subclasses) and
  `ConnectionTimeoutError` come from establishing a new connection, before a byte of the request is written
  (aiohttp never retries a POST on a stale pooled connection): `unsent`;
- everything after that may have reached the server: a reset or a disconnect on a reused keep-alive connection
  (the server may have read the request before it closed), a read timeout, a cut stream, a cancelled or killed
  request: `pending`, with the generation id when the `X-Generation-Id` header or the first streamed chunk gave it.
When in doubt it is `pending`: an over-count the provider's records can settle, never an under-count.
The endpoint as a whole going down is the circuit breaker's business (`tasks.generate.breaker`).
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from functools import partial
from types import TracebackType
from typing import Any, Literal, NamedTuple

import aiohttp
from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig
from tasks.common.errors import FatalEndpointError
from tasks.common.messages import Message
from tasks.generate.breaker import CircuitBreaker, OutageEvent
from tasks.generate.disk_guard import DiskGuard
from tasks.generate.endpoints import (
    CompletionMarkers,
    EndpointRequest,
    GenerationResult,
    MalformedResponseError,
    build_request,
    generation_lookup_url,
    parse_response,
    price_cost,
    reported_cost,
    usd_number,
)
from tasks.generate.health import UNAVAILABLE_STATUS, UPSTREAM_TIMEOUT_STATUS, probe_url
from tasks.generate.ledger import NO_USAGE_COST, LedgerWriter, Outcome, SettledBy
from tasks.generate.progress import RunEvent, emit_event
from tasks.generate.sse import StreamAssembler
from tasks.generate.stall_watch import StallWatch, stop_per_read_timer

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
RUN_FATAL_STATUS = frozenset({401, 403, 404})
RATE_LIMIT_STATUS = frozenset({429, 402})
RETRY_AFTER_CAP_S = 3600.0
ERROR_SNIPPET_CHARS = 300
RETRYABLE_FINISH = frozenset({"error", "abort"})
# Failures that say the endpoint as a whole may be unreachable or overloaded, not that this sample is bad.
OUTAGE_REASONS = frozenset({"connect", "connection", "timeout", "http_502", "http_503", "http_504"})
GENERATION_ID_HEADER = "X-Generation-Id"
# Connection failures raised while a new connection is established, before the request is written: `unsent`.
NEVER_SENT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
UNKNOWN_MODEL_HINTS = ("not a valid model", "model_not_found", "model does not exist", "unknown model", "invalid model")
"""A 400 naming the model itself as wrong: OpenRouter's "<model> is not a valid model ID" (HTTP 400, as its users
quote it), OpenAI's `model_not_found`. Read as one sample's failure, 100,000 prompts were each sent to be refused."""
CONTEXT_LENGTH_HINTS = ("context length", "context_length", "maximum context", "context window", "too many tokens")
# Window regrowth per healthy answer: from half of 2,000 back to 2,000 in ~4,000 answers (seconds at full rate).
GROWTH_PER_SUCCESS = 0.25
LOOKUP_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
RECORDS_PROBE_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
"""How long the first answer without usage.cost waits for its record before the run concludes the endpoint keeps
none (60 s): concluded after `LOOKUP_DELAYS_S` (15.5 s), a provider whose records took 20 s was taken for one
without records and its answers were recorded at the configured prices, half its bill."""
LOOKUP_TIMEOUT_S = 10.0
"""One generation-record request: the session's read timeout is the stream's idle timeout (300 s by default), so
a `/generation` that never answered held a budget stop's settlement for up to 25 minutes with nothing in flight."""
PRICE_FACTOR_STEP = 0.01
"""How far above the configured prices a bill must be before worst cases are counted higher: costs are rounded."""
UNSEEN_PRICES_IN_FLIGHT = 1
"""Requests a capped run keeps in flight until an answer's bill has been seen (`Budget.prices_seen`)."""


def _refuses_run(status: int, retry_after: str | None) -> bool:
    """401/403/404, or a 402 without Retry-After (no credit, as opposed to OpenRouter's in-flight budget): no
    request can succeed, and nothing was generated, so nothing was billed."""
    return status in RUN_FATAL_STATUS or (status == 402 and retry_after is None)


class RetryableError(Exception):
    def __init__(
        self,
        reason: str,
        message: str,
        retry_after_s: float | None = None,
        billed: float | None = 0.0,
        generation_id: str | None = None,
        sent: bool = True,
        answer: GenerationResult | None = None,
    ) -> None:
        """`billed`: what this failed attempt cost, 0.0 when nothing was billed, None when unknown (pending: the
        budget charges the attempt's worst case until the provider's records settle it). `sent=False`: the
        request never left the process (`unsent`, $0, no attempt used up). `answer`: an answer that parsed but
        is retried (a finish_reason "error", an empty answer); its cost is booked as a kept answer's is."""
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.billed = billed
        self.generation_id = generation_id
        self.sent = sent
        self.answer = answer

    @property
    def outcome(self) -> Outcome:
        if not self.sent:
            return "unsent"
        return "pending" if self.billed is None else "answered"


def _error_body_bill(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[float | None, str | None]:
    """(billed, generation id) of an HTTP 200 whose body is an error. OpenRouter answers 200 only once the model
    has started producing output, so the generation may be billed: its usage.cost when the body has one, else
    unknown, pending at worst case until its generation record (or, without an id, the key's account under
    `exclusive_key`) settles it. Booking an id-less one at $0 (a proxy that drops `X-Generation-Id`) left a
    fifth of what the provider billed unrecorded and let the spend pass the cap."""
    body_id = body.get("id") if isinstance(body.get("id"), str) else None
    generation_id = headers.get(GENERATION_ID_HEADER) or body_id
    return reported_cost(body.get("usage")), generation_id


def answer_cost(result: GenerationResult) -> float | None:
    """What an answer is recorded at: its reported (or priced) cost; $0 when it reports usage but nothing prices
    it (a self-hosted server without a price table bills nothing); unknown (None: pending at its worst case until
    the provider's records settle it) when it reports no usage at all (a stream whose usage chunk was cut off, an
    aborted generation: booked at $0, those left a quarter of a provider's bill unrecorded), or a cost that
    cannot be read."""
    if result.cost_usd is not None:
        return result.cost_usd
    if result.cost_unknown:
        return None
    return 0.0 if result.prompt_tokens is not None or result.completion_tokens is not None else None


def _whole_before_done(stream: StreamAssembler) -> bool:
    """A stream cut after its finish_reason chunk but before `[DONE]` (a proxy's idle timeout, a reset on close)
    holds the whole answer: buying it again would pay twice for it. Its bill may have been cut off with the usage
    chunk: the answer is then kept and its cost is pending until the generation record settles it."""
    try:
        stream.close()
    except MalformedResponseError:
        return False
    return stream.finish_reason is not None and stream.error is None


class SampleFatalError(Exception):
    def __init__(self, reason: str, message: str, billed: float | None = 0.0, generation_id: str | None = None) -> None:
        """`billed` as for `RetryableError`: None when the refusal may have been billed (pending)."""
        super().__init__(message)
        self.reason = reason
        self.billed = billed
        self.generation_id = generation_id


class BudgetExhausted(Exception):
    """No request may start: its worst-case cost would cross `max_cost_usd`."""


class SendingHalted(Exception):
    """No request may start: the run directory's disk stopped taking writes, full or failed (`disk_guard`); the
    request was not sent."""


class AttemptTag(NamedTuple):
    """Which sample an attempt belongs to, for its spend ledger records. A tuple of atoms, so the garbage
    collector stops tracking it: thousands are alive at once, one per sample waiting or in flight."""

    sample_id: str
    dataset: str
    part: int


@dataclass(slots=True)
class SampleOutcome:
    """What happened to one request chain: a result, the reason it failed, or `budget_stopped` (never sent,
    or abandoned between retries, because of the cost cap: the sample stays pending for a rerun)."""

    result: GenerationResult | None
    reason: str | None
    error: str | None
    attempts: int
    latency_s: float | None
    retry_reasons: list[str] = field(default_factory=list)
    cost_usd: float = 0.0
    budget_stopped: bool = False
    halted: bool = False
    """Not sent because the disk filled or failed: no row, so the sample stays pending for a rerun."""


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds, fractional allowed, or an HTTP date)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_S)


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: requests that failed together do not all retry together."""
    return rng.uniform(0.0, min(max_s, base_s * 2.0 ** min(attempt - 1, 60)))


def _blank(text: str | None) -> bool:
    return not text or text.isspace()


def ensure_open_files(needed: int) -> None:
    """Raise the soft descriptor limit toward `needed` (capped by the hard limit): one socket per request."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class AdaptiveWindow:
    """The run's one in-flight limit: FIFO admission, halved on rate limiting, regrown while answers succeed.

    A 429 shrinks the window at most once per round trip: only a request sent after the last shrink can shrink
    it again (the others were admitted under the old limit and say nothing new). A Retry-After pauses all new
    admissions until it has passed, since the limit it reports is the account's, not one request's.
    """

    def __init__(self, max_size: int, min_size: int) -> None:
        self.max_size = max_size
        self.min_size = min(min_size, max_size)
        self.limit = float(max_size)
        self.in_flight = 0
        self.peak_in_flight = 0
        self.shrinks = 0
        self.paused_until = 0.0
        self._seq = 0
        self._shrink_mark = 0
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._wake_handle: asyncio.TimerHandle | None = None

    def _admit(self) -> int:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self._seq += 1
        return self._seq

    def _open(self) -> bool:
        return self.in_flight < int(self.limit) and time.monotonic() >= self.paused_until

    async def acquire(self) -> int:
        """Wait for a slot; returns the request's send sequence number."""
        if not self._waiters and self._open():
            return self._admit()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._wake()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._open():
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._admit())
        if self._waiters and self.paused_until > time.monotonic() and self._wake_handle is None:
            delay = self.paused_until - time.monotonic()
            self._wake_handle = asyncio.get_running_loop().call_later(delay, self._resume)

    def _resume(self) -> None:
        self._wake_handle = None
        self._wake()

    def on_success(self) -> None:
        if self.limit < self.max_size:
            self.limit = min(float(self.max_size), self.limit + GROWTH_PER_SUCCESS)
            self._wake()

    def on_rate_limited(self, seq: int, retry_after_s: float | None) -> None:
        if seq > self._shrink_mark:
            self.limit = max(float(self.min_size), self.limit / 2)
            self._shrink_mark = self._seq
            self.shrinks += 1
        if retry_after_s:
            self.paused_until = max(self.paused_until, time.monotonic() + retry_after_s)


class Budget:
    """Spend against `max_cost_usd`: a request starts only if its worst case fits beside everything already
    spent and every in-flight worst case, so answers in flight can never carry the spend over the cap.

    A request that does not fit waits (FIFO) for in-flight requests to settle at their real, smaller cost; the
    run stops only when the first waiter still does not fit with nothing left in flight to free room. So the
    cap is used up to one worst case, never crossed.

    Worst cases are priced from the config; `price_factor` is how far above those prices the endpoint has
    been seen to bill (its models listing, or an answer's own cost), and every reservation, those in flight
    included, counts at that factor: a provider billing 3x the configured prices otherwise carried the spend to
    1.8x the cap while each request "fit". Amounts passed to `reserve` and `settle` are at the config's prices.
    Until the first answer's bill has been seen (`prices_seen`), one request is in flight at a time: a price
    the listing does not show (an unlisted model, a provider billing above its listing) is then learned before
    a whole window was reserved at the configured prices (16 requests in flight went to 1.77x the cap).
    """

    def __init__(self, cap_usd: float | None, spent_before_usd: float, prices_seen: bool = False) -> None:
        """`spent_usd` counts billed plus pending at worst case (the ledger's `counted_usd`); `prices_seen`: the
        configured prices are the cost by definition (a self-hosted server)."""
        self.cap_usd = cap_usd
        self.prior_usd = spent_before_usd
        self.spent_usd = spent_before_usd
        self.reserved_base_usd = 0.0
        self.reservations = 0
        self.prices_seen = prices_seen or cap_usd is None
        self.price_factor = 1.0
        self.stopped = False
        self.started = time.monotonic()
        self._waiters: deque[tuple[asyncio.Future[None], float]] = deque()
        self._retry_waiters: deque[tuple[asyncio.Future[None], float]] = deque()
        self.reclaim: Callable[[], Awaitable[None]] | None = None
        """Settles pending attempts from the provider's records (`Settler.mid_run`): tried before a stop."""
        self._reclaiming: asyncio.Task[None] | None = None
        self._reclaimed_at_usd = -1.0

    @property
    def reserved_usd(self) -> float:
        """In-flight worst cases at the prices the endpoint bills."""
        return self.reserved_base_usd * self.price_factor

    def _fits(self, amount: float) -> bool:
        if self.cap_usd is None:
            return True
        if not self.prices_seen and self.reservations >= UNSEEN_PRICES_IN_FLIGHT:
            return False
        return self.spent_usd + (self.reserved_base_usd + amount) * self.price_factor <= self.cap_usd

    def saw_prices(self) -> None:
        """An answer's bill has been seen (and any higher price learned from it): the whole window may open."""
        if not self.prices_seen:
            self.prices_seen = True
            self._admit_waiters()

    def _exhausted(self, amount: float) -> BudgetExhausted:
        return BudgetExhausted(
            f"spent ${self.spent_usd:.4f} + next request's worst case ${amount * self.price_factor:.4f} would cross "
            f"max_cost_usd ${self.cap_usd:.4f}"
        )

    def raise_prices(self, factor: float, why: str) -> None:
        """Count every worst case, in flight and to come, at `factor` times the configured prices (never lower)."""
        if factor <= self.price_factor * (1.0 + PRICE_FACTOR_STEP):
            return
        self.price_factor = factor
        emit_event(
            RunEvent(
                "price_drift",
                f"{why}: worst cases (what the cap reserves, what a pending attempt counts) now count at "
                f"{factor:.2f}x the configured endpoint.price_*_usd_per_mtok; set the prices the endpoint bills",
                time.monotonic() - self.started,
            )
        )

    async def reserve(self, amount: float, retry: bool = False) -> None:
        """`retry`: the attempt of a sample already admitted; retries are served before fresh samples, so a
        short budget finishes what it started instead of leaving first attempts stranded."""
        if self.cap_usd is None:
            return
        if self.stopped:
            raise self._exhausted(amount)
        if not self._retry_waiters and (retry or not self._waiters) and self._fits(amount):
            self.reserved_base_usd += amount
            self.reservations += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._retry_waiters if retry else self._waiters).append((fut, amount))
        self._admit_waiters()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.reserved_base_usd = max(0.0, self.reserved_base_usd - amount)
                self.reservations -= 1
            raise

    def _admit_waiters(self) -> None:
        while self._retry_waiters or self._waiters:
            queue = self._retry_waiters if self._retry_waiters else self._waiters
            fut, amount = queue[0]
            if fut.done():
                queue.popleft()
            elif self._fits(amount):
                queue.popleft()
                self.reserved_base_usd += amount
                self.reservations += 1
                fut.set_result(None)
            elif self.reservations <= 0:
                if self._reclaim_first():
                    return
                self.stopped = True
                emit_event(
                    RunEvent(
                        "budget_stop",
                        f"budget cap reached: {self.spent_usd:.4f} USD counted (billed + pending at worst case) of "
                        f"endpoint.max_cost_usd={self.cap_usd:g}, and the next request's worst case "
                        f"{amount * self.price_factor:.4f} USD does not fit; no new request starts, finished "
                        "samples are committed",
                        time.monotonic() - self.started,
                    )
                )
                for waiters in (self._retry_waiters, self._waiters):
                    while waiters:
                        waiter, need = waiters.popleft()
                        if not waiter.done():
                            waiter.set_exception(self._exhausted(need))
            else:
                return

    def _reclaim_first(self) -> bool:
        """Whether the stop waits for a settlement pass: pending attempts count at their worst case, and those the
        provider's records can settle were settled only when a run started and ended, so a run with cut streams
        stopped at a ninth of its cap. One pass per growth of the counted spend; the stop comes when a pass frees
        no room."""
        if self._reclaiming is not None:
            return True
        if self.reclaim is None or self.spent_usd <= self._reclaimed_at_usd:
            return False
        self._reclaiming = asyncio.get_running_loop().create_task(self._reclaim_then_admit(self.reclaim))
        return True

    async def _reclaim_then_admit(self, reclaim: Callable[[], Awaitable[None]]) -> None:
        try:
            await reclaim()
        except Exception as exc:  # best-effort: without it the stop comes as it did before
            emit_event(RunEvent("unreconciled", f"settling pending attempts before the budget stop failed: {exc}", 0.0))
        finally:
            self._reclaimed_at_usd = self.spent_usd
            self._reclaiming = None
            self._admit_waiters()

    def rebill(self, counted: float, billed: float) -> None:
        """A pending attempt counted at `counted` turned out to cost `billed`: waiters that now fit start."""
        self.spent_usd += billed - counted
        if self.cap_usd is not None:
            self._admit_waiters()

    def settle(self, reserved: float, billed: float) -> None:
        """`reserved`: the amount `reserve` took (config prices); `billed`: dollars spent."""
        self.spent_usd += billed
        if self.cap_usd is not None:
            self.reserved_base_usd = max(0.0, self.reserved_base_usd - reserved)
            self.reservations = max(0, self.reservations - 1)
            if self.reserved_base_usd < 1e-12 or not self.reservations:
                self.reserved_base_usd = 0.0
            self._admit_waiters()


class EndpointClient:
    """Sends one sample's requests with retries; all samples share the session, window and budget."""

    def __init__(
        self,
        cfg: PipelineConfig,
        markers: CompletionMarkers,
        tokenizer: PreTrainedTokenizerBase | None = None,
        rng: random.Random | None = None,
        budget: Budget | None = None,
        ledger: LedgerWriter | None = None,
    ) -> None:
        ep = cfg.endpoint
        self.cfg = cfg
        self.markers = markers
        self.tokenizer = tokenizer
        self.rng = rng or random.Random()
        self.requests_sent = 0
        self.window = AdaptiveWindow(ep.max_in_flight, ep.min_in_flight)
        self.budget = budget or Budget(ep.max_cost_usd, 0.0)
        self.ledger = ledger
        self.successes = 0
        # This run's attempts by ledger state, live (the ledger itself is read back only between runs).
        self.billed_usd = 0.0
        self.pending_usd = 0.0
        self.pending_attempts = 0
        self.unsent_attempts = 0
        self.retries_by_reason: Counter[str] = Counter()
        self.unreconciled = 0
        """Answers `reconcile_cost` could not look up (no generation record with a cost): kept at their own cost."""
        self.priced_not_billed = 0
        """Answers without usage.cost and without a generation record: recorded at the configured prices."""
        self._records: Literal["unknown", "yes", "no"] = "unknown"
        self._records_probe: asyncio.Future[None] | None = None
        self._bills: dict[str, asyncio.Task[None]] = {}
        self.started = time.monotonic()
        self._key = ep.resolved_api_key()
        self._session: aiohttp.ClientSession | None = None
        self._fatal: FatalEndpointError | None = None
        self.disk: DiskGuard | None = None
        """Set by the engine: once its disk is full, no request starts."""
        self._last_success = time.monotonic()
        self.breaker = CircuitBreaker(
            self._probe_once,
            lambda: self._last_success,
            self._outage_event,
            probe_min_s=ep.outage_probe_min_s,
            probe_max_s=ep.outage_probe_max_s,
            abort_s=ep.outage_abort_s,
            where=f"endpoint {ep.base_url}",
        )

    async def __aenter__(self) -> EndpointClient:
        ep = self.cfg.endpoint
        ensure_open_files(ep.max_in_flight + 256)
        self._last_success = time.monotonic()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=ep.max_in_flight + 64, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                # A streamed body's total and idle limits are kept by `_read_stream`'s StallWatch, at no cost per
                # read; aiohttp's total timeout costs a context switch on every read of the body.
                total=None if ep.stream else ep.request_timeout_s,
                sock_connect=ep.connect_timeout_s,
                sock_read=ep.stream_idle_timeout_s if ep.stream else None,
            ),
            headers=headers,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.breaker.close()
        for bill in list(self._bills.values()):  # a run that stopped early: those stay pending with their ids
            bill.cancel()
        await asyncio.gather(*self._bills.values(), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EndpointClient used outside 'async with'")
        return self._session

    def redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def worst_case_usd(self, request: EndpointRequest, messages: list[Message] | list[dict[str, Any]]) -> float:
        """Upper bound of one attempt's cost: exact prompt ids when known, else one token per UTF-8 byte (a
        byte-level BPE token always covers at least one byte) plus template overhead; max_tokens of output."""
        ep = self.cfg.endpoint
        if request.prompt_ids is not None:
            prompt_tokens = len(request.prompt_ids)
        else:
            prompt_tokens = sum(len(str(m.get("content") or "").encode()) + 16 for m in messages) + 16
        return (
            prompt_tokens * ep.price_prompt_usd_per_mtok
            + self.cfg.sampling.max_tokens * ep.price_completion_usd_per_mtok
        ) / 1e6

    async def generate(
        self, messages: list[Message] | list[dict[str, Any]], sample_index: int = 0, tag: AttemptTag | None = None
    ) -> SampleOutcome:
        """Retries until success, a sample-fatal answer, `max_attempts`, or the budget; run-fatal answers raise.
        Every attempt that leaves the process is in the spend ledger (when there is one) before it is sent.

        Thousands of these run at once, each alive for a whole round trip, so the per-request state is kept
        small: every object alive across a round trip is rescanned by each full garbage collection, which was
        half of the client's CPU at 4,000 in flight (`bench/client_throughput.py`). Hence one coroutine per
        request (the POST is inline, not a nested coroutine), the ledger uid as a local, no retry list until a
        retry, and the body encoded once per sample."""
        ep = self.cfg.endpoint
        budget = self.budget
        request = build_request(self.cfg, messages, self.tokenizer, sample_index)
        metered = budget.cap_usd is not None or self.ledger is not None
        reserve = self.worst_case_usd(request, messages) if metered else 0.0  # at the config's prices
        # The bytes aiohttp's `json=` would encode on every attempt; what waits for the window and what a retry
        # resends is then one bytes object, not a dict tree.
        url, prompt_ids, data = request.url, request.prompt_ids, json.dumps(request.payload).encode()
        del request
        attempt = charged = 0
        cost = 0.0
        retries: list[str] | None = None
        window, breaker = self.window, self.breaker
        while True:
            if budget.cap_usd is not None:  # without a cap `reserve` returns at once: no coroutine per attempt
                try:
                    await budget.reserve(reserve, retry=attempt > 0)
                except BudgetExhausted as exc:
                    return SampleOutcome(
                        None, "budget", str(exc), attempt, None, retries or [], cost, budget_stopped=True
                    )
            worst = reserve * budget.price_factor  # this attempt's worst case at the prices billed so far
            attempt += 1
            started = time.perf_counter()
            uid: str | None = None  # set once the attempt's "sent" record is written, right before the POST
            sent = trial = refused = False
            successes_before, sent_at = self.successes, time.monotonic()
            try:
                if self._session is None:
                    raise RuntimeError("EndpointClient used outside 'async with'")
                while True:  # a slot in the window while the breaker lets requests through
                    if not breaker.sendable():
                        await breaker.wait()
                    seq = await window.acquire()
                    try:
                        taken = breaker.take()
                    except BaseException:
                        window.release()
                        raise
                    if taken is not None:
                        trial = taken
                        break
                    window.release()
                successes_before, sent_at = self.successes, time.monotonic()
                uid = self._admitted(tag, worst, trial)
                sent = True
                try:
                    async with self._session.post(url, data=data) as resp:  # Content-Type: the session's (JSON)
                        status, headers = resp.status, resp.headers
                        refused = _refuses_run(status, headers.get("Retry-After"))
                        header_id = headers.get(GENERATION_ID_HEADER)
                        if header_id and uid is not None and self.ledger is not None:
                            self.ledger.generation(uid, header_id)
                        if status in RATE_LIMIT_STATUS and (status != 402 or "Retry-After" in headers):
                            # Before the slot is released: otherwise a waiter takes it under the limit that just
                            # failed.
                            window.on_rate_limited(seq, parse_retry_after(headers.get("Retry-After")))
                        if status == 200 and resp.content_type == "text/event-stream":
                            on_id = None
                            if uid is not None and self.ledger is not None and not header_id:
                                on_id = partial(self.ledger.generation, uid)
                            try:
                                body = await self._read_stream(resp, on_id)
                            except RetryableError:
                                # An error chunk, or a stream ended without a finish: the endpoint answered and
                                # the failure is this sample's own. A trial request that ended so was otherwise
                                # never returned to the breaker, and every sender waited for it forever.
                                breaker.alive(sent_at)
                                raise
                            raw = b""
                        else:
                            raw = await resp.read()
                            body = None
                except NEVER_SENT_ERRORS as exc:
                    raise RetryableError(
                        "connect", self.redact(f"{type(exc).__name__}: {exc}"), billed=0.0, sent=False
                    ) from exc
                except TimeoutError as exc:
                    raise RetryableError(
                        "timeout",
                        f"request timed out ({type(exc).__name__})",
                        billed=None,
                        generation_id=getattr(exc, "generation_id", None),
                    ) from exc
                except aiohttp.ClientError as exc:
                    raise RetryableError(
                        "connection",
                        self.redact(f"{type(exc).__name__}: {exc}"),
                        billed=None,
                        generation_id=getattr(exc, "generation_id", None),
                    ) from exc
                finally:
                    window.release()
                result = self._answer(status, headers, raw, body, url, prompt_ids, sent_at)
            except SampleFatalError as exc:
                budget.settle(reserve, worst if exc.billed is None else exc.billed)
                ended: Outcome = "pending" if exc.billed is None else "answered"
                self._ended(uid, ended, exc.billed, exc.generation_id, exc.reason, worst)
                cost += exc.billed or 0.0
                return SampleOutcome(None, exc.reason, str(exc), attempt, None, retries or [], cost)
            except RetryableError as exc:
                outcome = exc.outcome
                if exc.answer is not None:
                    await self._book_answer(uid, exc.answer, reserve, worst, exc.reason)
                else:
                    budget.settle(reserve, worst if outcome == "pending" else exc.billed or 0.0)
                    self._learn_prices(reserve, exc.billed, None)
                    self._ended(uid, outcome, exc.billed, exc.generation_id, exc.reason, worst)
                cost += exc.billed or 0.0  # the row's known cost; the ledger counts a pending one at worst case
                outage = exc.reason in OUTAGE_REASONS and await breaker.judge(
                    sent_at, self.successes != successes_before, trial, str(exc), exc.reason.startswith("http_")
                )
                charged += not (outage or outcome == "unsent")
                if charged >= ep.max_attempts:
                    message = f"gave up after {attempt} attempts: {exc}"
                    return SampleOutcome(None, exc.reason, message, attempt, None, retries or [], cost)
                if retries is None:
                    retries = []
                retries.append(exc.reason)
                self.retries_by_reason[exc.reason] += 1
                if outage:  # the breaker holds every sender until the endpoint answers again
                    continue
                delay = backoff_delay(charged or attempt, ep.backoff_base_s, ep.backoff_max_s, self.rng)
                if exc.retry_after_s is not None:
                    delay = exc.retry_after_s + self.rng.uniform(0.0, min(ep.backoff_base_s, ep.backoff_max_s))
                await asyncio.sleep(delay)
                continue
            except SendingHalted as exc:
                budget.settle(reserve, 0.0)
                attempt -= 1
                message = f"not sent: {exc}"
                return SampleOutcome(None, "disk_stopped", message, attempt, None, retries or [], cost, halted=True)
            except FatalEndpointError:
                budget.settle(reserve, 0.0)
                if sent:  # the endpoint answered 401/403/404/402: nothing is billed for a refusal
                    self._ended(uid, "answered", 0.0, None, "fatal", worst)
                raise
            except BaseException:
                # Cancelled or stopped by an outage: once sent, what it cost is unknown (pending at worst case),
                # unless its status line already said the endpoint refused it (a 402 racing the first one).
                if trial:
                    breaker.release_trial()
                budget.settle(reserve, worst if sent and not refused else 0.0)
                if refused:
                    self._ended(uid, "answered", 0.0, None, "fatal", worst)
                elif sent:
                    self._ended(uid, "pending", None, None, "cancelled", worst)
                raise
            latency = time.perf_counter() - started
            await self._book_answer(uid, result, reserve, worst, None)
            cost += result.cost_usd or 0.0  # the row's reported cost; billed_cost_usd beside it shows any drift
            return SampleOutcome(result, None, None, attempt, latency, retries or [], cost)

    async def _book_answer(
        self, uid: str | None, result: GenerationResult, reserve: float, worst: float, reason: str | None
    ) -> None:
        """Books what an answer cost, kept or retried (`reason`) alike: a retried answer booked at its configured
        prices, or at a usage.cost that `reconcile_cost` would have checked, was the one place the ledger did
        not follow the provider's record.

        /generation is OpenRouter's billing record; SGLang has none, and probing it would cost ~15 s of 404
        retries per sample. Where it answers, it is what the ledger records: an answer without usage.cost is
        otherwise priced from the config's table, which is not the bill. An answer with no cost at all (its usage
        chunk cut off after the finish chunk) is booked pending."""
        ep, budget = self.cfg.endpoint, self.budget
        paid = answer_cost(result)
        gid = result.generation_id
        if ep.kind == "openai_chat" and gid and not ep.reconcile_cost and result.cost_priced and ep.settle_pending:
            if self._records != "no" and uid is not None:
                budget.settle(reserve, worst)
                self._ended(uid, "pending", None, gid, NO_USAGE_COST, worst, paid)
                self._bills[uid] = asyncio.create_task(self._bill_from_record(uid, gid, worst, paid or 0.0, result))
                return
            self.priced_not_billed += 1
        try:
            if ep.reconcile_cost and ep.kind == "openai_chat" and gid:
                result.billed_cost_usd = await self.lookup_cost(gid)
                if result.billed_cost_usd is not None:
                    paid = result.billed_cost_usd
                else:
                    self.unreconciled += 1
        finally:  # a cancelled lookup still leaves the answer recorded, at its reported cost
            budget.settle(reserve, worst if paid is None else paid)
            self._ended(uid, "pending" if paid is None else "answered", paid, gid, reason, worst)
        self._learn_prices(reserve, paid, result)

    async def _bill_from_record(
        self, uid: str, generation_id: str, worst: float, estimate: float, result: GenerationResult
    ) -> None:
        """Settles an answer that carried no usage.cost from its generation record, after the answer was handed
        back (and journaled: looked up first, a `kill -9` during the seconds a record takes lost the paid answer).
        Priced from the config's table instead, a provider billing twice those prices was recorded at half its
        bill and crossed the cap by 1.6x. An endpoint without records: the configured prices' figure. A record not
        in yet: pending, for the settlement passes."""
        try:
            cost = await self._record_cost(generation_id)
        finally:
            self._bills.pop(uid, None)
        src: SettledBy = "generation"
        if cost is None:
            if self._records != "no":
                self.budget.saw_prices()  # no bill to learn from: a capped run's window opens as for any answer
                return
            cost, src = estimate, "configured_prices"
            self.priced_not_billed += 1
        if self.ledger is not None:
            self.ledger.settled(uid, cost, src)
        self.pending_usd -= worst
        self.pending_attempts -= 1
        self.billed_usd += cost
        self.budget.rebill(worst, cost)
        self._learn_prices(worst, cost if src == "generation" else None, result)

    async def drain_bills(self) -> None:
        """Waits for every `_bill_from_record` still looking its record up (before the end-of-run settlement)."""
        while self._bills:
            await asyncio.gather(*self._bills.values(), return_exceptions=True)

    async def _record_cost(self, generation_id: str) -> float | None:
        """The billed cost in a generation record, where the endpoint keeps them. Whether it does is learned from
        the first answer without usage.cost (one lookup, up to 60 s of 404s; the others wait for it): an
        OpenAI-compatible server without them (a vendor billing per token, a local server) costs one lookup per
        run, not one per answer."""
        while self._records == "unknown":
            if self._records_probe is not None:
                await asyncio.shield(self._records_probe)
                continue
            self._records_probe = asyncio.get_running_loop().create_future()
            try:
                cost = await self.lookup_cost(generation_id, RECORDS_PROBE_DELAYS_S)
                if cost is not None:
                    self._records = "yes"
                elif self._records == "unknown":
                    self._records = "no"
                return cost
            finally:
                self._records_probe.set_result(None)
                self._records_probe = None
        return await self.lookup_cost(generation_id) if self._records == "yes" else None

    def keeps_records(self) -> bool | None:
        """Whether the endpoint keeps generation records, as far as this run has learned it (None: not yet). One
        answer to the question for the whole run: the settlement passes ask it before settling a missing record
        at $0, and tell it what they read back (`saw_record`), so neither side probes what the other has proven."""
        return None if self._records == "unknown" else self._records == "yes"

    def saw_record(self) -> None:
        """A generation record was read back: the endpoint keeps them, and no answer needs the 60-s probe."""
        self._records = "yes"

    def _learn_prices(self, reserve: float, billed: float | None, result: GenerationResult | None) -> None:
        """Worst cases count at the prices the endpoint bills when they are above the config's: an answer's cost
        against its own tokens at the configured prices, or any bill above the attempt's whole worst case. An
        answer (`result`) opens the budget's whole window."""
        if billed and reserve > 0:
            factor = billed / reserve
            priced = None if result is None else price_cost(self.cfg, result.prompt_tokens, result.completion_tokens)
            if priced:
                factor = max(factor, billed / priced)
            if factor > 1.0 + PRICE_FACTOR_STEP:
                self.budget.raise_prices(
                    factor,
                    f"the endpoint billed ${billed:.6f} for an answer the configured prices put at "
                    f"${priced if priced else reserve:.6f}",
                )
        if result is not None:
            self.budget.saw_prices()

    def _admitted(self, tag: AttemptTag | None, worst_usd: float, trial: bool) -> str | None:
        """Right after a window slot is granted, before the POST: refuse if the run hit a run-fatal answer, else
        write the attempt's "sent" ledger record and return its uid. Slot and trial are released if either
        raises."""
        if self._fatal is not None:
            self.window.release()
            if trial:
                self.breaker.release_trial()
            raise FatalEndpointError(str(self._fatal))
        uid = None
        try:
            if self.disk is not None and self.disk.stopped:
                raise SendingHalted(str(self.disk.error))
            if self.ledger is not None and tag is not None:
                timeout_s = self.cfg.endpoint.request_timeout_s
                try:
                    uid = self.ledger.sent(tag.sample_id, tag.dataset, tag.part, worst_usd, timeout_s)
                except OSError as exc:
                    if self.disk is not None and self.disk.write_failed(exc):
                        raise SendingHalted(str(exc)) from exc
                    raise
        except BaseException:
            self.window.release()
            if trial:
                self.breaker.release_trial()
            raise
        self.requests_sent += 1
        return uid

    def _ended(
        self,
        uid: str | None,
        outcome: Outcome,
        cost: float | None,
        generation_id: str | None,
        reason: str | None,
        worst_usd: float,
        estimate_usd: float | None = None,
    ) -> None:
        if outcome == "pending":
            self.pending_usd += worst_usd
            self.pending_attempts += 1
        elif outcome == "unsent":
            self.unsent_attempts += 1
        else:
            self.billed_usd += cost or 0.0
        if self.ledger is not None and uid is not None:
            self.ledger.ended(uid, outcome, cost, generation_id, reason, estimate_usd)

    def _outage_event(self, kind: OutageEvent, message: str) -> None:
        emit_event(RunEvent(kind, message, time.monotonic() - self.started))

    async def _probe_once(self) -> bool:
        """True when the endpoint's liveness URL does not answer (transport error) or answers 502-504."""
        if self._session is None:
            return True
        ep = self.cfg.endpoint
        timeout = aiohttp.ClientTimeout(total=min(10.0, ep.connect_timeout_s, ep.request_timeout_s))
        try:
            async with self._session.get(probe_url(ep), timeout=timeout) as resp:
                await resp.read()
                return resp.status in UNAVAILABLE_STATUS
        except (TimeoutError, aiohttp.ClientError):
            return True

    def _answer(
        self,
        status: int,
        headers: Mapping[str, str],
        raw: bytes,
        body: dict[str, Any] | None,
        url: str,
        prompt_ids: list[int] | None,
        sent_at: float,
    ) -> GenerationResult:
        """The result an answer carries, or the error class it belongs to (raised)."""
        if status not in UNAVAILABLE_STATUS:
            self.breaker.alive(sent_at)
        if status != 200:
            snippet = self.redact(raw.decode("utf-8", errors="replace"))[:ERROR_SNIPPET_CHARS]
            self._classify_status(status, headers.get("Retry-After"), snippet, url, headers.get(GENERATION_ID_HEADER))
        if body is None:
            body = self._json_body(raw)
        if body.get("error"):
            error = self.redact(json.dumps(body["error"], ensure_ascii=False))[:ERROR_SNIPPET_CHARS]
            billed, generation_id = _error_body_bill(headers, body)
            raise RetryableError(
                "error_body", f"HTTP 200 carrying an error: {error}", billed=billed, generation_id=generation_id
            )
        try:
            result = parse_response(self.cfg, body, self.markers, prompt_ids, self.tokenizer)
        except MalformedResponseError as exc:
            raise RetryableError(
                "malformed_response",
                self.redact(str(exc)),
                billed=None,
                generation_id=headers.get(GENERATION_ID_HEADER)
                or (body.get("id") if isinstance(body.get("id"), str) else None),
            ) from exc
        self._check_answer(result)
        self.window.on_success()
        self.successes += 1
        self._last_success = time.monotonic()
        return result

    def _json_body(self, raw: bytes) -> dict[str, Any]:
        text = raw.decode("utf-8", errors="replace")
        try:
            body: Any = json.loads(text)
        except ValueError as exc:
            snippet = self.redact(text)[:ERROR_SNIPPET_CHARS]
            raise RetryableError(
                "invalid_json", f"HTTP 200 with a body that is not JSON: {snippet!r}", billed=None
            ) from exc
        if not isinstance(body, dict):
            raise RetryableError("invalid_json", f"HTTP 200 with a JSON {type(body).__name__}, expected an object")
        return body

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, on_generation_id: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """The SSE body folded into the equivalent non-streaming body; a cut, stalled or failing stream is
        retryable. `on_generation_id` is called once, as soon as the id is known.

        Reads whatever the socket has (`readany`), never line by line: a coroutine per line was most of the
        client's CPU at thousands of streams, and so was aiohttp's per-read timer, which `StallWatch` replaces."""
        stream = StreamAssembler(on_generation_id)
        content = resp.content
        stop_per_read_timer(resp)
        ep = self.cfg.endpoint
        watch = StallWatch(asyncio.get_running_loop(), content, ep.stream_idle_timeout_s, ep.request_timeout_s)
        feed = stream.feed
        try:
            while not stream.done:
                data = await content.readany()
                if not data:
                    stream.close()
                    break
                feed(data)
                data = b""  # not held while the next read waits: 10,000 streams would each keep their last read
        except MalformedResponseError as exc:
            raise RetryableError(
                "truncated_stream", self.redact(str(exc)), billed=None, generation_id=stream.generation_id()
            ) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            if not _whole_before_done(stream):
                # Cut mid-stream: billed, but by how much only the generation record can tell.
                setattr(exc, "generation_id", stream.generation_id())  # noqa: B010
                raise
        finally:
            watch.cancel()
        if stream.error is not None:
            error = self.redact(json.dumps(stream.error, ensure_ascii=False))[:ERROR_SNIPPET_CHARS]
            raise RetryableError(
                "stream_error", f"error chunk mid-stream: {error}", billed=None, generation_id=stream.generation_id()
            )
        if stream.finish_reason is None:
            raise RetryableError(
                "truncated_stream",
                "event stream ended without a finish_reason (connection cut)",
                billed=None,
                generation_id=stream.generation_id(),
            )
        return stream.body()

    def _check_answer(self, result: GenerationResult) -> None:
        """Answers that parsed but cannot be training data: retried, at the cost their usage reports, or, without
        one, pending at worst case until the generation record settles it (an aborted stream carries no usage
        chunk, yet the provider bills what it generated: booked at $0 it undercounted a quarter of the bill)."""
        billed, gid = answer_cost(result), result.generation_id
        if result.finish_reason in RETRYABLE_FINISH:
            raise RetryableError(
                f"finish_{result.finish_reason}",
                f"generation ended with finish_reason={result.finish_reason!r} after "
                f"{len(result.content or '')} content chars (partial answer discarded)",
                billed=billed,
                generation_id=gid,
                answer=result,
            )
        # `_blank(s)` is `not s.strip()` without copying the answer's text.
        no_reasoning = _blank(result.reasoning)
        if result.finish_reason != "length" and no_reasoning and _blank(result.content):
            raise RetryableError(
                "empty_response",
                "answer has neither content nor reasoning",
                billed=billed,
                generation_id=gid,
                answer=result,
            )
        if self.cfg.endpoint.require_reasoning and no_reasoning:
            raise RetryableError(
                "empty_reasoning",
                "answer has no reasoning (endpoint.require_reasoning)",
                billed=billed,
                generation_id=gid,
                answer=result,
            )

    def _classify_status(
        self, status: int, retry_after: str | None, snippet: str, url: str, generation_id: str | None = None
    ) -> None:
        """Raise the error class `status` belongs to; a run-fatal one also stops every later send.

        An error status is booked at $0 unless it may have been billed: it names a generation (the provider
        started one), or it is a timeout the server reported after accepting the request (`UPSTREAM_TIMEOUT_
        STATUS`). Those are pending at worst case until the generation record (or, without an id, the key's
        account under `exclusive_key`) settles them: booked at $0, a provider billing 408s and 524s left 30% of
        its bill unrecorded and the spend went to 1.9x the cap."""
        wait = parse_retry_after(retry_after)
        billed = None if generation_id or status in UPSTREAM_TIMEOUT_STATUS else 0.0
        unknown_model = status == 400 and any(hint in snippet.lower() for hint in UNKNOWN_MODEL_HINTS)
        if _refuses_run(status, retry_after) or unknown_model:
            what = {
                400: "unknown model",
                401: "unauthorized",
                402: "payment required",
                403: "forbidden",
                404: "not found",
            }[status]
            hint = (
                "check endpoint.base_url and endpoint.model (and provider pinning)"
                if status in (400, 404)
                else "check endpoint.api_key / endpoint.api_key_env and the account's credit"
            )
            self._fatal = FatalEndpointError(
                f"endpoint {url} answered HTTP {status} ({what}): {snippet!r}. No request can succeed, so "
                f"the run stops; {hint}. Finished samples are committed; a rerun resumes."
            )
            raise self._fatal
        if status in RETRYABLE_STATUS or status in UPSTREAM_TIMEOUT_STATUS or status >= 500 or status == 402:
            raise RetryableError(f"http_{status}", f"HTTP {status}: {snippet}", wait, billed, generation_id)
        if status in (400, 413) and any(hint in snippet.lower() for hint in CONTEXT_LENGTH_HINTS):
            message = f"HTTP {status}, prompt too long (not retried): {snippet}"
            raise SampleFatalError("context_length", message, billed, generation_id)
        raise SampleFatalError(f"http_{status}", f"HTTP {status} (not retried): {snippet}", billed, generation_id)

    async def lookup_cost(
        self,
        generation_id: str,
        delays_s: tuple[float, ...] | None = None,
        absent_usd: float | None = None,
        zero_is_final: bool = False,
    ) -> float | None:
        """OpenRouter's billed total for one generation; it appears a moment after the answer, so 404s are
        retried after each of `delays_s`, and so is a record that costs nothing and counts no tokens (one still
        being written: taken as final, it settled paid answers at $0 and let the cap stop nothing), unless it says
        the generation was `cancelled` (a request cut before its first token: a real $0, which left attempts
        pending at worst case forever). A free model's record counts its tokens. None when no record appears:
        reconciliation is best-effort. `absent_usd`: what to return when every lookup answered 404 (the provider
        has no such generation), for an attempt whose absent record means it was not billed. `zero_is_final`: a
        record of $0 with no token is the bill (a generation the provider ended with an error, long enough ago
        that its record is written)."""
        if self._session is None:
            return None
        url = generation_lookup_url(self.cfg, generation_id)
        only_404 = True
        for delay in (0.0, *(LOOKUP_DELAYS_S if delays_s is None else delays_s)):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S)) as resp:
                    only_404 = only_404 and resp.status == 404
                    if resp.status == 404 or resp.status == 429 or resp.status >= 500:
                        continue
                    if resp.status != 200:
                        return None
                    body = await resp.json(content_type=None)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                only_404 = False
                continue
            data = body.get("data") if isinstance(body, dict) else None
            cost = record_cost(data) if isinstance(data, dict) else None
            if cost is None or not isinstance(data, dict):
                return None
            if cost == 0 and not zero_is_final and not _counts_tokens(data) and data.get("cancelled") is not True:
                only_404 = False
                continue
            return cost
        return absent_usd if only_404 else None


RECORD_TOKEN_FIELDS = (
    "tokens_prompt",
    "tokens_completion",
    "native_tokens_prompt",
    "native_tokens_completion",
    "native_tokens_reasoning",
)


def record_cost(record: dict[str, Any]) -> float | None:
    """A generation record's cost to the user: `total_cost`, plus `upstream_inference_cost` for a request on the
    user's own provider key (`is_byok`), which the provider billed beside OpenRouter's fee (`reported_cost`)."""
    cost, upstream = usd_number(record.get("total_cost")), usd_number(record.get("upstream_inference_cost"))
    if cost is not None and record.get("is_byok") is True and upstream is not None:
        return cost + upstream
    return cost


def _counts_tokens(record: dict[str, Any]) -> bool:
    """Whether a generation record counts any token (OpenRouter's `tokens_*` and `native_tokens_*` fields)."""
    return any(isinstance(record.get(k), int | float) and record[k] > 0 for k in RECORD_TOKEN_FIELDS)
