"""The target scores its own training data at extraction: scores equal an independent full-logits computation,
are checked where produced, survive a kill between the index and the scores part, are rebuilt without a forward
pass when only a scoring setting changed, and are read by `status` and the exports' per-sample policy."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.common.errors import CaptureMismatchError
from tasks.common.schemas import SCORES_STAGE
from tasks.common.shards import PartRef, read_marker, read_part
from tasks.export import export_run
from tasks.export.progress import MANIFEST
from tasks.extract.capture import CapturedBatch
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.score_head import ScoreHead
from tasks.extract.scores import longest_run_below, sample_scores
from tasks.extract.stage import extract_part, hidden_states_current, needs_forward_pass
from tasks.extract.storage import HIDDEN_DIR
from tasks.extract.writer import TokenScores
from tasks.status.report import run_status
from tests.test_extract import make_cfg, sample_ids, write_tokens

LENGTHS = [17, 5, 33, 9, 24, 1, 60, 2]
"""Several padded batches at max_tokens_per_batch 96; a 1-token sample has nothing to score, a 2-token one one."""


def scores(run_dir: Path, part: int = 0) -> dict[str, dict[str, Any]]:
    return {r["sample_id"]: r for r in read_part(PartRef(run_dir, SCORES_STAGE, part)).to_pylist()}


@functools.cache
def reference(model_dir: Path, dtype: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def reference_logprobs(model: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logits of an unbatched forward, log-softmax in float32: (logprobs, top-1 flags) of the
    answer tokens (from position max(1, len // 3), as `tests.test_extract.write_tokens` sets prompt_len)."""
    start = min(max(1, len(ids) // 3), len(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    rows, targets = torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:], dtype=torch.long)
    logprobs = torch.log_softmax(logits, dim=-1)[rows, targets]
    top1 = logits[rows].gather(1, targets[:, None]).squeeze(1) >= logits[rows].amax(dim=1)
    return logprobs, top1


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 1e-4)])
def test_scores_equal_full_logits_computed_independently(
    tmp_path: Path, tiny_model_dir: Path, dtype: str, tol: float
) -> None:
    samples = sample_ids(LENGTHS, seed=21)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype=dtype, max_tokens_per_batch=96)
    cfg = cfg.model_copy(update={"scoring": cfg.scoring.model_copy(update={"logits_chunk_tokens": 7})})
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype=dtype, device="cpu", max_tokens_per_batch=96)
    stats = extract_part(cfg, 0, runner)
    assert stats["batches"] > 1 and stats["scores"]["source"] == "extraction"
    got = scores(tmp_path)
    f32 = reference(tiny_model_dir, "float32")
    same = reference(tiny_model_dir, dtype)
    nll_gap = []
    for sample_id, ids in samples.items():
        row = got[sample_id]
        logprobs, top1 = reference_logprobs(same, ids)
        assert row["scored_tokens"] == len(logprobs)
        if not len(logprobs):
            assert row["mean_nll"] is None and row["token_logprobs"] == [] and row["longest_low_prob_run"] == 0
            continue
        torch.testing.assert_close(torch.tensor(row["token_logprobs"]), logprobs, rtol=0, atol=tol)
        assert row["mean_nll"] == pytest.approx(-float(logprobs.double().mean()), abs=tol)
        assert row["top1_rate"] == pytest.approx(float(top1.double().mean()))
        assert row["end_logprob"] == pytest.approx(float(logprobs[-1]), abs=tol)
        below = [lp < math.log(cfg.scoring.low_prob_floor) for lp in logprobs.tolist()]
        longest = max((len(run) for run in "".join("x" if b else " " for b in below).split()), default=0)
        assert row["longest_low_prob_run"] == longest
        nll_gap.append(abs(row["mean_nll"] + float(reference_logprobs(f32, ids)[0].double().mean())))
    # The bar: within 1e-3 of a float32 full-logits computation on the tiny model. bf16 extraction
    # rounds the states and logits themselves (measured: up to 1.5e-3 on a 4-token sample, 5e-4 on average).
    assert max(nll_gap) < (1e-5 if dtype == "float32" else 3e-3)
    assert float(np.mean(nll_gap)) < 1e-3


