"""`eagle3-datagen generate` against the simulator (the first test as a real subprocess, the others through the
console script's `main` in this process): exit codes, the per-dataset table, the JSON total, the non-terminal
status line, no Prefect import, and an API key that never reaches the output."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_sim.server import SimConfig, SimulatorServer
from tests.conftest import DEMO_DATA, REPO, run_main

API_KEY = "sk-test-5f1c9e0a7b3d-must-never-be-printed"
SAMPLES = 6
# Runs flows.cli.main as the console script does, then reports whether anything imported Prefect.
ENTRY = (
    "import sys; from flows.cli import main; rc = main(sys.argv[1:]); "
    "print('prefect imported:', 'prefect' in sys.modules, file=sys.stderr); sys.exit(rc)"
)


@pytest.fixture(scope="module")
def sim(tokenizer_dir: Path) -> Iterator[SimulatorServer]:
    with SimulatorServer(tokenizer_dir, SimConfig(required_api_key=API_KEY)) as server:
        yield server


def write_config(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, **endpoint: Any) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "samples_per_shard": 4,
        "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": SAMPLES}],
        "endpoint": {
            "base_url": sim.base_url,
            "model": "sim/deepseek-v4-sim",
            "api_key": API_KEY,
            "max_in_flight": 4,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "price_prompt_usd_per_mtok": 0.6,
            "price_completion_usd_per_mtok": 2.5,
            "progress_every_s": 0.2,
            **endpoint,
        },
        "sampling": {"max_tokens": 1024},
        "tokenizer": {"path": str(tokenizer_dir)},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def generate(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", ENTRY, "generate", str(config), *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert API_KEY not in done.stdout + done.stderr
    assert "prefect imported: False" in done.stderr
    return done


def generate_here(capsys: pytest.CaptureFixture[str], config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The console script's `main` in this process (a process start costs seconds; the first test runs one)."""
    done = run_main(capsys, "generate", str(config), *extra)
    assert API_KEY not in done.stdout + done.stderr
    return done


def total_line(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")]


def test_generate_completes_prints_the_table_and_the_total(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, sim, tokenizer_dir)
    done = generate(config)
    assert done.returncode == 0, done.stderr
    total = total_line(done)
    assert (total["samples"], total["done"], total["stopped"]) == (SAMPLES, SAMPLES, None)
    assert "responses per dataset" in done.stdout
    table = {cells[0]: cells[1:] for cells in map(table_cells, done.stdout.splitlines()) if len(cells) == 2}
    assert table["metric"] == ["B1"]
    assert [table[m][0] for m in ("samples", "done", "failed", "pending")] == [str(SAMPLES), str(SAMPLES), "0", "0"]
    assert "SimProvider" in table["providers"][0]
    # stdout is no terminal here: progress goes to stderr as status lines, the last one for the final snapshot
    status = [line for line in done.stderr.splitlines() if line.startswith("generate ")]
    assert status and status[-1].startswith(f"generate {SAMPLES}/{SAMPLES} (100.0%)")
    assert "finished in" in status[-1]

    again = generate_here(capsys, config, "--no-progress")
    assert again.returncode == 0, again.stderr
    assert total_line(again)["requests_sent"] == 0
    assert not [line for line in again.stderr.splitlines() if line.startswith("generate ")]


def test_budget_cap_exits_3_and_a_higher_cap_continues_without_resending(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # worst case per request ~ 1024 completion tokens * $2.5/Mtok = $0.0026; real answers cost ~ $0.0004
    config = write_config(tmp_path, sim, tokenizer_dir, max_cost_usd=0.0032, max_in_flight=1, min_in_flight=1)
    stopped = generate_here(capsys, config, "--no-progress", "--set", "endpoint.max_attempts=4")
    assert stopped.returncode == 3, stopped.stderr
    first = total_line(stopped)
    assert first["stopped"] == "budget" and 0 < first["done"] < SAMPLES
    assert "stopped at the budget cap" in stopped.stderr and "endpoint.max_cost_usd" in stopped.stderr
    # the command it suggests is the one that ran (its overrides kept: one may name the run directory)
    assert "--set endpoint.max_attempts=4 --set endpoint.max_cost_usd=<higher>" in stopped.stderr
    assert "Traceback" not in stopped.stderr

    # `status` shows what the stopped run bought: the stage table counts finished parts only, so the answers
    # committed in the unfinished part and the spend ledger are listed beside it.
    shown = run_main(capsys, "status", str(tmp_path / "run"), "--json")
    status = json.loads(shown.stdout)
    table_done = sum(stages["responses"]["done"] for stages in status["counts"].values())
    waiting = sum(status["answers_in_unfinished_parts"].values())
    assert waiting > 0 and table_done + waiting == first["done"]
    assert status["spend"]["answered_attempts"] == first["done"] and status["spend"]["billed_usd"] > 0
    text = run_main(capsys, "status", str(tmp_path / "run")).stdout
    assert f"responses: {waiting} answers" in text and "spend ledger: $" in text

    resumed = generate_here(capsys, config, "--no-progress", "--set", "endpoint.max_cost_usd=1.0")
    assert resumed.returncode == 0, resumed.stderr
    second = total_line(resumed)
    assert second["done"] == SAMPLES - first["done"], "already-done samples were sent again"
    assert second["requests_sent"] == SAMPLES - first["done"]


def test_a_refused_key_exits_4_with_the_message_and_no_traceback(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = "sk-wrong-9d2e4b-also-secret"
    config = write_config(tmp_path, sim, tokenizer_dir, api_key=wrong)
    refused = generate_here(capsys, config, "--no-progress")
    assert refused.returncode == 4  # flows/exit_codes.py: endpoint refused the run
    assert "401" in refused.stderr and "Traceback" not in refused.stderr
    assert wrong not in refused.stdout + refused.stderr


def test_a_model_id_the_provider_does_not_know_exits_4_after_the_first_window(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OpenRouter answers a wrong model id with HTTP 400 "<model> is not a valid model ID". Read as each sample's
    own failure, every prompt was sent only to be refused, the run exited 5 on its gates, and the provider's words
    were only in failed_samples.jsonl."""
    config = write_config(tmp_path, sim, tokenizer_dir, model="moonshotai/kimi-k2.5-typo")
    before = sim.stats(with_keys=False)["total_requests"]
    sim.update_config(refuse_other_models=True)
    try:
        refused = generate_here(capsys, config, "--no-progress")
    finally:
        sim.update_config(refuse_other_models=False)
    assert refused.returncode == 4, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "moonshotai/kimi-k2.5-typo is not a valid model ID" in errors[0] and "endpoint.model" in errors[0]
    assert sim.stats(with_keys=False)["total_requests"] - before <= 4  # the first window (max_in_flight) only
