"""A local HTTP endpoint that behaves like OpenRouter's chat API and SGLang's native /generate.

It exists so the generate stage can be tested and benchmarked over real sockets (connection pooling, timeouts,
retries, thousands of requests in flight) without any network access. Failures are injected deterministically
per (prompt key, attempt number as seen by this server), so a test knows in advance which requests fail.

Handler work is kept small for high concurrency: tokenizer work is cached per prompt key in the `Responder`.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from statistics import NormalDist
from types import TracebackType
from typing import Any

from aiohttp import web

from endpoint_sim.responder import FailureRule, Responder, SimConfig, SimSample, unit_hash

__all__ = ["FailureRule", "SimConfig", "SimState", "SimulatorServer", "build_app", "serve_forever"]

LISTEN_BACKLOG = 8192
# stop() must not wait a minute for requests parked in an injected latency.
SHUTDOWN_TIMEOUT_S = 1.0
_STANDARD_NORMAL = NormalDist()


class SimState:
    """Mutable server state; touched only from the server's event loop thread."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.config = responder.config
        self.total_requests = 0
        self.by_key: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.by_route: Counter[str] = Counter()
        self.probes = 0

    def probe_unavailable(self) -> bool:
        self.probes += 1
        return self.probes <= self.config.unavailable_probes

    def update_config(self, config: SimConfig) -> None:
        self.config = config
        self.responder.update_config(config)

    def reset_stats(self) -> None:
        self.total_requests = 0
        self.by_key.clear()
        self.by_status.clear()
        self.by_route.clear()
        self.probes = 0

    def stats(self, with_keys: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_requests": self.total_requests,
            "by_status": dict(self.by_status),
            "by_route": dict(self.by_route),
            "probes": self.probes,
        }
        if with_keys:
            out["by_key"] = dict(self.by_key)
        return out

    def count(self, route: str, key: str) -> int:
        """Record one request for `key`; returns its attempt number (1-based) as this server saw it."""
        self.total_requests += 1
        self.by_route[route] += 1
        self.by_key[key] += 1
        return self.by_key[key]

    def respond(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
        label = str(status) if status != 200 or "error" not in body else "200_error_body"
        self.by_status[label] += 1
        return web.json_response(body, status=status, headers=headers)

    def failure_rule(self, key: str, attempt: int) -> FailureRule | None:
        u = unit_hash(key, self.config.seed, "failure")
        low = 0.0
        for rule in self.config.failures:
            if low <= u < low + rule.rate:
                return rule if rule.attempts is None or attempt <= rule.attempts else None
            low += rule.rate
        return None

    def latency(self, key: str, attempt: int) -> float:
        cfg = self.config
        delay = cfg.latency_s
        if cfg.latency_lognormal is not None:
            mu, sigma = cfg.latency_lognormal
            u = min(max(unit_hash(key, attempt, cfg.seed, "latency"), 1e-12), 1 - 1e-12)
            delay += math.exp(mu + sigma * _STANDARD_NORMAL.inv_cdf(u))
        return delay


STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message}}


async def _json_body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _auth_failure(state: SimState, request: web.Request) -> web.Response | None:
    cfg = state.config
    if cfg.auth_fail_all:
        return state.respond(401, _error(401, "simulated: invalid credentials"))
    expected = f"Bearer {cfg.required_api_key}"
    if cfg.required_api_key is not None and request.headers.get("Authorization", "") != expected:
        return state.respond(401, _error(401, "simulated: missing or wrong API key"))
    return None


async def _injected(state: SimState, key: str, attempt: int, prompt_len: int) -> web.Response | None:
    """Latency, then the failure this (key, attempt) is scheduled to get, if any."""
    delay = state.latency(key, attempt)
    if delay > 0:
        await asyncio.sleep(delay)
    rule = state.failure_rule(key, attempt)
    if rule is None:
        return None
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
        return state.respond(200, _error(502, f"simulated upstream error (attempt {attempt})"))
    headers = {"Retry-After": f"{rule.retry_after_s:g}"} if rule.retry_after_s is not None else None
    return state.respond(rule.status, _error(rule.status, f"simulated HTTP {rule.status} (attempt {attempt})"), headers)


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _cost(cfg: SimConfig, prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * cfg.price_prompt_usd_per_mtok + completion_tokens * cfg.price_completion_usd_per_mtok) / 1e6


def _truncate(sample: SimSample, limit: int | None) -> tuple[tuple[int, ...], str]:
    """The ids actually "generated" under a token limit, and the finish reason."""
    if limit is not None and len(sample.output_ids) > limit:
        return sample.output_ids[:limit], "length"
    return sample.output_ids, "stop"


