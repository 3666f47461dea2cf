"""CLI processes without the 3-4 s of imports each: a parent process imports the CLI's modules once, then forks
one child per command. Each child is a process of its own (own pid, session, file locks and sockets) that runs
`flows.cli.main(argv)`, the function the `eagle3-datagen` console script runs, with its stdout and stderr in a
log file; `kill -9` ends it exactly as it ends a process started from a shell: no cleanup, no flush, the
kernel drops its locks. The parent runs nothing else (no threads, no event loop, no tokenizer loaded), so the
fork copies modules only.

The ten-kill money test starts eleven generate processes; forked ones cost it ~1 s each instead of ~4.5 s. The
final run of that test, and every other CLI test, still starts `python -m flows.cli` from scratch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

PARENT = r"""
import json, os, signal, sys, traceback

import flows.cli
import tasks.generate.dataset_summary, tasks.generate.engine, tasks.generate.preflight
import tasks.generate.progress_display, tasks.prepare.datasets, tasks.reconstruct.tokenizer_loading
import tasks.status.report

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; the test watches their pids
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        code = 1
        try:
            code = flows.cli.main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
"""


class ForkedCli:
    """One forked CLI command: `poll()` is None while it runs (its exit status is not kept: the kernel reaps it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 0
        return None

    def kill_9(self) -> float:
        """SIGKILL, then wait until the process is gone; the time of the kill (time.monotonic)."""
        assert self.poll() is None, f"process {self.pid} ended by itself before it was killed"
        killed_at = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while self.poll() is None:
            assert time.monotonic() < deadline, f"process {self.pid} survived SIGKILL"
            time.sleep(0.01)
        return killed_at


class CliZygote:
    """`with CliZygote(repo) as z: z.start(["generate", config], log)`."""

    def __init__(self, repo: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PARENT],
            cwd=repo,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"the CLI parent process did not start: {ready!r}"

    def start(self, argv: list[str], log: Path) -> ForkedCli:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return ForkedCli(int(self.proc.stdout.readline()))

    def __enter__(self) -> CliZygote:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