def test_aggregates_of_hand_made_scores() -> None:
    floor = 0.01  # log 0.01 = -4.6
    logprobs = np.array([-0.1, -5.0, -6.0, -0.2, -7.0, -8.0, -9.0, -0.3], dtype=np.float32)
    top1 = np.array([True, False, False, True, False, False, False, True])
    row = sample_scores(logprobs, top1, floor)
    assert row["scored_tokens"] == 8 and row["longest_low_prob_run"] == 3
    assert row["mean_nll"] == pytest.approx(-float(logprobs.astype(np.float64).mean()))
    assert row["top1_rate"] == 3 / 8 and row["end_logprob"] == pytest.approx(-0.3)
    assert longest_run_below(np.array([], dtype=np.float32), floor) == 0
    assert longest_run_below(np.full(5, -9.0, dtype=np.float32), floor) == 5


def test_kill_between_index_and_scores_then_a_new_floor_need_no_forward_pass(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids(LENGTHS, seed=22)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=96)
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=96)
    extract_part(cfg, 0, runner)
    in_pass = scores(tmp_path)
    index_marker = read_marker(PartRef(tmp_path, HIDDEN_DIR, 0))

    # kill -9 after the index part was written, before its scores part: no marker, a leftover file
    scores_ref = PartRef(tmp_path, SCORES_STAGE, 0)
    scores_ref.marker.unlink()
    assert not hidden_states_current(cfg, 0) and not needs_forward_pass(cfg, 0)
    stats = extract_part(cfg, 0, None)  # no runner: the norm and lm_head are read from the checkpoint alone
    assert stats["scores"]["source"] == "stored_final_state"
    assert read_marker(PartRef(tmp_path, HIDDEN_DIR, 0)) == index_marker, "the states must not be extracted again"
    rescored = scores(tmp_path)
    for sample_id, row in in_pass.items():
        again = rescored[sample_id]
        assert again["scored_tokens"] == row["scored_tokens"] and again["top1_rate"] == row["top1_rate"]
        np.testing.assert_allclose(again["token_logprobs"], row["token_logprobs"], rtol=0, atol=1e-5)
    assert hidden_states_current(cfg, 0)

    def no_model(*args: Any, **kwargs: Any) -> ScoreHead:
        raise AssertionError("a new floor must not load the model")

    monkeypatch.setattr(ScoreHead, "load", classmethod(no_model))
    lower = cfg.model_copy(update={"scoring": cfg.scoring.model_copy(update={"low_prob_floor": 1e-9})})
    assert not hidden_states_current(lower, 0) and not needs_forward_pass(lower, 0)
    stats = extract_part(lower, 0, None)
    assert stats["scores"]["source"] == "refloor" and stats["scores"]["low_prob_floor"] == 1e-9
    refloored = scores(tmp_path)
    for sample_id, row in refloored.items():
        values = np.asarray(row["token_logprobs"], dtype=np.float32)
        assert row["longest_low_prob_run"] == longest_run_below(values, 1e-9)
        assert row["mean_nll"] == rescored[sample_id]["mean_nll"]
    assert any(refloored[s]["longest_low_prob_run"] != rescored[s]["longest_low_prob_run"] for s in samples)
    assert read_marker(PartRef(tmp_path, HIDDEN_DIR, 0)) == index_marker


def test_aux_only_part_without_scores_is_extracted_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_tokens(tmp_path, sample_ids(LENGTHS, seed=23))
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", store_final_state=False)
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device="cpu", store_final_state=False)
    extract_part(cfg, 0, runner)
    first = scores(tmp_path)
    PartRef(tmp_path, SCORES_STAGE, 0).marker.unlink()
    assert needs_forward_pass(cfg, 0)
    passes = runner.forward_passes
    extract_part(cfg, 0, runner)
    assert runner.forward_passes > passes and hidden_states_current(cfg, 0)
    assert {k: v["mean_nll"] for k, v in scores(tmp_path).items()} == {k: v["mean_nll"] for k, v in first.items()}


