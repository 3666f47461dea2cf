"""Validation over real reconstructed parts: reference classification (planted non-canonical split and planted
text change), structural issues, billing deltas, the per-dataset summary and the gates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig, ValidationConfig
from tasks.common.errors import ValidationGateError
from tasks.common.messages import Message
from tasks.common.shards import PartRef, read_part
from tasks.reconstruct.completion_format import PRESETS
from tasks.reconstruct.stage import reconstruct_part
from tasks.validate.checks import check_gates, summarize_validation, validate_part
from tests.test_reconstruct import make_cfg, response_row, sid_of, write_inputs

DEMO = PRESETS["deepseek_v4_thinking"]
EOS = "<｜end▁of▁sentence｜>"
REASONING = "Recall the truth table."
CONTENT = "A NOR gate is an OR gate followed by NOT."


def conv(i: int) -> list[Message]:
    return [Message(role="user", content=f"Question number {i}: explain NOR gates.")]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def run_part(cfg: PipelineConfig, part: int, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Write one prompts/responses part from `cases` (response_row overrides), reconstruct, validate."""
    convs = [conv(part * 100 + i) for i in range(len(cases))]
    rows = [
        response_row(sid_of(c), case.pop("reasoning", REASONING), case.pop("content", CONTENT), **case)
        for c, case in zip(convs, cases, strict=True)
    ]
    write_inputs(cfg.run_dir, part, convs, rows)
    reconstruct_part(cfg, part, DEMO)
    stats = validate_part(cfg, part, DEMO)
    assert stats["rows"] == sum(r["status"] == "done" for r in rows)
    out = read_part(PartRef(cfg.run_dir, "validation", part)).to_pylist()
    by_sid = {r["sample_id"]: r for r in out}
    return {
        str(i): by_sid[sid_of(c)] for i, (c, r) in enumerate(zip(convs, rows, strict=True)) if r["status"] == "done"
    }


@pytest.mark.parametrize("token_ids", ["model", "reencode"])
def test_reference_classification(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase, token_ids: str
) -> None:
    """The reference comparison is the re-encoding's either way; only a row storing re-encoded ids is warned
    about a BPE artifact, since one storing the model's ids holds the non-canonical split itself."""
    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    nor = encode(tokenizer, " NOR")
    assert len(nor) == 1
    split = encode(tokenizer, " ") + encode(tokenizer, "NOR")
    assert len(split) == 2 and tokenizer.decode(split) == " NOR"
    at = completion.index(nor[0])
    non_canonical = [*completion[:at], *split, *completion[at + 1 :]]
    changed = encode(tokenizer, f"{REASONING}</think>{CONTENT.replace('NOT', 'XOR')}{EOS}")

    cfg = make_cfg(tmp_path, tokenizer_dir, token_ids=token_ids)
    rows = run_part(
        cfg,
        0,
        [
            {"output_ids": completion},
            {"output_ids": completion[:-1]},  # a reference without the stop token
            {"output_ids": non_canonical},
            {"output_ids": changed},
            {},
        ],
    )
    assert [rows[k]["reference_match"] for k in "01234"] == [
        "exact",
        "exact",
        "bpe_artifact",
        "real_difference",
        "no_reference",
    ]
    model = token_ids == "model"
    assert [rows[k]["verdict"] for k in "01234"] == ["pass", "pass", "pass" if model else "warn", "fail", "pass"]
    sources = ["model", "model", "model", "reencoded", "reencoded"] if model else ["reencoded"] * 5
    assert [rows[k]["token_source"] for k in "01234"] == sources
    stored = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "tokens", 0)).to_pylist()}
    row2 = stored[rows["2"]["sample_id"]]
    assert row2["input_ids"][row2["prompt_len"] :] == (non_canonical if model else completion)
    assert rows["2"]["first_divergence"] == at
    real = rows["3"]
    assert real["first_divergence"] == changed.index(encode(tokenizer, " XOR")[0])
    assert "XOR" in real["divergence_reference"] and "NOT" in real["divergence_ours"]


