"""Reconstruction over real parquet parts and the real DeepSeek-V4 tokenizer: decoded ids equal the rendered
prompt + the model's literal completion, masks cover the right spans, and bad special tokens fail fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.assets import write_tokenizer_dir
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, ReconstructConfig, TokenizerConfig
from tasks.common.errors import ReconstructionError, SpecialTokenError
from tasks.common.messages import Message, prompt_messages, sample_id
from tasks.common.schemas import PROMPTS, RESPONSES
from tasks.common.shards import PartRef, read_part, read_provenance, write_part
from tasks.reconstruct.completion_format import PRESETS, CompletionFormat, completion_layout
from tasks.reconstruct.special_tokens import check_special_tokens, format_table, verify_special_tokens
from tasks.reconstruct.stage import encode_completions, reconstruct_part
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.reconstruct.tokenizer_loading import (
    load_tokenizer,
    render_prompt,
    render_prompt_ids,
)

DEMO = PRESETS["deepseek_v4_thinking"]
EOS = "<｜end▁of▁sentence｜>"
DATASET = "demo"

CONVERSATIONS: list[list[Message]] = [
    [Message(role="user", content="What is a NOR gate?")],
    [
        Message(role="system", content="You are terse."),
        Message(role="user", content="Name a prime."),
        Message(role="assistant", content="7"),
        Message(role="user", content="Another one, in words."),
    ],
    # A dataset row that still carries some other model's answer: the prompt is everything before it.
    [Message(role="user", content="Say hi 👋 in French."), Message(role="assistant", content="Salut")],
]
ANSWERS = [
    ("The user asks about logic gates.", "A NOR gate outputs 1 only when all inputs are 0."),
    ("Pick one that is not 7.\nEleven works.", "eleven"),
    ("Simple greeting; 👋 kept.", "Salut 👋 !"),
]


GENERATE_ROUTE = EndpointConfig(model="tiny", kind="sglang_generate")


def make_cfg(run_dir: Path, tokenizer_dir: Path, **reconstruct: Any) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name=DATASET, path=run_dir / "in.jsonl")],
        endpoint=EndpointConfig(model="tiny"),
        tokenizer=TokenizerConfig(path=tokenizer_dir),
        reconstruct=ReconstructConfig(**reconstruct),
    )


def response_row(sid: str, reasoning: str | None, content: str | None, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in RESPONSES.names}
    row.update(sample_id=sid, dataset=DATASET, status="done", reasoning=reasoning, content=content)
    row.update(finish_reason="stop", attempts=1, provider="sim")
    row.update(overrides)
    return row


def write_inputs(run_dir: Path, part: int, conversations: list[list[Message]], responses: list[dict[str, Any]]) -> None:
    prompts = [
        {
            "sample_id": sample_id(DATASET, prompt_messages(conv)),
            "dataset": DATASET,
            "source_file": "in.jsonl",
            "source_row": i,
            "messages": [dict(m) for m in conv],
            "prompt_id": sample_id(DATASET, prompt_messages(conv)),
            "sample_index": 0,
        }
        for i, conv in enumerate(conversations)
    ]
    write_part(PartRef(run_dir, "prompts", part), pa.Table.from_pylist(prompts, schema=PROMPTS), {})
    write_part(PartRef(run_dir, "responses", part), pa.Table.from_pylist(responses, schema=RESPONSES), {})


def sid_of(conv: list[Message]) -> str:
    return sample_id(DATASET, prompt_messages(conv))


def demo_responses() -> list[dict[str, Any]]:
    rows = [response_row(sid_of(c), r, a) for c, (r, a) in zip(CONVERSATIONS, ANSWERS, strict=True)]
    return list(reversed(rows))  # completion order differs from prompt order


def test_ids_decode_to_rendered_prompt_plus_literal_completion(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    write_inputs(tmp_path, 0, CONVERSATIONS, demo_responses())
    stats = reconstruct_part(cfg, 0, DEMO)
    rows = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()

    assert [r["sample_id"] for r in rows] == [sid_of(c) for c in CONVERSATIONS]
    for row, conv, (reasoning, content) in zip(rows, CONVERSATIONS, ANSWERS, strict=True):
        prompt = render_prompt(tokenizer, prompt_messages(conv))
        assert prompt.endswith("<｜Assistant｜><think>")
        expected = prompt + f"{reasoning}</think>{content}{EOS}"
        ids = row["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert ids[: row["prompt_len"]] == render_prompt_ids(tokenizer, prompt_messages(conv))
        assert row["prompt_len"] + row["completion_len"] == len(ids) == len(row["loss_mask"])
        assert row["loss_mask"] == [0] * row["prompt_len"] + [1] * row["completion_len"]
        reasoning_end = row["prompt_len"] + row["reasoning_len"]
        assert ids[reasoning_end - 1] == 128822  # </think> closes the reasoning section
        assert tokenizer.decode(ids[reasoning_end:-1]) == content
        assert ids[-1] == 1  # <｜end▁of▁sentence｜>
        assert row["completion_format"] == "deepseek_v4_thinking"

    assert stats["rows"] == 3 and not stats["reused"]
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["completion_tokens"] == sum(r["completion_len"] for r in rows)
    provenance = read_provenance(PartRef(tmp_path, "tokens", 0).path)
    assert provenance["completion_format"] == "deepseek_v4_thinking"
    assert provenance["tokenizer_hash"]


def test_loss_mask_options(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir, loss_on_reasoning=False, loss_on_end_of_turn=False)
    write_inputs(tmp_path, 0, CONVERSATIONS, demo_responses())
    reconstruct_part(cfg, 0, DEMO)
    for row in read_part(PartRef(tmp_path, "tokens", 0)).to_pylist():
        p, r, n = row["prompt_len"], row["reasoning_len"], row["completion_len"]
        assert row["loss_mask"] == [0] * (p + r) + [1] * (n - r - 1) + [0]


def test_failed_responses_are_skipped_and_rerun_is_a_no_op(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    responses = demo_responses()
    responses[0] = response_row(responses[0]["sample_id"], None, None, status="failed", error="HTTP 500")
    write_inputs(tmp_path, 3, CONVERSATIONS, responses)
    first = reconstruct_part(cfg, 3, DEMO)
    assert (first["rows"], first["responses_not_done"]) == (2, 1)
    path = PartRef(tmp_path, "tokens", 3).path
    before = path.stat().st_mtime_ns
    again = reconstruct_part(cfg, 3, DEMO)
    assert again["reused"] and again["rows"] == 2
    assert path.stat().st_mtime_ns == before


def test_endpoint_prompt_ids_are_checked(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Prompt ids sent to /generate were rendered here: rendered again now, they must come out the same."""
    cfg = make_cfg(tmp_path, tokenizer_dir).model_copy(update={"endpoint": GENERATE_ROUTE})
    conv = CONVERSATIONS[0]
    sent = render_prompt_ids(tokenizer, conv)
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "R", "C", prompt_ids=sent)])
    assert reconstruct_part(cfg, 0, DEMO)["rows"] == 1

    wrong = [*sent[:5], 128533, *sent[6:]]
    write_inputs(tmp_path, 1, [conv], [response_row(sid_of(conv), "R", "C", prompt_ids=wrong)])
    with pytest.raises(ReconstructionError, match=f"sample {sid_of(conv)}: .* at position 5"):
        reconstruct_part(cfg, 1, DEMO)
    assert not PartRef(tmp_path, "tokens", 1).is_done()


