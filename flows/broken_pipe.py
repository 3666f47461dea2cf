"""A flow run outlives the worker that started it.

A process worker starts each flow run as a child whose stdout and stderr are pipes to the worker. When the worker
dies or is restarted, the next line the run logs hits a closed pipe, and rich (Prefect's console log handler)
answers a `BrokenPipeError` with `SystemExit(1)`: an independent probe's run, answers journaled and its host
alive, ended "Execution was aborted by Python system exit call" seconds after `kill -9` of its worker alone. Here
the run's output goes to /dev/null instead and the run goes on; its log lines still reach the Prefect server
through Prefect's API log handler, and its heartbeats keep it alive there.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console


def _quiet_on_broken_pipe(self: Console) -> None:
    self.quiet = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (captured in tests)
            continue


def install() -> None:
    Console.on_broken_pipe = _quiet_on_broken_pipe  # type: ignore[method-assign]
