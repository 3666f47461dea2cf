"""Money is data: every paid answer is kept, every cent is counted, and the cost cap holds over the run directory's
life. The simulator keeps its own billing ledger (what it billed, per request, and when), and the run directory's
spend ledger is compared with it after `kill -9`s, capped reruns and concurrent triggers."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.shards import done_parts, read_part
from tasks.generate.chunks import CHUNKS_DIR, journal_rows, read_chunk
from tasks.generate.ledger import SpendLedger
from tests.conftest import REPO

PROMPTS = 800
PER_PART = 100
KILLS = 10
IN_FLIGHT = 16
SEED = 20261201
STARTUP_TIMEOUT_S = 180.0
GROUP_COMMIT_S = 0.2
# An answer billed this long before a kill must have been durable: 5x the group-commit window, room for a busy
# machine; the journal itself is written within GROUP_COMMIT_S.
DURABLE_AFTER_S = 1.0
CAP_USD = 1.0
SIM = SimConfig(
    seed=11,
    latency_lognormal=(math.log(0.25), 0.3),
    reasoning_words=(5, 30),
    content_words=(5, 30),
    failures=(FailureRule(kind="http", status=500, rate=0.10, attempts=1),),
)


def write_dataset(path: Path, n: int = PROMPTS, tag: str = "money") -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"[{tag}] question {i}: why?"}]}) + "\n")


def write_config(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, data: Path, **endpoint: Any) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "samples_per_shard": PER_PART,
        "datasets": [{"name": "money", "path": str(data)}],
        "endpoint": {
            "base_url": sim.base_url,
            "model": "sim/deepseek-v4-sim",
            "max_in_flight": IN_FLIGHT,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "commit_every_samples": 1000,  # chunks rarely: the journal is what keeps answers across kills
            "commit_every_s": 30.0,
            "request_timeout_s": 60.0,
            "progress_every_s": 0.5,
            "journal_group_commit_s": GROUP_COMMIT_S,
            "price_prompt_usd_per_mtok": SIM.price_prompt_usd_per_mtok,
            "price_completion_usd_per_mtok": SIM.price_completion_usd_per_mtok,
            "max_cost_usd": CAP_USD,
            **endpoint,
        },
        "sampling": {"max_tokens": 512},
        "tokenizer": {"path": str(tokenizer_dir)},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(config: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress", *extra],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def billed(sim: SimulatorServer) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = sim.billing()["records"]
    return records


def durable_rows(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What a rerun resumes from: finished parts, chunks and journals (done rows win, as the engine merges)."""
    rows: dict[str, dict[str, Any]] = {}

    def merge(row: dict[str, Any]) -> None:
        if rows.get(row["sample_id"], {}).get("status") != "done":
            rows[row["sample_id"]] = row

    for ref in done_parts(run_dir, "responses"):
        for row in read_part(ref).to_pylist():
            merge(row)
    for path in sorted((run_dir / "responses" / CHUNKS_DIR).glob("part-*/chunk-*.parquet")):
        for row in read_chunk(path):
            merge(row)
    for part_rows in journal_rows(run_dir).values():
        for row in part_rows:
            merge(row)
    return rows