def test_truncated_generation_gets_no_end_of_turn(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    conv = CONVERSATIONS[0]
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "cut off mid-thou", None, finish_reason="length")])
    reconstruct_part(cfg, 0, DEMO)
    row = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()[0]
    completion = row["input_ids"][row["prompt_len"] :]
    assert 1 not in completion and 128822 not in completion
    assert row["reasoning_len"] == row["completion_len"]


def test_reasoning_on_a_format_without_reasoning_names_the_sample(tmp_path: Path, tokenizer_dir: Path) -> None:
    no_reasoning = CompletionFormat("plain", None, False, None, EOS)
    conv = CONVERSATIONS[0]
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "thoughts", "C")])
    with pytest.raises(ReconstructionError, match=sid_of(conv)):
        reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, no_reasoning)


def test_special_tokens_of_the_demo_format_map_to_their_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    rows = verify_special_tokens(tokenizer, DEMO)
    assert {r.string: r.expected_id for r in rows} == {
        "<think>": 128821,
        "</think>": 128822,
        EOS: 1,
        "<｜tool▁calls▁begin｜>": 128806,
        "<｜tool▁call▁begin｜>": 128808,
    }
    assert all(r.encoded_ids == (r.expected_id,) and r.decoded == r.string for r in rows)


def test_special_token_check_fails_on_a_wrong_expected_id(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(SpecialTokenError, match="128533") as err:
        verify_special_tokens(tokenizer, DEMO, expected_ids={EOS: 128533})
    table = str(err.value)
    assert "vocabulary maps it to 1" in table and "FAIL" in table


def test_special_token_check_fails_on_a_string_that_is_not_special(tokenizer: PreTrainedTokenizerBase) -> None:
    chatml = CompletionFormat("chatml_on_deepseek", None, False, None, "<|im_end|>")
    rows = check_special_tokens(tokenizer, chatml)
    assert len(rows[0].encoded_ids) > 1 and not rows[0].ok
    assert "<|im_end|>" in format_table(rows)
    with pytest.raises(SpecialTokenError):
        verify_special_tokens(tokenizer, chatml)
    # The Kimi preset pins <|im_end|> to 163586; this tokenizer cannot honour that.
    with pytest.raises(SpecialTokenError, match="163586"):
        verify_special_tokens(tokenizer, PRESETS["kimi_k2_instruct"])


def test_reconstruct_fails_fast_on_bad_special_tokens(tmp_path: Path, tokenizer_dir: Path) -> None:
    conv = CONVERSATIONS[0]
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), None, "C")])
    with pytest.raises(SpecialTokenError):
        reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, PRESETS["kimi_k2_instruct"])
    assert not PartRef(tmp_path, "tokens", 0).path.exists()


