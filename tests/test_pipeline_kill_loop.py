"""`kill -9` of a whole `eagle3-datagen run` in each of its stages, then a run to the end: the guarantees that
the generate-only kill tests (test_generate_crash.py, test_generate_money.py) hold for answers must hold for
every stage after it. Each kill waits for a point in the run directory (answers being bought; the first tokens
part; the first hidden-states part; the last one), so the four kills land in generate, in the CPU stages, in
extract and after it (scores, status) whatever the machine's speed; a point the run passed before it was seen is
reported, not failed.

After the final run: `status` says the stages agree (exit 0); every sample has exactly one row in responses,
tokens and validation, and the hidden states hold exactly the samples validation let through; an answer durable
at a kill is never bought again, and no part finished before the last kill (responses, tokens, validation,
hidden states) is built again; the spend ledger is the simulator's bill (check_ledger_against_provider)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.shards import done_parts, read_part
from tests.conftest import CLI_ENTRY, REPO
from tests.test_generate_money import billed, check_ledger_against_provider, durable_rows

RUN_TIMEOUT_S = 600.0
POLL_S = 0.01
EXTRACTED = ("pass", "warn")
"""The verdicts whose rows `extract` stores (`fail` and `drop` rows stay in validation, out of hidden states)."""
BUILT = ("responses", "tokens", "validation", "hidden_states")
"""Stages whose parts finished before the last kill must be left as they are by the final run."""
SIM = SimConfig(
    seed=11,
    noncanonical_rate=0.1,
    latency_lognormal=(math.log(0.15), 0.5),
    failures=(
        FailureRule(kind="http", status=500, rate=0.05, attempts=1),
        FailureRule(kind="midstream_error", rate=0.05, attempts=1),
        FailureRule(kind="finish_error", rate=0.05, attempts=1),
    ),
)


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(REPO), COLUMNS="200")
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", CLI_ENTRY, *argv], env=env, cwd=REPO, stdout=out, stderr=out, start_new_session=True
        )


def _prompt_parts(run_dir: Path) -> int:
    """The parts `prepare` wrote; -1 before it has, so that no stage's count can equal it."""
    return len(done_parts(run_dir, "prompts")) or -1


def _markers(run_dir: Path, stage: str) -> dict[int, int]:
    """Each finished part's marker and when it was written: a part built again writes its marker again."""
    return {ref.part: ref.marker.stat().st_mtime_ns for ref in done_parts(run_dir, stage)}


def _rows(run_dir: Path, stage: str, *columns: str) -> list[dict[str, object]]:
    """Every finished part's rows of a stage: its sample ids and `columns`, nothing else read."""
    return [row for ref in done_parts(run_dir, stage) for row in read_part(ref, ["sample_id", *columns]).to_pylist()]


@pytest.mark.slow  # four Prefect runs killed and one to the end: about 100 s on 2 cores
def test_a_run_killed_in_every_stage_finishes_with_each_sample_once_in_each_stage_and_the_bill_counted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    with SimulatorServer(tiny_model_dir, SIM) as sim:
        argv = ["run", str(REPO / "flows" / "configs" / "demo.yaml"), "--no-progress"]
        for key, value in {
            "run_dir": run_dir,
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": tiny_model_dir,
            "endpoint.kind": "openai_chat",
            "endpoint.stream": "true",
            "endpoint.max_in_flight": 8,
            "endpoint.account_settlement": "exclusive_key",
            "endpoint.account_settle_stable_s": 0.2,
            "endpoint.max_cost_usd": 1.0,
        }.items():
            argv += ["--set", f"{key}={value}"]
        points: list[tuple[str, Callable[[], bool]]] = [
            ("generate: answers being bought", lambda: len(billed(sim)) >= 12),
            ("cpu stages: the first tokens part", lambda: bool(done_parts(run_dir, "tokens"))),
            ("extract: the first hidden-states part", lambda: bool(done_parts(run_dir, "hidden_states"))),
            ("after extract", lambda: len(done_parts(run_dir, "hidden_states")) == _prompt_parts(run_dir)),
        ]
        durable_at_kills: list[tuple[dict[str, str], Counter[str]]] = []
        missed: list[str] = []
        for what, reached in points:
            proc = _start(argv, log)
            started = time.monotonic()
            deadline = started + RUN_TIMEOUT_S
            while proc.poll() is None and not reached() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                print(f"killed at {what}, {time.monotonic() - started:.1f} s after the start")
            else:
                missed.append(f"{what} (exit {proc.returncode})")
            proc.wait(timeout=60)
            time.sleep(0.3)  # the server bills what the dead client's sockets had already carried
            done = {sid: r["generation_id"] for sid, r in durable_rows(run_dir).items() if r["status"] == "done"}
            durable_at_kills.append((done, Counter(sim.stats()["by_key"])))
        finished = {stage: _markers(run_dir, stage) for stage in BUILT}
        print(f"kill points the run passed before they were seen: {missed or 'none'}")
        assert len(missed) < len(points), "no kill landed: the run ended before each point was seen"

        final = _start(argv, log)
        assert final.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
        status = subprocess.run(
            [sys.executable, "-c", CLI_ENTRY, "status", str(run_dir)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
        check_ledger_against_provider(run_dir, sim)
        requests_at_end = Counter(sim.stats()["by_key"])

    rows = {
        "prompts": _rows(run_dir, "prompts"),
        "responses": _rows(run_dir, "responses", "generation_id"),
        "tokens": _rows(run_dir, "tokens"),
        "validation": _rows(run_dir, "validation", "verdict"),
        "hidden_states": _rows(run_dir, "hidden_states"),
    }
    counts = {stage: Counter(row["sample_id"] for row in stage_rows) for stage, stage_rows in rows.items()}
    for stage in ("responses", "tokens", "validation"):
        assert set(counts[stage]) == set(counts["prompts"]), f"{stage} does not hold every prepared sample"
        twice = [s for s, n in counts[stage].items() if n > 1]
        assert twice == [], f"{stage} holds a sample twice: {twice}"
    verdicts = {row["sample_id"]: row["verdict"] for row in rows["validation"]}
    assert set(counts["hidden_states"].values()) == {1}
    assert set(counts["hidden_states"]) == {s for s, v in verdicts.items() if v in EXTRACTED}
    final_ids = {row["sample_id"]: row["generation_id"] for row in rows["responses"]}
    for stage, markers in finished.items():
        again = [part for part, stamp in _markers(run_dir, stage).items() if markers.get(part, stamp) != stamp]
        assert again == [], f"{stage} parts finished before the last kill were built again: {again}"
    for n, (durable, requests) in enumerate(durable_at_kills):
        for sid, generation_id in durable.items():
            key = generation_id.split("-", 2)[2]
            assert requests_at_end[key] == requests[key], f"kill {n + 1}: the durable answer of {sid} was bought again"
            assert final_ids[sid] == generation_id
