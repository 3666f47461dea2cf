"""A `kill -9` of a CLI run no longer leaves its temporary Prefect server running (flows/server_reaper.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

RUN = """
import subprocess, sys, time
from prefect.server.api.server import SubprocessASGIServer
from flows.server_reaper import SERVER_MARK, stop_temporary_server_with_this_process

server = SubprocessASGIServer(port=1)  # stands for the temporary server Prefect starts: its process only
server.server_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", SERVER_MARK])
stop_temporary_server_with_this_process(poll_s=0.05)
print(server.server_process.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")
def test_a_killed_run_takes_its_temporary_server_with_it() -> None:
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    server = int(run.stdout.readline())
    time.sleep(1.0)  # the watchdog has been handed the server
    assert _running(server)
    os.kill(run.pid, signal.SIGKILL)  # not reaped until the end: a killed run that is still a zombie is gone too
    deadline = time.monotonic() + 10
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    run.wait()
    assert not _running(server), "the temporary server outlived its killed run"
