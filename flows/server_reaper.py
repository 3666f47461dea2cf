"""The temporary Prefect server of a CLI run ends with that run, even when the run is `kill -9`ed.

Prefect starts it as a child process (`SubprocessASGIServer`) and stops it at exit, which a SIGKILL skips: every
killed `eagle3-datagen run` left a uvicorn server behind, adopted by init, for good. A thread here waits for the
server to be started, then starts a watchdog process that outlives a SIGKILL of this one (its own session) and
stops the server once this process is gone. The watchdog checks the pid still belongs to that server before it
signals it, so a recycled pid is never hit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

SERVER_MARK = "prefect.server.api.server:create_app"
"""In the temporary server's command line (`SubprocessASGIServer._run_uvicorn_command`)."""

WATCHDOG = """
import os, signal, sys, time
parent, server, mark = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def alive(pid):  # a zombie (killed, not reaped yet by its parent) is gone
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False

def is_server(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return mark.encode() in fh.read()
    except OSError:
        return False

while alive(parent) and is_server(server):
    time.sleep(0.5)
if is_server(server):
    os.kill(server, signal.SIGTERM)
    for _ in range(50):
        time.sleep(0.1)
        if not is_server(server):
            break
    else:
        os.kill(server, signal.SIGKILL)
"""


_started = threading.Event()


def stop_temporary_server_with_this_process(poll_s: float = 0.2) -> None:
    """Start (once per process) the thread that hands Prefect's temporary server, once started, to a watchdog.
    Linux only (the watchdog reads /proc); elsewhere it does nothing."""
    if not sys.platform.startswith("linux") or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_hand_over, args=(os.getpid(), poll_s), name="server-reaper", daemon=True).start()


def _hand_over(parent: int, poll_s: float) -> None:
    from prefect.server.api.server import SubprocessASGIServer

    while True:
        servers = [s for s in list(SubprocessASGIServer._instances.values()) if s.server_process is not None]
        if servers:
            break
        time.sleep(poll_s)
    for server in servers:
        assert server.server_process is not None
        subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(parent), str(server.server_process.pid), SERVER_MARK],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
