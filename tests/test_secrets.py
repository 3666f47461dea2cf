"""The API key never leaves the Authorization header: not into the run directory (Parquet values and metadata,
markers, chunks, quarantine), the CLI's output, exceptions, log records, nor Prefect's flow runs, task runs,
artifacts, logs or database, even when the endpoint echoes the header back in its error messages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, get_args

import pyarrow.parquet as pq
import pytest
import yaml

from endpoint_sim.responder import FailureKind, FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from flows.cli import generate_without_prefect
from tasks.common.config import load_config
from tasks.common.errors import FatalEndpointError
from tasks.common.shards import done_parts, read_part
from tests.conftest import DEMO_DATA, REPO

KEY_PREFIX = "sk-or-v1-"
KEY = KEY_PREFIX + "e3dg7f41c9a2b85d06cafe51d2a9f0b4c7e8d13a"
WRONG_KEY = KEY_PREFIX + "e3dg0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a"
# Its own key: what its known leak leaves in the shared Prefect database must not fail the other Prefect test.
CONFIG_ERROR_KEY = KEY_PREFIX + "e3dg9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d"
KEYS = (KEY, WRONG_KEY, CONFIG_ERROR_KEY)
KEY_ENV = "E3DG_TEST_SECRET_KEY"
HAS_ECHO = "echo_key" in get_args(FailureKind)
NO_ECHO = "endpoint_sim has no FailureRule kind 'echo_key' (a 400 quoting the Authorization header) yet"
SAMPLES = 24
ECHOING = SimConfig(
    required_api_key=KEY,
    failures=(
        *((FailureRule(kind="echo_key", rate=0.25, attempts=None),) if HAS_ECHO else ()),
        FailureRule(kind="http", status=500, rate=0.15, attempts=1),
        FailureRule(kind="context_length", rate=0.1, attempts=None),
        FailureRule(kind="error_body", rate=0.1, attempts=1),
    ),
)


def leaks(text: str | bytes, where: str, keys: tuple[str, ...] = KEYS) -> list[str]:
    """Any 10 characters of a key's random part count: a key cut short (an error snippet, pydantic's elided
    input repr) still leaks."""
    data = text.encode() if isinstance(text, str) else text
    found = []
    for key in keys:
        secret = key.removeprefix(KEY_PREFIX).encode()
        hits = [secret[i : i + 10] for i in range(len(secret) - 9) if secret[i : i + 10] in data]
        found += [f"{where}: {hits[0].decode()} of {key}"] if hits else []
    return found


def tree_leaks(root: Path) -> list[str]:
    """Every file's raw bytes; Parquet also decoded (values are compressed on disk) with its key-value metadata."""
    found: list[str] = []
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files, f"nothing under {root}"
    for path in files:
        found += leaks(path.read_bytes(), str(path))
        if path.suffix == ".parquet":
            table = pq.read_table(path)
            meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
            found += leaks(json.dumps([table.to_pylist(), meta], default=str, ensure_ascii=False), f"{path} decoded")
    return found


def exception_leaks(exc: BaseException) -> list[str]:
    text = "".join(traceback.format_exception(exc)) + repr(exc) + str(exc) + repr(exc.args)
    return leaks(text, f"{type(exc).__name__}")


def write_config(work: Path, base_url: str, tokenizer_dir: Path, *, api_key: str | None = KEY, **endpoint: Any) -> Path:
    """`work`/config.yaml for a run in `work`/run; without `api_key` the key comes from `KEY_ENV`."""
    key = {"api_key": api_key} if api_key is not None else {"api_key_env": KEY_ENV}
    config = {
        "run_dir": str(work / "run"),
        "samples_per_shard": 8,
        # demo_b1 holds malformed rows, so a quarantine file is written (and searched) too
        "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": SAMPLES}],
        "endpoint": {
            "base_url": base_url,
            "model": "sim/deepseek-v4-sim",
            "max_in_flight": 8,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "commit_every_samples": 3,
            "price_prompt_usd_per_mtok": 0.6,
            "price_completion_usd_per_mtok": 2.5,
            "progress_every_s": 0.1,
            **endpoint,
            **key,  # last, as people often write it: pydantic's elided repr of the mapping keeps its tail
        },
        "sampling": {"max_tokens": 1024},
        "tokenizer": {"path": str(tokenizer_dir)},
        # failures on purpose: the test is about where the key goes
        "validation": {"max_failed_rate": 1.0, "max_deterministic_failed_rate": 1.0},
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_config_without_model(work: Path, tokenizer_dir: Path) -> Path:
    """pydantic quotes a failed model's input: for a missing `endpoint.model`, the endpoint mapping with its key."""
    config = write_config(work, "http://127.0.0.1:9", tokenizer_dir, api_key=CONFIG_ERROR_KEY)
    broken = yaml.safe_load(config.read_text())
    del broken["endpoint"]["model"]
    config.write_text(yaml.safe_dump(broken, sort_keys=False))
    return config


