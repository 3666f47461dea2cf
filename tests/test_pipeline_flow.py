"""The whole DAG under a real Prefect run against the real simulator, on the bundled demo config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import demo_config_path
from flows.params import RunParameters, resolve_run
from flows.pipeline import pipeline
from tasks.common.config import TokenizerConfig
from tasks.common.schemas import SCORES_STAGE as SCORES
from tasks.common.schemas import STAGES
from tasks.common.shards import PartRef, done_parts, read_part
from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt
from tasks.validate.checks import summarize_validation
from tests.conftest import DEMO_DATA


def _table(run_dir: Path, stage: str) -> pa.Table:
    return pa.concat_tables([read_part(r) for r in done_parts(run_dir, stage)])


def _sim_total(base_url: str) -> int:
    stats: dict[str, Any] = httpx.get(f"{base_url}/_sim/stats", timeout=10).json()
    return int(stats["total_requests"])


def _task_runs(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return list(client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))))


def _artifact_keys(flow_run_id: Any) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key for a in artifacts if a.key}


@pytest.mark.usefixtures("prefect_harness")
def test_pipeline_runs_every_stage_under_prefect_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    with SimulatorServer(tiny_model_dir, SimConfig(noncanonical_rate=0.3)) as sim:
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(tiny_model_dir),
        }
        run = RunParameters(config_path=str(demo_config_path()), overrides=overrides)
        state = pipeline(run, return_state=True)
        assert state.is_completed(), state.message
        stats = state.result()

        for stage in STAGES:
            refs = done_parts(run_dir, stage)
            assert refs, f"no finished {stage} parts"
            assert all(r.path.stat().st_size > 0 for r in refs)
        assert list((run_dir / "hidden_states" / "_data").glob("*.safetensors"))
        quarantine = (run_dir / "prompts" / "_quarantine.jsonl").read_text().splitlines()
        assert len(quarantine) == 9

        prompts = _table(run_dir, "prompts")
        responses = _table(run_dir, "responses")
        tokens = _table(run_dir, "tokens")
        validation = _table(run_dir, "validation")
        index = _table(run_dir, "hidden_states")
        assert prompts.num_rows == 80
        assert responses.num_rows == 80
        assert set(responses["status"].to_pylist()) == {"done"}
        assert tokens.num_rows == 80
        classes = validation["reference_match"].to_pylist()
        assert classes.count("bpe_artifact") > 0
        assert classes.count("real_difference") == 0
        assert index.num_rows == validation.filter(pa.compute.not_equal(validation["verdict"], "fail")).num_rows

        tokenizer = load_tokenizer(TokenizerConfig(path=tiny_model_dir))
        row = tokens.slice(0, 1).to_pylist()[0]
        by_id_prompt = {r["sample_id"]: r for r in prompts.to_pylist()}
        by_id_resp = {r["sample_id"]: r for r in responses.to_pylist()}
        p, r = by_id_prompt[row["sample_id"]], by_id_resp[row["sample_id"]]
        expected = (
            render_prompt(tokenizer, p["messages"]) + f"{r['reasoning']}</think>{r['content']}<｜end▁of▁sentence｜>"
        )
        assert tokenizer.decode(row["input_ids"]) == expected

        n_parts = len(stats["prepare"]["parts"])
        task_runs = _task_runs(state.state_details.flow_run_id)
        assert len(task_runs) <= 4 * n_parts + 5, "Prefect bookkeeping must be O(parts), not O(samples)"
        keys = _artifact_keys(state.state_details.flow_run_id)
        # keys end in the run directory's name (flows/artifact_keys.py), one history per run directory
        assert {f"{k}-run" for k in ("validation-summary", "generate-progress", "generate-summary")} <= keys
        assert "failed-samples-b1-run" in keys
        assert "generate-status" not in keys, "one progress card, updated in place"
        assert json.loads((run_dir / "run_summary.json").read_text())["run_dir"] == str(run_dir)
        for stage in STAGES:  # parts and markers only: reports live in reports/, quarantine and shards under _ names
            assert pq.read_table(run_dir / stage).num_rows == sum(
                read_part(r, ["sample_id"]).num_rows for r in done_parts(run_dir, stage)
            ), stage
        assert (run_dir / "reports" / "report.html").is_file() and (run_dir / "reports" / "summary.json").is_file()
        scores = pa.concat_tables([read_part(r, ["sample_id", "scored_tokens"]) for r in done_parts(run_dir, SCORES)])
        assert sorted(scores["sample_id"].to_pylist()) == sorted(index["sample_id"].to_pylist())
        assert min(scores["scored_tokens"].to_pylist()) > 0
        assert {"provider-parity-run", "provider-parity-table-run"} <= keys
        assert "## Provider parity" in (run_dir / "reports" / "report.md").read_text()
        assert stats["scores"]["scored_samples"] == index.num_rows

        sent = _sim_total(sim.base_url)
        marker_times = {str(r): r.marker.stat().st_mtime_ns for s in (*STAGES, SCORES) for r in done_parts(run_dir, s)}
        again = pipeline(run, return_state=True)
        assert again.is_completed(), again.message
        assert _sim_total(sim.base_url) == sent, "a rerun re-sent requests for finished samples"
        assert {
            str(r): r.marker.stat().st_mtime_ns for s in (*STAGES, SCORES) for r in done_parts(run_dir, s)
        } == marker_times
        assert PartRef(run_dir, "tokens", 0).is_done()
        # Nothing to build: no task run per part, no estimate of nothing; the summary and status the rerun
        # publishes are the ones recorded for these inputs, equal to what reading every part again gives.
        rerun = again.result()
        assert sorted(t.name.rsplit("-", 1)[0] for t in _task_runs(again.state_details.flow_run_id)) == [
            "prepare",
            "validation-report",
        ]
        assert rerun["validation_summary"] == stats["validation_summary"]
        assert rerun["validation_summary"] == summarize_validation(resolve_run(run).cfg)
        assert rerun["status"] == stats["status"] and rerun["status"]["consistent"]
        keys = _artifact_keys(again.state_details.flow_run_id)
        scoped = {f"{k}-run" for k in ("validation-summary", "validation-report", "run-status", "run-status-table")}
        assert scoped | {"run-summary-run"} <= keys


@pytest.mark.usefixtures("prefect_harness")
def test_crossed_gate_fails_the_run_after_writing_the_report_and_a_failure_summary(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from prefect.artifacts import Artifact

    run_dir = tmp_path / "gated"
    with SimulatorServer(tiny_model_dir, SimConfig(text_mismatch_rate=0.5)) as sim:
        run = RunParameters(
            config_path=str(demo_config_path()),
            overrides={
                "run_dir": str(run_dir),
                "endpoint.base_url": sim.base_url,
                "tokenizer.path": str(tiny_model_dir),
                "validation.max_real_difference_rate": 0.01,
                "datasets": [{"name": "B3", "path": str(DEMO_DATA / "demo_b3.parquet"), "shape": "sharegpt"}],
            },
        )
        state = pipeline(run, return_state=True)
    assert state.is_failed()
    assert "real_difference" in (state.message or "") or "gate" in (state.message or "").lower()
    # The UI's sidebar shows the message's first line, cut: it is a whole summary with the numbers (a UI probe)
    first = (state.message or "").splitlines()[0]
    assert "ValidationGateError: validation gates crossed (" in first and first.endswith("(details below)"), first
    assert "real_difference_rate" in first and "> max_real_difference_rate 0.01" in first and len(first) < 320
    assert (run_dir / "reports" / "report.md").exists()
    assert not done_parts(run_dir, "hidden_states"), "extraction must not run past a crossed gate"
    summary = Artifact.get("failure-summary-gated")
    assert summary is not None and summary.flow_run_id == state.state_details.flow_run_id
    assert "validation: 2" in str(summary.data) and "hidden_states: 0" in str(summary.data)
    # The gate is one line in the run's log too, not two tracebacks (an independent UI probe counted ~75 lines).
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    failures = [log.message for log in logs if "Encountered exception" in log.message]
    assert failures and not [m for m in failures if "Traceback" in m], failures


@pytest.mark.usefixtures("prefect_harness")
def test_a_run_that_completes_replaces_the_failure_summary_of_one_that_failed(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The UI's Retry of a failed run that then completes, or a new trigger of the same run directory, left the
    failure-summary of the run that failed as the latest version of the key (independent UI probes): the run that
    completes writes its own."""
    from prefect.artifacts import Artifact

    import flows.pipeline as pipeline_module

    attempts: list[int] = []

    def fails_once(cfg: Any, store: Any, run: Any) -> dict[str, Any]:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")
        return {"run_dir": str(cfg.run_dir)}

    monkeypatch.setattr(pipeline_module, "run_pipeline", fails_once)
    run = RunParameters(
        config_path=str(demo_config_path()),
        overrides={"run_dir": str(tmp_path / "retried"), "tokenizer.path": str(tiny_model_dir)},
    )
    state = pipeline.with_options(retries=1, retry_delay_seconds=0)(run, return_state=True)
    assert state.is_completed() and len(attempts) == 2
    assert Artifact.get("failure-summary-retried") is None, "an attempt Prefect retries writes no failure-summary"

    # Failed, then triggered again (the probe's case; the UI's Retry of the failed run is the same flow run with
    # run_count 2): the completed run writes its own; a clean run after a clean run writes nothing more.
    attempts.clear()
    failed = pipeline(run, return_state=True)
    assert (
        failed.is_failed() and Artifact.get("failure-summary-retried").flow_run_id == failed.state_details.flow_run_id
    )
    again = pipeline(run, return_state=True)
    summary = Artifact.get("failure-summary-retried")
    assert again.is_completed() and summary is not None and summary.flow_run_id == again.state_details.flow_run_id
    assert "completed (attempt 1)" in str(summary.data)
    assert pipeline(run, return_state=True).is_completed()
    assert Artifact.get("failure-summary-retried").flow_run_id == again.state_details.flow_run_id


@pytest.mark.usefixtures("prefect_harness")
def test_a_run_refused_before_prepare_writes_nothing_and_claims_no_stages(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A form naming an unknown extract deployment is refused before prepare (a UI probe): the failure summary
    was the error plus an empty stage table, 'stages disagree', 'It resumes from the finished parts above', and
    the hook created the run directory with `_status.json` and an empty failed-samples file."""
    from prefect.artifacts import Artifact

    run_dir = tmp_path / "refused"
    run = RunParameters(
        config_path=str(demo_config_path()),
        overrides={"run_dir": str(run_dir), "tokenizer.path": str(tiny_model_dir)},
        extract_deployment="eagle3-extract/nope",
    )
    state = pipeline(run, return_state=True)
    assert state.is_failed() and "no such deployment" in (state.message or "")
    assert not run_dir.exists()
    summary = str(Artifact.get("failure-summary-refused").data)
    assert "no such deployment" in summary and "Nothing to resume" in summary
    assert "resumes from" not in summary and "stages disagree" not in summary and "prompts: 0" not in summary
    assert Artifact.get("failed-samples-b1-refused") is None
