"""Paid answers thrown away by a `kill -9` of `eagle3-datagen generate`, for any checkout of the project.

What is measured: the simulator (this checkout's, in-process, with its own billing ledger) bills every answer it
delivers. `generate` from `--repo` (this checkout by default; pass another checkout, e.g. the main branch, to
compare) runs with the default commit settings and is killed with SIGKILL after a random number of billed
answers. After each kill, an answer billed during that run counts as lost if its generation id is in nothing a
rerun resumes from (finished parts, committed chunks, and the journal where the checkout has one): the rerun
has to buy it again. `--kills` kills, seeded; the run directory is kept across kills, as a user's would be.

    python bench/answers_lost_per_kill.py                       # this checkout
    python bench/answers_lost_per_kill.py --repo /path/to/main  # another checkout, same measurement

`read_lost_per_kill`: of the lost, those the client had already read and recorded as paid in its spend ledger
(the rest were still unread in its sockets when it was killed: at a request rate above what the client parses,
that backlog grows, and no journal can keep what was never read).

The last stdout line is one JSON object: lost answers per kill, answers billed per kill, and the means.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from endpoint_sim.assets import write_tokenizer_dir  # noqa: E402
from endpoint_sim.responder import SimConfig  # noqa: E402
from endpoint_sim.server import SimulatorServer  # noqa: E402
from tasks.generate.journal import read_records  # noqa: E402


def durable_generation_ids(run_dir: Path) -> set[str]:
    ids: set[str] = set()
    responses = run_dir / "responses"
    for path in responses.rglob("*.parquet") if responses.is_dir() else []:
        if path.name.startswith("."):
            continue
        table = pq.read_table(path, columns=["status", "generation_id"]).to_pylist()
        ids.update(r["generation_id"] for r in table if r["status"] == "done" and r["generation_id"])
    for path in (responses / "_journal").glob("journal-*.log") if (responses / "_journal").is_dir() else []:
        for rec in read_records(path):
            row = rec["r"]
            if row.get("status") == "done" and row.get("generation_id"):
                ids.add(row["generation_id"])
    return ids


def ledger_answered_ids(run_dir: Path) -> set[str]:
    """Generation ids the killed run's spend ledger recorded as answered: answers the client had read and paid
    for (what the client could have kept), as opposed to answers still unread in its sockets at the kill."""
    ids: set[str] = set()
    for path in sorted((run_dir / "spend").glob("ledger-*.log")) if (run_dir / "spend").is_dir() else []:
        for rec in read_records(path):
            if rec.get("k") == "b" and rec.get("o") == "answered" and rec.get("g"):
                ids.add(rec["g"])
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose `generate` is killed")
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--in-flight", type=int, default=200)
    parser.add_argument("--latency-s", type=float, default=0.5, help="median simulator latency (lognormal)")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lost: list[int] = []
    read_lost: list[int] = []
    billed_per_kill: list[int] = []
    with tempfile.TemporaryDirectory(prefix="lost-per-kill-") as tmp:
        work = Path(tmp)
        model_dir = write_tokenizer_dir(work / "tokenizer")
        data = work / "prompts.jsonl"
        data.write_text(
            "".join(
                json.dumps({"messages": [{"role": "user", "content": f"[kill] question {i}: why?"}]}) + "\n"
                for i in range(args.prompts)
            )
        )
        sim_cfg = SimConfig(seed=1, latency_lognormal=(math.log(args.latency_s), 0.4))
        with SimulatorServer(model_dir, sim_cfg) as sim:
            config = work / "config.yaml"
            config.write_text(
                yaml.safe_dump(
                    {
                        "run_dir": str(work / "run"),
                        "samples_per_shard": 250,
                        "datasets": [{"name": "kill", "path": str(data)}],
                        "endpoint": {
                            "base_url": sim.base_url,
                            "model": "sim/deepseek-v4-sim",
                            "max_in_flight": args.in_flight,
                            "price_prompt_usd_per_mtok": 0.5,
                            "price_completion_usd_per_mtok": 2.0,
                        },
                        "sampling": {"max_tokens": 1024},
                        "tokenizer": {"path": str(model_dir)},
                    }
                )
            )
            env = {**os.environ, "PYTHONPATH": str(args.repo.resolve())}
            for _ in range(args.kills):
                start = len(sim.billing()["records"])
                target = start + rng.randint(args.in_flight, 3 * args.in_flight)
                with (work / "generate.log").open("ab") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress"],
                        cwd=args.repo,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                deadline = time.monotonic() + 300
                while len(sim.billing()["records"]) < target:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"generate ended before the kill:\n{(work / 'generate.log').read_text()}")
                    time.sleep(0.02)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                time.sleep(0.5)
                # Requests the kill cut are billed too (for what they generated), but were never answers.
                records = [r for r in sim.billing()["records"][start:] if not r.get("cut")]
                durable = durable_generation_ids(work / "run")
                lost.append(sum(1 for r in records if r["id"] not in durable))
                answered = ledger_answered_ids(work / "run")
                read_lost.append(sum(1 for r in records if r["id"] in answered and r["id"] not in durable))
                billed_per_kill.append(len(records))
                print(
                    f"kill: {billed_per_kill[-1]} answers billed in the run, {lost[-1]} lost, of which "
                    f"{read_lost[-1]} read and recorded as paid by the client",
                    file=sys.stderr,
                )
    print(
        json.dumps(
            {
                "bench": "answers_lost_per_kill",
                "repo": str(args.repo),
                "in_flight": args.in_flight,
                "lost_per_kill": lost,
                "billed_per_kill": billed_per_kill,
                "mean_lost_per_kill": statistics.fmean(lost),
                "read_lost_per_kill": read_lost,
                "mean_read_lost_per_kill": statistics.fmean(read_lost),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
