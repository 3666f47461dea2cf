"""A nightly rerun over a run directory with deterministic failures (context length), run twice as the schedule
would: with the default gates both nights complete; with a gate a user tightened both nights fail with a message
naming the samples and the setting to change. Either way the second night sends nothing, and `status` agrees
with the run (its failed list says what the next run does; its exit code is the run's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli_common import demo_config_path
from flows.exit_codes import ExitCode
from flows.params import RunParameters
from flows.pipeline import pipeline
from tests.conftest import DEMO_DATA, run_main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

FAULTS = SimConfig(failures=(FailureRule(kind="context_length", status=400, rate=0.04, attempts=None),))


def _nights(run_dir: Path, model_dir: Path, sim: SimulatorServer, **extra: Any) -> list[Any]:
    overrides = {
        "run_dir": str(run_dir),
        "endpoint.base_url": sim.base_url,
        "tokenizer.path": str(model_dir),
        "extract.enabled": False,
        "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl")}],
        **extra,
    }
    states = []
    for _ in range(2):
        sent = sim.stats(with_keys=False)["total_requests"]
        states.append(
            pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides), return_state=True)
        )
        if len(states) == 2:
            assert sim.stats(with_keys=False)["total_requests"] == sent, "the second night sent a request"
    return states


def _deterministic(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    return [f for f in lines if f["class"] == "deterministic"]


def test_nightly_with_deterministic_failures_completes_under_the_default_gates(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with SimulatorServer(tiny_model_dir, FAULTS) as sim:
        states = _nights(run_dir, tiny_model_dir, sim)
    assert all(s.is_completed() for s in states), [s.message for s in states]
    failed = _deterministic(run_dir)
    assert 0 < len(failed) <= 0.10 * 48, "the fault rate must give a few failures, within the default gate"
    assert all(f["reason"] == "context_length" and f["rerun"].startswith("never as sent") for f in failed)
    status = run_main(capsys, "status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    payload = json.loads(status.stdout)
    assert payload["consistent"] and payload["gates_crossed"] == []
    listed = {f["sample_id"]: f["rerun"] for f in payload["failed_samples"] if f["class"] == "deterministic"}
    assert listed == {f["sample_id"]: f["rerun"] for f in failed}


def test_nightly_past_a_tightened_deterministic_gate_fails_both_nights_naming_samples_and_setting(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with SimulatorServer(tiny_model_dir, FAULTS) as sim:
        states = _nights(run_dir, tiny_model_dir, sim, **{"validation.max_deterministic_failed_rate": 0.0})
    failed = _deterministic(run_dir)
    assert failed
    for state in states:
        message = state.message or ""
        assert state.is_failed() and "max_deterministic_failed_rate" in message, message
        assert all(f["sample_id"] in message for f in failed[:5]), message
        assert "set validation.max_deterministic_failed_rate=" in message and "does not send them again" in message
    status = run_main(capsys, "status", str(run_dir))
    assert status.returncode == ExitCode.GATES, status.stderr
    assert (
        "validation gate crossed (a rerun stops here again): dataset 'B1': deterministic_failed_rate" in status.stderr
    )
    assert f"{len(failed)} deterministic (context_length {len(failed)}): never as sent" in status.stderr
