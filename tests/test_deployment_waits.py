"""Deployments that wait instead of failing, and fail instead of hanging, on the session's loopback cluster
(tests/prefect_cluster.py, set up by the README's deployments/setup.sh):

- `pipeline` and `nightly-rerun` pressed at once on one run directory: they share one concurrency slot, so the
  second waits (AwaitingConcurrencySlot) and then completes; no run goes red with RunDirBusyError.
- `pipeline` whose extraction deployment's pool has no worker: it says so in its log at once, and fails with one
  clear message after `extract_worker_wait_s`, the extraction run cancelled, everything before it kept.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DEMO_DATA
from tests.prefect_cluster import Cluster

pytestmark = pytest.mark.slow

SMALL = {
    "samples_per_shard": 6,
    "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": 12}],
}


def _blocks(c: Cluster, runs_root: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock

    with temporary_settings({PREFECT_API_URL: c.url}):
        InferenceEndpointBlock(kind="sglang_generate", base_url=c.sim_url, model="sim/tiny").save(
            "eagle3-endpoint", overwrite=True
        )
        ArtifactStoreBlock(location=str(runs_root)).save("eagle3-runs", overwrite=True)
        HiddenStateBackendBlock(backend="hf", device="cpu", dtype="bfloat16").save("eagle3-gpu-backend", overwrite=True)
    c.sim("POST", "/_sim/config", json={"unavailable_probes": 0, "failures": []})


def _params(c: Cluster, deployment: str, **run: Any) -> dict[str, Any]:
    shipped = c.api("GET", f"/deployments/name/{deployment}")["parameters"]["run"]
    return {"run": {**shipped, **run}}


def _state_names(c: Cluster, flow_run_id: str) -> list[str]:
    states = c.api("GET", "/flow_run_states/", params={"flow_run_id": flow_run_id})
    return [s["name"] for s in sorted(states, key=lambda s: s["timestamp"])]


def test_pipeline_and_nightly_pressed_at_once_queue_on_one_slot(deployed_cluster: Cluster, tmp_path: Path) -> None:
    c = deployed_cluster
    _blocks(c, tmp_path / "runs")
    overrides = {**SMALL, "run_dir": "pressed-at-once", "extract.enabled": False}
    runs = [
        c.trigger(name, _params(c, name, overrides=overrides))
        for name in ("eagle3-pipeline/pipeline", "eagle3-pipeline/nightly-rerun")
    ]
    finals = [c.wait_flow_run(run["id"]) for run in runs]
    assert [f["state"]["type"] for f in finals] == ["COMPLETED", "COMPLETED"], [f["state"] for f in finals]
    histories = [_state_names(c, run["id"]) for run in runs]
    assert any("AwaitingConcurrencySlot" in names for names in histories), histories
    assert not any("Failed" in names or "Crashed" in names for names in histories), histories
    first, second = sorted(finals, key=lambda f: f["start_time"])
    assert second["start_time"] >= first["end_time"], "the second run started while the first still ran"


UNSTAFFED_POOL = "eagle3-gpu-unstaffed"


def _unstaffed_extract_deployment(c: Cluster) -> str:
    """The shipped extraction deployment on a pool no worker polls."""
    pool = UNSTAFFED_POOL
    if not any(p["name"] == pool for p in c.api("POST", "/work_pools/filter", json={})):
        c.api("POST", "/work_pools/", json={"name": pool, "type": "process"})
    shipped = c.api("GET", "/deployments/name/eagle3-extract/extract-gpu")
    c.api(
        "POST",
        "/deployments/",
        json={
            "name": "extract-unstaffed",
            "flow_id": shipped["flow_id"],
            "entrypoint": shipped["entrypoint"],
            "pull_steps": shipped["pull_steps"],
            "parameter_openapi_schema": shipped["parameter_openapi_schema"],
            "parameters": shipped["parameters"],
            "work_pool_name": pool,
            "work_queue_name": "default",
        },
    )
    return "eagle3-extract/extract-unstaffed"


def test_pipeline_without_a_worker_on_the_gpu_pool_fails_clearly_within_the_configured_wait(
    deployed_cluster: Cluster, tmp_path: Path
) -> None:
    c = deployed_cluster
    _blocks(c, tmp_path / "runs")
    pool = UNSTAFFED_POOL
    _unstaffed_extract_deployment(c)
    wait_s = 5
    params = _params(
        c,
        "eagle3-pipeline/pipeline",
        overrides={**SMALL, "run_dir": "no-gpu-worker"},
        extract_deployment="eagle3-extract/extract-unstaffed",
        extract_worker_wait_s=wait_s,
    )
    run = c.trigger("eagle3-pipeline/pipeline", params)
    final = c.wait_flow_run(run["id"])
    message = final["state"]["message"] or ""
    assert final["state"]["type"] == "FAILED", final["state"]
    assert f"no worker on work pool '{pool}' took eagle3-extract/extract-unstaffed run" in message, message
    assert f"within {wait_s} s (extract_worker_wait_s)" in message and "prefect worker start --pool" in message

    children = c.api("POST", "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}})
    (child,) = [r for r in children if r["work_pool_name"] == pool]
    assert child["state"]["type"] == "CANCELLED"
    logs = c.api("POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    said = [log for log in logs if f"no worker is polling work pool '{pool}'" in log["message"]]
    assert said, [log["message"] for log in logs][-20:]
    created = time.mktime(time.strptime(child["created"][:19], "%Y-%m-%dT%H:%M:%S"))
    logged = time.mktime(time.strptime(said[0]["timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))
    print(f"\nno GPU worker: logged {logged - created:.0f} s after the extraction run was created; failed: {message}")
    run_dir = tmp_path / "runs" / "no-gpu-worker"
    assert (run_dir / "validation" / "_done").is_dir(), "every stage before extraction is finished and kept"


def test_a_rerun_of_a_finished_run_directory_needs_no_gpu_worker(deployed_cluster: Cluster, tmp_path: Path) -> None:
    """Extracted once (on the CPU worker here), the run directory is finished: the nightly-style rerun whose
    extraction deployment has no worker completes without creating a run there (an independent UI probe: it
    failed after extract_worker_wait_s, or stayed Running behind a busy GPU pool)."""
    c = deployed_cluster
    _blocks(c, tmp_path / "runs")
    extract = _unstaffed_extract_deployment(c)
    overrides = {**SMALL, "run_dir": "finished-then-rerun"}
    first = c.trigger(
        "eagle3-pipeline/pipeline", _params(c, "eagle3-pipeline/pipeline", overrides=overrides, extract_deployment=None)
    )
    assert c.wait_flow_run(first["id"])["state"]["type"] == "COMPLETED"
    params = _params(
        c, "eagle3-pipeline/pipeline", overrides=overrides, extract_deployment=extract, extract_worker_wait_s=5
    )
    rerun = c.trigger("eagle3-pipeline/pipeline", params)
    final = c.wait_flow_run(rerun["id"])
    assert final["state"]["type"] == "COMPLETED", final["state"]
    children = c.api("POST", "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [rerun["id"]]}}})
    assert not [r for r in children if r["work_pool_name"] == UNSTAFFED_POOL], children


def test_a_resumed_nightly_schedule_stays_resumed_across_setup(deployed_cluster: Cluster, tmp_path: Path) -> None:
    """deployments/setup.sh is idempotent: re-running it (a `prefect deploy` of prefect.yaml, which ships the
    schedule paused) used to pause a nightly rerun the user had resumed, silently."""
    import subprocess
    import sys

    from tests.conftest import REPO

    c = deployed_cluster
    name = "eagle3-pipeline/nightly-rerun"

    def schedule() -> dict[str, Any]:
        [found] = c.api("GET", f"/deployments/name/{name}")["schedules"]
        return dict(found)

    deployment_id = c.api("GET", f"/deployments/name/{name}")["id"]
    c.api("PATCH", f"/deployments/{deployment_id}/schedules/{schedule()['id']}", json={"active": True})
    state = tmp_path / "schedules.json"
    env = {**c.client_env, "EAGLE3_DATAGEN_HOME": str(REPO)}
    prefect = str(Path(sys.executable).parent / "prefect")
    steps = [
        [sys.executable, "deployments/schedule_state.py", "save", str(state)],
        [prefect, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "nightly-rerun"],
    ]
    try:
        for step in steps:
            subprocess.run(step, env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
        assert not schedule()["active"], "prefect deploy alone pauses it (what setup.sh now undoes)"
        subprocess.run(
            [sys.executable, "deployments/schedule_state.py", "restore", str(state)],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=120,
        )
        assert schedule()["active"]
    finally:
        c.api("PATCH", f"/deployments/{deployment_id}/schedules/{schedule()['id']}", json={"active": False})


def test_a_run_outlives_its_worker(deployed_cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 of the worker alone (a worker restart, its host alive): the run it started used to end "aborted by
    Python system exit call" at its next log line (rich's SystemExit on the closed pipe); it now completes."""
    import os
    import signal

    from tests.prefect_cluster import descendants

    c = deployed_cluster
    _blocks(c, tmp_path / "runs")
    c.sim("POST", "/_sim/config", json={"latency_s": 1.0})
    overrides = {**SMALL, "run_dir": "worker-killed", "extract.enabled": False, "endpoint.max_in_flight": 2}
    try:
        run = c.trigger("eagle3-pipeline/pipeline", _params(c, "eagle3-pipeline/pipeline", overrides=overrides))
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            flow_run = c.api("GET", f"/flow_runs/{run['id']}")
            pid = (flow_run.get("infrastructure_pid") or "").rpartition(":")[2]
            if flow_run["state"]["type"] == "RUNNING" and pid.isdigit():
                victim = next(
                    (h for h, w in c.workers.items() if w.poll() is None and int(pid) in descendants(w.pid)), None
                )
            time.sleep(0.2)
        assert victim is not None, "the run never started on a live worker"
        os.kill(c.workers[victim].pid, signal.SIGKILL)
        c.workers[victim].wait(timeout=30)
        c.start_worker("eagle3-cpu", f"{victim}-restarted")
        final = c.wait_flow_run(run["id"], timeout_s=300)
    finally:
        c.sim("POST", "/_sim/config", json={"latency_s": 0.0})
    assert final["state"]["type"] == "COMPLETED", final["state"]