def test_structural_issues(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    cases: list[dict[str, Any]] = [
        {"content": "Sure.</think>Actually the answer."},
        {"content": "Hello <｜User｜> again"},
        {"reasoning": "x<think>y"},
        {"reasoning": ""},
        {"content": "  "},
        {"finish_reason": "length"},
        {"content": 'Calling <tool_call>{"name": "f", "arguments": {}}'},
        {"content": "<tool_call>{not json}</tool_call>"},
        {"content": 'fine <tool_call>{"name": "f", "arguments": {}}</tool_call>'},
    ]
    rows = run_part(cfg, 0, cases)
    issues = {k: v["structural_issues"] for k, v in rows.items()}
    verdicts = {k: v["verdict"] for k, v in rows.items()}
    assert issues["0"] == ["close_tag_in_content"] and verdicts["0"] == "fail"
    assert issues["1"] == ["special_token_in_content:<｜User｜>"] and verdicts["1"] == "fail"
    # The generation prompt already opened <think>: a second one is both in the text and doubled on the ids.
    assert issues["2"] == ["open_tag_in_reasoning", "doubled_open_tag"] and verdicts["2"] == "fail"
    # Hidden reasoning in a thinking format fails by default (validation.empty_reasoning).
    assert issues["3"] == ["empty_reasoning"] and verdicts["3"] == "fail"
    assert issues["4"] == ["empty_content"] and verdicts["4"] == "warn"
    assert issues["5"] == ["finish_reason:length"] and verdicts["5"] == "fail"
    # Raw tool-call text with no tools sent: tool_call_policy "fail" (the default).
    markup = "tool_call_markup:qwen in content"
    assert issues["6"] == ["tool_call_unclosed", markup] and verdicts["6"] == "fail"
    assert issues["7"] == ["tool_call_invalid_json", markup] and verdicts["7"] == "fail"
    assert issues["8"] == [markup] and verdicts["8"] == "fail"


def test_billing_delta_is_flagged(tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    ours = len(encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}"))
    cfg = make_cfg(tmp_path, tokenizer_dir)
    rows = run_part(cfg, 0, [{"completion_tokens": ours}, {"completion_tokens": ours + 10}])
    assert rows["0"]["billing_delta_tokens"] == 0 and rows["0"]["verdict"] == "pass"
    flagged = rows["1"]
    assert flagged["our_completion_tokens"] == ours and flagged["billed_completion_tokens"] == ours + 10
    assert flagged["billing_delta_tokens"] == 10
    assert flagged["billing_delta_frac"] == pytest.approx(10 / ours)
    assert flagged["verdict"] == "warn"


def test_summary_and_gates(tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    changed = encode(tokenizer, f"{REASONING}</think>Something else entirely.{EOS}")
    cfg = make_cfg(tmp_path, tokenizer_dir, token_ids="reencode")  # the gates judge rows that store re-encodings
    run_part(
        cfg,
        0,
        [
            {"output_ids": completion, "provider": "alpha", "completion_tokens": len(completion)},
            {"output_ids": changed, "provider": "beta", "completion_tokens": len(completion) + 5},
            {"status": "failed", "error": "HTTP 500", "provider": "beta"},
        ],
    )
    run_part(cfg, 1, [{"provider": "alpha"}])

    (summary,) = summarize_validation(cfg)
    assert summary["dataset"] == "demo"
    assert (summary["responses"], summary["failed_responses"], summary["samples"]) == (4, 1, 3)
    assert (summary["pass"], summary["warn"], summary["fail"]) == (2, 0, 1)
    assert (summary["exact"], summary["real_difference"], summary["no_reference"]) == (1, 1, 1)
    assert summary["referenced"] == 2 and summary["real_difference_rate"] == pytest.approx(0.5)
    assert summary["failed_rate"] == pytest.approx(0.25)
    assert summary["providers"] == {"alpha": 2, "beta": 2}
    assert summary["billing"]["delta_tokens"] == 5 and summary["billing"]["flagged_samples"] == 1

    with pytest.raises(ValidationGateError, match=r"'demo': real_difference_rate 0\.5000 \(1/2"):
        check_gates([summary], ValidationConfig())
    retried = r"failed_rate 0\.2500 \(1/4 responses failed after their retries: .*\) > max_failed_rate 0\.1; these are"
    with pytest.raises(ValidationGateError, match=retried):
        check_gates([summary], ValidationConfig(max_real_difference_rate=1.0, max_failed_rate=0.1))
    check_gates([summary], ValidationConfig(max_real_difference_rate=0.5, max_failed_rate=0.25))


def test_rerun_reuses_the_done_part(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    run_part(cfg, 0, [{}])
    again = validate_part(cfg, 0, DEMO)
    assert again["reused"] and again["rows"] == 1


def test_a_think_tag_is_text_a_model_without_reasoning_tokens_may_write() -> None:
    """SmolLM2 (no reasoning section, `<think>` three ordinary tokens) explaining think tags was failed as
    `think_marker_in_content` and left out of the data. Where the marker is a control token of the tokenizer
    (Qwen3-Instruct) or the format has a reasoning section, it still fails."""
    from tasks.reconstruct.completion_format import CompletionFormat
    from tasks.validate.checks import text_issues

    smol = CompletionFormat("derived", None, False, None, "<|im_end|>")
    answer = "The <think> tags wrap a model's reasoning; Kimi's are ◁think▷."
    assert text_issues(smol, None, answer, "stop", ["stop"], {"<|im_end|>", "<|im_start|>"}) == []
    qwen_controls = {"<|im_end|>", "<think>", "</think>"}
    assert text_issues(smol, None, answer, "stop", ["stop"], qwen_controls) == ["think_marker_in_content:<think>"]
    thinking = PRESETS["deepseek_v31_thinking"]
    assert "think_marker_in_content:◁think▷" in text_issues(thinking, "r", answer, "stop", ["stop"], set())


def test_an_answer_without_reasoning_fails_only_where_its_layout_invents_a_block() -> None:
    """A thinking-off run on a template that writes an answer without reasoning as its content alone (Bielik-11B-v3)
    stores that answer exactly: it must not fail as hidden reasoning. Reasoning tokens the provider billed still
    say the model wrote reasoning that is missing; and a format that writes an empty block for it still fails."""
    from dataclasses import replace

    from tasks.validate.checks import text_issues

    omitting = replace(PRESETS["qwen3_thinking"], name="omitting", omit_empty_reasoning=True)
    controls = {"<|im_end|>", "<think>", "</think>"}
    assert text_issues(omitting, None, "It is 4.", "stop", ["stop"], controls) == []
    assert text_issues(omitting, "", "It is 4.", "stop", ["stop"], controls, 0) == []
    assert text_issues(omitting, None, "It is 4.", "stop", ["stop"], controls, 120) == ["empty_reasoning"]
    assert text_issues(PRESETS["qwen3_thinking"], None, "It is 4.", "stop", ["stop"], controls) == ["empty_reasoning"]