@pytest.fixture(scope="module")
def echoing_server(tokenizer_dir: Path) -> Iterator[SimulatorServer]:
    with SimulatorServer(tokenizer_dir, ECHOING) as server:
        yield server


@pytest.fixture()
def echoing(echoing_server: SimulatorServer) -> SimulatorServer:
    """Attempt numbers start over, so every test meets the first-attempt failures too."""
    echoing_server.reset_stats()
    return echoing_server


class _EchoRefusal(BaseHTTPRequestHandler):
    """A gateway that refuses every request with 401 and quotes the Authorization header it received."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        body = json.dumps({"error": {"code": 401, "message": f"invalid credentials: {auth}"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def refusing() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoRefusal)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def cli_generate(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "flows.cli", "generate", str(config)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def failed_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for ref in done_parts(run_dir, "responses") for r in read_part(ref).to_pylist() if r["status"] != "done"]


def assert_echoes_were_redacted(run_dir: Path) -> None:
    """The test means something only if the endpoint did quote the header and the rows kept the redacted quote."""
    echoed = [r for r in failed_rows(run_dir) if r["failure_reason"] == "http_400" and "Authorization" in r["error"]]
    assert echoed, "no echoed Authorization header reached a row"
    assert all("Bearer ***" in r["error"] for r in echoed), echoed[0]["error"]


@pytest.mark.parametrize("source", ["config", "env"])
def test_cli_generate_keeps_the_key_out_of_output_and_files(
    tmp_path: Path, tokenizer_dir: Path, echoing: SimulatorServer, source: str
) -> None:
    if not HAS_ECHO:
        pytest.skip(NO_ECHO)
    env = {**os.environ, KEY_ENV: KEY} if source == "env" else None
    config = write_config(tmp_path, echoing.base_url, tokenizer_dir, api_key=KEY if source == "config" else None)
    done = cli_generate(config, env)
    assert done.returncode == 0, done.stderr
    total = json.loads(done.stdout.strip().splitlines()[-1])
    assert total["done"] > 0 and total["failed"] > 0
    run_dir = tmp_path / "run"
    assert (run_dir / "prompts" / "_quarantine.jsonl").stat().st_size > 0
    assert_echoes_were_redacted(run_dir)
    assert leaks(done.stdout + done.stderr, "CLI output") + tree_leaks(run_dir) == []


@pytest.mark.slow  # two CLI processes (the key-from-config CLI test stays in make test): make test-long
def test_a_refused_key_leaks_neither_from_the_cli_nor_from_the_exception(
    tmp_path: Path, tokenizer_dir: Path, echoing: SimulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path, echoing.base_url, tokenizer_dir, api_key=WRONG_KEY)
    refused = cli_generate(config)
    assert refused.returncode == 4 and "401" in refused.stderr, refused.stderr
    assert leaks(refused.stdout + refused.stderr, "CLI output") == []

    caplog.set_level(logging.DEBUG)
    with pytest.raises(FatalEndpointError) as raised:
        generate_without_prefect(load_config(config))
    assert "401" in str(raised.value)
    assert exception_leaks(raised.value) + leaks(caplog.text, "log records") + tree_leaks(tmp_path / "run") == []


def test_cli_config_error_does_not_echo_the_key(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = write_config_without_model(tmp_path, tokenizer_dir)
    refused = cli_generate(config)
    assert refused.returncode == 2 and "endpoint.model" in refused.stderr, refused.stderr
    assert leaks(refused.stdout + refused.stderr, "CLI output") == []


@pytest.mark.slow  # a CLI process and a run against a refusing gateway: make test-long
def test_a_fatal_answer_quoting_the_key_is_redacted(
    tmp_path: Path, tokenizer_dir: Path, refusing: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path, refusing, tokenizer_dir)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(FatalEndpointError) as raised:
        generate_without_prefect(load_config(config))
    assert "invalid credentials: Bearer ***" in str(raised.value)
    assert exception_leaks(raised.value) + leaks(caplog.text, "log records") == []

    refused = cli_generate(config)
    assert refused.returncode == 4 and "Bearer ***" in refused.stderr, refused.stderr
    assert leaks(refused.stdout + refused.stderr, "CLI output") + tree_leaks(tmp_path / "run") == []


def test_in_process_generate_logs_and_stores_no_key(
    tmp_path: Path, tokenizer_dir: Path, echoing: SimulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A first pass stopped by the cost cap leaves its rows (chunks, or finished parts); the second finishes the
    rest."""
    if not HAS_ECHO:
        pytest.skip(NO_ECHO)
    caplog.set_level(logging.DEBUG)
    config = write_config(tmp_path, echoing.base_url, tokenizer_dir)
    found: list[str] = []
    for cap in (0.004, None):
        summary, _ = generate_without_prefect(load_config(config, {"endpoint.max_cost_usd": cap}))
        found += leaks(json.dumps(summary.to_dict()), "summary") + tree_leaks(tmp_path / "run")
        if cap is not None:
            assert summary.stopped == "budget"
            # its rows sit in chunks, or in a finished part when a whole part was answered before the cap
            assert list((tmp_path / "run" / "responses").rglob("*.parquet")), "the capped pass left no rows"
    assert summary.stopped is None and summary.total()["failed"] > 0
    assert_echoes_were_redacted(tmp_path / "run")
    records = "\n".join(f"{r.name} {r.getMessage()} {r.args!r} {r.exc_text}" for r in caplog.records)
    assert found + leaks(caplog.text + records, "log records") == []


