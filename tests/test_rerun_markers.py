"""Lineage at the marker level: a part is current only while its inputs' fingerprints and its recipe match, and
a marker written before lineage was recorded is judged by completion order, like `make`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

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


def test_a_part_cut_short_or_overwritten_is_rebuilt_and_reads_as_a_typed_error(tmp_path: Path) -> None:
    """A finished part whose file is not the size its marker recorded is missing to a rerun (derived stages rebuild
    it); reading it anyway is a `CorruptPartError` naming the file and what to do (exit 2), never an ArrowInvalid
    out of the reader (status and export exited 1, "internal error")."""
    from flows.exit_codes import ExitCode, exit_code_for
    from tasks.common.errors import CorruptPartError
    from tasks.common.shards import read_part

    tokens = PartRef(tmp_path, "tokens", 0)
    write_part(tokens, _tokens([5, 6, 7]), {})
    build = expected_build(tokens)
    assert part_state(tokens, build) == "current"
    whole = tokens.path.read_bytes()

    tokens.path.write_bytes(whole[:300])
    assert part_state(tokens, build) == "missing"
    with pytest.raises(CorruptPartError) as cut:
        read_part(tokens)
    message = str(cut.value)
    assert str(tokens.path) in message and f"its marker recorded {len(whole):,} bytes" in message
    assert str(tokens.marker) in message and exit_code_for(cut.value) == ExitCode.USER

    tokens.path.write_bytes(bytes(len(whole)))  # same size, garbage: its Parquet footer does not read
    assert part_state(tokens, build) == "missing"
    with pytest.raises(CorruptPartError):
        read_part(tokens)

    tokens.path.write_bytes(whole)
    assert part_state(tokens, build) == "current" and read_part(tokens).num_rows == 1


def test_a_hidden_states_shard_cut_short_is_a_typed_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tasks.common.errors import CorruptPartError
    from tasks.extract.storage import open_shard

    shard = tmp_path / "hidden_states" / "_data" / "part-00003-0000.safetensors"
    shard.parent.mkdir(parents=True)
    save_file({"input_ids": torch.arange(8, dtype=torch.int32)}, str(shard))
    with open_shard(shard) as fh:
        assert fh.get_slice("input_ids")[2:4].tolist() == [2, 3]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(CorruptPartError, match=r"part-00003-0000.safetensors is not a readable hidden-states shard"):
        open_shard(shard)
    with pytest.raises(CorruptPartError, match=r"_done/part-00003.json and rerun extract to rebuild part-00003"):
        open_shard(shard)
