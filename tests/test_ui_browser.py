"""The Prefect UI as a person sees it, in a real browser: a started Prefect server (UI on), a pipeline run through
`eagle3-datagen run` against the simulator injecting 503s, 429s, resets, 500s that never end, context-length
errors and truncated JSON; then the flow run's artifacts, the failed-samples artifact and the failure summary
opened in headless Chromium. The failed sample ids and their reasons must be on the page as text, no artifact
may show a literal `\\n`, and a task page's retry delay must be a number. Screenshots land in the test's output
folder (printed; `EAGLE3_UI_SCREENSHOTS` names another).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli_common import demo_config_path
from tests.browser import MISSING, Browser, chromium_path
from tests.conftest import REPO
from tests.prefect_cluster import PREFECT, Cluster, wait_until

pytestmark = pytest.mark.slow

FAULTS = SimConfig(
    failures=(
        FailureRule(status=503, rate=0.08, attempts=1),
        FailureRule(status=429, rate=0.08, attempts=1, retry_after_s=0.05),
        FailureRule(kind="reset", rate=0.05, attempts=1),
        FailureRule(status=500, rate=0.08, attempts=None),
        FailureRule(kind="context_length", status=400, rate=0.05, attempts=None),
        FailureRule(kind="truncated_json", rate=0.05, attempts=1),
    )
)
LITERAL_NEWLINE = re.compile(r"\\n")


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`prefect server start` with its UI on (the session's other servers run without one)."""
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    c = Cluster(tmp_path_factory.mktemp("ui-server"))
    c.server_env.update(PREFECT_UI_ENABLED="true", PREFECT_UI_API_URL=c.url)
    c.client_env["PREFECT_UI_ENABLED"] = "true"
    server = c.spawn(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(c.port)], c.server_env, "server.log"
    )
    try:
        wait_until("prefect server with UI", lambda: c.api("GET", "/health") is not None, server, c.root / "server.log")
        yield c
    finally:
        c.stop()


def _run_pipeline(
    c: Cluster, run_dir: Path, tiny_model_dir: Path, sim: SimulatorServer
) -> subprocess.CompletedProcess[str]:
    sets = {
        "run_dir": str(run_dir),
        "endpoint.base_url": sim.base_url,
        "tokenizer.path": str(tiny_model_dir),
        "extract.enabled": "false",
    }
    argv = [sys.executable, "-m", "flows.cli", "run", str(demo_config_path()), "--no-progress"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    env = {**c.client_env, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def _artifacts(c: Cluster, flow_run_id: str) -> dict[str, dict[str, Any]]:
    body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    return {a["key"]: a for a in c.api("POST", "/artifacts/filter", json=body) if a["key"]}


def test_failed_samples_read_in_a_browser(ui_server: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    c = ui_server
    out_dir = Path(os.environ.get("EAGLE3_UI_SCREENSHOTS", tmp_path / "screenshots"))
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with SimulatorServer(tiny_model_dir, FAULTS) as sim:
        result = _run_pipeline(c, run_dir, tiny_model_dir, sim)
    print(f"\npipeline run: {time.monotonic() - started:.1f} s")
    assert result.returncode == 5, (result.returncode, result.stderr[-3000:], result.stdout[-3000:])
    assert "max_failed_rate" in result.stderr

    failed = [json.loads(line) for line in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    generate_failed = [f for f in failed if f["stage"] == "responses"]
    assert {f["reason"] for f in generate_failed} >= {"http_500", "context_length"}, generate_failed
    (flow_run,) = c.api("POST", "/flow_runs/filter", json={"flow_runs": {"parent_task_run_id": {"is_null_": True}}})
    assert flow_run["state"]["type"] == "FAILED"
    artifacts = _artifacts(c, flow_run["id"])
    keys = {"failure-summary-run", "failed-samples-b1-run", "failed-samples-b3-run", "validation-summary-run"}
    assert keys <= set(artifacts)
    base = c.url.removesuffix("/api")

    browser = Browser(out_dir)
    try:
        browser.open(f"{base}/v2/runs/flow-run/{flow_run['id']}?tab=Artifacts")
        text = browser.wait_for(
            lambda t: "failed-samples-b1-run" in t and "failure-summary-run" in t, "the artifact cards"
        )
        browser.screenshot("flow-run-artifacts")
        assert not LITERAL_NEWLINE.search(text), "an artifact card shows a literal \\n"

        for dataset in ("b1", "b3"):
            # the artifact's rows in its order: failed samples by stage, then quarantined rows; the UI shows 10
            shown = [f for f in failed if f["dataset"].lower() == dataset][:10]
            expected = [f for f in shown if f["sample_id"] is not None]
            assert expected, f"no failed sample of {dataset} on the first page"
            browser.open(f"{base}/v2/artifacts/artifact/{artifacts[f'failed-samples-{dataset}-run']['id']}")
            text = browser.wait_for(
                lambda t, want=expected: all(f["sample_id"] in t for f in want), f"the failed ids of {dataset}"
            )
            browser.screenshot(f"failed-samples-{dataset}")
            rows = {cells[0]: cells for cells in browser.table_rows() if cells}
            header = rows.pop("sample_id")
            for f in expected:
                cells = dict(zip(header, rows[f["sample_id"]], strict=True))
                assert (cells["reason"], cells["class"]) == (f["reason"], f["class"]), (f, cells)
            assert not LITERAL_NEWLINE.search(text)

        browser.open(f"{base}/v2/artifacts/artifact/{artifacts['failure-summary-run']['id']}")
        text = browser.wait_for(lambda t: "What a rerun with the same parameters changes" in t, "the failure summary")
        browser.screenshot("failure-summary")
        assert not LITERAL_NEWLINE.search(text) and not text.lstrip().startswith('"')
        assert "max_failed_rate" in text and "retried by the next run" in text

        browser.open(f"{base}/v2/artifacts/artifact/{artifacts['validation-summary-run']['id']}")
        text = browser.wait_for(lambda t: "metric" in t and "B3" in t, "the validation summary")
        browser.screenshot("validation-summary")

        task_runs = c.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
        generate = next(t for t in task_runs if t["name"].startswith("generate"))
        for ui, path in (
            ("v2", f"/v2/runs/task-run/{generate['id']}?tab=Details"),
            ("v1", f"/runs/task-run/{generate['id']}"),
        ):
            browser.open(base + path)
            text = browser.wait_for(lambda t: "Retry Delay" in t, f"the {ui} task page's details")
            browser.screenshot(f"task-run-{ui}")
            assert "NaN" not in text, f"{ui}: {text[text.index('Retry Delay') :][:80]}"
    finally:
        browser.close()
    print(f"\nscreenshots: {out_dir}")