async def _admit(
    state: SimState,
    request: web.Request,
    route: str,
    prompt_ids: tuple[int, ...],
    seed: int | None,
    limit: int | None,
) -> web.Response | tuple[str, int, SimSample, tuple[int, ...], str]:
    """What both routes do once a request parsed: count the attempt, apply auth and injected failures (a
    response to send back), else draw the sample and cut it at the token limit."""
    key = state.responder.key(prompt_ids, seed)
    attempt = state.count(route, key)
    refused = _auth_failure(state, request) or await _injected(state, key, attempt, len(prompt_ids))
    if refused is not None:
        return refused
    sample = state.responder.sample(prompt_ids, seed, key)
    ids, finish = _truncate(sample, limit)
    return key, attempt, sample, ids, finish


async def chat_completions(request: web.Request) -> web.Response:
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
    try:
        seed = _int_or_none(body.get("seed"), "seed")
        max_tokens = _int_or_none(body.get("max_tokens", body.get("max_completion_tokens")), "max_tokens")
    except ValueError as exc:
        return state.respond(400, _error(400, str(exc)))
    responder = state.responder
    prompt_ids = responder.prompt_ids_for_messages(messages)
    admitted = await _admit(state, request, "chat", prompt_ids, seed, max_tokens)
    if isinstance(admitted, web.Response):
        return admitted
    key, attempt, sample, ids, finish = admitted
    if finish == "stop":
        reasoning, content, reasoning_tokens = sample.reasoning, sample.content, sample.reasoning_tokens
    elif responder.reasoning_close_id in ids:
        cut = ids.index(responder.reasoning_close_id)
        reasoning, content, reasoning_tokens = (
            responder.decode(ids[:cut]),
            responder.decode(ids[cut + 1 :]),
            cut,
        )
    else:
        reasoning, content, reasoning_tokens = responder.decode(ids), "", len(ids)
    cfg = state.config
    usage: dict[str, Any] = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt_ids) + len(ids),
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }
    if cfg.report_cost:
        usage["cost"] = _cost(cfg, len(prompt_ids), len(ids))
    return state.respond(
        200,
        {
            "id": f"gen-{attempt}-{key}",
            "provider": sample.provider,
            "model": cfg.model_name,
            "object": "chat.completion",
            "created": int(time.time()),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "reasoning": reasoning},
                    "finish_reason": finish,
                    "native_finish_reason": finish,
                }
            ],
            "usage": usage,
        },
    )


async def generate(request: web.Request) -> web.Response:
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
    key, attempt, sample, ids, finish = admitted
    skip = bool(params.get("skip_special_tokens", True))
    if finish == "stop":
        out_text = sample.reasoning + sample.content if skip and responder.close_is_special else sample.text
        reason: dict[str, Any] = {"type": "stop", "matched": responder.eos_id}
    else:
        out_text = responder.decode(ids, skip)
        reason = {"type": "length", "length": len(ids)}
    return state.respond(
        200,
        {
            "text": out_text,
            "output_ids": list(ids),
            "meta_info": {
                "id": f"{attempt}-{key}",
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "finish_reason": reason,
                "e2e_latency": time.perf_counter() - started,
            },
        },
    )


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


async def sim_stats(request: web.Request) -> web.Response:
    with_keys = request.query.get("keys", "1") not in ("0", "false")
    return web.json_response(request.app[STATE].stats(with_keys))


def build_app(state: SimState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024**2)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_sim/stats", sim_stats)
    return app


class SimulatorServer:
    """The simulator on its own event loop in a background thread, bound to 127.0.0.1 (port 0 = any free)."""

    def __init__(
        self, model_dir: Path | str, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.model_dir = Path(model_dir)
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
        self._state = SimState(Responder(self.model_dir, self._config))
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
        runner = web.AppRunner(
            build_app(self._state), access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
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
            loop.run_until_complete(runner.cleanup())
            loop.close()

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
        base = config or self.config
        new = SimConfig.model_validate({**base.model_dump(), **changes}) if changes else base
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


def serve_forever(model_dir: Path | str, config: SimConfig, host: str, port: int) -> None:
    """Foreground server for `python -m endpoint_sim` (benchmarks, manual runs)."""
    state = SimState(Responder(model_dir, config))
    web.run_app(build_app(state), host=host, port=port, backlog=LISTEN_BACKLOG, access_log=None, print=None)