def wait_for_billed(sim: SimulatorServer, proc: subprocess.Popen[bytes], target: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(billed(sim)) < target:
        assert proc.poll() is None, f"generate exited ({proc.returncode}) before it was killed:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {target} answers after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.01)


def kill_9(proc: subprocess.Popen[bytes], log: Path) -> float:
    killed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, f"generate ended by itself:\n{log.read_text()}"
    return killed_at


def check_ledger_against_provider(run_dir: Path, sim: SimulatorServer) -> SpendLedger:
    """(c): the spend the run directory counts is the provider's bill, to the cent, except for attempts the
    process never saw settle, which count at their worst case (never less than what they were billed)."""
    ledger = SpendLedger.load(run_dir)
    records = billed(sim)
    by_id = {r["id"]: r["cost_usd"] for r in records}
    assert len(by_id) == len(records), "the simulator billed one generation id twice"
    settled = {a.generation_id: a.cost_usd for a in ledger.attempts.values() if a.known and a.generation_id}
    assert set(settled) <= set(by_id), "the ledger settled a generation the provider never billed"
    assert sum(settled.values()) == pytest.approx(sum(by_id[g] for g in settled), abs=0.005)
    for gen_id, cost in settled.items():
        assert cost == pytest.approx(by_id[gen_id], abs=1e-12), gen_id
    unseen = [cost for gen_id, cost in by_id.items() if gen_id not in settled]
    totals = ledger.totals()
    assert totals.unknown_attempts >= len(unseen)
    assert sum(unseen) <= totals.unknown_usd + 1e-12
    assert sum(by_id.values()) <= totals.total_usd + 1e-12
    return ledger


def test_ten_kill_9s_keep_every_paid_answer_and_count_every_cent(tmp_path: Path, tokenizer_dir: Path) -> None:
    rng = random.Random(SEED)
    data = tmp_path / "prompts.jsonl"
    write_dataset(data)
    log = tmp_path / "generate.log"
    run_dir = tmp_path / "run"
    lost_per_kill: list[int] = []
    with SimulatorServer(tokenizer_dir, SIM) as sim:
        config = write_config(tmp_path, sim, tokenizer_dir, data)
        kills: list[tuple[int, float, dict[str, dict[str, Any]], Counter[str]]] = []
        for _ in range(KILLS):
            before = len(billed(sim))
            remaining = PROMPTS - len([r for r in durable_rows(run_dir).values() if r["status"] == "done"])
            assert remaining > 4 * IN_FLIGHT, "the kills used up the work: raise PROMPTS"
            proc = cli(config, log)
            try:
                wait_for_billed(sim, proc, before + rng.randint(20, 90), log)
                time.sleep(rng.uniform(0.0, 0.2))
            finally:
                killed_at = kill_9(proc, log)
            time.sleep(0.3)  # let the server bill whatever the dead client's sockets had already carried
            durable = durable_rows(run_dir)
            kills.append((before, killed_at, durable, Counter(sim.stats()["by_key"])))
            keys_done = {r["generation_id"] for r in durable.values() if r["status"] == "done"}
            lost_per_kill.append(
                sum(1 for r in billed(sim)[before:] if r["id"] not in keys_done and r["billed_at"] < killed_at)
            )
            ledger = SpendLedger.load(run_dir)
            assert ledger.totals().total_usd <= CAP_USD, "(d) the ledger crossed the cap"
            assert sum(r["cost_usd"] for r in billed(sim)) <= CAP_USD, "(d) the provider billed past the cap"
        final = subprocess.run(
            [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert final.returncode == 0, final.stdout + final.stderr
        end = Counter(sim.stats()["by_key"])
        records = billed(sim)
        ledger = check_ledger_against_provider(run_dir, sim)

    print(f"paid answers lost per kill (billed before the kill, not durable): {lost_per_kill}")
    # (a) every sample exactly once, all done (the only fault is a retried 500)
    finished = done_parts(run_dir, "responses")
    rows = [row for ref in finished for row in read_part(ref).to_pylist()]
    counts = Counter(row["sample_id"] for row in rows)
    assert len(counts) == PROMPTS and set(counts.values()) == {1}
    assert {row["status"] for row in rows} == {"done"}
    assert not (run_dir / "responses" / CHUNKS_DIR).exists()
    assert journal_rows(run_dir) == {}, "a finished run leaves no journal"
    # (b) an answer durable at a kill is never requested again, and one billed well before a kill was durable
    final_by_id = {row["sample_id"]: row for row in rows}
    for n, (run_from, killed_at, durable, by_key) in enumerate(kills):
        durable_ids = {r["generation_id"] for r in durable.values() if r["status"] == "done"}
        for sid, row in durable.items():
            if row["status"] == "done":
                key = row["generation_id"].split("-", 2)[2]
                assert end[key] == by_key[key], f"kill {n + 1}: durable answer of {sid} was requested again"
                assert final_by_id[sid]["generation_id"] == row["generation_id"]
        early = [r["id"] for r in records[run_from:] if r["billed_at"] < killed_at - DURABLE_AFTER_S]
        lost = [g for g in early if g not in durable_ids]
        assert lost == [], f"kill {n + 1}: answers billed {DURABLE_AFTER_S} s before it were lost: {lost[:3]}"
    # (c) ledger == provider, (d) the cap
    assert ledger.totals().total_usd <= CAP_USD
    assert sum(r["cost_usd"] for r in records) <= CAP_USD
    total = json.loads(final.stdout.strip().splitlines()[-1])
    assert total["run_dir_spent_usd"] == pytest.approx(ledger.totals().total_usd)
