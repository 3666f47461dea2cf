"""A chat-completions server that holds thousands of long answers open at a steady pace: production streaming shape.

Why not the main simulator's aiohttp app: at 10,000 paced streams every write is the server's cost, and aiohttp's
per-write coroutine and drain would make the server, not the client, the slower side on two cores. So this is a
bare asyncio protocol speaking just enough HTTP/1.1 (keep-alive, chunked transfer) for `POST .../chat/completions`
(streamed or not, the same answer either way), `GET .../models` (the client's liveness probe), and two test routes:
`GET /_stats` (streams started and finished, data events sent, when each stream's last byte was written, how late
the pacing ticks ran) and `POST /_reset`.

Pacing: each stream is written once per `write_interval_s`, with every group of chunks that fell due since its
last write; streams are spread over the interval in buckets so the writes are even, not a burst per interval.
The end time of every stream (`time.monotonic()`, one clock for every process on Linux) lets a client measure
how far behind the server it fell: when it saw the end minus when the server wrote it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import signal
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from endpoint_sim.long_answers import (
    CREATED,
    ENDING_EVENTS,
    ID_PLACEHOLDER,
    LongAnswer,
    LongStreamConfig,
    RenderedStream,
    completion_body,
    long_answer,
    pool_index,
    prompt_tokens,
    render_stream,
    usage,
)

LISTEN_BACKLOG = 16384
TICK_S = 0.01
_PLACEHOLDER = ID_PLACEHOLDER.encode()
MAX_HEAD_BYTES = 64 * 1024
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


class _Entry:
    """One pool answer, rendered both ways, built on first use."""

    __slots__ = ("answer", "rendered")

    def __init__(self, answer: LongAnswer, rendered: RenderedStream) -> None:
        self.answer = answer
        self.rendered = rendered


class _Stream:
    __slots__ = ("conn", "entry", "gen_id", "group", "n_prompt", "pace", "started")

    def __init__(
        self, conn: _Connection, entry: _Entry, n_prompt: int, gen_id: bytes, started: float, pace: float
    ) -> None:
        self.conn = conn
        self.entry = entry
        self.n_prompt = n_prompt
        self.gen_id = gen_id
        self.started = started
        self.pace = pace  # the schedule's stretch: group g is due at rendered.due_s[g] * pace
        self.group = 0


class LongStreamState:
    """Everything the server holds; lives on its event loop."""

    def __init__(self, cfg: LongStreamConfig) -> None:
        self.cfg = cfg
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()
        self.paces = random.Random(cfg.seed)
        self.n_buckets = max(1, round(cfg.write_interval_s / TICK_S))
        self.tick_s = cfg.write_interval_s / self.n_buckets
        self.buckets: list[list[_Stream]] = [[] for _ in range(self.n_buckets)]
        self.tick_no = 0
        self.next_tick_at = 0.0
        self.reset()

    def reset(self) -> None:
        self.started = 0
        self.finished = 0
        self.cut = 0
        self.non_streamed = 0
        self.data_events = 0
        self.bytes_sent = 0
        self.writes = 0
        self.writes_while_paused = 0
        self.max_tick_late_s = 0.0
        self.ends: dict[str, float] = {}

    def entry(self, prompt: str) -> _Entry:
        index = pool_index(self.cfg, prompt)
        entry = self._entries.get(index)
        if entry is None:
            answer = long_answer(self.cfg, index)
            entry = self._entries[index] = _Entry(answer, render_stream(self.cfg, answer))
        return entry

    def next_id(self) -> str:
        gen_id = f"gen-{CREATED}-{next(self._ids):020d}"
        assert len(gen_id) == len(ID_PLACEHOLDER)
        return gen_id

    def stats(self) -> dict[str, Any]:
        return {
            "streams_started": self.started,
            "streams_finished": self.finished,
            "streams_cut": self.cut,
            "non_streamed": self.non_streamed,
            "open_streams": sum(len(b) for b in self.buckets),
            "data_events": self.data_events,
            "bytes_sent": self.bytes_sent,
            "writes": self.writes,
            "writes_while_paused": self.writes_while_paused,
            "max_tick_late_s": self.max_tick_late_s,
            "ends": self.ends,
        }

    def add(self, stream: _Stream) -> None:
        self.started += 1
        self.buckets[(self.tick_no + 1) % self.n_buckets].append(stream)

    def tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if self.next_tick_at:
            self.max_tick_late_s = max(self.max_tick_late_s, now - self.next_tick_at)
        else:
            self.next_tick_at = now
        bucket = self.buckets[self.tick_no % self.n_buckets]
        if bucket:
            bucket[:] = [stream for stream in bucket if not self._pump(stream, now)]
        self.tick_no += 1
        self.next_tick_at += self.tick_s
        loop.call_at(max(self.next_tick_at, now), self.tick, loop)

    def _pump(self, stream: _Stream, now: float) -> bool:
        """Write the groups due by now; True once the stream is over (finished, or its connection gone)."""
        conn = stream.conn
        if conn.transport is None or conn.stream is not stream:
            return True
        entry = stream.entry
        rendered = entry.rendered
        first = stream.group
        upto = rendered.due_through((now - stream.started) / stream.pace, first)
        if upto == first:
            return False
        payload = rendered.blob[rendered.starts[first] : rendered.starts[upto]]
        stream.group = upto
        self.data_events += rendered.events_before[upto] - rendered.events_before[first]
        done = upto == rendered.groups
        if done:
            payload += rendered.ending(usage(self.cfg, entry.answer, stream.n_prompt))
            self.data_events += ENDING_EVENTS
        payload = payload.replace(_PLACEHOLDER, stream.gen_id)
        frame = b"%x\r\n%b\r\n" % (len(payload), payload)
        if done:
            frame += b"0\r\n\r\n"
        conn.write(frame)
        if done:
            self.finished += 1
            self.ends[stream.gen_id.decode()] = time.monotonic()
            conn.stream_ended()
        return done


class _Connection(asyncio.Protocol):
    """One client connection: requests one after another (keep-alive), at most one stream at a time."""

    def __init__(self, state: LongStreamState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.stream: _Stream | None = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.state.cut += 1
        self.transport = None
        self.stream = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        if self.transport is None:
            return
        state = self.state
        state.writes += 1
        state.writes_while_paused += self.paused
        state.bytes_sent += len(data)
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.stream is None:
            self._serve_buffered()

    def stream_ended(self) -> None:
        self.stream = None
        self._serve_buffered()

    def _serve_buffered(self) -> None:
        while self.stream is None and self.transport is not None:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._reply(431, {"error": {"message": "request head too large", "code": 431}}, close=True)
                return
            lines = bytes(self.buffer[:head_end]).decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = bytes(self.buffer[head_end + 4 : head_end + 4 + length])
            del self.buffer[: head_end + 4 + length]
            self._route(method, path, body, headers.get("connection", "").lower() == "close")

    def _route(self, method: str, path: str, body: bytes, close: bool) -> None:
        state = self.state
        if method == "POST" and path.endswith("/chat/completions"):
            self._chat(body, close)
        elif method == "GET" and path.endswith("/models"):
            model = {"id": state.cfg.model_name, "object": "model", "owned_by": "long-streams"}
            self._reply(200, {"object": "list", "data": [model]}, close)
        elif method == "GET" and path == "/health":
            self._reply(200, {"status": "ok"}, close)
        elif method == "GET" and path == "/_stats":
            self._reply(200, state.stats(), close)
        elif method == "POST" and path == "/_reset":
            state.reset()
            self._reply(200, {"reset": True}, close)
        else:
            self._reply(404, {"error": {"message": f"no route {method} {path}", "code": 404}}, close)

    def _chat(self, raw: bytes, close: bool) -> None:
        try:
            body = json.loads(raw)
            messages = body["messages"]
            prompt = "\n".join(str(m["content"]) for m in messages)
        except (ValueError, KeyError, TypeError):
            self._reply(400, {"error": {"message": "body must hold a messages list", "code": 400}}, close)
            return
        state = self.state
        entry, n_prompt = state.entry(prompt), prompt_tokens(prompt)
        gen_id = state.next_id()
        if body.get("stream") is not True:
            state.non_streamed += 1
            self._reply_bytes(200, completion_body(state.cfg, entry.answer, gen_id, n_prompt), close)
            return
        pace = 1.0 - state.cfg.pace_spread * state.paces.random()
        stream = _Stream(self, entry, n_prompt, gen_id.encode(), self.loop.time(), pace)
        self.stream = stream
        self.write(SSE_HEAD)
        state.add(stream)

    def _reply(self, status: int, body: dict[str, Any], close: bool) -> None:
        self._reply_bytes(status, json.dumps(body).encode(), close)

    def _reply_bytes(self, status: int, body: bytes, close: bool) -> None:
        head = (
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' if close else 'Connection: keep-alive'}\r\n\r\n"
        )
        self.write(head.encode() + body)
        if close and self.transport is not None:
            self.transport.close()


async def _listen(state: LongStreamState, host: str, port: int) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(state, loop), host, port, backlog=LISTEN_BACKLOG, reuse_address=True
    )
    loop.call_soon(state.tick, loop)
    return server


class LongStreamServer:
    """The server on its own event loop in a background thread (tests); `serve_forever` runs it in the foreground."""

    def __init__(self, cfg: LongStreamConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = cfg
        self.host = host
        self._port = port
        self._state = LongStreamState(cfg)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def answer_for(self, prompt: str) -> LongAnswer:
        return long_answer(self.cfg, pool_index(self.cfg, prompt))

    def start(self) -> LongStreamServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="long-streams", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"long-stream server failed to start on {self.host}:{self._port}") from self._error
        return self

    def _serve(self) -> None:
        assert self._loop is not None
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(_listen(self._state, self.host, self._port))
            self._port = int(server.sockets[0].getsockname()[1])
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            loop.close()

    def stats(self) -> dict[str, Any]:
        if self._loop is None:
            raise RuntimeError("long-stream server is not running")
        return asyncio.run_coroutine_threadsafe(_call(self._state.stats), self._loop).result()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._thread = None

    def __enter__(self) -> LongStreamServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def _call(fn: Any) -> Any:
    return fn()


def serve_forever(cfg: LongStreamConfig, host: str, port: int, port_file: Path | None) -> None:
    """Until SIGINT or SIGTERM; with `port_file`, the bound port is written there atomically once listening."""

    async def main() -> None:
        state = LongStreamState(cfg)
        server = await _listen(state, host, port)
        bound = int(server.sockets[0].getsockname()[1])
        if port_file is not None:
            tmp = port_file.with_name(f".{port_file.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{bound}\n")
            os.replace(tmp, port_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"long-stream server on http://{host}:{bound}", flush=True)
        await stop.wait()
        server.close()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m endpoint_sim.long_streams", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30001, help="0 = any free port (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here (atomically) once listening")
    parser.add_argument("--config-json", type=Path, help="LongStreamConfig as JSON")
    args = parser.parse_args(argv)
    cfg = LongStreamConfig.model_validate_json(args.config_json.read_text()) if args.config_json else LongStreamConfig()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    serve_forever(cfg, args.host, args.port, args.port_file)


if __name__ == "__main__":
    main()
