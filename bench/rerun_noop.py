"""A no-op rerun of a finished run directory against its first run: what "nothing changed" costs.

What is measured: the wall time of the whole `pipeline` flow (prepare, estimate, generate, reconstruct,
validate, the validation report, extraction with the tiny random model on CPU, the status artifact) under a
local Prefect server, against the endpoint simulator on loopback; then the same flow again on the finished run
directory. Every part's marker records the current fingerprints of its inputs, so no part is rebuilt and no task
run is created for one; what remains is reading O(parts) markers, the dataset digest, the validation summary and
report stamp, the status pass and Prefect's own per-flow cost.

The first run is one a user would have: `--samples-per-part` (25) generated single-turn prompts in each of
`--parts` (40) parts, i.e. 1,000 samples, and a simulator whose latency resembles a hosted endpoint answering
these short (100-200 token) reasoning completions: lognormal with median `--latency-median-s` (2.5 s) and
sigma `--latency-sigma` (0.5), so mean 2.8 s and p95 5.7 s, behind the demo's window of 64 requests in flight
(a real endpoint writing ~50-100 tokens/s after a 0.5-1 s first token takes 2-4 s for such answers). The
parameters are printed. `--tiny` is the earlier configuration: the 80 bundled demo samples in `--parts` parts
(2 per part at 40) against a zero-latency simulator, a first run of 10-30 s that is mostly Prefect overhead.

`ratio` = no-op rerun wall time / first run wall time (the goal is < 0.05). The number of task runs each flow
created is printed too: the no-op's must not grow with the number of parts, so `--parts` takes a list
(default "10,40") and each part count gets its own run directory, first run and no-op rerun. `flow body` is the
time inside the flow function (run_summary.json's wall_s); the rest of a no-op's wall time is Prefect's: flow
run creation and state changes, and joining its flow-heartbeat thread, which sleeps in whole seconds, so a sync
flow run lasts at least about one second. All runs share one Prefect server (started before the first timing),
one warm tokenizer cache and one process, so the ratio compares the work, not the start-up.

    python bench/rerun_noop.py                 # 10 and 40 parts of 25 samples (about 2-3 minutes on 2 cores)
    python bench/rerun_noop.py --parts 40      # one size
    python bench/rerun_noop.py --tiny          # 80 demo samples, zero latency (the old configuration)

Human-readable lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_UI_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
DEMO_SAMPLES = 80
TOPICS = (
    "binary search",
    "Rust lifetimes",
    "TCP congestion control",
    "the CAP theorem",
    "B-tree indexes",
    "gradient checkpointing",
    "Bloom filters",
    "consistent hashing",
    "the Fourier transform",
    "garbage collection",
    "vector clocks",
    "speculative decoding",
)
ASKS = (
    "Explain {t} to a new engineer, with one example.",
    "What is the most common mistake people make with {t}?",
    "Summarise {t} in three sentences, then give a pitfall.",
    "Compare {t} with the usual alternative and say when each wins.",
    "Write a short, careful answer: how would you test code that relies on {t}?",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_prompts(path: Path, n: int) -> Path:
    """`n` distinct single-turn prompts (a user's dataset of questions), one JSON object per line."""
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            ask = ASKS[i % len(ASKS)].format(t=TOPICS[(i // len(ASKS)) % len(TOPICS)])
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"({i}) {ask}"}]}) + "\n")
    return path


