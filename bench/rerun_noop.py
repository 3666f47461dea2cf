"""A no-op rerun of a finished run directory against its first run: what "nothing changed" costs.

What is measured: the wall time of the whole `pipeline` flow (prepare, generate, reconstruct, validate, the
validation report, extraction with the tiny random model on CPU, the status artifact) under a local Prefect
server, on the bundled demo config with `samples_per_shard` chosen so the 80 demo samples make `--parts` parts
(40 by default), against the endpoint simulator on loopback. Then the same flow again on the finished run
directory: every part's marker records the current fingerprints of its inputs, so no part is rebuilt and no
task run is created for one; what remains is reading O(parts) markers, the dataset digest, the tokenizer check,
the validation report and the status pass.

`ratio` = no-op rerun wall time / first run wall time (the goal is < 0.05). The number of task runs each flow
created is printed too: the no-op's must not grow with the number of parts. Both runs share one Prefect server
(started before the first timing), one warm tokenizer cache and one process, so the ratio compares the work,
not the start-up.

    python bench/rerun_noop.py              # 40 parts (about a minute on 2 cores)
    python bench/rerun_noop.py --parts 10   # smaller

Human-readable lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
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
SAMPLES = 80


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=40, help="parts per stage (80 demo samples split evenly)")
    args = parser.parse_args()
    per_part = max(1, SAMPLES // args.parts)

    with tempfile.TemporaryDirectory(prefix="eagle3-rerun-noop-") as scratch:
        root = Path(scratch)
        os.environ["PREFECT_HOME"] = str(root / "prefect-home")
        from prefect.testing.utilities import prefect_test_harness

        from endpoint_sim.assets import build_tiny_model_dir
        from endpoint_sim.server import SimConfig, SimulatorServer
        from flows.cli import demo_config_path
        from flows.params import RunParameters
        from flows.pipeline import pipeline
        from tasks.common.shards import done_parts

        model_dir = build_tiny_model_dir(root / "tiny-model")
        with prefect_test_harness(server_startup_timeout=120), SimulatorServer(model_dir, SimConfig()) as sim:
            overrides = {
                "run_dir": str(root / "run"),
                "endpoint.base_url": sim.base_url,
                "tokenizer.path": str(model_dir),
                "samples_per_shard": per_part,
            }
            run = RunParameters(config_path=str(demo_config_path()), overrides=overrides)
            timings: dict[str, float] = {}
            tasks: dict[str, int] = {}
            for name in ("first", "noop"):
                started = time.perf_counter()
                state = pipeline(run, return_state=True)
                timings[name] = time.perf_counter() - started
                if not state.is_completed():
                    raise SystemExit(f"{name} run ended {state.type}: {state.message}")
                tasks[name] = _task_runs(state.state_details.flow_run_id)
                stats = state.result()
                log(f"{name:>5} run: {timings[name]:7.2f} s, {tasks[name]} task runs")
            parts = len(done_parts(root / "run", "hidden_states"))
            requests = int(sim.stats(with_keys=False)["total_requests"])

    ratio = timings["noop"] / timings["first"]
    log(f"parts per stage {parts}; no-op rerun / first run = {ratio:.4f} (goal < 0.05)")
    print(
        json.dumps(
            {
                "parts": parts,
                "samples_per_shard": per_part,
                "first_wall_s": round(timings["first"], 3),
                "noop_wall_s": round(timings["noop"], 3),
                "ratio": round(ratio, 4),
                "first_task_runs": tasks["first"],
                "noop_task_runs": tasks["noop"],
                "requests_sent": requests,
                "status_consistent": stats["status"]["consistent"],
            },
            sort_keys=True,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
