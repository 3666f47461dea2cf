"""Exactly-once under `kill -9`: `eagle3-datagen generate` is killed at random points of a busy run (requests in
flight, chunks being committed, parts being finalized), then finishes; every sample ends with exactly one row,
and a sample once committed "done" is never sent to the endpoint again."""

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
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from endpoint_sim.responder import FailureRule, Responder, SimConfig, scheduled_failure
from endpoint_sim.server import SimulatorServer
from tasks.common.messages import prompt_messages
from tasks.common.shards import done_parts, read_part
from tasks.generate.chunks import CHUNKS_DIR, journal_rows, read_chunk
from tests.conftest import REPO
from tests.test_generate_money import generate_to_the_end

PROMPTS = 480
PER_PART = 50
KILLS = 5
IN_FLIGHT = 64
SEED = 20250917
STARTUP_TIMEOUT_S = 180.0
QUIET_S = 0.3
SIM = SimConfig(
    seed=7,
    latency_lognormal=(math.log(0.08), 0.6),
    reasoning_words=(5, 30),
    content_words=(5, 30),
    failures=(
        FailureRule(kind="http", status=500, rate=0.10, attempts=1),
        FailureRule(kind="context_length", rate=0.05, attempts=None),
    ),
)


@dataclass
class Snapshot:
    """What was committed on disk, and what the endpoint had received, right after one kill."""

    done: dict[str, str] = field(default_factory=dict)  # sample_id -> generation_id of its committed "done" row
    failed: set[str] = field(default_factory=set)
    by_key: dict[str, int] = field(default_factory=dict)
    chunk_files: int = 0
    finished_parts: int = 0


def write_dataset(path: Path) -> None:
    topics = ("binary search", "TCP congestion", "NORTH star", "Rust lifetimes", "café résumé", "B-trees")
    with path.open("w") as fh:
        for i in range(PROMPTS):
            messages = [{"role": "user", "content": f"Question {i}: explain {topics[i % len(topics)]} (variant {i})."}]
            if i % 4 == 0:
                messages.insert(0, {"role": "system", "content": "Answer briefly."})
            fh.write(json.dumps({"messages": messages}) + "\n")


def write_config(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, data: Path) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "samples_per_shard": PER_PART,
        "datasets": [{"name": "crash", "path": str(data)}],
        "endpoint": {
            "base_url": sim.base_url,
            "model": "sim/deepseek-v4-sim",
            "max_in_flight": IN_FLIGHT,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "commit_every_samples": 7,
            "commit_every_s": 0.1,
            "request_timeout_s": 60.0,
            "progress_every_s": 0.5,
        },
        "sampling": {"max_tokens": 1024},
        "tokenizer": {"path": str(tokenizer_dir)},
        # 5% of prompts fail for good (context length), by design of the crash mix
        "validation": {"max_failed_rate": 1.0, "max_deterministic_failed_rate": 1.0},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def total_requests(sim: SimulatorServer) -> int:
    return int(sim.stats(with_keys=False)["total_requests"])


