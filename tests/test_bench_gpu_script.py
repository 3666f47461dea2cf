"""The prepared GPU run (`bench/gpu_extract.sh`) must work when a GPU is finally lent: device time is 15 minutes,
so a script broken by a schema change is a lost lease. Its `--tiny` path runs the same code on the CPU.

A `token_source` column added to the tokens schema once broke `bench/extract_throughput.py` unnoticed until the
next GPU lease; this runs it on every `make test`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_extraction_benchmark_runs_its_tiny_preset(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "extract_throughput.py"),
            "--tiny",
            "--workdir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert record["preset"] == "tiny" and record["tokens"] >= 4000 and record["samples"] > 0
    assert record["stage_tok_s"] > 0 and record["raw_forward_tok_s"] > 0 and record["limit"] in ("forward", "write")


def test_gpu_wheel_list_pins_what_constraints_pin() -> None:
    """The wheels carried to a GPU host are the versions this project resolves to, so the device runs the same
    transformers, speculators and pydantic as CI."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[norm(name)] = version.strip()
    carried = [line for line in (REPO / "bench" / "gpu_wheels.txt").read_text().splitlines() if "==" in line]
    assert carried
    for line in carried:
        name, version = line.split("==", 1)
        assert pins.get(norm(name)) == version, f"{line}: constraints.txt pins {pins.get(norm(name))}"
