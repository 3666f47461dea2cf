"""The endpoint's circuit breaker: while the endpoint as a whole is down no request is sent at all, and one liveness
probe at a time, backing off to `endpoint.outage_probe_max_s`, decides when sending resumes.

Why: without it every sample retried on its own short backoff, and a dead host took about 180 refused connections
a second (issue 19: 10,789 requests in a 60 s outage). With it an outage costs the requests in flight when it
began, the few already on their way when the first failures came back, and one probe per back-off step.

States:
- `closed`: requests flow.
- `suspect`: an outage-class failure (transport error, 502-504) arrived with no answer since it was sent, or
  `trip_after` of them in a row: new sends wait for one probe. Down: open. Up: closed again, unless `trip_after`
  502-504 answers came in a row with no answer in between: then open ("failing while up"), with one trial request at
  once and then one per `probe_min_s` (no back-off: the probe says up). A provider's burst of 503s while its model
  listing still answers (OpenRouter's liveness URL) had used up every attempt of 858 of 2,000 samples in 60 s;
  now the failures while it is open are free, and a failed trial uses up its own sample's attempt: from the
  client's side a burst looks like a few samples the endpoint fails every time with nothing else left to send,
  which, all free, would have stopped the run after `outage_abort_s` instead of failing them. A burst then
  costs one attempt per trial, spread over the waiting samples. A lone failure among answers still counts as
  its sample's own, and so do timeouts and resets while the probe answers: an endpoint too slow for
  `request_timeout_s` is not one that refuses, and trials of a whole timeout each would crawl.
- `open`: an outage. No sends; a probe at growing intervals. A probe that finds the endpoint up lets exactly one
  real request through (`trial`), since a liveness URL can answer while completions still fail.
- `trial`: that one request is out. Its answer closes the breaker; its outage-class failure reopens it.
An answer to a request sent after the endpoint was suspected closes the breaker at once. An answer to one sent
before (a long stream that was still running) proves less: a draining server (SIGTERM, a pod being replaced, a
simulator shutting down) finishes the requests it holds while it refuses new connections, and closing on those
answers let every sender fire at a dead port, then opened a second outage. So it lets one trial request through
while open, and leaves a suspect breaker to its probe.

Whether a failure uses up one of the sample's attempts is decided here too (`judge`): not while the endpoint is
down. When nothing has answered for `outage_abort_s`, every waiting sender gets `EndpointUnavailableError`:
the run stops resumably and no sample is marked failed for the outage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from tasks.common.errors import EndpointUnavailableError

BreakerState = Literal["closed", "suspect", "open", "trial"]
OutageEvent = Literal["outage_start", "outage_end"]


class CircuitBreaker:
    """Event-loop confined. `probe()` returns True when the endpoint is down; `last_success()` is the monotonic
    time of the last answer; `on_event(kind, message)` hears outages start and end."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        last_success: Callable[[], float],
        on_event: Callable[[OutageEvent, str], None],
        *,
        probe_min_s: float,
        probe_max_s: float,
        abort_s: float,
        trip_after: int = 3,
        where: str = "the endpoint",
    ) -> None:
        self._probe_fn = probe
        self._last_success = last_success
        self._on_event = on_event
        self.probe_min_s = min(probe_min_s, probe_max_s)
        self.probe_max_s = probe_max_s
        self.abort_s = abort_s
        self.trip_after = trip_after
        self.where = where
        self.state: BreakerState = "closed"
        self.down_since: float | None = None
        self.outages = 0
        self.probes = 0
        self.sent_while_down = 0
        self.failures_in_a_row = 0
        self._trial_out = False
        self._changed: asyncio.Future[None] | None = None
        self._probe: asyncio.Future[bool] | None = None
        self._probe_started = 0.0
        self._prober: asyncio.Task[None] | None = None
        self._abort: EndpointUnavailableError | None = None
        self._failing_up = False
        self._streak_sent_at: float | None = None
        self._statuses_in_a_row = 0
        self._last_error = ""

    # --- senders ----------------------------------------------------------------------------------------------
    def sendable(self) -> bool:
        return self._abort is None and (self.state == "closed" or (self.state == "trial" and not self._trial_out))

    async def wait(self) -> None:
        """Until a request may be sent (closed, or a trial is free); raises once the outage window is used up."""
        while not self.sendable():
            if self._abort is not None:
                raise self._abort
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)

    def take(self) -> bool | None:
        """Synchronously, right before a request is sent: None when it may not go now (wait again), else whether
        it is the trial request. A taken trial must end in `alive`, `judge` or `release_trial`."""
        if self._abort is not None:
            raise self._abort
        if self.state == "closed":
            return False
        if self.state == "trial" and not self._trial_out:
            self._trial_out = True
            self.sent_while_down += 1
            return True
        return None

    def release_trial(self) -> None:
        """The trial was taken but never sent (cancelled, no budget): let another sender take it."""
        if self.state == "trial" and self._trial_out:
            self._trial_out = False
            self._notify()

    # --- outcomes ---------------------------------------------------------------------------------------------
    def alive(self, sent_at: float) -> None:
        """An HTTP answer (anything but 502-504, a success above all) to a request sent at `sent_at`. It ends a run
        of failures only if it was sent no earlier than the first of them: streams sent before a provider's burst
        of 503s kept finishing through it, each reset the count, and about 1,000 requests went out into the burst
        (one per stream in flight) before the breaker opened."""
        if self._streak_sent_at is None or sent_at >= self._streak_sent_at:
            self.failures_in_a_row = 0
            self._statuses_in_a_row = 0
            self._streak_sent_at = None
        if self.state == "closed":
            return
        if self.down_since is not None and sent_at < self.down_since:
            self._allow_trial()
            return
        self._close()

    async def judge(
        self, sent_at: float, answered_since: bool, trial: bool, error: str, status_answer: bool = False
    ) -> bool:
        """An outage-class failure of a request sent at `sent_at`: True when the endpoint is down (the attempt
        is free and the sender just waits for the breaker), False when it answers (the sample's own failure).
        `status_answer`: the endpoint answered 502-504 (not a timeout or a reset)."""
        self._last_error = error
        self.failures_in_a_row += 1
        self._statuses_in_a_row = self._statuses_in_a_row + 1 if status_answer else 0
        if self._streak_sent_at is None:
            self._streak_sent_at = sent_at
        if trial:
            self._trial_out = False
            self._reopen()
            return not self._failing_up
        if self.state in ("open", "trial"):
            return True
        if self.state == "closed" and (not answered_since or self.failures_in_a_row >= self.trip_after):
            self.state = "suspect"
            self.down_since = time.monotonic()
        down = await self._probe_after(sent_at)
        if self.state in ("open", "trial"):
            return True
        if down:
            self._open()
            return True
        if self._statuses_in_a_row >= self.trip_after:
            self._open(probe_up=True)
            self._failing_up = True
            self._allow_trial()
            return True
        if self.state == "suspect":
            self._close(quiet=True)
        return False

    # --- internals --------------------------------------------------------------------------------------------
    async def _probe_after(self, sent_at: float) -> bool:
        """The verdict of a probe started after `sent_at`; concurrent failures share one probe."""
        while True:
            probe = self._probe
            if probe is not None and self._probe_started >= sent_at:
                return await asyncio.shield(probe)
            if probe is not None and not probe.done():
                await asyncio.wait([probe])
                continue
            self._probe_started = time.monotonic()
            self.probes += 1
            self._probe = asyncio.ensure_future(self._probe_fn())

    def _open(self, probe_up: bool = False) -> None:
        """`probe_up`: the liveness probe answers, but `trip_after` requests failed in a row with no answer in
        between (a provider's burst of 503s while the model listing stays up): one trial request decides."""
        self.state = "open"
        self.outages += 1
        self.down_since = self.down_since or time.monotonic()
        self.sent_while_down = 0
        if probe_up:
            what = (
                f"fails every request ({self.failures_in_a_row} in a row, last: {self._last_error}) while its "
                f"liveness probe answers: one trial request every {self.probe_min_s:g} s decides when sending "
                f"resumes (the run stops after {self.abort_s:g} s without an answer); a failed trial uses up its "
                "sample's attempt, the samples waiting meanwhile use up none"
            )
        else:
            what = (
                f"is down ({self._last_error}): no request is sent until a probe finds it up again (probes back "
                f"off to {self.probe_max_s:g} s; the run stops after {self.abort_s:g} s without an answer); no "
                "sample uses up an attempt meanwhile"
            )
        self._on_event("outage_start", f"{self.where} {what}")
        self._notify()
        self._prober = asyncio.ensure_future(self._probe_until_up())

    def _allow_trial(self) -> None:
        """Evidence the endpoint may be back: one real request decides."""
        if self.state == "open":
            self.state = "trial"
            self._notify()

    def _reopen(self) -> None:
        if self.state == "trial":
            self.state = "open"
            self._notify()

    def _close(self, quiet: bool = False) -> None:
        was_open = self.state in ("open", "trial")
        self.state = "closed"
        self._trial_out = False
        self._failing_up = False
        if was_open and not quiet:
            down_s = time.monotonic() - (self.down_since or time.monotonic())
            self._on_event(
                "outage_end",
                f"{self.where} answers again after {down_s:.1f} s down; only liveness probes and single trial "
                f"requests were sent while it was down ({self.sent_while_down}); sending resumes",
            )
        self.down_since = None
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def _probe_until_up(self) -> None:
        delay = self.probe_min_s
        while self.state != "closed":
            if self.state == "trial":
                await self._wait_change()
                continue
            deadline = self._last_success() + self.abort_s
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            if self.state != "open":
                continue
            silent_s = time.monotonic() - self._last_success()
            if silent_s >= self.abort_s:
                self._stop(silent_s)
                return
            self.probes += 1
            self.sent_while_down += 1
            self._probe_started = time.monotonic()
            self._probe = asyncio.ensure_future(self._probe_fn())
            down = await asyncio.shield(self._probe)
            self._failing_up = self._failing_up and not down
            if not down:
                self._allow_trial()
            delay = self.probe_min_s if self._failing_up else min(self.probe_max_s, delay * 2)

    async def _wait_change(self) -> None:
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._changed)

    def _stop(self, silent_s: float) -> None:
        self._abort = EndpointUnavailableError(
            f"no successful answer from {self.where} for {silent_s:.0f} s (last error: {self._last_error}); the "
            "endpoint is down (endpoint.outage_abort_s). Committed results are kept and nothing was marked failed "
            "for the outage; rerun to resume."
        )
        self._notify()

    async def close(self) -> None:
        for task in (self._prober, self._probe):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
