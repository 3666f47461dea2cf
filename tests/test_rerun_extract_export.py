"""Extraction (the stage the GPU pool runs) and the exports follow their inputs: a tokens part that changed under
a finished hidden-states part is extracted again, the others are not, and an export rewrites only the part
whose sources changed."""

from __future__ import annotations

from pathlib import Path

from tasks.common.shards import PartRef, read_marker, read_part
from tasks.export import export_run
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part, hidden_states_current
from tasks.extract.storage import HIDDEN_DIR, load_hidden_states
from tests.test_export import PART_LENGTHS, build_run, stored
from tests.test_extract import make_cfg, sample_ids, write_tokens


def test_changed_tokens_part_is_extracted_and_exported_again_alone(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    build_run(run_dir, tiny_model_dir)
    cfg = make_cfg(run_dir, tiny_model_dir, max_tokens_per_batch=64)
    out = tmp_path / "export"
    assert export_run(run_dir, "speculators", out)["parts_skipped"] == 0
    parts = sorted(PART_LENGTHS)
    before = {p: read_marker(PartRef(run_dir, HIDDEN_DIR, p))["fingerprint"] for p in parts}
    assert all(hidden_states_current(cfg, p) for p in parts)

    changed = parts[1]
    samples = sample_ids(PART_LENGTHS[changed], seed=999, prefix=f"p{changed}-")  # same ids, other tokens
    write_tokens(run_dir, samples, part=changed)
    assert [hidden_states_current(cfg, p) for p in parts] == [p != changed for p in parts]

    runner = HFHiddenStateRunner.load(tiny_model_dir, device="cpu", max_tokens_per_batch=64)
    for part in parts:
        extract_part(cfg, part, runner)
    after = {p: read_marker(PartRef(run_dir, HIDDEN_DIR, p))["fingerprint"] for p in parts}
    assert {p for p in parts if after[p] != before[p]} == {changed}
    assert all(hidden_states_current(cfg, p) for p in parts)
    for row in read_part(PartRef(run_dir, HIDDEN_DIR, changed)).to_pylist():
        input_ids, _, _ = load_hidden_states(run_dir, row)
        assert input_ids.tolist() == samples[row["sample_id"]]

    again = export_run(run_dir, "speculators", out)
    assert again["parts_skipped"] == len(parts) - 1 and again["bytes_written"] > 0
    assert export_run(run_dir, "speculators", out)["parts_skipped"] == len(parts)
    assert set(stored(run_dir)) >= set(samples)
