"""Reruns follow their inputs: every stage's parts are rebuilt exactly when the parts (or the config) they were
built from changed, under a real Prefect run against the real simulator, with the tiny model extracting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import demo_config_path
from flows.params import RunParameters
from flows.pipeline import pipeline
from tasks.common.schemas import SCORES_STAGE, STAGES
from tasks.common.shards import done_parts, read_marker, read_part
from tasks.status.report import run_status
from tests.conftest import DEMO_DATA

pytestmark = pytest.mark.slow  # minutes of real pipeline and training runs: make test-long (CI runs both)

PER_PART = 8


def _dataset(path: Path, rows: int) -> Path:
    """The first `rows` valid demo B1 rows (malformed demo lines are skipped: this test is about lineage)."""
    lines = []
    for line in (DEMO_DATA / "demo_b1.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        msgs = row.get("messages") if isinstance(row, dict) else None
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and m.get("content") for m in msgs):
            lines.append(line)
    path.write_text("".join(line + "\n" for line in lines[:rows]))
    return path


def _run(run_dir: Path, sim: SimulatorServer, model: Path, data: Path, **extra: Any) -> dict[str, Any]:
    overrides = {
        "run_dir": str(run_dir),
        "endpoint.base_url": sim.base_url,
        "tokenizer.path": str(model),
        "samples_per_shard": PER_PART,
        "datasets": [{"name": "B1", "path": str(data)}],
        **extra,
    }
    state = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides), return_state=True)
    assert state.is_completed(), state.message
    result: dict[str, Any] = state.result()
    return result


def _ids(run_dir: Path, stage: str) -> set[str]:
    refs = done_parts(run_dir, stage)
    return (
        set(pa.concat_tables([read_part(r, ["sample_id"]) for r in refs])["sample_id"].to_pylist()) if refs else set()
    )


def _builds(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Every finished part's recorded fingerprint and its file's mtime: what a rebuild would change."""
    return {
        str(r): (read_marker(r)["fingerprint"], r.path.stat().st_mtime_ns)
        for stage in STAGES
        for r in done_parts(run_dir, stage)
    }


def _not_failed(run_dir: Path) -> set[str]:
    table = pa.concat_tables([read_part(r, ["sample_id", "verdict"]) for r in done_parts(run_dir, "validation")])
    return {
        s
        for s, v in zip(table["sample_id"].to_pylist(), table["verdict"].to_pylist(), strict=True)
        if v not in ("fail", "drop")
    }


