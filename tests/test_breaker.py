"""The circuit breaker alone, with a scripted liveness probe: when sends pause, how often it probes while the
endpoint is down, the one trial request, and the stop after outage_abort_s."""

from __future__ import annotations

import asyncio
import time

import pytest

from tasks.common.errors import EndpointUnavailableError
from tasks.generate.breaker import CircuitBreaker


class Endpoint:
    """A probe target that is down until `up()`; counts probes."""

    def __init__(self) -> None:
        self.down = True
        self.probes = 0
        self.last_success = time.monotonic()
        self.events: list[str] = []
        self.gate: asyncio.Event | None = None  # set: each probe answers only once the gate opens

    async def probe(self) -> bool:
        self.probes += 1
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        return self.down

    def breaker(self, abort_s: float = 60.0, probe_max_s: float = 0.08) -> CircuitBreaker:
        return CircuitBreaker(
            self.probe,
            lambda: self.last_success,
            lambda kind, message: self.events.append(kind),
            probe_min_s=0.01,
            probe_max_s=probe_max_s,
            abort_s=abort_s,
        )


def test_a_lone_failure_among_answers_pauses_nothing_and_uses_up_an_attempt() -> None:
    async def scenario() -> None:
        endpoint = Endpoint()
        endpoint.down = False
        breaker = endpoint.breaker()
        down = await breaker.judge(time.monotonic(), answered_since=True, trial=False, error="reset")
        assert down is False and breaker.state == "closed" and breaker.sendable()
        assert endpoint.events == [] and endpoint.probes == 1

    asyncio.run(scenario())


def test_an_outage_holds_every_sender_probes_with_backoff_and_resumes_through_one_trial() -> None:
    async def scenario() -> None:
        endpoint = Endpoint()
        breaker = endpoint.breaker()
        sent_at = time.monotonic()
        # Three senders fail at once with nothing answered since they were sent: one probe decides for all.
        verdicts = await asyncio.gather(
            *(breaker.judge(sent_at, answered_since=False, trial=False, error="refused") for _ in range(3))
        )
        assert verdicts == [True, True, True] and breaker.state == "open" and not breaker.sendable()
        assert endpoint.events == ["outage_start"]
        assert breaker.take() is None, "no request leaves while the endpoint is down"
        waiters = [asyncio.ensure_future(breaker.wait()) for _ in range(5)]
        began = time.monotonic()
        await asyncio.sleep(0.4)
        down_s = time.monotonic() - began
        assert not any(w.done() for w in waiters)
        # Probes back off 0.01, 0.02, 0.04, then one every 0.08 s at most, one at a time, whoever waits.
        assert 2 <= endpoint.probes <= 4 + down_s / 0.08, (endpoint.probes, down_s)
        endpoint.down = False
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=5)
        assert breaker.state == "trial"
        takes = [breaker.take() for _ in range(5)]
        assert takes.count(True) == 1 and takes.count(None) == 4, "exactly one trial request"
        # The trial fails as the endpoint goes down again: open, and still no other request.
        assert await breaker.judge(time.monotonic(), answered_since=False, trial=True, error="503") is True
        assert breaker.state == "open" and breaker.take() is None
        await asyncio.wait_for(breaker.wait(), timeout=5)
        assert breaker.take() is True
        breaker.alive(time.monotonic())  # the trial's answer
        assert breaker.state == "closed" and breaker.take() is False
        assert endpoint.events == ["outage_start", "outage_end"]
        assert breaker.outages == 1
        await breaker.close()

    asyncio.run(scenario())


def test_a_trial_that_is_never_sent_lets_another_sender_take_it() -> None:
    async def scenario() -> None:
        endpoint = Endpoint()
        breaker = endpoint.breaker()
        await breaker.judge(time.monotonic(), answered_since=False, trial=False, error="refused")
        endpoint.down = False
        await asyncio.wait_for(breaker.wait(), timeout=5)
        assert breaker.take() is True and breaker.take() is None
        breaker.release_trial()
        assert breaker.take() is True
        await breaker.close()

    asyncio.run(scenario())


def test_after_outage_abort_s_without_an_answer_every_waiting_sender_stops() -> None:
    async def scenario() -> None:
        endpoint = Endpoint()
        breaker = endpoint.breaker(abort_s=0.2)
        await breaker.judge(time.monotonic(), answered_since=False, trial=False, error="refused")
        waiters = [asyncio.ensure_future(breaker.wait()) for _ in range(3)]
        done, _ = await asyncio.wait(waiters, timeout=5)
        assert len(done) == 3
        for waiter in waiters:
            with pytest.raises(EndpointUnavailableError, match="rerun to resume"):
                waiter.result()
        with pytest.raises(EndpointUnavailableError):
            breaker.take()
        await breaker.close()

    asyncio.run(scenario())


def test_answers_to_requests_sent_before_the_outage_do_not_end_it() -> None:
    """A draining server answers what it holds while it refuses new connections (CI caught the simulator doing
    so as it shut down: the breaker closed on those answers, all 64 senders hit the dead port, and a second
    outage opened). An old answer earns one trial request in an outage, and nothing while suspect; an answer to
    a request sent after the endpoint was suspected ends the outage."""

    async def scenario() -> None:
        endpoint = Endpoint()
        breaker = endpoint.breaker(probe_max_s=10.0)
        before = time.monotonic()
        await asyncio.sleep(0.001)
        assert await breaker.judge(time.monotonic(), answered_since=False, trial=False, error="refused") is True
        assert breaker.state == "open"
        breaker.alive(before)
        assert breaker.state == "trial" and endpoint.events == ["outage_start"], "an old answer ended the outage"
        breaker.alive(before)
        assert breaker.state == "trial"
        assert breaker.take() is True and breaker.take() is None, "exactly one trial request"
        assert await breaker.judge(time.monotonic(), answered_since=True, trial=True, error="refused") is True
        assert breaker.state == "open" and breaker.outages == 1, "a refused trial is the same outage"
        breaker.alive(time.monotonic())
        assert breaker.state == "closed" and endpoint.events == ["outage_start", "outage_end"]
        await breaker.close()

    asyncio.run(scenario())


