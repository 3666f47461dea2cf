"""Waiting for an endpoint that does not answer, the same way before `run`, in `generate` and in the Prefect
generate task: probe until it answers or `endpoint.outage_abort_s` has passed, and say so at once.

Invariant: the first line about a wait comes right after the first failed probe (the first probe gives up after
`FIRST_PROBE_TIMEOUT_S`, so an endpoint that swallows connections is announced as fast as one that refuses them),
and it names what is waited for, why, and until when; a line follows every `NOTE_EVERY_S` while the wait lasts,
and one when the endpoint answers. Light on purpose (httpx only): `run` reaches it before any heavy import.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tasks.common.config import EndpointConfig
from tasks.common.errors import EndpointUnavailableError
from tasks.generate.health import probe_endpoint, probe_url

PROBE_EVERY_S = (0.5, 1.0, 2.0, 5.0, 10.0)
FIRST_PROBE_TIMEOUT_S = 1.0
PROBE_TIMEOUT_S = 10.0
NOTE_EVERY_S = 60.0

Announce = Callable[[str], None]


class OutageAbortError(EndpointUnavailableError):
    """The endpoint answered nothing for `outage_abort_s`: the outage window is used up, so retrying the task
    would only wait it out again. Resumable: nothing was marked failed."""


def _until(seconds_from_now: float) -> str:
    return time.strftime("%H:%M:%S %Z", time.localtime(time.time() + seconds_from_now))


def wait_for_endpoint(
    cfg: EndpointConfig, announce: Announce | None = None, clock: Callable[[], float] = time.monotonic
) -> int:
    """Probe until the endpoint answers (returns the status) or `outage_abort_s` passes (OutageAbortError).
    `announce` receives the waiting lines (a logger's method, or a print to stderr)."""
    say = announce or (lambda _line: None)
    url = probe_url(cfg)
    limit = cfg.outage_abort_s
    started = clock()
    tries = 0
    noted: float | None = None
    while True:
        timeout = min(FIRST_PROBE_TIMEOUT_S if tries == 0 else PROBE_TIMEOUT_S, limit)
        try:
            status = probe_endpoint(cfg, timeout_s=timeout)
        except EndpointUnavailableError as exc:
            waited = clock() - started
            if waited >= limit:
                raise OutageAbortError(
                    f"{exc}; no answer for {waited:.0f} s (endpoint.outage_abort_s={limit:g}). "
                    "Nothing was sent or marked failed; rerun when the endpoint is up."
                ) from exc
            why = str(exc).removeprefix(f"endpoint {url} ")
            if noted is None:
                say(
                    f"waiting for the endpoint {url} to answer ({why}): up to {limit:g} s "
                    f"(endpoint.outage_abort_s), until {_until(limit - waited)}; nothing is sent meanwhile"
                )
                noted = clock()
            elif clock() - noted >= NOTE_EVERY_S:
                say(f"still waiting for the endpoint {url} ({why}): {limit - waited:.0f} s left")
                noted = clock()
            delay = PROBE_EVERY_S[min(tries, len(PROBE_EVERY_S) - 1)]
            tries += 1
            time.sleep(max(0.0, min(delay, limit - waited)))
            continue
        if noted is not None:
            say(f"the endpoint {url} answers (HTTP {status}) after {clock() - started:.0f} s; going on")
        return status
