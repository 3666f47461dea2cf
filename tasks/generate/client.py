"""The HTTP side of generation: one pooled session, one global in-flight limit, typed retry decisions.

Every response is sorted into exactly one of three classes, because each needs a different reaction:
- retryable (rate limits, overload, server errors, timeouts, broken bodies): back off and try again;
- sample-fatal (400 and other 4xx): this prompt can never succeed as sent, record the reason and move on;
- run-fatal (401/403, 402 without Retry-After): no request can succeed, so stop the run with
  `FatalEndpointError` instead of burning through every sample. Messages never contain the API key.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any

import aiohttp
from transformers import PreTrainedTokenizerBase

from tasks.config import PipelineConfig
from tasks.errors import FatalEndpointError
from tasks.generate.endpoints import (
    CompletionMarkers,
    EndpointRequest,
    GenerationResult,
    MalformedResponseError,
    build_request,
    parse_response,
)
from tasks.messages import Message

RETRYABLE_STATUS = frozenset({408, 429})
RUN_FATAL_STATUS = frozenset({401, 403})
RETRY_AFTER_CAP_S = 3600.0
ERROR_SNIPPET_CHARS = 300
RETRYABLE_FINISH = frozenset({"error", "abort"})


class RetryableError(Exception):
    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class SampleFatalError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class SampleOutcome:
    """What happened to one sample: a result, or the reason it failed; `attempts` = requests sent."""

    result: GenerationResult | None
    reason: str | None
    error: str | None
    attempts: int
    latency_s: float | None
    retry_reasons: list[str] = field(default_factory=list)


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
    return rng.uniform(0.0, min(max_s, base_s * 2 ** (attempt - 1)))


def ensure_open_files(needed: int) -> None:
    """Raise the soft descriptor limit toward `needed` (capped by the hard limit): one socket per request."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class EndpointClient:
    """Sends one sample's request with retries; all samples share the session and the in-flight semaphore."""

    def __init__(
        self,
        cfg: PipelineConfig,
        markers: CompletionMarkers,
        tokenizer: PreTrainedTokenizerBase | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.markers = markers
        self.tokenizer = tokenizer
        self.rng = rng or random.Random()
        self.requests_sent = 0
        self._key = cfg.endpoint.resolved_api_key()
        self._limit = asyncio.Semaphore(cfg.endpoint.max_in_flight)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EndpointClient:
        ep = self.cfg.endpoint
        ensure_open_files(ep.max_in_flight + 256)
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=ep.max_in_flight, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=ep.request_timeout_s, sock_connect=ep.connect_timeout_s),
            headers=headers,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def generate(self, messages: list[Message]) -> SampleOutcome:
        """Retries until success, a sample-fatal answer, or `max_attempts`; run-fatal answers raise."""
        ep = self.cfg.endpoint
        request = build_request(self.cfg, messages, self.tokenizer)
        attempt = 0
        retries: list[str] = []
        while True:
            attempt += 1
            started = time.perf_counter()
            try:
                result = await self._send(request)
            except SampleFatalError as exc:
                return SampleOutcome(None, exc.reason, str(exc), attempt, None, retries)
            except RetryableError as exc:
                if attempt >= ep.max_attempts:
                    message = f"gave up after {attempt} attempts: {exc}"
                    return SampleOutcome(None, exc.reason, message, attempt, None, retries)
                retries.append(exc.reason)
                delay = backoff_delay(attempt, ep.backoff_base_s, ep.backoff_max_s, self.rng)
                if exc.retry_after_s is not None:
                    delay = exc.retry_after_s + self.rng.uniform(0.0, min(ep.backoff_base_s, ep.backoff_max_s))
                await asyncio.sleep(delay)
                continue
            return SampleOutcome(result, None, None, attempt, time.perf_counter() - started, retries)

    async def _send(self, request: EndpointRequest) -> GenerationResult:
        if self._session is None:
            raise RuntimeError("EndpointClient used outside 'async with'")
        async with self._limit:
            self.requests_sent += 1
            try:
                async with self._session.post(request.url, json=request.payload) as resp:
                    raw = await resp.read()
                    status, headers = resp.status, resp.headers
            except TimeoutError as exc:
                raise RetryableError("timeout", f"request timed out ({type(exc).__name__})") from exc
            except aiohttp.ClientError as exc:
                raise RetryableError("connection", self.redact(f"{type(exc).__name__}: {exc}")) from exc
        text = raw.decode("utf-8", errors="replace")
        snippet = self.redact(text)[:ERROR_SNIPPET_CHARS]
        if status != 200:
            self._classify_status(status, headers.get("Retry-After"), snippet, request.url)
        try:
            body: Any = json.loads(text)
        except ValueError as exc:
            raise RetryableError("invalid_json", f"HTTP 200 with a body that is not JSON: {snippet!r}") from exc
        if not isinstance(body, dict):
            raise RetryableError("invalid_json", f"HTTP 200 with a JSON {type(body).__name__}, expected an object")
        if body.get("error"):
            error = self.redact(json.dumps(body["error"], ensure_ascii=False))[:ERROR_SNIPPET_CHARS]
            raise RetryableError("error_body", f"HTTP 200 carrying an error: {error}")
        try:
            result = parse_response(self.cfg, body, self.markers, request.prompt_ids, self.tokenizer)
        except MalformedResponseError as exc:
            raise RetryableError("malformed_response", self.redact(str(exc))) from exc
        if result.finish_reason in RETRYABLE_FINISH:
            raise RetryableError(f"finish_{result.finish_reason}", f"generation ended with {result.finish_reason!r}")
        return result

    def _classify_status(self, status: int, retry_after: str | None, snippet: str, url: str) -> None:
        """Raise the error class `status` belongs to."""
        wait = parse_retry_after(retry_after)
        if status in RUN_FATAL_STATUS or (status == 402 and retry_after is None):
            what = {401: "unauthorized", 402: "payment required", 403: "forbidden"}[status]
            raise FatalEndpointError(
                f"endpoint {url} answered HTTP {status} ({what}): {snippet!r}. No request can succeed, so "
                "the run stops; check endpoint.api_key / endpoint.api_key_env and the account's credit."
            )
        if status in RETRYABLE_STATUS or status >= 500 or status == 402:
            raise RetryableError(f"http_{status}", f"HTTP {status}: {snippet}", wait)
        raise SampleFatalError(f"http_{status}", f"HTTP {status} (not retried): {snippet}")