def test_scores_that_do_not_match_their_sample_are_refused(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = sample_ids(LENGTHS, seed=24)
    write_tokens(tmp_path, samples)
    cfg = make_cfg(tmp_path, tiny_model_dir, dtype="float32", max_tokens_per_batch=96)
    runner = HFHiddenStateRunner.load(tiny_model_dir, dtype="float32", device="cpu", max_tokens_per_batch=96)
    original = runner.iter_captures

    def one_token_short(
        sequences: Sequence[Sequence[int]], batches: Sequence[Sequence[int]]
    ) -> Iterator[CapturedBatch]:
        for batch in original(sequences, batches):
            assert batch.scores is not None
            counts = list(batch.scores.counts)
            counts[0] -= 1
            shortened = TokenScores(batch.scores.logprobs[1:], batch.scores.top1[1:], counts)
            yield replace(batch, scores=shortened)

    monkeypatch.setattr(runner, "iter_captures", one_token_short)
    with pytest.raises(CaptureMismatchError, match="scored answer tokens") as err:
        extract_part(cfg, 0, runner)
    assert err.value.sample_id in samples and err.value.actual == int(err.value.expected) - 1  # type: ignore[call-overload]
    assert not PartRef(tmp_path, HIDDEN_DIR, 0).is_done() and not PartRef(tmp_path, SCORES_STAGE, 0).is_done()

    monkeypatch.undo()
    write_tokens(tmp_path, {**samples, "s-oov": [5, 6, 10**6, 7]})
    with pytest.raises(CaptureMismatchError, match="vocabulary") as err:
        extract_part(cfg, 0, runner)
    assert err.value.sample_id == "s-oov"


def test_status_expects_a_score_for_every_extracted_sample(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.test_export import build_run

    build_run(tmp_path, tiny_model_dir)  # tokens and hidden states only: the part-level view is what is checked
    status = run_status(tmp_path, extract_enabled=True, scoring_enabled=True)
    assert status.stages[-2:] == ["hidden_states", SCORES_STAGE]
    assert status.parts[SCORES_STAGE].current == status.parts["hidden_states"].current == [0, 1, 2]
    PartRef(tmp_path, SCORES_STAGE, 1).marker.unlink()
    status = run_status(tmp_path, extract_enabled=True, scoring_enabled=True)
    assert status.parts[SCORES_STAGE].missing == [1]
    assert any(p.startswith("scores: unfinished parts [1]") for p in status.problems)
    assert SCORES_STAGE not in run_status(tmp_path, extract_enabled=True, scoring_enabled=False).stages


def test_exports_keep_flag_or_drop_samples_outside_the_bounds(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.test_export import PART_LENGTHS, build_run

    run_dir = tmp_path / "run"
    build_run(run_dir, tiny_model_dir)
    nll = {sid: row["mean_nll"] for part in PART_LENGTHS for sid, row in scores(run_dir, part).items()}
    scored = sorted(v for v in nll.values() if v is not None)
    bound = scored[len(scored) // 2]
    above = {sid for sid, v in nll.items() if v is not None and v > bound}
    assert 0 < len(above) < len(nll)
    settings = {"max_mean_nll_nats": bound, "sample_policy": "flag"}
    (run_dir / "run_summary.json").write_text(json.dumps({"config": {"scoring": settings}}))

    flagged = export_run(run_dir, "speculators", tmp_path / "flag")
    manifest = json.loads((tmp_path / "flag" / MANIFEST).read_text())
    assert flagged["samples"] == len(nll) and flagged["out_of_bounds"] == len(above)
    assert {f["sample_id"] for f in manifest["scores"]["flagged"]} == above
    assert all(f["reasons"] == ["high_nll"] for f in manifest["scores"]["flagged"])
    by_index = {i: s for p in manifest["parts"] for i, s in zip(p["indices"], p["sample_ids"], strict=True)}
    assert all(by_index[f["index"]] == f["sample_id"] for f in manifest["scores"]["flagged"])

    dropped = export_run(run_dir, "speculators", tmp_path / "drop", score_policy="drop")
    manifest = json.loads((tmp_path / "drop" / MANIFEST).read_text())
    kept = {s for p in manifest["parts"] for s in p["sample_ids"]}
    assert kept == set(nll) - above and dropped["dropped_out_of_bounds"] == len(above)
    assert manifest["scores"]["out_of_bounds_by_reason"] == {"high_nll": len(above)}

    keep = export_run(run_dir, "speculators", tmp_path / "keep", score_policy="keep")
    manifest = json.loads((tmp_path / "keep" / MANIFEST).read_text())
    assert keep["samples"] == len(nll) and manifest["scores"]["flagged"] == []
    assert manifest["scores"]["out_of_bounds_by_reason"] == {"high_nll": len(above)}