def prefect_records(flow_run_id: Any) -> dict[str, str]:
    """What Prefect keeps about one flow run, read back through its API: label -> JSON."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    records = {f"flow run {flow_run.name}": flow_run.model_dump_json()}
    records |= {f"task run {t.name}": t.model_dump_json() for t in task_runs}
    records |= {f"artifact {a.key} {a.id}": a.model_dump_json() for a in artifacts}
    records |= {f"log {log.id}": log.model_dump_json() for log in logs}
    return records


def prefect_files() -> list[Path]:
    """The harness's database (parameters, states, logs, artifacts, events as stored) and PREFECT_HOME."""
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_DATABASE_CONNECTION_URL

    db = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    return [p for p in [*db.parent.glob(f"{db.name}*"), *Path(PREFECT_HOME.value()).rglob("*")] if p.is_file()]


@pytest.mark.usefixtures("prefect_harness")
def test_prefect_generate_flow_keeps_the_key_out_of_every_record(
    tmp_path: Path, tokenizer_dir: Path, echoing: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flow runs with the key in the YAML file and with it in the environment (`api_key_env`)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler

    from flows.params import RunParameters
    from flows.pipeline import generate_flow, prepare_flow

    monkeypatch.setenv(KEY_ENV, KEY)
    found: list[str] = []
    flow_runs = []
    for source in ("config", "env"):
        work = tmp_path / source
        work.mkdir()
        config = write_config(work, echoing.base_url, tokenizer_dir, api_key=KEY if source == "config" else None)
        params = RunParameters(config_path=str(config))
        prepared = prepare_flow(params, return_state=True)
        assert prepared.is_completed(), prepared.message
        state = generate_flow(params, return_state=True)
        assert state.is_completed(), state.message
        assert state.result()["total"]["done"] > 0
        if HAS_ECHO:
            assert_echoes_were_redacted(work / "run")
        found += tree_leaks(work / "run") + leaks(json.dumps(state.result(), default=str), "flow result")
        flow_runs += [prepared.state_details.flow_run_id, state.state_details.flow_run_id]

    APILogHandler().flush()
    EventsWorker.drain_all(timeout=30)
    for flow_run_id in flow_runs:
        records = prefect_records(flow_run_id)
        found += [x for label, text in records.items() for x in leaks(text, label)]
        labels = " ".join(records)
        assert "task run " in labels and "log " in labels, labels
    generate_labels = " ".join(prefect_records(flow_runs[1]))
    for key in ("generate-progress-run", "generate-summary-run"):
        assert f"artifact {key} " in generate_labels, generate_labels
    stored = [path.read_bytes() for path in prefect_files()]
    assert any(str(tmp_path / "env" / "config.yaml").encode() in data for data in stored), "database not searched"
    found += [x for data in stored for x in leaks(data, "Prefect database or PREFECT_HOME", keys=(KEY,))]
    assert found == []


@pytest.mark.usefixtures("prefect_harness")
def test_a_config_error_in_a_prefect_flow_does_not_echo_the_key(tmp_path: Path, tokenizer_dir: Path) -> None:
    """pydantic quotes the input of a failed validation: for a missing `endpoint.model` that is the whole
    endpoint mapping, key included. The flow's failure (state message, logged traceback) must not carry it."""
    from prefect.logging.handlers import APILogHandler

    from flows.params import RunParameters
    from flows.pipeline import generate_flow

    config = write_config_without_model(tmp_path, tokenizer_dir)
    state = generate_flow(RunParameters(config_path=str(config)), return_state=True)
    assert state.is_failed()
    assert "model" in (state.message or "")
    APILogHandler().flush()
    records = prefect_records(state.state_details.flow_run_id)
    found = leaks(state.message or "", "state message")
    found += [x for label, text in records.items() for x in leaks(text, label)]
    found += [x for path in prefect_files() for x in leaks(path.read_bytes(), str(path))]
    assert found == []