def test_qwen3_layout_spans_with_padding_and_separator(tmp_path: Path) -> None:
    from tests.test_completion_format import QWEN3_FORM_TEMPLATE

    tokenizer_dir = write_tokenizer_dir(tmp_path / "tok")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_FORM_TEMPLATE
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    fmt = CompletionFormat("qwen3_form", "<think>", False, "</think>", "<|EOT|>", "\n", "\n\n")
    tokenizer = load_tokenizer(TokenizerConfig(path=tokenizer_dir))
    conv = CONVERSATIONS[0]
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "\nshort thought\n", "\n\nThe answer.")])
    reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, fmt)
    row = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()[0]
    ids = row["input_ids"]
    p, r = row["prompt_len"], row["reasoning_len"]
    assert tokenizer.decode(ids[:p]) == render_prompt(tokenizer, conv)
    assert tokenizer.decode(ids[p : p + r]) == "<think>\nshort thought\n</think>\n\n"
    assert tokenizer.decode(ids[p + r :]) == "The answer.<|EOT|>"


def test_real_qwen3_tokenizer_round_trip(tmp_path: Path) -> None:
    from tests.fixtures import families as F
    from tests.test_completion_format import QWEN3_TEMPLATE

    tokenizer_dir = F.qwen3_dir_with_template(tmp_path / "qwen3", QWEN3_TEMPLATE)
    tokenizer = load_tokenizer(TokenizerConfig(path=tokenizer_dir))
    fmt = PRESETS["qwen3_thinking"]
    write_inputs(
        tmp_path,
        0,
        CONVERSATIONS,
        [response_row(sid_of(c), r, a) for c, (r, a) in zip(CONVERSATIONS, ANSWERS, strict=True)],
    )
    reconstruct_part(make_cfg(tmp_path, tokenizer_dir, loss_on_reasoning=False), 0, fmt)
    for row, conv, (reasoning, content) in zip(
        read_part(PartRef(tmp_path, "tokens", 0)).to_pylist(), CONVERSATIONS, ANSWERS, strict=True
    ):
        ids, p, r = row["input_ids"], row["prompt_len"], row["reasoning_len"]
        prompt = render_prompt(tokenizer, prompt_messages(conv))
        assert prompt.endswith("<|im_start|>assistant\n")
        expected = prompt + f"<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>"
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert ids[p] == 151667 and ids[-1] == 151645
        assert tokenizer.decode(ids[p + r :]) == f"{content}<|im_end|>"
        assert row["loss_mask"] == [0] * (p + r) + [1] * (row["completion_len"] - r)


