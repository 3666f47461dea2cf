"""Production path, for real, on the session's loopback cluster (tests/prefect_cluster.py): `prefect server
start`, the README's setup steps (simulator, `EAGLE3_DEMO_BLOCKS=1 deployments/setup.sh`), two process workers on
the CPU pool and one on the GPU pool; then every deployment of deployments/prefect.yaml is triggered with its
shipped parameters through the REST call the UI's Run button makes, and a transient endpoint outage is waited
out inside the outage window.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import demo_config_path
from tasks.common.schemas import STAGES
from tasks.common.shards import done_parts
from tests.prefect_cluster import REPO, Cluster


def _state_names(c: Cluster, task_run_id: str, timeout_s: float = 30) -> list[str]:
    """Task-run states arrive through the event pipeline, so the history can lag the final state briefly."""
    deadline = time.monotonic() + timeout_s
    names: list[str] = []
    while time.monotonic() < deadline:
        states = c.api("GET", "/task_run_states/", params={"task_run_id": task_run_id})
        names = [s["name"] for s in sorted(states, key=lambda s: s["timestamp"])]
        if names and names[-1] == "Completed":
            return names
        time.sleep(1)
    return names


def _artifact_keys(c: Cluster, flow_run_id: str) -> set[str]:
    artifacts = c.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"] for a in artifacts}


@pytest.mark.slow  # the loopback cluster (~60 s): `make test-long`, which CI runs after `make test`
def test_shipped_deployments_run_from_the_run_button_on_workers_and_wait_out_a_transient_outage(
    deployed_cluster: Cluster,
) -> None:
    """Every deployment triggered with its shipped parameters (configs/run.yaml, the shipped block names);
    nightly-rerun's form switches on the Dask runner for the per-part CPU stages."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, InferenceEndpointBlock

    c = deployed_cluster
    assert "registered 4 blocks" in c.setup_stdout and "saved demo blocks" in c.setup_stdout
    assert c.api("GET", "/work_pools/eagle3-gpu")["concurrency_limit"] == 1
    for slug in ("eagle3-artifact-store", "eagle3-hidden-state-backend", "eagle3-inference-endpoint"):
        assert c.api("GET", f"/block_types/slug/{slug}")["slug"] == slug
    nightly = c.api("GET", "/deployments/name/eagle3-pipeline/nightly-rerun")
    assert nightly["schedules"] and not any(s["active"] for s in nightly["schedules"]), "schedules ship paused"

    runs_root = c.root / "shared-runs"
    with temporary_settings({PREFECT_API_URL: c.url}):
        # README step 2: your own endpoint block, with its key (the demo one has none); the store as the demo set it
        InferenceEndpointBlock(
            kind="sglang_generate", base_url=c.sim_url, model="sim/tiny", api_key="sk-e2e-SECRET-KEY"
        ).save("eagle3-endpoint", overwrite=True)
        ArtifactStoreBlock(location=str(runs_root)).save("eagle3-runs", overwrite=True)
    c.sim("POST", "/_sim/config", json={"noncanonical_rate": 0.2, "unavailable_probes": 1})
    c.sim("POST", "/_sim/reset")

    deployment = c.api("GET", "/deployments/name/eagle3-pipeline/pipeline")
    assert deployment["parameter_openapi_schema"]["properties"]["run"], "UI run form must come from the model"
    assert deployment["parameters"]["run"]["config_path"] == "configs/run.yaml"
    assert (REPO / "configs" / "run.yaml").is_file()
    pipeline_run = c.run_to_completion("eagle3-pipeline/pipeline")

    run_dir = runs_root / "run"
    for stage in STAGES:
        assert done_parts(run_dir, stage), f"no finished {stage} parts in {run_dir}"
    parts = len(done_parts(run_dir, "hidden_states"))

    workers = c.api("POST", "/work_pools/eagle3-cpu/workers/filter", json={})
    assert len(workers) >= 2

    extract_runs = c.api(
        "POST",
        "/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"any_": [pipeline_run["id"]]}}},
    )
    gpu_runs = [r for r in extract_runs if r.get("work_pool_name") == "eagle3-gpu"]
    assert gpu_runs and all(r["state"]["type"] == "COMPLETED" for r in gpu_runs), extract_runs
    assert "extract-summary-run" in _artifact_keys(c, gpu_runs[0]["id"])

    assert {"validation-summary-run", "run-summary-run", "estimate-run"} <= _artifact_keys(c, pipeline_run["id"])
    summary = c.api("GET", "/artifacts/run-summary-run/latest")["data"]
    assert f"| hidden_states | {parts} |" in summary, summary

    task_runs = c.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [pipeline_run["id"]]}}})
    generate = [t for t in task_runs if t["name"].startswith("generate")]
    assert len(generate) == 1
    names = _state_names(c, generate[0]["id"])
    # The endpoint refused its first probe: the task waits it out inside the outage window (no Prefect retry, no
    # sample failed) and completes.
    assert names[-1] == "Completed" and "Failed" not in names, names
    assert c.sim("GET", "/_sim/stats")["probes"] >= 2

    # Both pressed at once, as a user might: the nightly run's GPU stage queues behind the extract run (the GPU
    # pool takes one run at a time) and both find nothing left to do.
    nightly_params = {"run": {**nightly["parameters"]["run"], "cpu_task_runner": "dask", "dask_workers": 2}}
    triggered = [c.trigger("eagle3-extract/extract-gpu"), c.trigger("eagle3-pipeline/nightly-rerun", nightly_params)]
    for flow_run in triggered:
        final = c.wait_flow_run(flow_run["id"])
        assert final["state"]["type"] == "COMPLETED", (final["name"], final["state"])
    assert len(done_parts(run_dir, "hidden_states")) == parts, "a rerun of a finished run adds nothing"

    # A key typed into the Run form's overrides is refused by the server before it stores the run (the flow's own
    # check came after the key was in the database and on the run's Parameters tab).
    typed = {"run": {**deployment["parameters"]["run"], "overrides": {"endpoint.api_key": "sk-typed-SECRET-KEY"}}}
    with pytest.raises(httpx.HTTPStatusError) as refused:
        c.trigger("eagle3-pipeline/pipeline", typed)
    assert refused.value.response.status_code == 409 and "SECRET-KEY" not in refused.value.response.text

    for path in [*run_dir.rglob("*.parquet"), *run_dir.rglob("*.json"), *c.root.glob("*.log")]:
        assert b"SECRET-KEY" not in path.read_bytes(), f"API key leaked into {path}"
    recorded: dict[str, Any] = {
        "flow_runs": c.api("POST", "/flow_runs/filter", json={}),
        "task_runs": c.api("POST", "/task_runs/filter", json={}),
        "artifacts": c.api("POST", "/artifacts/filter", json={}),
        "logs": c.api("POST", "/logs/filter", json={"limit": 200}),
    }
    for kind, records in recorded.items():
        assert records and "SECRET-KEY" not in json.dumps(records), f"API key leaked into the server's {kind}"


