"""The cost cap under a real Prefect run: the flow completes as "BudgetStopped" with the spend under the cap and
nothing after generate run, and a rerun with a higher cap sends only the samples that were never answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import demo_config_path
from flows.params import RunParameters
from flows.pipeline import pipeline
from tasks.common.shards import done_parts, read_part
from tasks.generate.chunks import chunk_paths, read_chunk

CAP_USD = 0.02


def _sim_total(base_url: str) -> int:
    stats: dict[str, Any] = httpx.get(f"{base_url}/_sim/stats?keys=0", timeout=10).json()
    return int(stats["total_requests"])


def _rows_on_disk(run_dir: Path, parts: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    finished = {r.part for r in done_parts(run_dir, "responses")}
    for part in parts:
        if part in finished:
            rows += read_part(next(r for r in done_parts(run_dir, "responses") if r.part == part)).to_pylist()
        else:
            for path in chunk_paths(run_dir, part):
                rows += read_chunk(path)
    return rows


def _flow_run_tags(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return list(client.read_flow_run(flow_run_id).tags)


@pytest.mark.slow  # moved to make test-long (CI runs both) to keep make test near 6 minutes
@pytest.mark.usefixtures("prefect_harness")
def test_budget_stop_is_clean_and_resumable(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    with SimulatorServer(tiny_model_dir, SimConfig()) as sim:
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(tiny_model_dir),
            "endpoint.max_cost_usd": CAP_USD,
            "extract.enabled": False,
        }
        state = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides), return_state=True)
        # a plain Completed, so the deployment page (which lists runs by state name) shows it; tagged and named
        assert state.is_completed() and state.name == "Completed", (state.name, state.message)
        assert (state.message or "").startswith("BudgetStopped: ") and "max_cost_usd" in (state.message or "")
        assert "budget-stopped" in _flow_run_tags(state.state_details.flow_run_id)
        stats = state.result()
        total = stats["generate"]["total"]
        assert total["stopped"] == "budget"
        assert 0 < total["run_dir_counted_usd"] <= CAP_USD and total["run_dir_pending_usd"] == 0.0
        assert not (run_dir / "tokens").exists(), "stages after generate must not run on a budget stop"

        parts = stats["prepare"]["parts"]
        rows = _rows_on_disk(run_dir, parts)
        done_first = {r["sample_id"] for r in rows if r["status"] == "done"}
        assert 0 < len(done_first) < 80
        assert sum(r["cost_usd"] or 0.0 for r in rows) <= CAP_USD
        sent_first = _sim_total(sim.base_url)
        assert sent_first == sum(r["attempts"] for r in rows), "every request sent must be on disk after a stop"

        rerun = RunParameters(
            config_path=str(demo_config_path()), overrides={**overrides, "endpoint.max_cost_usd": 1.0}
        )
        state = pipeline(rerun, return_state=True)
        assert state.is_completed() and state.name == "Completed", (state.name, state.message)
        responses = pa.concat_tables([read_part(r) for r in done_parts(run_dir, "responses")])
        assert responses.num_rows == 80 and set(responses["status"].to_pylist()) == {"done"}
        assert _sim_total(sim.base_url) - sent_first == 80 - len(done_first)
        assert len(done_parts(run_dir, "validation")) == len(parts)
