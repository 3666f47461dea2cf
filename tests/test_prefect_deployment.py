"""Production path, for real: `prefect server start` on loopback, pools, blocks, `prefect deploy` from
deployments/prefect.yaml, two process workers on the CPU pool and one on the GPU pool, a run triggered through the
REST call the UI's Run button makes, and a transient endpoint outage that the generate task survives by retrying.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import demo_config_path
from tasks.common.schemas import STAGES
from tasks.common.shards import done_parts

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


class Cluster:
    """A Prefect server plus the CLI environment that talks to it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        common = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
        self.server_env = {
            **base,
            **common,
            "PREFECT_HOME": str(root / "server-home"),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root}/prefect.db",
        }
        self.client_env = {
            **base,
            **common,
            "PREFECT_HOME": str(root / "client-home"),
            "PREFECT_API_URL": self.url,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "EAGLE3_DATAGEN_HOME": str(REPO),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
        log = (self.root / log_name).open("wb")
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(method, f"{self.url}{path}", timeout=30, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("prefect-cluster"))
    server = c.spawn(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(c.port)], c.server_env, "server.log"
    )
    try:
        _wait_healthy(c.url, server, c.root / "server.log")
        yield c
    finally:
        c.stop()


def _wait_flow_run(c: Cluster, flow_run_id: str, timeout_s: float = 420) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run: dict[str, Any] = c.api("GET", f"/flow_runs/{flow_run_id}")
        if run["state"]["type"] in TERMINAL:
            return run
        time.sleep(1)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(c.root.glob("worker-*.log")))
    raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s} s; worker logs:\n{logs}")


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


