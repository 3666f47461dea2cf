"""Hidden states depend on validation only through the samples it leaves out: a validation part rewritten with the
same samples failed (another billing tolerance, another warning, a new validation code version) re-extracts
nothing, and `status` agrees; one that fails another sample re-extracts that part, without it. Hidden-states
parts written before the digest existed (their marker names the validation part's fingerprint) follow the same
rule, so an upgrade does not re-extract a run either.

Real parts: the tiny random-weight model extracting, real Parquet parts and markers, `run_status` over them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.exclusions import (
    EXCLUDED_INPUT,
    EXCLUDED_STAT,
    LEGACY_INPUT,
    excluded_ids_digest,
    exclusions_digest,
)
from tasks.common.shards import PartRef, fingerprint, read_marker, read_part
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part, index_current
from tasks.extract.storage import HIDDEN_DIR
from tasks.status.report import run_status
from tests.test_extract import LENGTHS, index_rows, make_cfg, sample_ids, write_tokens, write_validation
from tests.test_generate import make_cfg as make_sim_cfg
from tests.test_model_ids import run_stages


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> HFHiddenStateRunner:
    return HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=96)


def _finished_at(run_dir: Path) -> float:
    return float(read_marker(PartRef(run_dir, HIDDEN_DIR, 0))["finished_at"])


def _hidden_stale(run_dir: Path) -> list[int]:
    status = run_status(run_dir, extract_enabled=True, skip_failed_validation=True, scoring_enabled=False)
    return status.parts["hidden_states"].stale


def _as_legacy(run_dir: Path) -> None:
    """Rewrite the hidden-states marker as a release before the digest wrote it: inputs keyed by the validation
    part's fingerprint."""
    ref = PartRef(run_dir, HIDDEN_DIR, 0)
    marker = read_marker(ref)
    marker["inputs"] = {
        "tokens": marker["inputs"]["tokens"],
        LEGACY_INPUT: fingerprint(PartRef(run_dir, "validation", 0)),
    }
    ref.marker.write_text(json.dumps(marker, sort_keys=True))


@pytest.mark.parametrize("legacy", [False, True], ids=["digest", "legacy-marker"])
def test_only_a_change_in_the_samples_validation_leaves_out_re_extracts(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner, legacy: bool
) -> None:
    samples = sample_ids(LENGTHS, seed=3)
    verdicts = {sid: "pass" for sid in samples} | {"s01": "fail", "s04": "drop"}
    write_tokens(tmp_path, samples)
    write_validation(tmp_path, verdicts)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    extract_part(cfg, 0, runner)
    assert [r["sample_id"] for r in index_rows(tmp_path)] == [s for s in samples if s not in ("s01", "s04")]
    recorded = read_marker(PartRef(tmp_path, HIDDEN_DIR, 0))["inputs"]
    assert recorded[EXCLUDED_INPUT] == excluded_ids_digest(["s04", "s01"])
    if legacy:
        _as_legacy(tmp_path)
    built = _finished_at(tmp_path)

    # Another warning and another verdict among the kept samples: a new validation part, the same samples left out.
    write_validation(tmp_path, verdicts | {"s00": "warn", "s02": "warn"})
    assert fingerprint(PartRef(tmp_path, "validation", 0)) != (recorded.get(LEGACY_INPUT) or "")
    assert index_current(cfg, 0)
    assert _hidden_stale(tmp_path) == []
    extract_part(cfg, 0, runner)
    assert _finished_at(tmp_path) == built, "the same states were extracted again"

    # One more sample failed: this part is stale, and re-extracted without it.
    write_validation(tmp_path, verdicts | {"s02": "fail"})
    assert not index_current(cfg, 0)
    assert _hidden_stale(tmp_path) == [0]
    extract_part(cfg, 0, runner)
    assert _finished_at(tmp_path) > built
    assert [r["sample_id"] for r in index_rows(tmp_path)] == [s for s in samples if s not in ("s01", "s02", "s04")]
    assert read_marker(PartRef(tmp_path, HIDDEN_DIR, 0))["inputs"] == {
        "tokens": fingerprint(PartRef(tmp_path, "tokens", 0)),
        EXCLUDED_INPUT: excluded_ids_digest(["s01", "s02", "s04"]),
    }
    assert _hidden_stale(tmp_path) == []


def test_a_changed_tokens_part_re_extracts_a_legacy_part(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner
) -> None:
    """The legacy rule holds only while the tokens part is the one the states were extracted from."""
    samples = sample_ids(LENGTHS, seed=4)
    write_tokens(tmp_path, samples)
    write_validation(tmp_path, {sid: "pass" for sid in samples})
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    extract_part(cfg, 0, runner)
    _as_legacy(tmp_path)
    assert index_current(cfg, 0)
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=5))
    assert not index_current(cfg, 0)
    assert _hidden_stale(tmp_path) == [0]


def test_the_validate_stage_records_the_digest_of_the_samples_it_leaves_out(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Written by the validate stage itself, so deciding whether states are current reads a marker, not rows."""
    with SimulatorServer(tokenizer_dir, SimConfig(tool_call_rate=0.5, seed=7)) as sim:
        _, _, stats = run_stages(make_sim_cfg(tmp_path, sim, tokenizer_dir))
    table = read_part(PartRef(tmp_path, "validation", 0), columns=["sample_id", "verdict"]).to_pydict()
    left_out = [s for s, v in zip(table["sample_id"], table["verdict"], strict=True) if v in ("fail", "drop")]
    assert left_out and len(left_out) < len(table["sample_id"]), stats
    recorded = read_marker(PartRef(tmp_path, "validation", 0))["stats"][EXCLUDED_STAT]
    assert recorded == excluded_ids_digest(left_out) == exclusions_digest(PartRef(tmp_path, "validation", 0))


def test_a_hidden_states_marker_from_before_lineage_follows_completion_order(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner
) -> None:
    """A marker with no inputs at all is judged as before the digest: current while it finished after its
    tokens and validation parts, stale once either is rewritten after it."""
    samples = sample_ids(LENGTHS, seed=6)
    write_tokens(tmp_path, samples)
    write_validation(tmp_path, {sid: "pass" for sid in samples})
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    extract_part(cfg, 0, runner)
    ref = PartRef(tmp_path, HIDDEN_DIR, 0)
    marker = {k: v for k, v in read_marker(ref).items() if k not in ("inputs", "recipe", "fingerprint")}
    ref.marker.write_text(json.dumps(marker))
    assert _hidden_stale(tmp_path) == []
    write_validation(tmp_path, {sid: "warn" for sid in samples})
    assert _hidden_stale(tmp_path) == [0]