def test_finished_conversation_is_not_re_rendered(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The demo template drops reasoning from assistant turns: a re-render would lose what the model generated."""
    conv = CONVERSATIONS[0]
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "R", "C")])
    reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, DEMO)
    ids = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()[0]["input_ids"]
    finished: list[dict[str, str]] = [
        {"role": "user", "content": conv[0]["content"]},
        {"role": "assistant", "content": "C", "reasoning_content": "R"},
    ]
    re_rendered = tokenizer.apply_chat_template(finished, tokenize=False)
    assert isinstance(re_rendered, str) and "R</think>" not in re_rendered
    ours = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(ours, str) and ours.endswith(f"<think>R</think>C{EOS}")


def test_chat_template_kwargs_reach_the_prompt(tmp_path: Path) -> None:
    """DeepSeek-V3.1's real template opens <think> only when rendered with thinking=True: the kwargs in the
    config decide the prompt; ids sent to /generate rendered without them are refused, and a chat server's own
    rendering without them is what its target read, so it is the stored prompt (and counted)."""
    from tests.fixtures.families import deepseek_dir

    tokenizer_dir = deepseek_dir(tmp_path / "v31")
    conv = CONVERSATIONS[0]
    base = make_cfg(tmp_path, tokenizer_dir)
    thinking = base.model_copy(
        update={"tokenizer": TokenizerConfig(path=tokenizer_dir, chat_template_kwargs={"thinking": True})}
    )
    tokenizer = load_tokenizer(thinking.tokenizer)
    write_inputs(tmp_path, 0, [conv], [response_row(sid_of(conv), "R", "C")])
    reconstruct_part(thinking, 0, PRESETS["deepseek_v31_thinking"])
    row = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()[0]
    prompt = tokenizer.decode(row["input_ids"][: row["prompt_len"]], skip_special_tokens=False)
    assert prompt.endswith("<｜Assistant｜><think>")
    assert read_provenance(PartRef(tmp_path, "tokens", 0).path)["chat_template_kwargs"] == {"thinking": True}

    sent_without = render_prompt_ids(tokenizer, conv)  # rendered with the template's defaults
    write_inputs(tmp_path, 1, [conv], [response_row(sid_of(conv), "R", "C", prompt_ids=sent_without)])
    with pytest.raises(ReconstructionError, match="rendered prompt ids differ"):  # sent to /generate so: refused
        reconstruct_part(thinking.model_copy(update={"endpoint": GENERATE_ROUTE}), 1, PRESETS["deepseek_v31_thinking"])
    stats = reconstruct_part(thinking, 1, PRESETS["deepseek_v31_thinking"])  # a chat server's own rendering: kept
    row = read_part(PartRef(tmp_path, "tokens", 1)).to_pylist()[0]
    assert row["input_ids"][: row["prompt_len"]] == sent_without and stats["endpoint_prompt_rows"] == 1


@pytest.mark.parametrize("family", ["deepseek_v31", "kimi_k2_thinking", "gpt_oss", "qwen3"])
def test_spans_read_off_ids_equal_spans_from_offsets(family: str) -> None:
    """The fast path (boundaries from control-token ids) and the offsets path agree, including rows where the
    close tag also sits inside the text (ambiguous: those rows are redone with offsets) and truncated rows."""
    from tests.fixtures import families as F

    fmt = {
        "deepseek_v31": PRESETS["deepseek_v31_thinking"],
        "kimi_k2_thinking": PRESETS["kimi_k2_thinking"],
        "gpt_oss": PRESETS["gpt_oss_harmony"],
        "qwen3": PRESETS["qwen3_thinking"],
    }[family]
    backend = backend_for(F.shared(family))
    close = fmt.reasoning_close or ""
    layouts = [
        completion_layout(fmt, "Plain reasoning.", "Plain answer."),
        completion_layout(fmt, "Reasoning that quotes " + close + " once.", "Answer."),
        completion_layout(fmt, "R", "An answer that quotes " + close + " too."),
        completion_layout(fmt, "cut off in the reaso", None, truncated=True),
        completion_layout(fmt, "R", "cut off in the ans", truncated=True),
        completion_layout(fmt, "", "No reasoning at all. 你好 👋"),
    ]
    ids, at = encode_completions(backend, fmt, layouts)
    ref_ids, ref_at = backend.encode_with_boundaries(
        [lay.text for lay in layouts], [(lay.content_start, lay.end_of_turn_start) for lay in layouts]
    )
    assert ids == ref_ids
    assert at.tolist() == ref_at.tolist()