def test_deployed_pipeline_runs_on_workers_and_retries_a_transient_outage(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock

    c = cluster
    runs_root = tmp_path / "shared-runs"
    setup = subprocess.run(
        ["bash", "deployments/setup.sh"], env=c.client_env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert setup.returncode == 0, f"{setup.stdout}\n{setup.stderr}"
    assert "registered 4 blocks" in setup.stdout
    assert c.api("GET", "/work_pools/eagle3-gpu")["concurrency_limit"] == 1
    for slug in ("eagle3-artifact-store", "eagle3-hidden-state-backend", "eagle3-inference-endpoint"):
        assert c.api("GET", f"/block_types/slug/{slug}")["slug"] == slug

    with SimulatorServer(tiny_model_dir, SimConfig(noncanonical_rate=0.2, unavailable_probes=1)) as sim:
        with temporary_settings({PREFECT_API_URL: c.url}):
            InferenceEndpointBlock(
                kind="sglang_generate", base_url=sim.base_url, model="sim/tiny", api_key="sk-e2e-SECRET-KEY"
            ).save("eagle3-endpoint", overwrite=True)
            ArtifactStoreBlock(location=str(runs_root)).save("eagle3-runs", overwrite=True)
            HiddenStateBackendBlock(backend="hf", device="cpu", dtype="bfloat16").save(
                "eagle3-gpu-backend", overwrite=True
            )

        for i, pool in enumerate(["eagle3-cpu", "eagle3-cpu", "eagle3-gpu"]):
            c.spawn(
                [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", f"{pool}-{i}"],
                c.client_env,
                f"worker-{i}.log",
            )

        deployment = c.api("GET", "/deployments/name/eagle3-pipeline/pipeline")
        assert deployment["parameter_openapi_schema"]["properties"]["run"], "UI run form must come from the model"
        run_params = {
            **deployment["parameters"]["run"],
            "config_path": str(demo_config_path()),
            "overrides": {"run_dir": "e2e", "tokenizer.path": str(tiny_model_dir), "samples_per_shard": 24},
            "cpu_task_runner": "dask",
            "dask_workers": 2,
        }
        flow_run = c.api(
            "POST", f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"run": run_params}}
        )
        final = _wait_flow_run(c, flow_run["id"])
        assert final["state"]["type"] == "COMPLETED", final["state"]

    run_dir = runs_root / "e2e"
    for stage in STAGES:
        assert done_parts(run_dir, stage), f"no finished {stage} parts in {run_dir}"

    workers = c.api("POST", "/work_pools/eagle3-cpu/workers/filter", json={})
    assert len(workers) == 2

    extract_runs = c.api(
        "POST",
        "/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"any_": [flow_run["id"]]}}},
    )
    gpu_runs = [r for r in extract_runs if r.get("work_pool_name") == "eagle3-gpu"]
    assert gpu_runs and all(r["state"]["type"] == "COMPLETED" for r in gpu_runs), extract_runs

    artifacts = c.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    assert {"validation-summary", "run-summary"} <= {a["key"] for a in artifacts}

    task_runs = c.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    generate = [t for t in task_runs if t["name"].startswith("generate")]
    assert len(generate) == 1
    names = _state_names(c, generate[0]["id"])
    assert "Retrying" in names and names[-1] == "Completed", names
    assert names.index("Retrying") < len(names) - 1

    for path in [*run_dir.rglob("*.parquet"), *run_dir.rglob("*.json"), *c.root.glob("*.log")]:
        assert b"SECRET-KEY" not in path.read_bytes(), f"API key leaked into {path}"
    recorded = {
        "flow_runs": c.api("POST", "/flow_runs/filter", json={}),
        "task_runs": c.api("POST", "/task_runs/filter", json={}),
        "artifacts": c.api("POST", "/artifacts/filter", json={}),
        "logs": c.api("POST", "/logs/filter", json={"limit": 200}),
    }
    for kind, records in recorded.items():
        assert records and "SECRET-KEY" not in json.dumps(records), f"API key leaked into the server's {kind}"


def _ensure_deployed(c: Cluster) -> None:
    """Pools, blocks, deployments and the three workers, once per cluster (the test above may have done it)."""
    if any("worker" in proc.args for proc in c.procs if isinstance(proc.args, list)):
        return
    setup = subprocess.run(
        ["bash", "deployments/setup.sh"], env=c.client_env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert setup.returncode == 0, f"{setup.stdout}\n{setup.stderr}"
    for i, pool in enumerate(["eagle3-cpu", "eagle3-cpu", "eagle3-gpu"]):
        c.spawn(
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", f"{pool}-{i}"],
            c.client_env,
            f"worker-{i}.log",
        )


@pytest.mark.slow
def test_nightly_rerun_after_a_faulty_night_completes_every_stage(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Night 1: half the requests fail for good, the failed-rate gate stops the run after the report. Night 2: the
    endpoint is healthy, failed samples are retried and every later stage follows its changed inputs."""
    import pyarrow as pa
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import ArtifactStoreBlock, HiddenStateBackendBlock, InferenceEndpointBlock
    from endpoint_sim.responder import FailureRule
    from tasks.common.shards import read_part
    from tasks.status.report import run_status

    c = cluster
    _ensure_deployed(c)
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
            nights.append((flow_run["id"], _wait_flow_run(c, flow_run["id"])))

    first, second = (final["state"] for _, final in nights)
    assert first["type"] == "FAILED" and "max_failed_rate" in (first["message"] or ""), first
    assert second["type"] == "COMPLETED", second

    run_dir = runs_root / "nightly"
    status = run_status(run_dir)
    assert status.consistent, status.problems
    assert "hidden_states" in status.stages and not status.failed
    expected = sum(c.expected for c in (by_stage["responses"] for by_stage in status.counts.values()))
    assert expected == 80 and len(status.quarantined) == 9  # the demo's samples and malformed rows
    for dataset, by_stage in status.counts.items():
        assert by_stage["responses"].done == by_stage["tokens"].done == by_stage["validation"].expected, dataset
    validation = pa.concat_tables([read_part(r, ["sample_id", "verdict"]) for r in done_parts(run_dir, "validation")])
    kept = {
        s for s, v in zip(*(validation[k].to_pylist() for k in ("sample_id", "verdict")), strict=True) if v != "fail"
    }
    index = pa.concat_tables([read_part(r, ["sample_id"]) for r in done_parts(run_dir, "hidden_states")])
    assert set(index["sample_id"].to_pylist()) == kept

    artifacts = c.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [nights[1][0]]}}})
    markdown = next(a for a in artifacts if a["key"] == "run-status")
    assert "**consistent**" in markdown["data"]
