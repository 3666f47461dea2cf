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


def _start_documented_simulator(c: Cluster, config: dict[str, Any]) -> str:
    """README step: `python -m endpoint_sim --model-dir runs/_assets/tiny-deepseek-v31 --build-tiny-model`
    (any free port instead of 30000, plus the outage this test wants the generate task to survive)."""
    port_file = c.root / "sim.port"
    (c.root / "sim.json").write_text(json.dumps(config))
    c.spawn(
        [
            sys.executable,
            "-m",
            "endpoint_sim",
            "--model-dir",
            str(REPO / "runs" / "_assets" / "tiny-deepseek-v31"),
            "--build-tiny-model",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--config-json",
            str(c.root / "sim.json"),
        ],
        c.client_env,
        "sim.log",
    )
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulator did not start:\n{(c.root / 'sim.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return f"http://127.0.0.1:{port_file.read_text().strip()}"


def _trigger(c: Cluster, name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the UI's Run button does: POST create_flow_run with the deployment's (form) parameters."""
    deployment = c.api("GET", f"/deployments/name/{name}")
    body = {"parameters": parameters if parameters is not None else deployment["parameters"]}
    flow_run: dict[str, Any] = c.api("POST", f"/deployments/{deployment['id']}/create_flow_run", json=body)
    final = _wait_flow_run(c, flow_run["id"])
    assert final["state"]["type"] == "COMPLETED", (name, final["state"])
    return final


def _artifact_keys(c: Cluster, flow_run_id: str) -> set[str]:
    artifacts = c.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"] for a in artifacts}


def test_shipped_deployments_run_from_the_run_button_on_workers_and_retry_a_transient_outage(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The README's setup steps as written, then every deployment of deployments/prefect.yaml triggered with its
    shipped parameters (configs/run.yaml, the shipped block names); nightly-rerun's form switches on Dask."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import InferenceEndpointBlock

    c = cluster
    runs_root = tmp_path / "shared-runs"
    sim_url = _start_documented_simulator(c, {"noncanonical_rate": 0.2, "unavailable_probes": 1})
    demo = {"EAGLE3_DEMO_BLOCKS": "1", "EAGLE3_DEMO_ENDPOINT": sim_url, "EAGLE3_DEMO_RUNS_DIR": str(runs_root)}
    setup = subprocess.run(
        ["bash", "deployments/setup.sh"],
        env={**c.client_env, **demo},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert setup.returncode == 0, f"{setup.stdout}\n{setup.stderr}"
    assert "registered 4 blocks" in setup.stdout and "saved demo blocks" in setup.stdout
    assert c.api("GET", "/work_pools/eagle3-gpu")["concurrency_limit"] == 1
    for slug in ("eagle3-artifact-store", "eagle3-hidden-state-backend", "eagle3-inference-endpoint"):
        assert c.api("GET", f"/block_types/slug/{slug}")["slug"] == slug
    nightly = c.api("GET", "/deployments/name/eagle3-pipeline/nightly-rerun")
    assert nightly["schedules"] and not any(s["active"] for s in nightly["schedules"]), "schedules ship paused"

    with temporary_settings({PREFECT_API_URL: c.url}):  # README step 2: your own endpoint block, with its key
        InferenceEndpointBlock(
            kind="sglang_generate", base_url=sim_url, model="sim/tiny", api_key="sk-e2e-SECRET-KEY"
        ).save("eagle3-endpoint", overwrite=True)

    for i, pool in enumerate(["eagle3-cpu", "eagle3-cpu", "eagle3-gpu"]):
        c.spawn(
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", f"{pool}-{i}"],
            c.client_env,
            f"worker-{i}.log",
        )

    deployment = c.api("GET", "/deployments/name/eagle3-pipeline/pipeline")
    assert deployment["parameter_openapi_schema"]["properties"]["run"], "UI run form must come from the model"
    assert deployment["parameters"]["run"]["config_path"] == "configs/run.yaml"
    assert (REPO / "configs" / "run.yaml").is_file()
    pipeline_run = _trigger(c, "eagle3-pipeline/pipeline")

    run_dir = runs_root / "run"
    for stage in STAGES:
        assert done_parts(run_dir, stage), f"no finished {stage} parts in {run_dir}"
    parts = len(done_parts(run_dir, "hidden_states"))

    workers = c.api("POST", "/work_pools/eagle3-cpu/workers/filter", json={})
    assert len(workers) == 2

    extract_runs = c.api(
        "POST",
        "/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"any_": [pipeline_run["id"]]}}},
    )
    gpu_runs = [r for r in extract_runs if r.get("work_pool_name") == "eagle3-gpu"]
    assert gpu_runs and all(r["state"]["type"] == "COMPLETED" for r in gpu_runs), extract_runs
    assert "extract-summary" in _artifact_keys(c, gpu_runs[0]["id"])

    keys = _artifact_keys(c, pipeline_run["id"])
    assert {"validation-summary", "run-summary", "estimate"} <= keys
    summary = c.api("GET", "/artifacts/run-summary/latest")["data"]
    assert f"| hidden_states | {parts} |" in summary, summary

    task_runs = c.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [pipeline_run["id"]]}}})
    generate = [t for t in task_runs if t["name"].startswith("generate")]
    assert len(generate) == 1
    names = _state_names(c, generate[0]["id"])
    assert "Retrying" in names and names[-1] == "Completed", names
    assert names.index("Retrying") < len(names) - 1

    _trigger(c, "eagle3-extract/extract-gpu")
    nightly_params = {"run": {**nightly["parameters"]["run"], "cpu_task_runner": "dask", "dask_workers": 2}}
    _trigger(c, "eagle3-pipeline/nightly-rerun", nightly_params)
    assert len(done_parts(run_dir, "hidden_states")) == parts, "a rerun of a finished run adds nothing"

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
