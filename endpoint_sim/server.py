"""A local HTTP endpoint that behaves like OpenRouter's chat API and SGLang's native /generate.

It exists so the generate stage can be tested and benchmarked over real sockets (connection pooling, timeouts,
retries, streaming, thousands of requests in flight) without any network access. Failures are injected
deterministically per (prompt key, attempt number as seen by this server), so a test knows in advance which
requests fail and how; `request_latency_s` and `scheduled_failure` in `endpoint_sim.responder` predict both.

Handler work is kept small for high concurrency: tokenizer work is cached per prompt key in the `Responder`,
and nothing is logged per request.

Billing is the provider's (`endpoint_sim.billing`): every completion is billed when its answer is produced, and
a client that goes away mid-generation (a cut stream, a timeout, a killed client) is billed for the prompt and
the completion tokens generated until then, as OpenRouter bills a cancelled stream. The injected latency is the
generation time; a stream sends its headers (`X-Generation-Id`) and a first chunk carrying the id at once.
With a billing file the bill survives a restart of the simulator on the same port; `GET /api/v1/key` reads it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from endpoint_sim.billing import Bill, BillingLedger
from endpoint_sim.generations import Generation, GenerationStore
from endpoint_sim.openrouter import (
    ChatAnswer,
    ChatMeta,
    StreamFrames,
    chat_answer,
    completion_body,
    empty_answer,
    partial_answer,
    reported_ids,
    spent_usd,
    stream_frames,
    token_pieces,
    usage,
    without_reasoning,
)
from endpoint_sim.responder import (
    FailureRule,
    Responder,
    SimConfig,
    SimSample,
    request_latency_s,
    scheduled_failure,
)

__all__ = ["FailureRule", "SimConfig", "SimState", "SimulatorServer", "build_app", "serve_forever"]

LISTEN_BACKLOG = 8192
# stop() must not wait a minute for requests parked in an injected latency or a "hang" failure.
SHUTDOWN_TIMEOUT_S = 1.0
INVALID_JSON_BODY = "<html><body>502 Bad Gateway</body></html>"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
GENERATION_ID_HEADER = "X-Generation-Id"
KEY_LABEL = "sk-or-v1-sim...key"
# Failure kinds that replace the whole response; the others change the answer inside a 200.
_RESPONSE_KINDS = frozenset({"http", "context_length", "error_body", "invalid_json", "echo_key", "reset", "disconnect"})
# Generation failed partway: half the content is billed; a stream shows the full answer's first half, then an error.
_PARTIAL_KINDS = frozenset({"finish_error", "finish_error_no_usage", "midstream_error", "late_error_body"})
_ERROR_CHUNK_KINDS = frozenset({"midstream_error", "late_error_body"})


class SimState:
    """Mutable server state; touched only from the server's event loop thread."""

    def __init__(self, responder: Responder, billing_file: Path | None = None) -> None:
        self.responder = responder
        self.config = responder.config
        self.total_requests = 0
        self.by_key: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.by_route: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.lookups: Counter[str] = Counter()
        self.probes = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.rate_limited = 0
        self.generations = GenerationStore(self.config.generation_store_size)
        self.handlers: set[asyncio.Task[Any]] = set()
        # The provider's own bill, never reset: what a test compares a run directory's spend ledger with. A
        # restarted simulator reads it back, with its generation records, and numbers attempts on from it.
        self.billing = BillingLedger(billing_file)
        for bill in self.billing.bills:
            self.generations.add(_generation(bill, 0.0, 0.0))

    def key_usage_usd(self, lag_s: float | None = None) -> float:
        lag = self.config.account_usage_lag_s if lag_s is None else lag_s
        return self.billing.usage_usd(time.monotonic(), lag)

    def probe_unavailable(self) -> bool:
        self.probes += 1
        return self.probes <= self.config.unavailable_probes

    def update_config(self, config: SimConfig) -> None:
        self.config = config
        self.responder.update_config(config)
        self.generations.size = config.generation_store_size

    def reset_stats(self) -> None:
        """Counters and attempt numbers start over; requests in flight and the billing records stay."""
        self.total_requests = 0
        self.by_key.clear()
        self.by_status.clear()
        self.by_route.clear()
        self.injected.clear()
        self.lookups.clear()
        self.probes = 0
        self.peak_in_flight = self.in_flight
        self.rate_limited = 0

    def stats(self, with_keys: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_requests": self.total_requests,
            "by_status": dict(self.by_status),
            "by_route": dict(self.by_route),
            "injected": dict(self.injected),
            "probes": self.probes,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "rate_limited": self.rate_limited,
            "generation_lookups": dict(self.lookups),
            "generations_stored": len(self.generations),
        }
        if with_keys:
            out["by_key"] = dict(self.by_key)
        return out

    def count(self, route: str, key: str) -> int:
        """Record one request for `key`; returns its attempt number (1-based) as this server saw it, offset by
        boot x 1,000,000 for a simulator restarted on a billing file (`endpoint_sim.billing`)."""
        self.total_requests += 1
        self.by_route[route] += 1
        self.by_key[key] += 1
        return self.billing.attempt_base + self.by_key[key]

    def respond(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
        label = str(status) if status != 200 or "error" not in body else "200_error_body"
        self.by_status[label] += 1
        return web.json_response(body, status=status, headers=headers)

    def failure_rule(self, key: str, attempt: int) -> FailureRule | None:
        return scheduled_failure(self.config, key, attempt)

    def latency(self, key: str, attempt: int) -> float:
        return request_latency_s(self.config, key, attempt)

    def cancel_handlers(self) -> None:
        """Shutdown must not wait for handlers parked in a latency sleep or a hang."""
        for task in list(self.handlers):
            task.cancel()


STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message}}