@pytest.mark.slow
def test_nightly_rerun_after_a_faulty_night_completes_every_stage(
    deployed_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Night 1: half the requests fail for good, the failed-rate gate stops the run after the report. Night 2: the
    endpoint is healthy, failed samples are retried and every later stage follows its changed inputs."""
    import pyarrow as pa
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock
    from endpoint_sim.responder import FailureRule
    from tasks.common.shards import read_part
    from tasks.status.report import run_status

    c = deployed_cluster
    runs_root = tmp_path / "nightly-runs"
    faults = SimConfig(failures=(FailureRule(status=500, rate=0.5, attempts=None),))
    with SimulatorServer(tiny_model_dir, faults) as sim:
        with temporary_settings({PREFECT_API_URL: c.url}):
            InferenceEndpointBlock(kind="sglang_generate", base_url=sim.base_url, model="sim/tiny").save(
                "eagle3-endpoint", overwrite=True
            )
            ArtifactStoreBlock(location=str(runs_root)).save("eagle3-runs", overwrite=True)
            HiddenStateBackendBlock(backend="hf", device="cpu", dtype="bfloat16").save(
                "eagle3-gpu-backend", overwrite=True
            )
        deployment = c.api("GET", "/deployments/name/eagle3-pipeline/nightly-rerun")
        run_params = {
            **deployment["parameters"]["run"],
            "config_path": str(demo_config_path()),
            "overrides": {"run_dir": "nightly", "tokenizer.path": str(tiny_model_dir), "samples_per_shard": 24},
        }
        nights = []
        for night in range(2):
            if night == 1:
                sim.update_config(failures=())
            flow_run = c.api(
                "POST", f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"run": run_params}}
            )
            nights.append((flow_run["id"], c.wait_flow_run(flow_run["id"])))

    first, second = (final["state"] for _, final in nights)
    assert first["type"] == "FAILED" and "max_failed_rate" in (first["message"] or ""), first
    assert second["type"] == "COMPLETED", second

    run_dir = runs_root / "nightly"
    status = run_status(run_dir)
    assert status.consistent, status.problems
    assert "hidden_states" in status.stages
    assert all(f["stage"] == "validation" for f in status.failed), "only validation verdicts remain failed"
    expected = sum(c.expected for c in (by_stage["responses"] for by_stage in status.counts.values()))
    assert expected == 80 and len(status.quarantined) == 9  # the demo's samples and malformed rows
    for dataset, by_stage in status.counts.items():
        assert by_stage["responses"].done == by_stage["tokens"].done == by_stage["validation"].expected, dataset
    validation = pa.concat_tables([read_part(r, ["sample_id", "verdict"]) for r in done_parts(run_dir, "validation")])
    kept = {
        s
        for s, v in zip(*(validation[k].to_pylist() for k in ("sample_id", "verdict")), strict=True)
        if v not in ("fail", "drop")
    }
    index = pa.concat_tables([read_part(r, ["sample_id"]) for r in done_parts(run_dir, "hidden_states")])
    assert set(index["sample_id"].to_pylist()) == kept

    artifacts = c.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [nights[1][0]]}}})
    markdown = next(a for a in artifacts if a["key"] == "run-status-nightly")
    assert "**consistent**" in markdown["data"]
