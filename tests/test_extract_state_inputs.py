"""Hidden states are extracted again exactly when what they are computed from changed: a sample's ids or answer
start in the tokens part, or the samples validation leaves out. A tokens part rewritten with another loss mask, or
a validation part with the same samples failed (another billing tolerance, another warning, a new validation code
version), re-extracts nothing, and `status` agrees; a changed id or one more failed sample re-extracts that part.
Hidden-states parts written before the digests (their markers name whole fingerprints) stay current on upgrade.

Real parts: the tiny random-weight model extracting, real Parquet parts and markers, `run_status` over them, and
the reconstruct and validate stages recording their digests against the simulator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pytest

from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.schemas import TOKENS
from tasks.common.shards import PartRef, fingerprint, read_marker, read_part, write_part
from tasks.common.state_inputs import (
    EXCLUDED_INPUT,
    EXCLUDED_STAT,
    IDS_COLUMNS,
    IDS_INPUT,
    IDS_STAT,
    LEGACY_TOKENS,
    LEGACY_VALIDATION,
    excluded_ids_digest,
    exclusions_digest,
    ids_digest,
    tokens_ids_digest,
)
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


def _hidden_stale(run_dir: Path, skip: bool = True) -> list[int]:
    status = run_status(run_dir, extract_enabled=True, skip_failed_validation=skip, scoring_enabled=False)
    return status.parts["hidden_states"].stale


def _as_legacy(run_dir: Path) -> None:
    """Rewrite the hidden-states marker as a release before the digests wrote it: the tokens and validation
    parts' whole fingerprints."""
    ref = PartRef(run_dir, HIDDEN_DIR, 0)
    marker = read_marker(ref)
    marker["inputs"] = {
        LEGACY_TOKENS: fingerprint(PartRef(run_dir, "tokens", 0)),
        LEGACY_VALIDATION: fingerprint(PartRef(run_dir, "validation", 0)),
    }
    ref.marker.write_text(json.dumps(marker, sort_keys=True))


def _rewrite_tokens(run_dir: Path, **columns: Mapping[str, object]) -> None:
    """The tokens part again with some columns changed for some samples ({column: {sample_id: value}})."""
    ref = PartRef(run_dir, "tokens", 0)
    rows = read_part(ref).to_pylist()
    for row in rows:
        for column, values in columns.items():
            row[column] = values.get(row["sample_id"], row[column])
    table = pa.Table.from_pylist(rows, schema=TOKENS)
    write_part(ref, table, {"rewritten": True}, {IDS_STAT: ids_digest(table)})


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
    assert read_marker(PartRef(tmp_path, HIDDEN_DIR, 0))["inputs"] == {
        IDS_INPUT: ids_digest(read_part(PartRef(tmp_path, "tokens", 0))),
        EXCLUDED_INPUT: excluded_ids_digest(["s04", "s01"]),
    }
    if legacy:
        _as_legacy(tmp_path)
    built = _finished_at(tmp_path)

    # Another warning and another verdict among the kept samples: a new validation part, the same samples left out.
    before = fingerprint(PartRef(tmp_path, "validation", 0))
    write_validation(tmp_path, verdicts | {"s00": "warn", "s02": "warn"})
    assert fingerprint(PartRef(tmp_path, "validation", 0)) != before
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
    assert read_marker(PartRef(tmp_path, HIDDEN_DIR, 0))["inputs"][EXCLUDED_INPUT] == excluded_ids_digest(
        ["s01", "s02", "s04"]
    )
    assert _hidden_stale(tmp_path) == []


