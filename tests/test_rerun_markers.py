"""Lineage at the marker level: a part is current only while its inputs' fingerprints and its recipe match, and
a marker written before lineage was recorded is judged by completion order, like `make`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from tasks.common.schemas import TOKENS, VALIDATION
from tasks.common.shards import PartRef, expected_build, fingerprint, part_state, read_marker, write_part


def _tokens(ids: list[int]) -> pa.Table:
    row = {
        "sample_id": "s0",
        "dataset": "d",
        "input_ids": ids,
        "loss_mask": [1] * len(ids),
        "prompt_len": 1,
        "completion_len": len(ids) - 1,
        "reasoning_len": 0,
        "completion_format": "f",
    }
    return pa.Table.from_pylist([row], schema=TOKENS)


def _validation() -> pa.Table:
    row = {name: None for name in VALIDATION.names}
    row.update(sample_id="s0", dataset="d", verdict="pass", reference_match="exact")
    row.update(structural_issues=[], our_completion_tokens=2)
    return pa.Table.from_pylist([row], schema=VALIDATION)


def test_inputs_and_recipe_decide_and_legacy_markers_follow_completion_order(tmp_path: Path) -> None:
    tokens = PartRef(tmp_path, "tokens", 0)
    validation = tokens.with_stage("validation")
    write_part(tokens, _tokens([5, 6, 7]), {})
    recipe = {"completion_format": "f"}
    write_part(validation, _validation(), {}, build=expected_build(validation, recipe))
    assert part_state(validation, expected_build(validation, recipe)) == "current"
    assert part_state(validation, expected_build(validation, {"completion_format": "g"})) == "stale"

    same = fingerprint(tokens)
    write_part(tokens, _tokens([5, 6, 7]), {"written": "again"})  # same rows: same fingerprint, nothing stale
    assert fingerprint(tokens) == same
    assert part_state(validation, expected_build(validation, recipe)) == "current"
    write_part(tokens, _tokens([5, 6, 8]), {})
    assert fingerprint(tokens) != same
    assert part_state(validation, expected_build(validation, recipe)) == "stale"
    assert part_state(PartRef(tmp_path, "validation", 1), expected_build(validation, recipe)) == "missing"

    legacy = {k: v for k, v in read_marker(validation).items() if k not in ("inputs", "recipe", "fingerprint")}
    validation.marker.write_text(json.dumps(legacy))  # older than the tokens part rewritten above
    assert part_state(validation, expected_build(validation, recipe)) == "stale"
    legacy["finished_at"] = read_marker(tokens)["finished_at"] + 1
    validation.marker.write_text(json.dumps(legacy))
    assert part_state(validation, expected_build(validation, recipe)) == "current"
    assert fingerprint(validation) == f"legacy:{legacy['bytes']}:{legacy['finished_at']}"
