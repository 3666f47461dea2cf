"""A production-shaped cluster on loopback, shared by the deployment and multi-host tests (one per session):
`prefect server start`, an S3-compatible server (moto), the endpoint simulator started as the README says, the
README's `EAGLE3_DEMO_BLOCKS=1 EAGLE3_STORE_URL=s3://eagle3/runs deployments/setup.sh` (with the S3 credentials and
endpoint every host gets), and three process workers (two on eagle3-cpu, one on
eagle3-gpu), each its own "host": its own local cache directory, sharing only the Prefect server and S3.
A session whose collected tests use it starts it in the background as soon as collection ends (conftest), so its
20-30 s of process start-ups overlap the tests that run before the first one that needs it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
BUCKET = "eagle3"
STORE_URL = f"s3://{BUCKET}/runs"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-3000:]}")
        try:
            if ready():
                return
        except (httpx.TransportError, OSError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


class Cluster:
    """A Prefect server plus the CLI environment that talks to it, and the processes started around it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
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
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.sim_url = ""
        self.s3_url = ""
        self.setup_stdout = ""

    def spawn(self, args: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
        log = (self.root / log_name).open("wb")
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """One REST call; a 503 (the SQLite-backed server busy under a loaded machine) is retried, as the UI's
        own client does, before it counts as a failure."""
        for _ in range(10):
            response = httpx.request(method, f"{self.url}{path}", timeout=30, **kwargs)
            if response.status_code != 503:
                break
            time.sleep(1)
        response.raise_for_status()
        return response.json() if response.content else None

    def host_env(self, host: str) -> dict[str, str]:
        """A worker host: the cluster's client environment, S3 credentials, and a cache folder of its own."""
        cache = {"EAGLE3_DATAGEN_CACHE_DIR": str(self.cache(host))}
        return {**self.client_env, **S3_ENV, "AWS_ENDPOINT_URL": self.s3_url, **cache}

    def cache(self, host: str) -> Path:
        return self.root / "hosts" / host / "cache"

    def start_worker(self, pool: str, host: str) -> subprocess.Popen[bytes]:
        args = [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", host]
        self.workers[host] = proc = self.spawn(args, self.host_env(host), f"worker-{host}.log")
        return proc

    def kill_host(self, host: str) -> None:
        """SIGKILL a worker and every process under it (its flow runs run in sessions of their own)."""
        victims = [self.workers[host].pid, *descendants(self.workers[host].pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.workers[host].wait(timeout=30)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                for pid in descendants(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    def sim(self, method: str, path: str, **kwargs: Any) -> Any:
        return httpx.request(method, f"{self.sim_url}{path}", timeout=10, **kwargs).json()

    def trigger(self, name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the UI's Run button does: POST create_flow_run with the deployment's (form) parameters."""
        deployment = self.api("GET", f"/deployments/name/{name}")
        body = {"parameters": parameters if parameters is not None else deployment["parameters"]}
        flow_run: dict[str, Any] = self.api("POST", f"/deployments/{deployment['id']}/create_flow_run", json=body)
        return flow_run

    def wait_flow_run(self, flow_run_id: str, timeout_s: float = 420) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run: dict[str, Any] = self.api("GET", f"/flow_runs/{flow_run_id}")
            if run["state"]["type"] in TERMINAL:
                return run
            time.sleep(1)
        logs = "\n".join(p.read_text()[-2000:] for p in sorted(self.root.glob("worker-*.log")))
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s} s; worker logs:\n{logs}")

    def run_to_completion(self, name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
        final = self.wait_flow_run(self.trigger(name, parameters)["id"])
        assert final["state"]["type"] == "COMPLETED", (name, final["state"])
        return final


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _start_s3(c: Cluster) -> Any:
    port = free_port()
    proc = c.spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], c.client_env, "s3.log")
    c.s3_url = f"http://127.0.0.1:{port}"

    def ready() -> None:  # the bucket is created by the README's setup step (EAGLE3_STORE_URL)
        wait_until("moto S3 server", lambda: httpx.get(c.s3_url, timeout=2).status_code < 500, proc, c.root / "s3.log")

    return ready


def _start_documented_simulator(c: Cluster) -> Any:
    """README step: `python -m endpoint_sim --model-dir runs/_assets/tiny-deepseek-v31 --build-tiny-model`
    (any free port instead of 30000)."""
    port_file = c.root / "sim.port"
    args = [sys.executable, "-m", "endpoint_sim", "--model-dir", str(REPO / "runs" / "_assets" / "tiny-deepseek-v31")]
    args += ["--build-tiny-model", "--port", "0", "--port-file", str(port_file)]
    proc = c.spawn(args, c.client_env, "sim.log")

    def ready() -> None:
        wait_until("endpoint simulator", port_file.exists, proc, c.root / "sim.log", timeout_s=300)
        c.sim_url = f"http://127.0.0.1:{port_file.read_text().strip()}"

    return ready


def _bring_up(c: Cluster) -> None:
    server = c.spawn(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(c.port)], c.server_env, "server.log"
    )
    # the three servers start side by side; then each is waited for
    s3_ready, sim_ready = _start_s3(c), _start_documented_simulator(c)
    healthy = lambda: httpx.get(f"{c.url}/health", timeout=2).status_code == 200  # noqa: E731
    wait_until("prefect server", healthy, server, c.root / "server.log")
    s3_ready()
    sim_ready()
    demo = {
        "EAGLE3_DEMO_BLOCKS": "1",
        "EAGLE3_DEMO_ENDPOINT": c.sim_url,
        "EAGLE3_DEMO_RUNS_DIR": str(c.root / "shared-runs"),
        "EAGLE3_STORE_URL": STORE_URL,  # README, "Several hosts": the shared store, with the hosts' credentials
    }
    setup = subprocess.run(
        ["bash", "deployments/setup.sh"],
        env={**c.client_env, **S3_ENV, "AWS_ENDPOINT_URL": c.s3_url, **demo},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert setup.returncode == 0, f"{setup.stdout}\n{setup.stderr}"
    c.setup_stdout = setup.stdout
    for pool, host in (("eagle3-cpu", "cpu-a"), ("eagle3-cpu", "cpu-b"), ("eagle3-gpu", "gpu")):
        c.start_worker(pool, host)


class _Background(threading.Thread):
    """The cluster coming up while the tests before the first one that needs it run: it is mostly waiting on
    processes that start (20-30 s), which the suite need not wait for in a row."""

    def __init__(self, root: Path) -> None:
        super().__init__(name="prefect-cluster", daemon=True)
        self.cluster = Cluster(root)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _bring_up(self.cluster)
        except BaseException as exc:
            self.error = exc

    def wait(self) -> None:
        self.join(timeout=600)
        assert not self.is_alive(), f"the cluster did not come up in 600 s: {dump(self.cluster)}"
        if self.error is not None:
            raise self.error


_BACKGROUND: list[_Background] = []


def start_in_background(session: pytest.Session) -> None:
    """Called once collection is final: only a session that will use the cluster starts it."""
    if session.config.option.collectonly:
        return
    if any("deployed_cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        root = Path(tempfile.mkdtemp(prefix="eagle3-prefect-cluster-"))
        starting = _Background(root)
        _BACKGROUND.append(starting)
        atexit.register(starting.cluster.stop)
        starting.start()


@pytest.fixture(scope="session")
def deployed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    starting = _BACKGROUND[0] if _BACKGROUND else None
    c = starting.cluster if starting is not None else Cluster(tmp_path_factory.mktemp("prefect-cluster"))
    try:
        if starting is not None:
            starting.wait()
        else:
            _bring_up(c)
        yield c
    finally:
        c.stop()


def s3_fs(c: Cluster) -> Any:
    import fsspec

    return fsspec.filesystem(
        "s3",
        endpoint_url=c.s3_url,
        key=S3_ENV["AWS_ACCESS_KEY_ID"],
        secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )


def dump(c: Cluster) -> str:
    return json.dumps({p.name: p.read_text()[-1500:] for p in sorted(c.root.glob("*.log"))}, indent=1)
