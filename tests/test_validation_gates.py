"""Billing reconciliation (completion and reasoning tokens), provider parity and the configurable gates, over
real reconstructed and validated parts (DeepSeek-V4 tokenizer, DeepSeek-V3.1 thinking layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.config import ValidationConfig
from tasks.common.errors import ValidationGateError
from tasks.validate.checks import check_gates, gate_violations, serving_key, summarize_validation
from tests.test_reconstruct import make_cfg
from tests.test_validate import CONTENT, EOS, REASONING, encode, run_part


def ours(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """(our completion tokens, our reasoning tokens) for the default REASONING/CONTENT answer."""
    return len(encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")), len(encode(tokenizer, REASONING))


def test_reasoning_tokens_are_reconciled_per_row(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    completion, reasoning = ours(tokenizer)
    cfg = make_cfg(tmp_path, tokenizer_dir)
    rows = run_part(
        cfg,
        0,
        [
            {"completion_tokens": completion, "reasoning_tokens": reasoning},
            {"completion_tokens": completion, "reasoning_tokens": reasoning + 3},
            {},
        ],
    )
    exact, off, unbilled = rows["0"], rows["1"], rows["2"]
    assert exact["our_reasoning_tokens"] == reasoning and exact["reasoning_delta_tokens"] == 0
    assert not exact["billing_flagged"] and exact["verdict"] == "pass"
    assert off["billing_delta_tokens"] == 0 and off["reasoning_delta_tokens"] == 3
    assert off["billing_flagged"] and off["verdict"] == "warn"
    assert unbilled["billed_reasoning_tokens"] is None and not unbilled["billing_flagged"]

    (summary,) = summarize_validation(cfg)
    billing = summary["billing"]
    assert (billing["billed_reasoning_tokens"], billing["our_reasoning_tokens"]) == (2 * reasoning + 3, 2 * reasoning)
    assert billing["reasoning_delta_frac"] == pytest.approx(3 / (2 * reasoning))
    assert billing["flagged_samples"] == 1 and billing["flagged_rate"] == pytest.approx(1 / 3)


def test_billing_gates(tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    completion, _ = ours(tokenizer)
    cfg = make_cfg(tmp_path, tokenizer_dir)
    run_part(cfg, 0, [{"completion_tokens": completion + 4}, {"completion_tokens": completion}])
    (summary,) = summarize_validation(cfg)
    delta = 4 / (2 * completion)
    assert 4 / completion > cfg.validation.billing_tolerance_frac  # the first row is flagged at validation time
    assert summary["billing"]["delta_frac"] == pytest.approx(delta)
    assert summary["billing"]["flagged_rate"] == pytest.approx(0.5)
    assert gate_violations([summary], ValidationConfig()) == []
    crossed = gate_violations([summary], ValidationConfig(max_billing_delta_frac=delta / 2))
    assert len(crossed) == 1 and "max_billing_delta_frac" in crossed[0] and f"{delta:+.4%}" in crossed[0]
    (flagged,) = gate_violations([summary], ValidationConfig(max_billing_flagged_rate=0.25))
    assert "flagged_rate 0.5000 (1/2" in flagged


def test_mixed_providers_and_quantizations_are_flagged(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    run_part(
        cfg,
        0,
        [
            {"provider": "alpha", "quantization": "fp8"},
            {"provider": "alpha", "quantization": "int4"},
            {"provider": "beta", "quantization": "fp8"},
            {"status": "failed", "error": "HTTP 500", "provider": "gamma"},
        ],
    )
    (summary,) = summarize_validation(cfg)
    assert summary["mixed_serving"]
    assert summary["providers"] == {"alpha/fp8": 1, "alpha/int4": 1, "beta/fp8": 1, "gamma": 1}
    by_key = {row["serving"]: row for row in summary["serving"]}
    assert by_key["gamma"]["failed_responses"] == 1 and by_key["gamma"]["samples"] == 0
    assert by_key["alpha/int4"]["samples"] == 1 and by_key["alpha/int4"]["exact_rate"] == 0.0
    lenient = {"max_failed_rate": 1.0}  # the gamma row's failure is not what this test is about
    assert gate_violations([summary], ValidationConfig(**lenient)) == []
    (crossed,) = gate_violations([summary], ValidationConfig(fail_on_mixed_providers=True, **lenient))
    assert "served by a mix" in crossed and "alpha/int4" in crossed


def test_one_provider_is_not_a_mix(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    run_part(cfg, 0, [{"provider": "alpha", "quantization": "int4"}, {"provider": "alpha", "quantization": "int4"}])
    (summary,) = summarize_validation(cfg)
    assert not summary["mixed_serving"] and summary["providers"] == {"alpha/int4": 2}
    assert gate_violations([summary], ValidationConfig(fail_on_mixed_providers=True)) == []
    assert serving_key(None, None) == "unreported"


def test_reference_and_verdict_rate_gates(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    nor = encode(tokenizer, " NOR")[0]
    at = completion.index(nor)
    split = [*completion[:at], *encode(tokenizer, " "), *encode(tokenizer, "NOR"), *completion[at + 1 :]]
    cases: list[dict[str, Any]] = [
        {"output_ids": completion},
        {"output_ids": split},
        {"content": "Sure.</think>Actually."},
    ]
    cfg = make_cfg(tmp_path, tokenizer_dir, token_ids="reencode")  # the gates judge rows that store re-encodings
    run_part(cfg, 0, cases)
    (summary,) = summarize_validation(cfg)
    assert summary["bpe_artifact_rate"] == pytest.approx(1 / 2) and summary["fail_rate"] == pytest.approx(1 / 3)
    crossed = gate_violations([summary], ValidationConfig(max_bpe_artifact_rate=0.2, max_fail_verdict_rate=0.1))
    assert [c.split(":")[1].split()[0] for c in crossed] == ["bpe_artifact_rate", "fail_rate"]
    with pytest.raises(ValidationGateError, match=r"bpe_artifact_rate 0\.5000 \(1/2 referenced samples\)"):
        check_gates([summary], ValidationConfig(max_bpe_artifact_rate=0.2))


def test_a_gate_errors_first_line_is_a_whole_short_summary_with_the_numbers(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The Prefect UI shows a failed run's state message by its first line, cut short: it was "validation gates
    crossed:" with ~900 characters on the lines after it (a UI probe). Now the first line names every gate it can
    with its value and limit, within HEADLINE_CHARS; the full sentences follow."""
    from tasks.validate.checks import HEADLINE_CHARS, gate_headline

    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    at = completion.index(encode(tokenizer, " NOR")[0])
    split = [*completion[:at], *encode(tokenizer, " "), *encode(tokenizer, "NOR"), *completion[at + 1 :]]
    cfg = make_cfg(tmp_path, tokenizer_dir, token_ids="reencode")
    run_part(cfg, 0, [{"output_ids": completion}, {"output_ids": split}, {"content": "Sure.</think>Actually."}])
    (summary,) = summarize_validation(cfg)
    vcfg = ValidationConfig(max_bpe_artifact_rate=0.2, max_fail_verdict_rate=0.1)
    with pytest.raises(ValidationGateError) as raised:
        check_gates([summary], vcfg)
    first, *details = str(raised.value).splitlines()
    name = summary["dataset"]
    assert first == (
        f"validation gates crossed (2): '{name}' bpe_artifact_rate 0.5000 > max_bpe_artifact_rate 0.2; "
        f"'{name}' fail_rate 0.3333 > max_fail_verdict_rate 0.1 (details below)"
    )
    assert [d.strip() for d in details] == gate_violations([summary], vcfg)

    many = [
        f"dataset 'B{i}': failed_rate 0.{i}000 ({i}/10 responses: {'x' * 300}) > max_failed_rate 0.05; later"
        for i in range(9)
    ]
    headline = gate_headline(many)
    assert len(headline) <= HEADLINE_CHARS and "xxx" not in headline and "later" not in headline
    assert headline.startswith("validation gates crossed (9): 'B0' failed_rate 0.0000 > max_failed_rate 0.05; 'B1'")
    assert headline.endswith(" more (details below)")


def test_the_reencoding_gates_judge_only_rows_that_store_a_reencoding(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A row that stores the model's own ids is not flawed by what re-encoding its text would give: a SmolLM2 answer
    spelling `<|im_end|>` as text passed validation yet crossed `max_real_difference_rate: 0` and stopped the run
    (a real-model probe). The report still counts every row's re-encoding; the gates count the stored ones."""
    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    at = completion.index(encode(tokenizer, " NOR")[0])
    split = [*completion[:at], *encode(tokenizer, " "), *encode(tokenizer, "NOR"), *completion[at + 1 :]]
    cfg = make_cfg(tmp_path, tokenizer_dir)
    run_part(cfg, 0, [{"output_ids": completion}, {"output_ids": split}])
    (summary,) = summarize_validation(cfg)
    assert summary["bpe_artifact_rate"] == pytest.approx(1 / 2) and summary["gated"]["referenced"] == 0
    assert gate_violations([summary], ValidationConfig(max_bpe_artifact_rate=0.0, max_real_difference_rate=0.0)) == []
