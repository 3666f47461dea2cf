"""The idle timeout of a streamed body, at one timer per idle period instead of one per read.

aiohttp's `sock_read` cancels and re-creates a loop timer on every read; with 10,000 streams that is tens of
thousands of timers a second in a heap of 10,000, about 5 us a read, as much as parsing the events the read
carried. So once a stream's head has arrived the client switches `sock_read` off for that response (as aiohttp
does itself after a websocket handshake) and a `StallWatch` keeps the same promise: the body fails with the error
`sock_read` raises, `SocketTimeoutError` (a `TimeoutError`, so the attempt is still classified as a timeout), when
nothing arrived for `idle_s`. The reader only stamps `last` after each read; the watch's one timer, when it fires, is
re-armed from that stamp or fails the body.
"""

from __future__ import annotations

import asyncio

import aiohttp


class StallWatch:
    __slots__ = ("_content", "_handle", "_loop", "idle_s", "last")

    def __init__(self, loop: asyncio.AbstractEventLoop, content: aiohttp.StreamReader, idle_s: float) -> None:
        self._loop = loop
        self._content = content
        self.idle_s = idle_s
        self.last = loop.time()
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + idle_s, self._check)

    def _check(self) -> None:
        due = self.last + self.idle_s
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._content.set_exception(
            aiohttp.SocketTimeoutError(f"stream sent nothing for {self.idle_s:g} s (endpoint.stream_idle_timeout_s)")
        )

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
