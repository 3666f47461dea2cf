"""The idle and total timeouts of a streamed body, at one timer per stream instead of work on every read.

aiohttp's `sock_read` cancels and re-creates a loop timer on every read, and its total timeout enters and leaves a
timer context on every read; with 10,000 streams the first is about 5 us a read in a timer heap of 10,000, as much
as parsing the events the read carried. So a streaming session has no total timeout, and once a stream's head has
arrived the client switches `sock_read` off for that response (as aiohttp does itself after a websocket handshake);
a `StallWatch` keeps both promises for the body: it fails with the error `sock_read` raises, `SocketTimeoutError`,
when no byte arrived for `idle_s`, and with a `TimeoutError` when the body is still going `total_s` after its head
arrived (the head itself is bounded by `sock_connect` and `sock_read`). Both are `TimeoutError`s, so the attempt
is classified as a timeout, as before. The reader does nothing per read: the watch's one timer looks at how many
bytes the body has received (`StreamReader.total_bytes`) every eighth of `idle_s`, so a stall is caught within
`idle_s * 9 / 8` of the last byte.
"""

from __future__ import annotations

import asyncio

import aiohttp

CHECKS_PER_IDLE = 8


class StallWatch:
    __slots__ = ("_content", "_deadline", "_handle", "_loop", "_quiet_since", "_seen", "idle_s", "total_s")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, content: aiohttp.StreamReader, idle_s: float, total_s: float
    ) -> None:
        self._loop = loop
        self._content = content
        self.idle_s = idle_s
        self.total_s = total_s
        self._seen = content.total_bytes
        self._quiet_since = now = loop.time()
        self._deadline = now + total_s
        self._handle: asyncio.TimerHandle | None = loop.call_at(self._next(now), self._check)

    def _next(self, now: float) -> float:
        return min(now + self.idle_s / CHECKS_PER_IDLE, self._quiet_since + self.idle_s, self._deadline)

    def _check(self) -> None:
        now = self._loop.time()
        received = self._content.total_bytes
        if received != self._seen:
            self._seen, self._quiet_since = received, now
        elif now - self._quiet_since >= self.idle_s:
            self._fail(
                aiohttp.SocketTimeoutError(
                    f"stream sent nothing for {self.idle_s:g} s (endpoint.stream_idle_timeout_s)"
                )
            )
            return
        if now >= self._deadline:
            self._fail(TimeoutError(f"stream still going after {self.total_s:g} s (endpoint.request_timeout_s)"))
            return
        self._handle = self._loop.call_at(self._next(now), self._check)

    def _fail(self, exc: BaseException) -> None:
        self._handle = None
        self._content.set_exception(exc)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def stop_per_read_timer(resp: aiohttp.ClientResponse) -> None:
    """Switch aiohttp's `sock_read` off for the rest of this response (the next request on the connection sets its
    own again); a `StallWatch` must then guard the body."""
    connection = resp.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is not None:
        protocol.read_timeout = None
