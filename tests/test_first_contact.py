"""First contact with `run` and `generate` against an endpoint that does not answer: the inputs are checked before
any endpoint wait (an empty or all-quarantined dataset is one line and exit 2 at once), a wait says right away
what it waits for and until when, and there is no wait at all when nothing is left to send.

`run` runs as a real process, as a user starts it, with the default `endpoint.outage_abort_s` (600 s): a run
that waited would outlast the test's deadline instead of answering. The measured times are printed, not asserted.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimulatorServer
from tasks.common.config import load_config
from tasks.common.shards import PartRef, done_parts, read_marker
from tests.conftest import CLI_ENTRY, DEMO_DATA, REPO, run_main

DEADLINE_S = 120.0
"""Far below the default outage_abort_s (600 s), far above what the answer takes on a loaded machine."""


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _config(root: Path, base_url: str, tokenizer_dir: Path, data: Path, **extra: Any) -> Path:
    config: dict[str, Any] = {
        "run_dir": str(root / "run"),
        "samples_per_shard": 3,
        "datasets": [{"name": "B1", "path": str(data), "max_samples": 6}],
        "endpoint": {
            "kind": "sglang_generate",
            "base_url": base_url,
            "model": "sim/tiny",
            "max_in_flight": 4,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
        },
        "sampling": {"max_tokens": 256},
        "tokenizer": {"path": str(tokenizer_dir)},
        "extract": {"enabled": False},
        **extra,
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-c", CLI_ENTRY, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize("content", ["", '{"nope": 1}\nnot json\n{"messages": []}\n'], ids=["empty", "quarantined"])
def test_run_on_an_unusable_dataset_with_a_dead_endpoint_is_one_line_and_exit_2_without_waiting(
    tmp_path: Path, tokenizer_dir: Path, content: str
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    config = _config(tmp_path, _dead_url(), tokenizer_dir, data)
    started = time.monotonic()
    proc = _start("run", str(config), "--no-progress")
    out, err = proc.communicate(timeout=DEADLINE_S)
    elapsed = time.monotonic() - started
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, err, out)
    assert lines[0].startswith("error: dataset B1") and ("no rows" in lines[0] or "quarantined" in lines[0])
    assert "waiting" not in out + err and "Traceback" not in out + err
    print(f"\n{(content and 'all-quarantined') or 'empty'} dataset, dead endpoint: exit 2 after {elapsed:.2f} s")


def test_run_with_valid_data_and_a_dead_endpoint_says_at_once_what_it_waits_for_and_until_when(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    url = _dead_url()
    config = _config(tmp_path, url, tokenizer_dir, DEMO_DATA / "demo_b1.jsonl")
    started = time.monotonic()
    proc = _start("run", str(config), "--no-progress")
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True)
    reader.start()
    line = ""
    try:
        while "waiting for the endpoint" not in line:
            line = lines.get(timeout=max(0.1, DEADLINE_S - (time.monotonic() - started)))
        elapsed = time.monotonic() - started
        assert proc.poll() is None, "it waits: still running after saying so"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert f"{url}/health" in line and "up to 600 s (endpoint.outage_abort_s), until " in line, line
    assert "nothing is sent meanwhile" in line
    print(f"\nvalid data, dead endpoint: the waiting line after {elapsed:.2f} s: {line.strip()}")


def test_no_endpoint_wait_when_nothing_is_left_to_send(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every sample done or failed deterministically (kept by the rerun policy): `generate` and `run`'s pre-flight
    do not wait for a dead endpoint; a transient failure, or `retry_failed: all`, does make a part to send."""
    from flows.cli import _prepare_then_wait
    from tasks.status.sending import parts_to_send

    sim.update_config(failures=(FailureRule(kind="context_length", status=400, rate=0.3, attempts=None),))
    lenient = {"validation": {"max_deterministic_failed_rate": 1.0}}
    data = DEMO_DATA / "demo_b1.jsonl"
    live = _config(tmp_path, sim.base_url, tokenizer_dir, data, **lenient)
    assert run_main(capsys, "generate", str(live), "--no-progress").returncode == 0
    cfg = load_config(live)
    failed_parts = {
        ref.part for ref in done_parts(cfg.run_dir, "responses") if "failed" in read_marker(ref)["status_counts"]
    }
    assert failed_parts, "the context_length rule must fail some sample"
    assert parts_to_send(cfg, [0, 1]) == []
    assert set(parts_to_send(load_config(live, {"endpoint.retry_failed": "all"}), [0, 1])) == failed_parts

    dead = _config(tmp_path, _dead_url(), tokenizer_dir, data, **lenient)
    sent = sim.stats(with_keys=False)["total_requests"]
    result = run_main(capsys, "generate", str(dead), "--no-progress")
    assert result.returncode == 0 and "waiting" not in result.stdout + result.stderr, result.stdout + result.stderr
    _prepare_then_wait(load_config(dead), probe=True)
    assert "waiting" not in capsys.readouterr().out
    assert sim.stats(with_keys=False)["total_requests"] == sent

    PartRef(cfg.run_dir, "responses", min(failed_parts)).marker.unlink()  # an unfinished part is always sent
    assert parts_to_send(cfg, [0, 1]) == [min(failed_parts)]


def test_the_wait_says_when_the_endpoint_answers(sim: SimulatorServer) -> None:
    from tasks.common.config import EndpointConfig
    from tasks.generate.endpoint_wait import wait_for_endpoint

    sim.update_config(unavailable_probes=2)  # its /health answers 503 twice, then 200
    said: list[str] = []
    cfg = EndpointConfig(kind="sglang_generate", base_url=sim.base_url, model="sim/tiny", outage_abort_s=60)
    assert wait_for_endpoint(cfg, announce=said.append) == 200
    assert len(said) == 2, said
    assert said[0].startswith(f"waiting for the endpoint {sim.base_url}/health to answer (answered 503")
    assert said[1].startswith(f"the endpoint {sim.base_url}/health answers (HTTP 200) after ")