@pytest.mark.parametrize("skip", [True, False], ids=["skip-failed", "extract-all"])
def test_only_a_change_in_the_ids_or_answer_start_re_extracts(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner, skip: bool
) -> None:
    samples = sample_ids(LENGTHS, seed=5)
    write_tokens(tmp_path, samples)
    write_validation(tmp_path, {sid: "pass" for sid in samples})
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", skip_failed_validation=skip)
    extract_part(cfg, 0, runner)
    built = _finished_at(tmp_path)

    tokens_before = fingerprint(PartRef(tmp_path, "tokens", 0))
    _rewrite_tokens(tmp_path, loss_mask={"s02": [1] * LENGTHS[2]}, token_source={"s00": "model"})
    assert fingerprint(PartRef(tmp_path, "tokens", 0)) != tokens_before
    assert index_current(cfg, 0) and _hidden_stale(tmp_path, skip) == []
    extract_part(cfg, 0, runner)
    assert _finished_at(tmp_path) == built, "a loss-mask change extracted the same states again"

    _rewrite_tokens(tmp_path, prompt_len={"s02": 2})  # the scores start elsewhere
    assert not index_current(cfg, 0) and _hidden_stale(tmp_path, skip) == [0]
    extract_part(cfg, 0, runner)
    again = _finished_at(tmp_path)
    assert again > built

    _rewrite_tokens(tmp_path, input_ids={"s03": [7] * LENGTHS[3]})
    assert not index_current(cfg, 0) and _hidden_stale(tmp_path, skip) == [0]
    extract_part(cfg, 0, runner)
    assert _finished_at(tmp_path) > again


def test_a_changed_tokens_part_re_extracts_a_legacy_part(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner
) -> None:
    """The legacy rule holds only while the tokens part is the one the states were extracted from (its marker
    recorded no ids to compare)."""
    samples = sample_ids(LENGTHS, seed=4)
    write_tokens(tmp_path, samples)
    write_validation(tmp_path, {sid: "pass" for sid in samples})
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32")
    extract_part(cfg, 0, runner)
    _as_legacy(tmp_path)
    assert index_current(cfg, 0)
    _rewrite_tokens(tmp_path, loss_mask={"s02": [1] * LENGTHS[2]})
    assert not index_current(cfg, 0)
    assert _hidden_stale(tmp_path) == [0]


def test_a_hidden_states_marker_from_before_lineage_follows_completion_order(
    tmp_path: Path, tiny_model_dir: Path, runner: HFHiddenStateRunner
) -> None:
    """A marker with no inputs at all is judged as before: current while it finished after its tokens and
    validation parts, stale once either is rewritten after it."""
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


def test_the_stages_record_the_digests_extraction_is_judged_by(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Written by the reconstruct and validate stages themselves, so deciding whether states are current reads
    markers, not rows; each equals the digest computed again from the part's rows."""
    with SimulatorServer(tokenizer_dir, SimConfig(tool_call_rate=0.5, seed=7)) as sim:
        _, _, stats = run_stages(make_sim_cfg(tmp_path, sim, tokenizer_dir))
    validation, tokens = PartRef(tmp_path, "validation", 0), PartRef(tmp_path, "tokens", 0)
    table = read_part(validation, columns=["sample_id", "verdict"]).to_pydict()
    left_out = [s for s, v in zip(table["sample_id"], table["verdict"], strict=True) if v in ("fail", "drop")]
    assert left_out and len(left_out) < len(table["sample_id"]), stats
    assert read_marker(validation)["stats"][EXCLUDED_STAT] == excluded_ids_digest(left_out)
    assert read_marker(tokens)["stats"][IDS_STAT] == ids_digest(read_part(tokens, columns=IDS_COLUMNS))
    for ref, stat in ((validation, EXCLUDED_STAT), (tokens, IDS_STAT)):
        recorded = read_marker(ref)
        without = {**recorded, "stats": {k: v for k, v in recorded["stats"].items() if k != stat}}
        ref.marker.write_text(json.dumps(without))  # a part from before the digests
    assert exclusions_digest(validation) == excluded_ids_digest(left_out)  # read off its verdict column
    # A tokens part from before the digest stands for itself by its fingerprint: its ids are never read again.
    assert tokens_ids_digest(tokens) == f"fingerprint:{fingerprint(tokens)}"