def test_a_suspect_breaker_is_left_to_its_probe_by_an_old_answer() -> None:
    async def scenario() -> None:
        endpoint = Endpoint()
        endpoint.gate = asyncio.Event()
        breaker = endpoint.breaker(probe_max_s=10.0)
        before = time.monotonic()
        await asyncio.sleep(0.001)
        verdict = asyncio.ensure_future(
            breaker.judge(time.monotonic(), answered_since=False, trial=False, error="reset")
        )
        await asyncio.sleep(0.01)
        assert breaker.state == "suspect"
        breaker.alive(before)
        assert breaker.state == "suspect" and not breaker.sendable(), "an old answer let every sender fire"
        endpoint.gate.set()
        assert await verdict is True and breaker.state == "open" and endpoint.events == ["outage_start"]
        await breaker.close()

    asyncio.run(scenario())


def test_failures_in_a_row_while_the_probe_answers_open_the_breaker_for_one_trial_request() -> None:
    """A 60 s burst of 503s on completions while GET /v1/models answered 200 (how a provider-side burst looks on
    OpenRouter) used up every attempt of 858 of 2,000 samples: each probe said up, so each 503 counted. Now
    `trip_after` failures in a row with no answer in between open the breaker on the probe's word "up" too, and
    one trial request per probe step decides; the failures while it is open are free, a failed trial uses up its
    own sample's attempt (so samples the endpoint fails every time still fail instead of holding the run until
    outage_abort_s), and while the probe says up the trials do not back off."""

    async def scenario() -> None:
        endpoint = Endpoint()
        endpoint.down = False
        breaker = endpoint.breaker()
        verdicts = [
            await breaker.judge(
                time.monotonic(), answered_since=True, trial=False, error="HTTP 503", status_answer=True
            )
            for _ in range(breaker.trip_after)
        ]
        assert verdicts == [False] * (breaker.trip_after - 1) + [True], "the burst's failures were not free"
        assert breaker.state == "trial" and endpoint.events == ["outage_start"]
        assert breaker.take() is True and breaker.take() is None, "more than one trial request went out"
        for _ in range(4):  # each probe step lets one more trial through, every probe_min_s
            assert (
                await breaker.judge(
                    time.monotonic(), answered_since=False, trial=True, error="HTTP 503", status_answer=True
                )
                is False
            )
            assert breaker.state == "open" and not breaker.sendable()
            for _ in range(100):
                await asyncio.sleep(0.005)
                if breaker.state == "trial":
                    break
            assert breaker.state == "trial" and breaker.take() is True
        assert endpoint.probes <= 2 + 4 + 1
        started = time.monotonic()
        await breaker.judge(time.monotonic(), answered_since=False, trial=True, error="HTTP 503", status_answer=True)
        while breaker.state != "trial":
            await asyncio.sleep(0.001)
        assert time.monotonic() - started < 0.05, "trials backed off while the probe says up"
        assert breaker.take() is True
        breaker.alive(time.monotonic())
        assert breaker.state == "closed" and endpoint.events == ["outage_start", "outage_end"]
        await breaker.close()

    asyncio.run(scenario())


def test_answers_to_streams_sent_before_a_burst_do_not_reset_its_count() -> None:
    """Streams sent before a provider's burst of 503s kept finishing through it; each answer reset the count of
    failures in a row, so the breaker opened only once they had drained: about 1,000 requests (one per stream in
    flight) went out into the burst, each using up its sample's attempt. An answer ends the run of failures only
    when it was sent no earlier than the first of them."""

    async def scenario() -> None:
        endpoint = Endpoint()
        endpoint.down = False
        breaker = endpoint.breaker()
        before_burst = time.monotonic()
        await asyncio.sleep(0.001)
        verdicts = []
        for _ in range(breaker.trip_after):
            verdicts.append(
                await breaker.judge(
                    time.monotonic(), answered_since=True, trial=False, error="HTTP 503", status_answer=True
                )
            )
            breaker.alive(before_burst)  # an old stream finishes between two failures
        assert verdicts[-1] is True and breaker.state == "trial", verdicts
        await breaker.close()

        fresh = endpoint.breaker()
        first = time.monotonic()
        assert await fresh.judge(first, answered_since=True, trial=False, error="HTTP 503", status_answer=True) is False
        fresh.alive(time.monotonic())  # sent after the failure and answered: the endpoint serves new requests
        assert fresh.failures_in_a_row == 0
        await fresh.close()

    asyncio.run(scenario())


def test_timeouts_in_a_row_while_the_probe_answers_stay_each_samples_own() -> None:
    """An endpoint too slow for request_timeout_s answers its liveness probe and times every request out: that
    is not a refusal, and one trial at a time, each a whole timeout long, would crawl through the samples. Only
    502-504 answers in a row open the breaker on the probe's word "up"."""

    async def scenario() -> None:
        endpoint = Endpoint()
        endpoint.down = False
        breaker = endpoint.breaker()
        verdicts = [
            await breaker.judge(time.monotonic(), answered_since=True, trial=False, error="request timed out")
            for _ in range(breaker.trip_after + 2)
        ]
        assert verdicts == [False] * (breaker.trip_after + 2) and breaker.state == "closed"
        await breaker.close()

    asyncio.run(scenario())