def wait_for_requests(sim: SimulatorServer, proc: subprocess.Popen[bytes], target: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while total_requests(sim) < target:
        assert proc.poll() is None, f"generate exited ({proc.returncode}) before it was killed:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {target} requests after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.01)


def wait_quiet(sim: SimulatorServer) -> None:
    """Let the server count whatever the dead client had already written to its sockets."""
    last, since = total_requests(sim), time.monotonic()
    while time.monotonic() - since < QUIET_S:
        time.sleep(0.05)
        now = total_requests(sim)
        if now != last:
            last, since = now, time.monotonic()


def committed(run_dir: Path) -> Snapshot:
    """Done rows the engine would resume from: finished parts (marker present), chunk files and journals. Every Parquet
    file under the run directory must read: a torn file under a final name is corruption."""
    snap = Snapshot()
    for path in sorted(run_dir.rglob("*.parquet")):
        pq.read_table(path)
    finished = done_parts(run_dir, "responses")
    snap.finished_parts = len(finished)
    rows = [row for ref in finished for row in read_part(ref).to_pylist()]
    chunks = sorted((run_dir / "responses" / CHUNKS_DIR).glob("part-*/chunk-*.parquet"))
    snap.chunk_files = len(chunks)
    for path in chunks:
        rows += read_chunk(path)
    for part_rows in journal_rows(run_dir).values():  # answers journaled within the group-commit window
        rows += part_rows
    for row in rows:
        if row["status"] != "done":
            snap.failed.add(row["sample_id"])
            continue
        seen = snap.done.setdefault(row["sample_id"], row["generation_id"])
        assert seen == row["generation_id"], f"{row['sample_id']} committed done twice: {seen}, {row['generation_id']}"
    return snap


def kill_during_run(sim: SimulatorServer, config: Path, log: Path, remaining: int, rng: random.Random) -> None:
    """Start generate and SIGKILL it mid-run. Past the first window's burst, requests follow answers, so the
    kill comes after a random share of the remaining work on any machine, and before the last request."""
    before = total_requests(sim)
    proc = start(config, log)
    try:
        sent = IN_FLIGHT + rng.randint(remaining // 10, remaining // 4)
        wait_for_requests(sim, proc, before + min(sent, remaining - 1), log)
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        returncode = proc.wait(timeout=60)
    assert returncode == -signal.SIGKILL, f"generate ended by itself ({returncode}):\n{log.read_text()}"


@pytest.mark.slow  # tests/test_generate_money.py's ten kills (with the billing ledger) cover this in the default suite
def test_kill_9_at_random_points_loses_and_repeats_nothing(tmp_path: Path, tokenizer_dir: Path) -> None:
    rng = random.Random(SEED)
    data = tmp_path / "prompts.jsonl"
    write_dataset(data)
    log = tmp_path / "generate.log"
    local = Responder(tokenizer_dir, SIM)
    run_dir = tmp_path / "run"
    with SimulatorServer(tokenizer_dir, SIM) as sim:
        config = write_config(tmp_path, sim, tokenizer_dir, data)
        snapshots: list[Snapshot] = []
        for _ in range(KILLS):
            kill_during_run(sim, config, log, PROMPTS - len(snapshots[-1].done if snapshots else {}), rng)
            wait_quiet(sim)
            snap = committed(run_dir)
            snap.by_key = sim.stats()["by_key"]
            snapshots.append(snap)
        final = generate_to_the_end(config)
        end = sim.stats()["by_key"]

    last = snapshots[-1]
    total = json.loads(final.stdout.strip().splitlines()[-1])
    assert total["skipped_already_done"] == len(last.done), "resume disagrees with what was committed"
    assert any(s.chunk_files for s in snapshots), "no kill found committed chunks"
    assert any(s.finished_parts for s in snapshots), "no kill found a finished part"
    assert 0 < len(last.done) < PROMPTS

    prompt_refs = done_parts(run_dir, "prompts")
    prompts = {r["sample_id"]: r for ref in prompt_refs for r in read_part(ref).to_pylist()}
    assert len(prompts) == PROMPTS
    finished = done_parts(run_dir, "responses")
    assert [r.part for r in finished] == [r.part for r in prompt_refs]
    rows = [row for ref in finished for row in read_part(ref).to_pylist()]
    counts = Counter(row["sample_id"] for row in rows)
    assert set(counts) == set(prompts)
    assert [sid for sid, n in counts.items() if n != 1] == []
    assert not (run_dir / "responses" / CHUNKS_DIR).exists()
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.tmp")) == []
    for path in run_dir.rglob("*.parquet"):
        pq.read_table(path)

    keys = {
        sid: local.key_for_messages([dict(m) for m in prompt_messages(p["messages"])]) for sid, p in prompts.items()
    }
    assert len(set(keys.values())) == PROMPTS
    for n, snap in enumerate(snapshots):
        resent = [sid for sid in snap.done if end.get(keys[sid]) != snap.by_key.get(keys[sid])]
        assert resent == [], f"samples committed done at kill {n + 1} were sent again: {resent[:5]}"
    final_rows = {row["sample_id"]: row for row in rows}
    for snap in snapshots:
        changed = [sid for sid, gen in snap.done.items() if final_rows[sid]["generation_id"] != gen]
        assert changed == [], f"a committed done row was replaced: {changed[:5]}"

    doomed = {
        sid for sid, key in keys.items() if (rule := scheduled_failure(SIM, key, 1)) and rule.kind == "context_length"
    }
    assert doomed, "the seed scheduled no context_length failure"
    pending_failed = last.failed - last.done.keys()
    assert pending_failed and pending_failed <= doomed
    rebought = [sid for sid in pending_failed if end[keys[sid]] != last.by_key[keys[sid]]]
    assert rebought == [], "a committed context_length failure (deterministic) was sent again by the rerun"
    for sid, row in final_rows.items():
        if sid in doomed:
            assert (row["status"], row["failure_reason"]) == ("failed", "context_length"), row
        else:
            assert row["status"] == "done", row
            assert row["generation_id"].endswith(keys[sid])
    for sid in rng.sample(sorted(set(final_rows) - doomed), 40):
        expected = local.sample_for_messages([dict(m) for m in prompt_messages(prompts[sid]["messages"])])
        row = final_rows[sid]
        assert (row["reasoning"], row["content"], row["provider"]) == (
            expected.reasoning,
            expected.content,
            expected.provider,
        )
