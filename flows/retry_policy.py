"""Which task failures Prefect retries: transport trouble yes, bad data or bad config never.

Retrying a task whose input is wrong only burns time and hides the error; per-sample failures already live in
Parquet (status="failed"), so a task-level failure is either transient infrastructure or a real defect.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx

from tasks.common.errors import DatagenError

TRANSIENT = (ConnectionError, TimeoutError, aiohttp.ClientError, httpx.TransportError)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, DatagenError):
        return False
    if isinstance(exc, TRANSIENT):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, BaseException) and is_transient(exc)
