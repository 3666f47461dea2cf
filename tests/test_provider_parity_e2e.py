"""Provider parity end to end (make test-long): `eagle3-datagen run` under Prefect against the simulator serving
two providers of the tiny target. One is the target itself; the other is either a copy of it with noise added to
its weights (it must be named in the report, the artifact and the exit status, as the gate is configured) or a
second unperturbed host (no provider may be named: no false alarm, at the sample count the report states)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from endpoint_sim.assets import build_tiny_model_dir
from endpoint_sim.model_backend import ModelResponder
from endpoint_sim.providers import ProviderPool, SimProvider, write_noised_model_dir
from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from flows.exit_codes import ExitCode
from tests.test_cli_errors import cli

pytestmark = pytest.mark.slow

PROMPTS_PER_DATASET = 24
SIM = SimConfig(reasoning_words=(6, 12), content_words=(4, 8), tool_call_rate=0.0)


@pytest.fixture(scope="module")
def prefect_api(prefect_harness: None) -> str:
    """`run` runs as a real process (Prefect's logging as a user sees it) against the session's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny target (fast decode; aux layers 0, 1, 2)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("target"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def responder(target: Path) -> ModelResponder:
    return ModelResponder(target, SIM)


@pytest.fixture(scope="module")
def noisy(target: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelResponder:
    """The same model with Gaussian noise as large as each weight matrix's own spread: a broken conversion."""
    return ModelResponder(write_noised_model_dir(target, tmp_path_factory.mktemp("noisy"), relative_noise=1.0), SIM)


def write_config(tmp_path: Path, base_url: str, target: Path, gate: str) -> Path:
    datasets = []
    for name in ("X", "Y"):
        path = tmp_path / f"{name}.jsonl"
        rows = [
            {"messages": [{"role": "user", "content": f"{name} question {i}: explain topic {i * 7 % 13}."}]}
            for i in range(PROMPTS_PER_DATASET)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        datasets.append({"name": name, "path": str(path)})
    config = {
        "run_dir": str(tmp_path / "run"),
        "samples_per_shard": 16,
        "datasets": datasets,
        "endpoint": {"kind": "openai_chat", "base_url": base_url, "model": "sim/tiny", "max_in_flight": 16},
        "tokenizer": {"path": str(target), "completion_format": "deepseek_v4_thinking"},
        "extract": {"device": "cpu", "dtype": "float32", "layers": [0, 1, 2]},
        "scoring": {"parity_gate": gate, "parity_min_samples": 10},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture()
def served(request: pytest.FixtureRequest, target: Path, responder: ModelResponder) -> Iterator[SimulatorServer]:
    other = request.getfixturevalue("noisy") if request.param == "noisy" else responder
    pool = ProviderPool([SimProvider("Target", responder), SimProvider("Other", other)])
    with SimulatorServer(target, SIM, responder=pool) as sim:
        yield sim


def _summary(tmp_path: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((tmp_path / "run" / "reports" / "scores.json").read_text())["summary"]
    return summary


@pytest.mark.parametrize("served", ["noisy"], indirect=True)
def test_the_perturbed_provider_is_named_and_the_gate_acts_as_configured(
    tmp_path: Path, target: Path, served: SimulatorServer, prefect_api: str
) -> None:
    config = write_config(tmp_path, served.base_url, target, gate="fail")
    failed = cli("run", str(config), "--no-progress", prefect_api=prefect_api)
    assert failed.returncode == ExitCode.GATES, failed.stderr
    error = failed.stderr.strip().splitlines()[-1]  # after transformers' weight-loading progress bars
    assert error.startswith("error: provider parity gate crossed") and "'Other'" in error
    summary = _summary(tmp_path)
    assert summary["named"] == ["Other"] and summary["scored_samples"] == 2 * PROMPTS_PER_DATASET
    other = next(p for p in summary["providers"] if p["serving"] == "Other")
    nll = other["comparisons"]["mean_nll"]
    assert nll["difference"] > 0.05 and nll["ci95_low"] > 0 and nll["samples"] + nll["rest_samples"] == 48
    report = (tmp_path / "run" / "reports" / "report.md").read_text()
    assert report.startswith("# Validation report") and "## Provider parity" in report
    assert f"on {nll['samples']} vs {nll['rest_samples']} samples over 2 datasets" in report
    assert 'ignore: ["Other"]' in report, "the routing hint drops the named provider"

    sent = httpx.get(f"{served.base_url}/_sim/stats", timeout=10).json()["total_requests"]
    warned = cli("run", str(config), "--no-progress", "--set", "scoring.parity_gate=warn", prefect_api=prefect_api)
    assert warned.returncode == ExitCode.OK, warned.stderr
    assert "provider parity" in warned.stdout and "NAMED" in warned.stdout
    assert httpx.get(f"{served.base_url}/_sim/stats", timeout=10).json()["total_requests"] == sent

    status = cli("status", str(tmp_path / "run"), "--json")
    counts = json.loads(status.stdout)["counts"]
    assert status.returncode == ExitCode.OK
    assert all(c["hidden_states/_scores"]["done"] == c["hidden_states"]["done"] > 0 for c in counts.values())


@pytest.mark.parametrize("served", ["same"], indirect=True)
def test_two_unperturbed_providers_name_no_one(
    tmp_path: Path, target: Path, served: SimulatorServer, prefect_api: str
) -> None:
    config = write_config(tmp_path, served.base_url, target, gate="fail")
    result = cli("run", str(config), "--no-progress", prefect_api=prefect_api)
    assert result.returncode == ExitCode.OK, result.stderr
    summary = _summary(tmp_path)
    assert summary["named"] == [] and summary["scored_samples"] == 2 * PROMPTS_PER_DATASET
    assert {p["serving"] for p in summary["providers"]} == {"Target", "Other"}
    assert all(p["judged"] and not p["beyond_margin"] for p in summary["providers"])
    assert (
        "no provider named (2 of 2 judged, 48 scored samples)"
        in (tmp_path / "run" / "reports" / "report.md").read_text()
    )