@pytest.mark.usefixtures("prefect_harness")
def test_rerun_after_failures_carries_retried_samples_through_every_stage(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    data = _dataset(tmp_path / "b1.jsonl", 24)
    faults = SimConfig(failures=(FailureRule(status=500, rate=0.5, attempts=None),))
    with SimulatorServer(tiny_model_dir, faults) as sim:
        first = _run(run_dir, sim, tiny_model_dir, data, **{"validation.max_failed_rate": 1.0})
        responses = pa.concat_tables([read_part(r) for r in done_parts(run_dir, "responses")])
        done_first = {
            s
            for s, st in zip(responses["sample_id"].to_pylist(), responses["status"].to_pylist(), strict=True)
            if st == "done"
        }
        assert 0 < len(done_first) < 24
        assert _ids(run_dir, "tokens") == done_first
        assert first["status"]["consistent"], first["status"]["problems"]
        before = _builds(run_dir)

        sim.update_config(SimConfig())
        second = _run(run_dir, sim, tiny_model_dir, data)

    every = _ids(run_dir, "prompts")
    assert len(every) >= 20  # a few demo rows are quarantined (no user turn to answer)
    assert _ids(run_dir, "responses") == every
    assert set(read_part(done_parts(run_dir, "responses")[0], ["status"])["status"].to_pylist()) == {"done"}
    assert _ids(run_dir, "tokens") == every and _ids(run_dir, "validation") == every
    assert _ids(run_dir, "hidden_states") == _not_failed(run_dir)
    assert len(_ids(run_dir, "hidden_states")) > len(done_first)

    status = run_status(run_dir)
    assert status.consistent, status.problems
    assert all(not p.stale for p in status.parts.values())
    # What still counts as failed is validation's own verdicts (raw tool-call text the simulator writes into some
    # answers); no generate failure survives the rerun.
    assert second["status"]["consistent"] and second["status"]["failed"] == len(every) - len(_not_failed(run_dir))
    after = _builds(run_dir)
    assert {k for k in after if k.startswith("prompts/")} <= {k for k in before if after[k] == before.get(k)}


@pytest.mark.usefixtures("prefect_harness")
def test_grown_dataset_reaches_every_stage_and_untouched_parts_are_not_rebuilt(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    data = _dataset(tmp_path / "b1.jsonl", 16)
    with SimulatorServer(tiny_model_dir, SimConfig()) as sim:
        _run(run_dir, sim, tiny_model_dir, data)
        before = _builds(run_dir)
        old = _ids(run_dir, "prompts")
        _dataset(data, 24)
        second = _run(run_dir, sim, tiny_model_dir, data)

    new = _ids(run_dir, "prompts") - old
    assert len(new) == 8
    for stage in ("responses", "tokens", "validation"):
        assert new <= _ids(run_dir, stage), stage
    assert new & _not_failed(run_dir) <= _ids(run_dir, "hidden_states")
    after = _builds(run_dir)
    assert {k: after[k] for k in before} == before, "a part whose inputs did not change was rebuilt"
    assert len(after) == len(before) + len(STAGES), "one new part per stage for the grown rows"
    assert second["status"]["consistent"], second["status"]["problems"]


@pytest.mark.usefixtures("prefect_harness")
def test_config_changes_rebuild_exactly_the_stages_they_shape(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    data = _dataset(tmp_path / "b1.jsonl", 16)

    def changed(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> set[str]:
        assert after.keys() == before.keys()
        return {k.split("/")[0] for k in after if after[k] != before[k]}

    with SimulatorServer(tiny_model_dir, SimConfig()) as sim:
        _run(run_dir, sim, tiny_model_dir, data)
        sent = sim.stats(with_keys=False)["total_requests"]
        base = _builds(run_dir)

        _run(run_dir, sim, tiny_model_dir, data, **{"extract.layers": [1, 2, 5]})
        layers = _builds(run_dir)
        assert changed(base, layers) == {"hidden_states"}
        index = pa.concat_tables([read_part(r, ["layers"]) for r in done_parts(run_dir, "hidden_states")])
        assert set(map(tuple, index["layers"].to_pylist())) == {(1, 2, 5)}

        # A validation setting that changes no verdict that leaves samples out re-extracts nothing.
        tolerance = {"extract.layers": [1, 2, 5], "validation.billing_tolerance_frac": 0.5}
        result = _run(run_dir, sim, tiny_model_dir, data, **tolerance)
        tolerant = _builds(run_dir)
        assert changed(layers, tolerant) == {"validation"}
        assert result["status"]["consistent"], result["status"]["problems"]

        # A loss-mask setting rebuilds the tokens (and so validation), not the states: every id is the same.
        extra = {"extract.layers": [1, 2, 5], "reconstruct.loss_on_reasoning": False}
        _run(run_dir, sim, tiny_model_dir, data, **extra)
        rebuilt = _builds(run_dir)
        assert changed(tolerant, rebuilt) == {"tokens", "validation"}
        assert sim.stats(with_keys=False)["total_requests"] == sent, "a config change re-sent requests"

        scores = {str(r): read_marker(r)["fingerprint"] for r in done_parts(run_dir, SCORES_STAGE)}
        assert len(scores) == len(done_parts(run_dir, "hidden_states"))
        result = _run(run_dir, sim, tiny_model_dir, data, **extra, **{"scoring.low_prob_floor": 1e-9})
        assert _builds(run_dir) == rebuilt, "a scoring setting re-extracted hidden states"
        again = {str(r): read_marker(r) for r in done_parts(run_dir, SCORES_STAGE)}
        assert all(again[k]["fingerprint"] != fp for k, fp in scores.items())
        assert {m["stats"]["source"] for m in again.values()} == {"refloor"}, "recounted, no model loaded"
        assert result["status"]["consistent"], result["status"]["problems"]


@pytest.mark.usefixtures("prefect_harness")
def test_parts_cut_short_are_rebuilt_by_the_rerun_exactly_as_they_were(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A derived part cut short under its marker (a copy that broke off, a disk that lost blocks): `status` says it
    is missing instead of failing with an internal error, and the rerun rebuilds it, row for row; before, the
    rerun trusted the marker and left it, and `status`/`export` exited 1 on `ArrowInvalid` for good."""
    run_dir = tmp_path / "run"
    data = _dataset(tmp_path / "b1.jsonl", 16)
    with SimulatorServer(tiny_model_dir, SimConfig()) as sim:
        _run(run_dir, sim, tiny_model_dir, data)
        cut = [done_parts(run_dir, stage)[1] for stage in ("tokens", "validation", "hidden_states")]
        overwritten, gone = done_parts(run_dir, "tokens")[0], done_parts(run_dir, "prompts")[1]
        rows = {str(r): read_part(r).sort_by("sample_id") for r in [*cut, overwritten, gone]}
        for ref in cut:
            ref.path.write_bytes(ref.path.read_bytes()[:300])
        overwritten.path.write_bytes(bytes(overwritten.path.stat().st_size))  # same size, not Parquet
        gone.path.unlink()  # its marker kept: prepared again under its own number, nothing bought twice
        status = run_status(run_dir)
        assert not status.consistent
        answered = sim.stats()["generations_stored"]
        second = _run(run_dir, sim, tiny_model_dir, data)
        assert sim.stats()["generations_stored"] == answered  # nothing bought again
    assert second["status"]["consistent"], second["status"]["problems"]
    for ref in [*cut, overwritten, gone]:
        assert read_part(ref).sort_by("sample_id").equals(rows[str(ref)]), ref
    for stage in ("prompts", "responses", "tokens", "validation"):
        ids = [i for r in done_parts(run_dir, stage) for i in read_part(r, ["sample_id"])["sample_id"].to_pylist()]
        assert len(ids) == len(set(ids)) == len(_ids(run_dir, "prompts")), stage