def _task_runs(flow_run_id: Any) -> int:
    """Task runs of a flow run and of its subflows (the CPU stages run in one)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        ids = [flow_run_id, *(f.id for f in subflows)]
        return len(client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))))


def measure(root: Path, parts: int, per_part: int, tiny: bool, base_url: str, model_dir: Path) -> dict[str, Any]:
    """First run and no-op rerun of one fresh run directory of `parts` parts."""
    from flows.cli import demo_config_path
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from tasks.common.shards import done_parts, read_marker

    run_dir = root / f"run-{parts}"
    overrides: dict[str, Any] = {
        "run_dir": str(run_dir),
        "endpoint.base_url": base_url,
        "tokenizer.path": str(model_dir),
        "samples_per_shard": per_part,
    }
    if not tiny:
        prompts = write_prompts(root / f"prompts-{parts}.jsonl", parts * per_part)
        overrides["datasets"] = [{"name": "questions", "path": str(prompts)}]
    run = RunParameters(config_path=str(demo_config_path()), overrides=overrides)
    out: dict[str, Any] = {"parts": parts, "samples_per_part": per_part}
    for name in ("first", "noop"):
        started = time.perf_counter()
        state = pipeline(run, return_state=True)
        wall = time.perf_counter() - started
        if not state.is_completed():
            raise SystemExit(f"{parts} parts, {name} run ended {state.type}: {state.message}")
        stats = state.result()
        out[f"{name}_wall_s"] = round(wall, 3)
        out[f"{name}_body_s"] = stats["wall_s"]
        out[f"{name}_task_runs"] = _task_runs(state.state_details.flow_run_id)
        log(
            f"{parts:>3} parts x {per_part} samples, {name:>5} run: {wall:7.2f} s wall "
            f"(flow body {stats['wall_s']:.2f} s), {out[f'{name}_task_runs']} task runs"
        )
    out["samples"] = sum(int(read_marker(r)["rows"]) for r in done_parts(run_dir, "prompts"))
    out["hidden_state_samples"] = sum(int(s["samples"]) for s in stats["extract"])  # validation's fails skipped
    out["hidden_states_parts"] = len(done_parts(run_dir, "hidden_states"))
    out["ratio"] = round(out["noop_wall_s"] / out["first_wall_s"], 4)
    out["status_consistent"] = stats["status"]["consistent"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="10,40", help="comma-separated part counts (parts per stage)")
    parser.add_argument("--samples-per-part", type=int, default=25, help="generated prompts per part")
    parser.add_argument("--latency-median-s", type=float, default=2.5, help="simulator latency median (lognormal)")
    parser.add_argument("--latency-sigma", type=float, default=0.5, help="simulator latency sigma of log-seconds")
    parser.add_argument("--tiny", action="store_true", help="80 demo samples split into the parts, zero latency")
    args = parser.parse_args()
    sizes = [int(p) for p in args.parts.split(",") if p.strip()]

    from endpoint_sim.server import SimConfig

    if args.tiny:
        sim_config = SimConfig()
        latency = "zero latency"
    else:
        mu, sigma = math.log(args.latency_median_s), args.latency_sigma
        sim_config = SimConfig(latency_lognormal=(mu, sigma))
        mean, p95 = math.exp(mu + sigma**2 / 2), math.exp(mu + 1.645 * sigma)
        latency = f"lognormal latency median {args.latency_median_s:.2f} s, mean {mean:.2f} s, p95 {p95:.2f} s"
    log(
        ("tiny: 80 demo samples per run directory" if args.tiny else f"{args.samples_per_part} samples per part")
        + f"; simulator: {latency}; endpoint.max_in_flight 64 (demo config); part counts {sizes}"
    )

    results = []
    with tempfile.TemporaryDirectory(prefix="eagle3-rerun-noop-") as scratch:
        root = Path(scratch)
        os.environ["PREFECT_HOME"] = str(root / "prefect-home")
        from prefect.testing.utilities import prefect_test_harness

        from endpoint_sim.assets import build_tiny_model_dir
        from endpoint_sim.server import SimulatorServer

        model_dir = build_tiny_model_dir(root / "tiny-model")
        with prefect_test_harness(server_startup_timeout=120), SimulatorServer(model_dir, sim_config) as sim:
            for parts in sizes:
                per_part = max(1, DEMO_SAMPLES // parts) if args.tiny else args.samples_per_part
                results.append(measure(root, parts, per_part, args.tiny, sim.base_url, model_dir))

    log("")
    log(f"{'parts':>5} {'samples':>7} {'first s':>8} {'no-op s':>8} {'ratio':>7} {'tasks first':>11} {'no-op':>5}")
    for r in results:
        log(
            f"{r['parts']:>5} {r['samples']:>7} {r['first_wall_s']:>8.2f} {r['noop_wall_s']:>8.2f} "
            f"{r['ratio']:>7.4f} {r['first_task_runs']:>11} {r['noop_task_runs']:>5}"
        )
    log("goal: no-op rerun / first run < 0.05, and the no-op's task runs the same for every part count")
    config = {
        "tiny": args.tiny,
        "latency": latency,
        "samples_per_part": None if args.tiny else args.samples_per_part,
        "latency_median_s": None if args.tiny else args.latency_median_s,
        "latency_sigma": None if args.tiny else args.latency_sigma,
    }
    print(json.dumps({"config": config, "runs": results}, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