async def _json_body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _auth_error(cfg: SimConfig, request: web.Request) -> str | None:
    if cfg.auth_fail_all:
        return "simulated: invalid credentials"
    expected = f"Bearer {cfg.required_api_key}"
    if cfg.required_api_key is not None and request.headers.get("Authorization", "") != expected:
        return "simulated: missing or wrong API key"
    return None


def _abort(request: web.Request, rst: bool) -> None:
    """Close the connection under the handler: a TCP RST (SO_LINGER 0) or a plain FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if rst and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _drop_connection(state: SimState, request: web.Request, kind: str) -> web.Response:
    """No response at all ("reset": RST, "disconnect": FIN). The returned response is never delivered; aiohttp
    drops it quietly on the closed transport."""
    _abort(request, rst=kind == "reset")
    state.by_status[kind] += 1
    return web.Response(status=500)


async def _reset_midway(state: SimState, request: web.Request, body: bytes) -> web.StreamResponse:
    """Headers promise the whole JSON body, half of it arrives, then a RST: the client's payload is incomplete."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    _abort(request, rst=True)
    state.by_status["200"] += 1
    return response


def _failure_response(
    state: SimState, request: web.Request, rule: FailureRule, attempt: int, prompt_len: int, key: str
) -> web.Response:
    if rule.kind == "context_length":
        limit = max(1, prompt_len // 2)
        return state.respond(
            400,
            _error(
                400,
                f"This endpoint's maximum context length is {limit} tokens. However, you requested about "
                f"{prompt_len} tokens. Please reduce the length of the messages or completion.",
            ),
        )
    if rule.kind == "error_body":
        if not rule.names_generation:
            return state.respond(200, _error(502, f"simulated upstream error (attempt {attempt})"))
        gen_id = f"gen-{attempt}-{key}"  # an errored generation OpenRouter records: nothing charged, no token
        state.generations.add(
            Generation(gen_id, 0.0, "sim", state.config.model_name, 0, 0, 0, "error", 0.0, 0.0, False, time.monotonic())
        )
        body = {**_error(502, f"simulated upstream error (attempt {attempt})"), "id": gen_id}
        return state.respond(200, body, {GENERATION_ID_HEADER: gen_id})
    if rule.kind == "invalid_json":
        state.by_status["200"] += 1
        return web.Response(status=200, text=INVALID_JSON_BODY, content_type="text/html")
    if rule.kind == "echo_key":
        auth = request.headers.get("Authorization", "")
        return state.respond(400, _error(400, f"simulated: request rejected for Authorization {auth!r}"))
    if rule.kind in ("reset", "disconnect"):
        return _drop_connection(state, request, rule.kind)
    headers = {"Retry-After": f"{rule.retry_after_s:g}"} if rule.retry_after_s is not None else {}
    if rule.names_generation:
        headers[GENERATION_ID_HEADER] = f"gen-{attempt}-{key}"
    return state.respond(
        rule.status, _error(rule.status, f"simulated HTTP {rule.status} (attempt {attempt})"), headers or None
    )


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _truncate(sample: SimSample, limit: int | None) -> tuple[tuple[int, ...], str]:
    """The ids actually "generated" under a token limit, and the finish reason (a model-backed decode that hit
    its own token cap before its end of turn is a "length" answer too)."""
    if limit is not None and len(sample.output_ids) > limit:
        return sample.output_ids[:limit], "length"
    return sample.output_ids, "stop" if sample.finished else "length"


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed auth and injected refusals; `rule` is a failure kind that shapes the 200 answer."""

    key: str
    attempt: int
    sample: SimSample
    ids: tuple[int, ...]
    finish: str
    rule: FailureRule | None
    started: float
    latency_s: float

    @property
    def kind(self) -> str | None:
        return self.rule.kind if self.rule is not None else None


async def _admit(
    state: SimState,
    request: web.Request,
    route: str,
    prompt_ids: tuple[int, ...],
    seed: int | None,
    limit: int | None,
    routing: Any = None,
) -> web.Response | Admitted:
    """What both routes do once a request parsed: count the attempt, apply auth, then either answer with the
    scheduled failure after the injected latency (a response), or draw the sample and cut it at the limit; the
    route then spends the latency generating it (`_generating`). `routing` is the request's OpenRouter
    `provider` object, for a responder serving several providers (`endpoint_sim.providers.ProviderPool`)."""
    started = time.perf_counter()
    key = state.responder.key(prompt_ids, seed)
    attempt = state.count(route, key)
    auth = _auth_error(state.config, request)
    if auth is not None:
        return state.respond(401, _error(401, auth))
    limit_usd = state.config.key_limit_usd
    if limit_usd is not None and state.key_usage_usd(0.0) >= limit_usd:
        return state.respond(402, _error(402, f"simulated: key limit of {limit_usd:g} USD reached"))
    pick = getattr(state.responder, "pick", None)  # endpoint_sim.providers.ProviderPool
    sample_args: tuple[Any, ...] = (prompt_ids, seed, key)
    if pick is not None:
        try:
            pick(key, routing)
        except LookupError as exc:
            return state.respond(404, _error(404, str(exc)))
        sample_args = (*sample_args, routing)
    delay = state.latency(key, attempt)
    rule = state.failure_rule(key, attempt)
    if rule is not None:
        state.injected[f"http_{rule.status}" if rule.kind == "http" else rule.kind] += 1
        if rule.kind in _RESPONSE_KINDS:
            if delay > 0:
                await asyncio.sleep(delay)
            return _failure_response(state, request, rule, attempt, len(prompt_ids), key)
    if getattr(state.responder, "model_backed", False):  # endpoint_sim.model_backend: batched, off the loop
        sample = await state.responder.sample_async(*sample_args, limit=limit)  # type: ignore[attr-defined]
    else:
        sample = state.responder.sample(*sample_args)
    ids, finish = _truncate(sample, limit)
    return Admitted(key, attempt, sample, ids, finish, rule, started, delay)


def _record(
    state: SimState,
    admitted: Admitted,
    meta: ChatMeta,
    prompt_tokens: int,
    billed: ChatAnswer,
    streamed: bool,
    cut: bool = False,
) -> None:
    bill = Bill(
        id=meta.id,
        key=admitted.key,
        cost_usd=spent_usd(state.config, prompt_tokens, billed.completion_tokens),
        billed_at=time.monotonic(),
        prompt_tokens=prompt_tokens,
        completion_tokens=billed.completion_tokens,
        reasoning_tokens=billed.reasoning_tokens,
        provider=meta.provider,
        model=meta.model,
        finish_reason=billed.finish,
        streamed=streamed,
        cut=cut,
    )
    state.billing.add(bill)
    state.generations.add(_generation(bill, admitted.latency_s, time.perf_counter() - admitted.started))


def _generation(bill: Bill, latency_s: float, generation_s: float) -> Generation:
    return Generation(
        id=bill.id,
        cost_usd=bill.cost_usd,
        provider=bill.provider,
        model=bill.model,
        prompt_tokens=bill.prompt_tokens,
        completion_tokens=bill.completion_tokens,
        reasoning_tokens=bill.reasoning_tokens,
        finish_reason=bill.finish_reason,
        latency_ms=latency_s * 1000,
        generation_time_ms=generation_s * 1000,
        streamed=bill.streamed,
        completed_at=bill.billed_at,
    )


def _bill_cut(
    state: SimState,
    admitted: Admitted,
    meta: ChatMeta,
    prompt_tokens: int,
    billed: ChatAnswer,
    streamed: bool,
    fraction: float,
) -> None:
    """The client went away mid-generation: bill the prompt and the completion tokens generated until then."""
    if state.config.bill_cancelled:
        tokens = int(billed.completion_tokens * min(max(fraction, 0.0), 1.0))
        cut = replace(billed, completion_tokens=tokens, reasoning_tokens=min(tokens, billed.reasoning_tokens))
        _record(state, admitted, meta, prompt_tokens, replace(cut, finish="cancelled"), streamed, cut=True)
    else:  # not billed; the generation record says so: nothing charged, no token counted, cancelled
        state.generations.add(
            Generation(
                id=meta.id,
                cost_usd=0.0,
                provider=meta.provider,
                model=meta.model,
                prompt_tokens=0,
                completion_tokens=0,
                reasoning_tokens=0,
                finish_reason="cancelled",
                latency_ms=admitted.latency_s * 1000,
                generation_time_ms=0.0,
                streamed=streamed,
                completed_at=time.monotonic(),
                cancelled=True,
            )
        )


async def _generating(
    state: SimState, admitted: Admitted, meta: ChatMeta, prompt_tokens: int, billed: ChatAnswer, streamed: bool
) -> None:
    """The injected latency, spent generating: a client that goes away meanwhile (the handler is cancelled) is
    billed for what was generated by then."""
    if admitted.latency_s <= 0:
        return
    began = time.monotonic()
    try:
        await asyncio.sleep(admitted.latency_s)
    except asyncio.CancelledError:
        _bill_cut(
            state, admitted, meta, prompt_tokens, billed, streamed, (time.monotonic() - began) / admitted.latency_s
        )
        raise


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _completion_route(route: str, handler: Handler) -> Handler:
    """Concurrency accounting and the rate limit around a completion handler.

    A request over the limit is refused before its body is read or its attempt counted, so load never shifts
    a prompt's failure schedule.
    """

    async def tracked(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        limit = state.config.rate_limit_concurrency
        if limit is not None and state.in_flight >= limit:
            state.total_requests += 1
            state.by_route[route] += 1
            state.rate_limited += 1
            retry = state.config.rate_limit_retry_after_s
            headers = {"Retry-After": f"{retry:g}"} if retry is not None else None
            refusal = _error(429, "simulated: rate limit exceeded, too many requests in flight")
            return state.respond(429, refusal, headers)
        task = asyncio.current_task()
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        if task is not None:
            state.handlers.add(task)
        try:
            return await handler(request)
        finally:
            state.in_flight -= 1
            if task is not None:
                state.handlers.discard(task)

    return tracked


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    if body is None:
        return state.respond(400, _error(400, "request body must be a JSON object"))
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return state.respond(400, _error(400, "messages must be a non-empty list of {role, content} strings"))
    if state.config.refuse_other_models and body.get("model") != state.config.model_name:
        return state.respond(400, _error(400, f"{body.get('model')} is not a valid model ID"))
    try:
        seed = _int_or_none(body.get("seed"), "seed")
        max_tokens = _int_or_none(body.get("max_tokens", body.get("max_completion_tokens")), "max_tokens")
    except ValueError as exc:
        return state.respond(400, _error(400, str(exc)))
    want_logprobs = body.get("logprobs") is True
    want_ids = body.get("return_token_ids") is True  # vLLM's: the sampled ids and the rendered prompt's
    responder = state.responder
    prompt_ids = responder.prompt_ids_for_messages(messages)
    admitted = await _admit(state, request, "chat", prompt_ids, seed, max_tokens, body.get("provider"))
    if isinstance(admitted, web.Response):
        return admitted
    cfg = state.config
    kind = admitted.kind
    stream = body.get("stream") is True
    full = chat_answer(responder, admitted.sample, admitted.ids, admitted.finish)
    billed = _billed_answer(responder, full, kind)
    # A stream that dies midway has already sent pieces of the full answer; the others show what is billed.
    shown = full if stream and kind in _ERROR_CHUNK_KINDS else billed
    gen_id = f"gen-{admitted.attempt}-{admitted.key}"
    meta = ChatMeta(gen_id, admitted.sample.provider, cfg.model_name, int(time.time()))
    usage_ = None if kind == "finish_error_no_usage" else usage(cfg, len(prompt_ids), billed)
    # Per-token logprobs with bytes (OpenAI's shape) and token ids (vLLM's) for a whole answer; a broken one
    # carries none.
    whole = kind in (None, "hang", "reset_before_done", "cut_after_finish")
    per_token = (want_logprobs or want_ids) and whole
    pieces = token_pieces(responder, admitted.sample, admitted.ids, admitted.finish) if per_token else None
    ids = reported_ids(responder, prompt_ids, admitted.ids, admitted.finish) if want_ids and whole else None
    if kind == "billed_http" and admitted.rule is not None:  # generated and billed, then an error status
        await _generating(state, admitted, meta, len(prompt_ids), billed, streamed=stream)
        _record(state, admitted, meta, len(prompt_ids), billed, streamed=stream)
        status = admitted.rule.status
        error_headers = {GENERATION_ID_HEADER: meta.id} if cfg.generation_id_header else None
        return state.respond(status, _error(status, f"simulated HTTP {status} after generation"), error_headers)
    if stream:
        options = body.get("stream_options")
        include_usage = not (isinstance(options, dict) and options.get("include_usage") is False)
        frames = stream_frames(meta, shown, usage_ if include_usage else None, admitted.key, pieces, want_logprobs, ids)
        return await _stream(state, request, admitted, meta, frames, len(prompt_ids), billed)
    await _generating(state, admitted, meta, len(prompt_ids), billed, streamed=False)
    if admitted.rule is not None and kind == "hang":
        await asyncio.sleep(admitted.rule.hang_s)
    out = completion_body(meta, shown, usage_, pieces, want_logprobs, ids)
    _record(state, admitted, meta, len(prompt_ids), billed, streamed=False)
    id_header = {GENERATION_ID_HEADER: meta.id} if cfg.generation_id_header else None
    if kind == "late_error_body":
        failed = {"id": meta.id, **_error(502, "simulated: the provider failed mid-generation")}
        return state.respond(200, failed, id_header)
    if kind == "truncated_json":
        return _truncated_json(state, out)
    if kind == "midstream_reset":
        return await _reset_midway(state, request, json.dumps(out).encode())
    return state.respond(200, out, id_header)


def _billed_answer(responder: Responder, full: ChatAnswer, kind: str | None) -> ChatAnswer:
    if kind in _PARTIAL_KINDS:
        return partial_answer(responder, full)
    if kind == "empty":
        return empty_answer()
    if kind == "empty_reasoning":
        return without_reasoning(full)
    return full


def _truncated_json(state: SimState, body: dict[str, Any]) -> web.Response:
    text = json.dumps(body)
    state.by_status["200"] += 1
    return web.Response(status=200, text=text[: len(text) // 2], content_type="application/json")


async def _stream(
    state: SimState,
    request: web.Request,
    admitted: Admitted,
    meta: ChatMeta,
    source: StreamFrames,
    prompt_tokens: int,
    billed: ChatAnswer,
) -> web.StreamResponse:
    """The SSE answer. Frames go out in one write unless a hang or `stream_chunk_delay_s` spaces them; the
    generation is recorded before the last write so a client that saw the end can already look it up."""
    kind = admitted.kind
    if kind in _ERROR_CHUNK_KINDS:
        frames = source.midstream_error()
    elif kind == "truncated_json":
        frames = source.truncated()
    elif kind == "midstream_reset":
        frames = source.first_half()
    elif kind == "reset_before_done":
        frames = source.without_done()
    elif kind == "cut_after_finish":
        frames = source.without_usage()
    else:
        frames = source.complete()
    headers = {**SSE_HEADERS, GENERATION_ID_HEADER: meta.id} if state.config.generation_id_header else SSE_HEADERS
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(request)
    state.by_status["200"] += 1
    # The keep-alive comment and the first token go out as generation starts; the rest once it is done.
    early = 2 if source.deltas and len(frames) > 1 and frames[1] == source.deltas[0] else 1
    try:
        await response.write("".join(frames[:early]).encode())
    except ConnectionResetError:  # the client left before generation started: nothing to bill
        return response
    frames = frames[early:]
    await _generating(state, admitted, meta, prompt_tokens, billed, streamed=True)
    if admitted.rule is not None and kind == "hang":
        await asyncio.sleep(admitted.rule.hang_s)
    delay = state.config.stream_chunk_delay_s
    if delay > 0:
        sent = 0
        billed_from = _usage_frame(frames)
        try:
            for frame in frames[:billed_from]:
                await response.write(frame.encode())
                sent += 1
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            _bill_cut(state, admitted, meta, prompt_tokens, billed, True, sent / len(frames))
            raise
        except ConnectionResetError:
            _bill_cut(state, admitted, meta, prompt_tokens, billed, True, sent / len(frames))
            return response
        frames = frames[billed_from:]
    _record(state, admitted, meta, prompt_tokens, billed, streamed=True)
    try:
        await response.write("".join(frames).encode())
    except ConnectionResetError:  # billed above: the answer was generated, the client left before reading it
        return response
    if kind in ("midstream_reset", "reset_before_done", "cut_after_finish"):
        _abort(request, rst=True)
        return response
    await response.write_eof()
    return response


def _usage_frame(frames: list[str]) -> int:
    """Where the bill is written before the rest goes out: the usage chunk (it quotes the cost), else the last
    frame. A usage chunk sent before its bill was written let a simulator killed between the two hand the client
    a cost its own ledger never recorded."""
    return next((i for i, frame in enumerate(frames) if '"usage"' in frame), max(len(frames) - 1, 0))


async def generate(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    state = request.app[STATE]
    body = await _json_body(request)
    if body is None:
        return state.respond(400, _error(400, "request body must be a JSON object"))
    params = body.get("sampling_params") or {}
    input_ids, text = body.get("input_ids"), body.get("text")
    if not isinstance(params, dict):
        return state.respond(400, _error(400, "sampling_params must be an object"))
    if isinstance(input_ids, list) and input_ids and all(isinstance(i, int) for i in input_ids):
        prompt_ids = tuple(input_ids)
    elif isinstance(text, str) and text:
        prompt_ids = state.responder.prompt_ids_for_text(text)
    else:
        return state.respond(400, _error(400, "need a non-empty input_ids list of ints or a text string"))
    try:
        seed = _int_or_none(params.get("sampling_seed"), "sampling_seed")
        max_new = _int_or_none(params.get("max_new_tokens"), "max_new_tokens")
    except ValueError as exc:
        return state.respond(400, _error(400, str(exc)))
    responder = state.responder
    admitted = await _admit(state, request, "generate", prompt_ids, seed, max_new)
    if isinstance(admitted, web.Response):
        return admitted
    key, attempt, sample, ids, finish = admitted.key, admitted.attempt, admitted.sample, admitted.ids, admitted.finish
    kind = admitted.kind
    skip = bool(params.get("skip_special_tokens", True))
    reason: dict[str, Any]
    if kind == "empty":
        ids, out_text, reason = (), "", {"type": "stop", "matched": responder.eos_id}
    elif kind in _PARTIAL_KINDS:
        ids = ids[: len(ids) // 2]
        out_text = responder.decode(ids, skip)
        reason = {"type": "abort", "message": f"simulated: request aborted (attempt {attempt})"}
    elif finish == "stop":
        out_text = sample.reasoning + sample.content if skip and responder.close_is_special else sample.text
        reason = {"type": "stop", "matched": responder.eos_id}
    else:
        out_text = responder.decode(ids, skip)
        reason = {"type": "length", "length": len(ids)}
    meta = ChatMeta(f"{attempt}-{key}", sample.provider, state.config.model_name, int(time.time()))
    billed = ChatAnswer("", "", len(ids), 0, str(reason["type"]))
    await _generating(state, admitted, meta, len(prompt_ids), billed, streamed=False)
    if admitted.rule is not None and kind == "hang":
        await asyncio.sleep(admitted.rule.hang_s)
    _record(state, admitted, meta, len(prompt_ids), billed, streamed=False)
    out = {
        "text": out_text,
        "output_ids": list(ids),
        "meta_info": {
            "id": meta.id,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": reason,
            "e2e_latency": time.perf_counter() - started,
        },
    }
    if kind == "truncated_json":
        return _truncated_json(state, out)
    if kind == "midstream_reset":
        return await _reset_midway(state, request, json.dumps(out).encode())
    return state.respond(200, out)


UNAVAILABLE = {"error": {"message": "server is starting", "code": 503}}


async def health(request: web.Request) -> web.Response:
    if request.app[STATE].probe_unavailable():
        return web.json_response(UNAVAILABLE, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    if request.app[STATE].probe_unavailable():
        return web.json_response(UNAVAILABLE, status=503)
    name = request.app[STATE].config.model_name
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "endpoint-sim"}]})


async def openrouter_models(request: web.Request) -> web.Response:
    """OpenRouter's public models listing (USD per token as strings); not a completion, counted apart."""
    state = request.app[STATE]
    state.by_route["models_listing"] += 1
    cfg = state.config
    pricing = {
        "prompt": f"{cfg.price_prompt_usd_per_mtok / 1e6:.12f}",
        "completion": f"{cfg.price_completion_usd_per_mtok / 1e6:.12f}",
    }
    entry = {"id": cfg.model_name, "canonical_slug": cfg.model_name, "name": cfg.model_name, "pricing": pricing}
    return web.json_response({"data": [entry]})


async def generation_lookup(request: web.Request) -> web.Response:
    """OpenRouter's billing record of one completion; counted apart from completions (not in by_key)."""
    state = request.app[STATE]
    state.by_route["generation_lookup"] += 1
    auth = _auth_error(state.config, request)
    gen_id = request.query.get("id", "")
    if auth is not None:
        status, body = 401, _error(401, auth)
    elif not gen_id:
        status, body = 400, _error(400, "query parameter id is required")
    elif (found := state.generations.visible(gen_id, state.config.generation_lookup_delay_s)) is not None:
        settling = state.config.generation_lookup_delay_s + state.config.generation_unsettled_s
        settled = state.generations.visible(gen_id, settling) is not None
        status, body = (
            200,
            {"data": found.data(settled, state.config.byok_fee_fraction)},
        )
    else:
        status, body = 404, _error(404, "Generation not found")
    state.lookups[str(status)] += 1
    return web.json_response(body, status=status)


async def sim_stats(request: web.Request) -> web.Response:
    with_keys = request.query.get("keys", "1") not in ("0", "false")
    return web.json_response(request.app[STATE].stats(with_keys))


def merged_config(base: SimConfig, changes: dict[str, Any]) -> SimConfig:
    return SimConfig.model_validate({**base.model_dump(), **changes}) if changes else base


async def sim_config(request: web.Request) -> web.Response:
    """POST merges fields into the live config (like `SimulatorServer.update_config`), for out-of-process tests."""
    state = request.app[STATE]
    if request.method == "POST":
        changes = await _json_body(request)
        if changes is None:
            return web.json_response(_error(400, "body must be a JSON object of SimConfig fields"), status=400)
        try:
            state.update_config(merged_config(state.config, changes))
        except ValidationError as exc:
            return web.json_response(_error(400, str(exc)), status=400)
    return web.json_response(state.config.model_dump(mode="json"))


def billing_ledger(state: SimState) -> dict[str, Any]:
    return state.billing.to_dict()


async def key_info(request: web.Request) -> web.Response:
    """OpenRouter's current-key record: the account's usage (with the configured lag) and limit."""
    state = request.app[STATE]
    state.by_route["key"] += 1
    auth = _auth_error(state.config, request)
    if auth is not None:
        return web.json_response(_error(401, auth), status=401)
    usage = state.key_usage_usd()
    limit = state.config.key_limit_usd
    data = {
        "label": KEY_LABEL,
        "usage": usage,
        "usage_daily": usage,
        "usage_weekly": usage,
        "usage_monthly": usage,
        "limit": limit,
        "limit_remaining": None if limit is None else max(0.0, limit - usage),
        "limit_reset": None,
        "include_byok_in_limit": False,
        "is_free_tier": False,
        "is_provisioning_key": False,
        "rate_limit": {"requests": -1, "interval": "10s"},
    }
    return web.json_response({"data": data})


async def sim_ledger(request: web.Request) -> web.Response:
    """GET: every completion this server billed (id, prompt key, cost, monotonic time), and their total."""
    return web.json_response(billing_ledger(request.app[STATE]))


async def sim_reset(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.reset_stats()
    return web.json_response(state.stats(with_keys=False))


def build_app(state: SimState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024**2)
    app[STATE] = state
    chat = _completion_route("chat", chat_completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    app.router.add_post("/generate", _completion_route("generate", generate))
    app.router.add_get("/api/v1/generation", generation_lookup)
    app.router.add_get("/v1/generation", generation_lookup)
    app.router.add_get("/api/v1/key", key_info)
    app.router.add_get("/v1/key", key_info)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/api/v1/models", openrouter_models)
    app.router.add_get("/_sim/stats", sim_stats)
    app.router.add_get("/_sim/config", sim_config)
    app.router.add_post("/_sim/config", sim_config)
    app.router.add_post("/_sim/reset", sim_reset)
    app.router.add_get("/_sim/ledger", sim_ledger)
    return app


def _runner(state: SimState) -> web.AppRunner:
    """Handlers are cancelled when their client goes away, so a timed-out "hang" stops holding a slot."""
    return web.AppRunner(
        build_app(state),
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


class SimulatorServer:
    """The simulator on its own event loop in a background thread, bound to 127.0.0.1 (port 0 = any free)."""

    def __init__(
        self,
        model_dir: Path | str,
        config: SimConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        responder: Responder | None = None,
        billing_file: Path | None = None,
    ) -> None:
        """`responder`: answer with this one instead of a fresh `Responder` (e.g. `model_backend.ModelResponder`).
        `billing_file`: keep the bill there, so a simulator started on it again continues it."""
        self.model_dir = Path(model_dir)
        self._responder = responder
        self.billing_file = billing_file
        self._config = config or SimConfig()
        self.host = host
        self._port = port
        self._state: SimState | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None

    @property
    def config(self) -> SimConfig:
        return self._state.config if self._state is not None else self._config

    @property
    def port(self) -> int:
        if self._runner is None or not self._ready.is_set():
            raise RuntimeError("simulator is not running")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> SimulatorServer:
        if self._thread is not None:
            raise RuntimeError("simulator already started")
        self._state = SimState(self._responder or Responder(self.model_dir, self._config), self.billing_file)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="endpoint-sim", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"simulator failed to start on {self.host}:{self._port}") from self._startup_error
        return self

    def _serve(self) -> None:
        assert self._loop is not None and self._state is not None
        loop = self._loop
        asyncio.set_event_loop(loop)
        runner = _runner(self._state)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self._port, backlog=LISTEN_BACKLOG, reuse_address=True)
            loop.run_until_complete(site.start())
            self._port = int(runner.addresses[0][1])
        except BaseException as exc:
            self._startup_error = exc
            loop.run_until_complete(runner.cleanup())
            loop.close()
            self._ready.set()
            return
        self._runner = runner
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._state.cancel_handlers()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            self._state.billing.close()

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None
        self._runner = None
        self._ready.clear()

    def _on_loop(self, fn: Any) -> Any:
        """Run `fn()` on the server loop (state is loop-confined) and return its result."""
        if self._thread is None or self._loop is None:
            return fn()
        result: Future[Any] = Future()

        def run() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return result.result()

    def update_config(self, config: SimConfig | None = None, **changes: Any) -> SimConfig:
        """Swap knobs between test phases; attempt counters and stats are kept (a rerun sees attempt N+1)."""
        new = merged_config(config or self.config, changes)
        self._config = new
        if self._state is not None:
            state = self._state
            self._on_loop(lambda: state.update_config(new))
        return new

    def stats(self, with_keys: bool = True) -> dict[str, Any]:
        if self._state is None:
            raise RuntimeError("simulator was never started")
        state = self._state
        snapshot: dict[str, Any] = self._on_loop(lambda: state.stats(with_keys))
        return snapshot

    def billing(self) -> dict[str, Any]:
        """The simulator's billing ledger (as GET /_sim/ledger)."""
        if self._state is None:
            raise RuntimeError("simulator was never started")
        state = self._state
        ledger: dict[str, Any] = self._on_loop(lambda: billing_ledger(state))
        return ledger

    def reset_stats(self) -> None:
        """Also resets attempt numbers: injected failures start over for every key."""
        if self._state is not None:
            state = self._state
            self._on_loop(state.reset_stats)

    def __enter__(self) -> SimulatorServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_forever(
    model_dir: Path | str,
    config: SimConfig,
    host: str,
    port: int,
    port_file: Path | None = None,
    responder: Responder | None = None,
    billing_file: Path | None = None,
) -> None:
    """Foreground server for `python -m endpoint_sim` (benchmarks, manual runs) until SIGINT or SIGTERM.

    With `port_file`, the bound port (useful with port 0) is written there atomically once the server listens,
    so a parent process can wait for the file instead of polling the socket. With `billing_file`, the bill
    survives a restart (killed or not) on it.
    """
    state = SimState(responder or Responder(model_dir, config), billing_file)
    asyncio.run(_serve_until_signal(state, f"endpoint-sim serving {model_dir}", host, port, port_file))


async def _serve_until_signal(state: SimState, banner: str, host: str, port: int, port_file: Path | None) -> None:
    runner = _runner(state)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, reuse_address=True)
        await site.start()
        bound = int(runner.addresses[0][1])
        if port_file is not None:
            _write_atomically(port_file, f"{bound}\n")
        print(f"{banner} on http://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        state.cancel_handlers()
        await runner.cleanup()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
