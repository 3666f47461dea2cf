"""`flows.run_log`: the errors raised on purpose reach a flow run's log as one line; any other keeps its traceback."""

from __future__ import annotations

import logging
import sys

from flows.run_log import TypedErrorsInOneLine
from tasks.common.errors import ConfigError, EndpointUnavailableError


def record_of(exc: BaseException, message: str = "failed") -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, None, info)


def test_typed_errors_and_outage_aborts_lose_their_traceback_others_keep_it() -> None:
    """An outage outlasting outage_abort_s logged two full tracebacks (httpx's chained one too) under a state
    message that already said it in one line (an independent Prefect probe)."""
    keep = TypedErrorsInOneLine()
    for exc in (ConfigError("fix datasets[0].path"), EndpointUnavailableError("endpoint unreachable for 20 s")):
        record = record_of(exc)
        assert keep.filter(record) and record.exc_info is None
    record = record_of(KeyError("a bug"))
    assert keep.filter(record) and record.exc_info is not None


def test_the_engines_last_error_record_is_dropped_for_typed_errors_only() -> None:
    """A UI probe's gate and config-error runs ended with "Engine execution exited with unexpected exception" at
    ERROR, after the failure had been logged and the state said it."""
    keep = TypedErrorsInOneLine()
    engine = "Engine execution exited with unexpected exception"
    assert not keep.filter(record_of(ConfigError("endpoint_block 'nope': no such block"), engine))
    record = record_of(KeyError("a bug"), engine)
    assert keep.filter(record) and record.exc_info is not None
