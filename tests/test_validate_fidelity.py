"""Fidelity checks against what an API's text cannot show, end to end over the simulator on 127.0.0.1 and real
tokenizers: a provider that injects a system prompt (prompt-token drift, gated), hidden reasoning, a doubled
`<think>` across the prompt boundary, tool-call markup of every family under each policy, a control token inside
the content, and a stack that strips whitespace, caught against the reference ids of SGLang's /generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig, ValidationConfig
from tasks.common.errors import ValidationGateError
from tasks.common.messages import Message
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.extract.stage import failed_validation_ids
from tasks.generate import CompletionMarkers, generate_parts
from tasks.reconstruct.completion_format import PRESETS, CompletionFormat
from tasks.reconstruct.stage import reconstruct_part
from tasks.validate.checks import check_gates, gate_violations, summarize_validation, validate_part
from tasks.validate.fidelity import WhitespaceTally, whitespace_findings
from tasks.validate.report import write_validation_report
from tests.fixtures import families as F
from tests.test_reconstruct import DATASET, response_row, sid_of, write_inputs

DEMO = PRESETS["deepseek_v4_thinking"]
N = 12


def sim_cfg(run_dir: Path, sim: SimulatorServer, tokenizer_dir: Path, kind: str, **validation: Any) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name=DATASET, path=run_dir / "in.jsonl")],
        endpoint=EndpointConfig(
            kind=kind,  # type: ignore[arg-type]
            base_url=sim.base_url,
            model="sim/deepseek-v4-sim",
            max_in_flight=8,
            backoff_base_s=0.01,
            backoff_max_s=0.05,
        ),
        tokenizer=TokenizerConfig(path=tokenizer_dir, completion_format=DEMO.name),
        validation=ValidationConfig(**validation),
    )


def run_through_simulator(cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """prompts -> generate (over HTTP) -> reconstruct -> validate; the validation rows."""
    rows = []
    for i in range(N):
        messages = [{"role": "user", "content": f"Question {i}: what lies NORTH of Paris, and why?"}]
        sid = sid_of([Message(role="user", content=messages[0]["content"])])
        rows.append(
            {
                "sample_id": sid,
                "dataset": DATASET,
                "source_file": "in.jsonl",
                "source_row": i,
                "messages": messages,
                "prompt_id": sid,
                "sample_index": 0,
            }
        )
    ref = PartRef(cfg.run_dir, "prompts", 0)
    write_part(ref, pa.Table.from_pylist(rows, schema=PROMPTS), {})
    summary = generate_parts(cfg, [ref], CompletionMarkers.of(DEMO), tokenizer)
    assert summary is not None
    reconstruct_part(cfg, 0, DEMO)
    validate_part(cfg, 0, DEMO)
    out: list[dict[str, Any]] = read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()
    assert len(out) == N
    return out


def test_a_provider_injecting_a_system_prompt_drifts_and_is_gated(
    tmp_path: Path, server: SimulatorServer, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    injected = "You are a helpful assistant. Current date: 2026-12-01."
    server.update_config(SimConfig(tool_call_rate=0.0, injected_system_prompt=injected))
    cfg = sim_cfg(tmp_path / "drift", server, tokenizer_dir, "openai_chat")
    rows = run_through_simulator(cfg, tokenizer)
    extra = len(tokenizer.encode(injected, add_special_tokens=False))
    assert {r["prompt_match"] for r in rows} == {"drift"}
    assert {r["prompt_delta_tokens"] for r in rows} == {extra}
    assert all(r["billed_prompt_tokens"] == r["our_prompt_tokens"] + extra for r in rows)
    assert all(f"prompt_drift:+{extra} tokens" in r["structural_issues"] for r in rows)
    assert {r["verdict"] for r in rows} == {"warn"}

    summary = summarize_validation(cfg)
    prompt = summary[0]["prompt_tokens"]
    assert (prompt["drift"], prompt["with_usage"], prompt["drift_rate"]) == (N, N, 1.0)
    assert sum(s["prompt_tokens"]["drift"] for s in summary[0]["serving"]) == N  # per provider, too
    crossed = gate_violations(summary, cfg.validation)
    assert any("prompt-token drift_rate 1.0000" in c and "max_prompt_drift_rate 0.01" in c for c in crossed)
    with pytest.raises(ValidationGateError, match="drift_rate"):
        check_gates(summary, cfg.validation)
    report = write_validation_report(cfg.run_dir, summary, crossed)
    text = (report.parent / "report.md").read_text()
    assert "## Prompt-token reconciliation" in text and "## Excluded samples" in text

    # The same provider without the injection: every row exact, no gate.
    server.update_config(SimConfig(tool_call_rate=0.0))
    clean = sim_cfg(tmp_path / "clean", server, tokenizer_dir, "openai_chat")
    assert {r["prompt_match"] for r in run_through_simulator(clean, tokenizer)} == {"exact"}
    assert not gate_violations(summarize_validation(clean), clean.validation)


@pytest.mark.parametrize(("policy", "verdict", "excluded"), [("fail", "fail", True), ("warn", "warn", False)])
def test_hidden_reasoning_fails_and_is_not_extracted(
    tmp_path: Path,
    server: SimulatorServer,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    policy: str,
    verdict: str,
    excluded: bool,
) -> None:
    """A provider that drops the reasoning (reasoning.exclude, or a stack that hides it): the completion would be
    `</think>content`, training a drafter to skip thinking."""
    hidden = FailureRule(kind="empty_reasoning", rate=1.0, attempts=None)
    server.update_config(SimConfig(tool_call_rate=0.0, failures=(hidden,)))
    cfg = sim_cfg(tmp_path, server, tokenizer_dir, "openai_chat", empty_reasoning=policy)
    rows = run_through_simulator(cfg, tokenizer)
    assert all(r["structural_issues"] == ["empty_reasoning"] for r in rows)
    assert {r["verdict"] for r in rows} == {verdict}
    skipped = failed_validation_ids(cfg, 0)
    assert skipped == ({r["sample_id"] for r in rows} if excluded else set())
    summary = summarize_validation(cfg)[0]
    assert summary["excluded"] == (N if excluded else 0)
    assert summary["exclusion_reasons"] == ({"empty_reasoning": N} if excluded else {})


def kimi_cfg(run_dir: Path, preset: str) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name=DATASET, path=run_dir / "in.jsonl")],
        endpoint=EndpointConfig(model="moonshotai/kimi-k2.5"),
        tokenizer=TokenizerConfig(path=F.shared_dir("kimi_k25"), trust_remote_code=True, completion_format=preset),
        validation=ValidationConfig(format_disagreement="warn"),
    )


def kimi_rows(cfg: PipelineConfig, fmt: CompletionFormat, answers: list[tuple[str, str]]) -> list[dict[str, Any]]:
    convs = [[Message(role="user", content=f"Kimi question {i}")] for i in range(len(answers))]
    write_inputs(
        cfg.run_dir, 0, convs, [response_row(sid_of(c), r, a) for c, (r, a) in zip(convs, answers, strict=True)]
    )
    reconstruct_part(cfg, 0, fmt)
    validate_part(cfg, 0, fmt)
    tokens = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "tokens", 0)).to_pylist()}
    rows = read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()
    return [{**r, "input_ids": tokens[r["sample_id"]]["input_ids"]} for r in rows]


def test_a_doubled_think_fails(tmp_path: Path) -> None:
    """README's old example: the K2-Thinking preset against K2.5's template (which opens <think> in the
    generation prompt), let through by format_disagreement=warn. Every sample carries 163601 163606 163606."""
    answers = [("Plan the answer.", "The answer.")]
    wrong = kimi_rows(kimi_cfg(tmp_path / "wrong", "kimi_k2_thinking"), PRESETS["kimi_k2_thinking"], answers)[0]
    ids = wrong["input_ids"]
    at = ids.index(163606)
    assert ids[at - 1 : at + 2] == [163601, 163606, 163606]
    assert "doubled_open_tag" in wrong["structural_issues"] and wrong["verdict"] == "fail"

    right = kimi_rows(kimi_cfg(tmp_path / "right", "kimi_k25_thinking"), PRESETS["kimi_k25_thinking"], answers)[0]
    assert right["input_ids"].count(163606) == 1
    assert right["structural_issues"] == [] and right["verdict"] == "pass"


def test_kimi_markup_and_stray_end_of_turn_on_kimi_ids(tmp_path: Path) -> None:
    """On Kimi's own tokenizer its tool-call markers are control ids: they are tool-call markup (policy), not
    stray special tokens; an `<|im_end|>` inside the content is (the format allows it only at the end)."""
    call = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    answers = [("Use the tool.", f"Calling.{call}<|tool_calls_section_end|>"), ("Think.", "Done.<|im_end|>More.")]
    cfg = kimi_cfg(tmp_path, "kimi_k25_thinking")
    rows = {r["sample_id"]: r for r in kimi_rows(cfg, PRESETS["kimi_k25_thinking"], answers)}
    convs = [sid_of([Message(role="user", content=f"Kimi question {i}")]) for i in range(2)]
    tool, stray = rows[convs[0]], rows[convs[1]]
    assert tool["structural_issues"] == ["tool_call_markup:kimi in content"] and tool["verdict"] == "fail"
    assert stray["structural_issues"] == ["special_token_in_content:<|im_end|>"] and stray["verdict"] == "fail"


MARKUP = {
    "qwen": '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "gpt_oss": "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
}


@pytest.mark.parametrize(("policy", "verdict"), [("fail", "fail"), ("keep", "warn"), ("drop", "drop")])
def test_tool_call_markup_of_every_family_follows_the_policy(
    tmp_path: Path, tokenizer_dir: Path, policy: Literal["fail", "keep", "drop"], verdict: str
) -> None:
    cfg = PipelineConfig(
        run_dir=tmp_path,
        datasets=[DatasetConfig(name=DATASET, path=tmp_path / "in.jsonl")],
        endpoint=EndpointConfig(model="tiny"),
        tokenizer=TokenizerConfig(path=tokenizer_dir),
        validation=ValidationConfig(tool_call_policy=policy),
    )
    families = sorted(MARKUP)
    convs = [[Message(role="user", content=f"Tool question {f}")] for f in [*families, "none"]]
    answers = [f"Let me call it. {MARKUP[f]}" for f in families] + ["No tools here."]
    write_inputs(
        tmp_path, 0, convs, [response_row(sid_of(c), "Think.", a) for c, a in zip(convs, answers, strict=True)]
    )
    reconstruct_part(cfg, 0, DEMO)
    validate_part(cfg, 0, DEMO)
    rows = {r["sample_id"]: r for r in read_part(PartRef(tmp_path, "validation", 0)).to_pylist()}
    for family, conv in zip(families, convs, strict=False):
        row = rows[sid_of(conv)]
        assert row["structural_issues"] == [f"tool_call_markup:{family} in content"], row["structural_issues"]
        assert row["verdict"] == verdict
    assert rows[sid_of(convs[-1])]["verdict"] == "pass"
    skipped = failed_validation_ids(cfg, 0)
    assert skipped == (set() if policy == "keep" else {sid_of(c) for c in convs[:-1]})
    summary = summarize_validation(cfg)[0]
    assert summary["excluded"] == (0 if policy == "keep" else len(families))
    assert summary["exclusion_reasons"] == ({} if policy == "keep" else {"tool_call_markup": len(families)})
    assert summary["fail"] == (len(families) if policy == "fail" else 0)
    report = write_validation_report(tmp_path, [summary]).parent / "report.md"
    excluded = report.read_text().split("## Excluded samples", 1)[1]
    expected = "none" if policy == "keep" else f"tool_call_markup: {len(families)}"
    assert f"| {DATASET} | {summary['excluded']} | {summary['fail']} | {summary['drop']} | {expected} |" in excluded


def test_a_stripped_whitespace_provider_is_caught_by_reference_ids(
    tmp_path: Path, server: SimulatorServer, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The model ends its reasoning with a newline and opens its content with a blank line; a stack that strips
    returns the texts without them while SGLang's /generate still gives the ids it generated."""
    server.update_config(SimConfig(tool_call_rate=0.0, boundary_whitespace_rate=1.0, strip_whitespace=True))
    cfg = sim_cfg(tmp_path / "stripped", server, tokenizer_dir, "sglang_generate", max_real_difference_rate=1.0)
    rows = run_through_simulator(cfg, tokenizer)
    assert {r["reference_match"] for r in rows} == {"real_difference"}
    assert all("whitespace_stripped" in r["structural_issues"] for r in rows)
    found = summarize_validation(cfg)[0]["whitespace"]
    assert [(w["finding"], w["whitespace_stripped"]) for w in found] == [("stripped", N)]

    server.update_config(SimConfig(tool_call_rate=0.0, boundary_whitespace_rate=1.0))
    honest = sim_cfg(tmp_path / "honest", server, tokenizer_dir, "sglang_generate")
    rows = run_through_simulator(honest, tokenizer)
    assert {r["reference_match"] for r in rows} == {"exact"} and all(r["boundary_whitespace"] for r in rows)
    assert [w["finding"] for w in summarize_validation(honest)[0]["whitespace"]] == ["too_few_answers"]


def test_whitespace_signature_without_reference_ids() -> None:
    """No reference ids (OpenRouter): a provider none of whose answers has boundary whitespace while another's
    do is flagged; alone, it is only 'unverified'."""

    def tally(answers: int, with_ws: int) -> WhitespaceTally:
        t = WhitespaceTally()
        for i in range(answers):
            t.add({"boundary_whitespace": i < with_ws, "reference_match": "no_reference", "structural_issues": []})
        return t

    found = {w["serving"]: w for w in whitespace_findings({"A": tally(60, 0), "B": tally(60, 24)}, 50)}
    assert found["A"]["finding"] == "suspect" and "40.0%" in found["A"]["detail"]
    assert found["B"]["finding"] == "ok"
    alone = whitespace_findings({"A": tally(60, 0)}, 50)
    assert alone[0]["finding"] == "unverified"
    assert whitespace_findings({"A": tally(10, 0)}, 50)[0]["finding"] == "too_few_answers"
