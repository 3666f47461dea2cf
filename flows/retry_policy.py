"""Which task failures Prefect retries: transport trouble yes, bad data or bad config never.

Retrying a task whose input is wrong only burns time and hides the error; per-sample failures already live in
Parquet (status="failed"), so a task-level failure is either transient infrastructure or a real defect.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx

from tasks.common.errors import DatagenError, EndpointUnavailableError

TRANSIENT = (ConnectionError, TimeoutError, aiohttp.ClientError, httpx.TransportError)


def is_transient(exc: BaseException) -> bool:
    """An endpoint outage is retried by the task only while it is inside `outage_abort_s`: the generate stage
    and the probe already wait that long, so an outage error raised by them has used the window up."""
    if isinstance(exc, DatagenError | EndpointUnavailableError):
        return False
    if isinstance(exc, TRANSIENT):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, BaseException) and is_transient(exc)
