"""A flow run's output pipe closing (its worker died or restarted) no longer ends the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

WRITER = """
import pathlib, sys, time
import flows  # what every flow run's process imports first
from rich.console import Console
console = Console(file=sys.stdout)
time.sleep(1.0)  # the reader is gone by now
for i in range(200):
    console.print("progress line", i)
pathlib.Path(sys.argv[1]).write_text("still running")
"""


def test_a_closed_output_pipe_leaves_the_process_running(tmp_path: Path) -> None:
    """rich raised SystemExit(1) on a broken pipe: an independent probe's flow run ended "aborted by Python system
    exit call" seconds after only its worker was killed."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(marker)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0
    assert marker.read_text() == "still running"
