"""One line, not a traceback, in a flow run's log for the errors this package raises on purpose.

Prefect's engines log every failure with its traceback ("Encountered exception during execution", once for the
task and once for the flow): an independent probe counted about 75 lines in the UI's log for a crossed validation
gate, whose state message already says it in one line. A `DatagenError` (a gate, a refusal, a config error, a
sample that does not check out) names what to change; its traceback tells the user nothing the CLI would not hide
too (`--debug` shows it there). So does an `EndpointUnavailableError` (an outage outlasting `outage_abort_s`:
not a DatagenError, so that no sample is failed for it, but its message says all there is). Any other exception
keeps its traceback: that one is a bug to report. A worker's run also ended with Prefect's "Engine execution exited
with unexpected exception" at ERROR, after the failure was already logged and the final state said it: for these
errors that record is dropped.
"""

from __future__ import annotations

import logging

from tasks.common.errors import DatagenError, EndpointUnavailableError

ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


ENGINE_EXIT = "Engine execution exited with unexpected exception"
"""The last record of a deployment run's process that raised (prefect.flow_engine.run_flow's error_logger)."""


class TypedErrorsInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, DatagenError | EndpointUnavailableError):
            if record.msg == ENGINE_EXIT:
                return False
            record.exc_info = None
            record.exc_text = None
        return True


def install() -> None:
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TypedErrorsInOneLine) for f in logger.filters):
            logger.addFilter(TypedErrorsInOneLine())
