"""Completion-format presets against chat templates in each family's real form, over real tokenizers.

For every family shipped: the format derived from the template by rendering sentinel conversations is the
preset, the preset's control tokens are single ids at their pinned ids, and a completion laid out by the preset
is exactly what the template renders for that turn (where the template shows it). Wrong presets, wrong ids and
templates that drop reasoning are caught.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from tasks.common.config import (
    CompletionFormatSpec,
    DatasetConfig,
    EndpointConfig,
    PipelineConfig,
    TokenizerConfig,
    ValidationConfig,
)
from tasks.common.errors import ConfigError, SpecialTokenError
from tasks.common.messages import Message
from tasks.common.shards import PartRef, read_part
from tasks.generate.endpoints import CompletionMarkers, split_completion
from tasks.reconstruct.completion_format import (
    PRESETS,
    SENTINEL_CONTENT,
    SENTINEL_REASONING,
    CompletionFormat,
    _closed_before_eos,
    check_format,
    completion_layout,
    completion_text,
    derive_format,
    format_for,
    resolve_format,
)
from tasks.reconstruct.special_tokens import check_special_tokens, format_table, verify_special_tokens
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_loading import render_prompt, template_message
from tasks.validate.checks import validate_part
from tests.fixtures import families as F
from tests.test_reconstruct import make_cfg, response_row, sid_of, write_inputs

# (family, chat-template kwargs, preset the template must derive to, preset names it must accept): every family
# and version shipped, each over its fixture template (tests/fixtures/templates/, source named in its header).
CASES: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    ("deepseek_v31", {"thinking": True}, "deepseek_v31_thinking", ("deepseek_v31_thinking", "deepseek_v32_thinking")),
    ("deepseek_v31", {}, "deepseek_v31_instruct", ("deepseek_v31_instruct",)),
    ("deepseek_v32", {"thinking": True}, "deepseek_v31_thinking", ("deepseek_v32_thinking",)),
    ("deepseek_v32", {"thinking": False}, "deepseek_v31_instruct", ("deepseek_v32_instruct",)),
    ("deepseek_v4_demo", {"thinking": True}, "deepseek_v4_thinking", ("deepseek_v4_thinking",)),
    ("deepseek_v4_demo", {}, "deepseek_v4_instruct", ("deepseek_v4_instruct",)),
    ("qwen3", {}, "qwen3_thinking", ("qwen3_thinking",)),
    ("qwen3", {"enable_thinking": False}, "qwen3_instruct", ("qwen3_instruct",)),
    ("qwen3_2507_thinking", {}, "qwen3_2507_thinking", ("qwen3_2507_thinking",)),
    ("qwen3_2507_instruct", {}, "qwen3_instruct", ("qwen3_instruct",)),
    ("kimi_k2_thinking", {}, "kimi_k2_thinking", ("kimi_k2_thinking",)),
    ("kimi_k2_instruct", {}, "kimi_k2_instruct", ("kimi_k2_instruct",)),
    ("kimi_k2_instruct_0905", {}, "kimi_k2_instruct", ("kimi_k2_instruct",)),
    ("kimi_k25", {}, "kimi_k25_thinking", ("kimi_k25_thinking",)),
    ("kimi_k25", {"thinking": False}, "kimi_k2_instruct", ("kimi_k25_instruct", "kimi_k2_instruct")),
    ("gpt_oss", {}, "gpt_oss_harmony", ("gpt_oss_harmony",)),
]
SOURCE = re.compile(
    r"Source checked against: ([\w.-]+/[\w.-]+\s+models/templates/\S+\s+@ [0-9a-f]{12}"
    r"|llama-cpp-python [\d.]+ \(PyPI sdist\)\s+vendor/llama\.cpp/models/templates/\S+ .*sha256:[0-9a-f]{64})"
    r"|Reconstructed: ",
    re.DOTALL,
)


def test_every_fixture_template_names_its_source() -> None:
    """Each template's header says which published file it was checked against (repository, path, commit), or
    that it was reconstructed and why."""
    templates = sorted(F.TEMPLATES.glob("*.jinja"))
    assert len(templates) >= 11
    for path in templates:
        text = path.read_text()
        assert text.startswith("{#-"), path.name
        header = text[: text.index("-#}")]
        assert SOURCE.search(header), f"{path.name}: header names no source"


def test_a_template_that_states_its_hash_is_the_published_text() -> None:
    """A header that says what the published text after it hashes to is checked: an edit below the header (a
    template "fixed" to make a test pass) no longer passes as the provider's file."""
    stated = 0
    for path in sorted(F.TEMPLATES.glob("*.jinja")):
        text = path.read_text()
        header = text[: text.index("-#}")]
        digest = re.search(r"sha256:([0-9a-f]{64})", header)
        if digest is None or "after these five header lines" not in " ".join(header.split()):
            continue
        body = "".join(text.splitlines(keepends=True)[5:])
        assert hashlib.sha256(body.encode()).hexdigest() == digest.group(1), path.name
        stated += 1
    assert stated >= 3


def test_kimi_k25_inserts_no_default_system_prompt() -> None:
    """The published K2.5 template adds no system turn (K2 and K2-Thinking add "You are Kimi, ...")."""
    user = [{"role": "user", "content": "hi"}]
    k25 = render_prompt(F.shared("kimi_k25"), user, {})  # type: ignore[arg-type]
    k2 = render_prompt(F.shared("kimi_k2_thinking"), user, {})  # type: ignore[arg-type]
    assert k25 == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert k2.startswith("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.")


def test_a_template_that_leaves_the_last_turn_open_still_derives() -> None:
    """Kimi-K2-Instruct-0905 renders a finished conversation without its final <|im_end|>: the end of turn is
    read where a further user turn follows."""
    tok = F.shared("kimi_k2_instruct_0905")
    finished = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenize=False
    )
    assert isinstance(finished, str) and finished.endswith("<|im_middle|>a")
    assert derive_format(tok).end_of_turn == "<|im_end|>"


@pytest.mark.parametrize(
    ("family", "kwargs", "wrong"),
    [
        ("deepseek_v4_demo", {"thinking": True}, "deepseek_v31_thinking"),
        ("deepseek_v4_demo", {"thinking": True}, "deepseek_v32_thinking"),
        ("deepseek_v4_demo", {}, "deepseek_v31_instruct"),
        ("deepseek_v31", {"thinking": True}, "deepseek_v4_thinking"),
    ],
)
def test_a_wrong_deepseek_versions_tokenizer_is_refused(family: str, kwargs: dict[str, Any], wrong: str) -> None:
    """Same layout, other ids: V4 moved <think> from 128798 to 128821. The preset's pins refuse the tokenizer
    before anything is sent (format check and special-token table both)."""
    tok = F.shared(family)
    with pytest.raises(ConfigError, match="pinned_ids"):
        resolve_format(wrong, tok, kwargs)
    with pytest.raises(SpecialTokenError, match="<think>"):
        verify_special_tokens(tok, PRESETS[wrong])


@pytest.fixture(scope="module")
def tokenizers() -> Callable[[str], PreTrainedTokenizerBase]:
    return F.shared


@pytest.mark.parametrize(("family", "kwargs", "derives", "accepts"), CASES)
def test_preset_and_derivation_agree(
    tokenizers: Callable[[str], PreTrainedTokenizerBase],
    family: str,
    kwargs: dict[str, Any],
    derives: str,
    accepts: tuple[str, ...],
) -> None:
    tok = tokenizers(family)
    assert derive_format(tok, kwargs) is PRESETS[derives]
    for name in accepts:
        check = check_format(name, tok, kwargs)
        assert check.agrees, check.notes()
        assert resolve_format(name, tok, kwargs) is PRESETS[name]
        rows = verify_special_tokens(tok, PRESETS[name])
        assert all(r.encoded_ids == (r.expected_id,) for r in rows)
        assert {r.string: r.expected_id for r in rows if r.string in PRESETS[name].pinned()} == PRESETS[name].pinned()


@pytest.mark.parametrize(
    ("family", "kwargs", "preset"),
    [
        ("qwen3", {}, "qwen3_thinking"),
        ("kimi_k2_thinking", {}, "kimi_k2_thinking"),
        ("deepseek_v32", {"thinking": True}, "deepseek_v32_thinking"),
        ("gpt_oss", {}, "gpt_oss_harmony"),
    ],
)
def test_preset_layout_is_what_the_template_renders(
    tokenizers: Callable[[str], PreTrainedTokenizerBase], family: str, kwargs: dict[str, Any], preset: str
) -> None:
    """Where the template shows a finished turn with its reasoning, generation prompt + preset layout is it."""
    tok = tokenizers(family)
    user = {"role": "user", "content": "Why is the sky blue?"}
    prompt = render_prompt(tok, [user], kwargs)  # type: ignore[list-item]
    assistant: dict[str, Any] = {"role": "assistant", "content": SENTINEL_CONTENT}
    assistant.update(reasoning_content=SENTINEL_REASONING, thinking=SENTINEL_REASONING)
    if family == "kimi_k2_thinking":  # Kimi-K2 shows reasoning only inside a tool-call sequence
        assistant["tool_calls"] = [{"id": "f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    finished = tok.apply_chat_template([user, assistant], tokenize=False, **kwargs)
    fmt = PRESETS[preset]
    layout = completion_text(fmt, SENTINEL_REASONING, SENTINEL_CONTENT)
    assert isinstance(finished, str) and layout.endswith(fmt.end_of_turn)
    if family == "kimi_k2_thinking":  # the tool-call section sits between the content and the end of turn
        assert finished.startswith(prompt + layout[: -len(fmt.end_of_turn)])
        assert finished.endswith("<|tool_calls_section_end|>" + fmt.end_of_turn)
    else:  # templates may add a newline after the turn; the model's output stops at its end-of-turn token
        assert finished.rstrip("\n") == prompt + layout


def test_templates_that_rewrite_history_are_told_apart(tokenizers: Callable[[str], PreTrainedTokenizerBase]) -> None:
    """DeepSeek-V3.1 and SpecForge's Kimi template never render reasoning_content; Kimi's own template does (in
    a tool-call sequence). The check says so, so a re-rendering pipeline's loss of reasoning is visible."""
    real = check_format("kimi_k2_thinking", tokenizers("kimi_k2_thinking"))
    specforge = check_format("kimi_k2_thinking", tokenizers("specforge_kimi_k2"))
    deepseek = check_format("deepseek_v31_thinking", tokenizers("deepseek_v31"), {"thinking": True})
    assert real.reasoning_visible and not real.notes()
    assert not specforge.reasoning_visible and not deepseek.reasoning_visible
    assert "drops reasoning" in specforge.notes()[0]
    assert specforge.describe()["reasoning_visible"] is False
    # What it cannot see (the padding inside the tags) is not claimed.
    assert "reasoning_pad" not in specforge.compared and "reasoning_pad" in real.compared


@pytest.mark.parametrize(
    ("family", "kwargs", "wrong", "expected"),
    [
        ("qwen3", {}, "kimi_k2_thinking", "pinned_ids"),
        ("kimi_k2_thinking", {}, "qwen3_thinking", "reasoning_pad: preset '\\n' vs template ''"),
        ("kimi_k2_thinking", {}, "kimi_k25_thinking", "open_in_prompt: preset True vs template False"),
        ("kimi_k25", {}, "kimi_k2_thinking", "open_in_prompt: preset False vs template True"),
        ("deepseek_v31", {}, "deepseek_v31_thinking", "has_reasoning: preset True vs template False"),
        ("gpt_oss", {}, "qwen3_thinking", "reasoning_open: preset '<think>' vs template '<|channel|>analysis"),
    ],
)
def test_wrong_preset_is_refused(
    tokenizers: Callable[[str], PreTrainedTokenizerBase], family: str, kwargs: dict[str, Any], wrong: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match="disagrees") as err:
        resolve_format(wrong, tokenizers(family), kwargs)
    assert expected in str(err.value)


def test_disagreement_can_be_a_warning(
    tokenizers: Callable[[str], PreTrainedTokenizerBase], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tasks.reconstruct.completion_format"):
        fmt = resolve_format("kimi_k25_thinking", tokenizers("kimi_k2_thinking"), on_disagreement="warn")
    assert fmt is PRESETS["kimi_k25_thinking"]
    assert "open_in_prompt" in caplog.text and "format_disagreement=warn" in caplog.text


def test_the_seeds_wrong_kimi_id_is_caught(tokenizers: Callable[[str], PreTrainedTokenizerBase]) -> None:
    """The seed once assumed <|im_end|> was 163533 (it is 163586): the table fails, showing both."""
    tok = tokenizers("kimi_k2_thinking")
    with pytest.raises(SpecialTokenError) as err:
        verify_special_tokens(tok, PRESETS["kimi_k2_thinking"], expected_ids={"<|im_end|>": 163533})
    table = str(err.value)
    assert "163533" in table and "vocabulary maps it to 163586" in table
    ok = {r.string: r for r in check_special_tokens(tok, PRESETS["kimi_k2_thinking"])}
    assert ok["<|im_end|>"].encoded_ids == (163586,) and ok["<|im_end|>"].decoded == "<|im_end|>"
    assert "163606" in format_table(list(ok.values()))


def test_harmony_control_tokens_are_each_verified(tokenizers: Callable[[str], PreTrainedTokenizerBase]) -> None:
    rows = verify_special_tokens(tokenizers("gpt_oss"), PRESETS["gpt_oss_harmony"])
    assert {r.string: r.expected_id for r in rows} == dict(PRESETS["gpt_oss_harmony"].pinned_ids)
    text = completion_text(PRESETS["gpt_oss_harmony"], "R", "C")
    assert text == "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>C<|return|>"


def test_run_config_drives_kwargs_and_disagreement_policy(tmp_path: Path) -> None:
    path = F.shared_dir("deepseek_v31")

    def cfg(**tokenizer: Any) -> PipelineConfig:
        return PipelineConfig(
            run_dir=tmp_path,
            datasets=[DatasetConfig(name="d", path=tmp_path / "d.jsonl")],
            endpoint=EndpointConfig(model="m"),
            tokenizer=TokenizerConfig(path=path, **tokenizer),
            validation=ValidationConfig(format_disagreement="fail"),
        )

    tok = F.shared("deepseek_v31")
    thinking = cfg(completion_format="deepseek_v31_thinking", chat_template_kwargs={"thinking": True})
    assert format_for(thinking, tok) is PRESETS["deepseek_v31_thinking"]
    assert format_for(cfg(completion_format="auto"), tok) is PRESETS["deepseek_v31_instruct"]
    with pytest.raises(ConfigError, match="has_reasoning"):
        format_for(cfg(completion_format="deepseek_v31_thinking"), tok)
    lenient = cfg(completion_format="deepseek_v31_thinking").model_copy(
        update={"validation": ValidationConfig(format_disagreement="warn")}
    )
    assert format_for(lenient, tok) is PRESETS["deepseek_v31_thinking"]


def test_a_prompt_that_closes_the_think_block_keeps_the_newline_the_model_writes() -> None:
    """GLM-4.6 with thinking off ends its prompt `<think></think>` and renders `</think>\\n` before an answer
    without reasoning: the model writes that newline first. Left out, every stored answer starts one id short;
    an API that returns it inside the content must not double it."""
    kwargs = {"enable_thinking": False}
    tok = F.shared("glm_46")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert not fmt.has_reasoning and fmt.content_separator == "\n"
    user = [{"role": "user", "content": "And 3+3?"}]
    prompt = render_prompt(tok, user, kwargs)
    finished = tok.apply_chat_template([*user, {"role": "assistant", "content": "It is 6."}], tokenize=False, **kwargs)
    assert isinstance(finished, str) and prompt.endswith("<think></think>")
    for content in ("It is 6.", "\nIt is 6."):
        assert prompt + completion_text(fmt, None, content) == finished + fmt.end_of_turn


def test_a_tool_call_rendered_between_reasoning_and_content_is_not_read_as_the_close() -> None:
    """Gemma-4 shows reasoning only in turns with tool calls, and renders the call between the reasoning and the
    content. The close is `<channel|>`: the derivation's own sentinel call must not become part of every answer."""
    kwargs = {"enable_thinking": True}
    tok = F.shared("gemma4_31b_it")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert (fmt.reasoning_open, fmt.reasoning_close, fmt.end_of_turn) == ("<|channel>thought", "<channel|>", "<turn|>")
    assert completion_text(fmt, "3 + 3 = 6.", "It is 6.") == "<|channel>thought\n3 + 3 = 6.\n<channel|>It is 6.<turn|>"
    call = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    turn = {"role": "assistant", "content": "It is 6.", "reasoning_content": "3 + 3 = 6.", "tool_calls": [call]}
    rendered = tok.apply_chat_template([{"role": "user", "content": "And 3+3?"}, turn], tokenize=False, **kwargs)
    assert isinstance(rendered, str) and "<|channel>thought\n3 + 3 = 6.\n<channel|><|tool_call>call:add" in rendered


# (family, chat-template kwargs): published templates whose generation prompt opens no think block and that render
# an answer without reasoning as its content alone, and one with reasoning inside a think block.
OMITTING: list[tuple[str, dict[str, Any]]] = [
    ("bielik_11b_v3", {}),
    ("bielik_11b_v3", {"enable_thinking": False}),
    ("lfm25_8b_a1b", {}),
]


@pytest.mark.parametrize(("family", "kwargs"), OMITTING)
def test_an_answer_without_reasoning_gets_no_think_block_the_template_never_writes(
    family: str, kwargs: dict[str, Any]
) -> None:
    """Bielik-11B-v3 with thinking off (and LFM2.5) show reasoning in a think block when given, and an answer
    without it as the content alone: the model writes no block. Laying out an empty `<think>\\n\\n</think>\\n`
    gave every row of a thinking-off run ids the model never produced. An answer with reasoning keeps the block."""
    tok = F.shared(family)
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert fmt.has_reasoning and fmt.omit_empty_reasoning
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, kwargs)
    for reasoning in (None, "Two plus two is four."):
        answer = {"role": "assistant", "content": "It is 4.", **({"reasoning_content": reasoning} if reasoning else {})}
        finished = tok.apply_chat_template([*user, template_message(answer)], tokenize=False, **kwargs)
        assert isinstance(finished, str)
        assert finished.startswith(prompt + completion_text(fmt, reasoning, "It is 4."))


def test_a_template_that_writes_an_empty_think_block_keeps_it() -> None:
    """Qwen3 renders `<think>\\n\\n</think>\\n\\n` before the last answer without reasoning: that block stays."""
    fmt = resolve_format("auto", F.shared("qwen3"), {})
    assert fmt is PRESETS["qwen3_thinking"] and not fmt.omit_empty_reasoning
    assert completion_text(fmt, None, "It is 4.") == "<think>\n\n</think>\n\nIt is 4.<|im_end|>"


# (family, chat-template kwargs, preset derived): llama.cpp's DeepSeek-V3.x templates over the V3.x table.
LLAMACPP_DEEPSEEK: list[tuple[str, dict[str, Any], str]] = [
    ("deepseek_v31_llamacpp", {"thinking": True}, "deepseek_v31_thinking"),
    ("deepseek_v32_llamacpp", {}, "deepseek_v31_instruct"),
    ("deepseek_v32_llamacpp", {"thinking": False}, "deepseek_v31_instruct"),
]


@pytest.mark.parametrize(("family", "kwargs", "preset"), LLAMACPP_DEEPSEEK)
def test_llamacpp_deepseek_templates_derive_the_deepseek_presets(
    family: str, kwargs: dict[str, Any], preset: str
) -> None:
    """V3.1 with thinking on opens `<think>` in the prompt and renders history `<think></think>content`; V3.2 with
    thinking off ends its prompt with the empty block `<think></think>` and renders history `</think>content`.
    Both were refused though their presets were accepted; the prompt says where the block opens or that it is
    already closed."""
    tok = F.shared(family)
    fmt = resolve_format("auto", tok, kwargs)
    assert fmt is PRESETS[preset]
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, kwargs)
    if fmt.has_reasoning:
        assert prompt.endswith("<｜Assistant｜><think>")
        assert completion_text(fmt, "Two and two.", "It is 4.") == "Two and two.</think>It is 4.<｜end▁of▁sentence｜>"
    else:
        assert prompt.endswith("<｜Assistant｜><think></think>")
        assert completion_text(fmt, None, "It is 4.") == "It is 4.<｜end▁of▁sentence｜>"


def test_a_prompt_that_closes_the_block_refuses_answers_with_reasoning_per_row() -> None:
    """GLM-4.7-Flash with thinking off ends its prompt `<|assistant|></think>` yet renders a turn's reasoning in
    `<think>...</think>`: the model writes no reasoning section, and an answer that carries reasoning cannot be
    laid out after that prompt, so the row is refused rather than stored with tags the prompt already closed."""
    kwargs = {"enable_thinking": False}
    tok = F.shared("glm_47_flash")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert not fmt.has_reasoning and fmt.end_of_turn == "<|user|>"
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, kwargs)
    finished = tok.apply_chat_template([*user, {"role": "assistant", "content": "It is 4."}], tokenize=False, **kwargs)
    assert isinstance(finished, str) and prompt.endswith("</think>")
    assert finished.startswith(prompt + completion_text(fmt, None, "It is 4.").removesuffix(fmt.end_of_turn))
    with pytest.raises(ValueError, match="has no reasoning, but the response carries reasoning text"):
        completion_text(fmt, "Two and two.", "It is 4.")


def test_a_template_that_ends_a_finished_conversation_with_eos_is_derived() -> None:
    """Phi-3.5 writes `<|endoftext|>` after the last turn only when no generation prompt follows, so the prompt
    `<|assistant|>\\n` does not extend the bare user turn: it continues from before that token. Refused before."""
    tok = F.shared("phi35_mini_instruct")
    fmt = resolve_format("auto", tok, {})
    verify_special_tokens(tok, fmt)
    assert not fmt.has_reasoning and fmt.end_of_turn == "<|end|>"
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, {})
    finished = tok.apply_chat_template([*user, {"role": "assistant", "content": "It is 4."}], tokenize=False)
    assert isinstance(finished, str) and finished.endswith("<|endoftext|>")
    assert finished.startswith(prompt + completion_text(fmt, None, "It is 4."))


def test_a_template_that_needs_a_tool_list_says_so_and_where_to_give_it() -> None:
    """Hermes-3's tool_use template loops over `tools` unguarded; the bare "'NoneType' object is not iterable"
    named neither the variable nor the config key. Given in the chat-template kwargs, it renders."""
    tok = F.shared("hermes3_tool_use")
    with pytest.raises(ConfigError, match=r"needs `tools`: set it in tokenizer\.chat_template_kwargs") as refused:
        resolve_format("auto", tok, {})
    assert "\n" not in str(refused.value)
    tool = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}
    assert resolve_format("auto", tok, {"tools": [tool]}).end_of_turn == "<|im_end|>"


# (family, chat-template kwargs, the assistant content holding reasoning and answer, the literals derived, the text
# the template writes after the content when another user turn follows): templates that read an answer's reasoning
# only from structured content, never from a reasoning_content key.
STRUCTURED: list[tuple[str, dict[str, Any], Callable[[str | None, str], Any], tuple[str, str, str]]] = [
    (
        "ministral3_reasoning",
        {},
        lambda r, c: [*([{"type": "thinking", "thinking": r}] if r else []), {"type": "text", "text": c}],
        ("[THINK]", "[/THINK]", "</s>"),
    ),
    (
        "apertus_8b_instruct",
        {"enable_thinking": True},
        lambda r, c: {"blocks": [*([{"type": "thoughts", "text": r}] if r else []), {"type": "response", "text": c}]},
        ("<|inner_prefix|>", "<|inner_suffix|>", "<|assistant_end|>"),
    ),
]


@pytest.mark.parametrize(("family", "kwargs", "content", "literals"), STRUCTURED)
def test_a_template_that_reads_reasoning_from_structured_content_derives_its_tags(
    family: str, kwargs: dict[str, Any], content: Callable[[str | None, str], Any], literals: tuple[str, str, str]
) -> None:
    """Ministral-3-Reasoning renders a `{"type": "thinking"}` chunk as `[THINK]...[/THINK]` and Apertus a
    `{"type": "thoughts"}` block as `<|inner_prefix|>...<|inner_suffix|>`; neither reads reasoning_content, so
    derivation saw no reasoning, derived a format without it and refused every answer that carried reasoning.
    The ids are the template's own rendering of the answer given that way, with reasoning and without it."""
    tok = F.shared(family)
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert (fmt.reasoning_open, fmt.reasoning_close, fmt.end_of_turn) == literals
    assert not fmt.open_in_prompt and fmt.omit_empty_reasoning
    assert check_format("auto", tok, kwargs).reasoning_visible
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, kwargs)
    follow = {"role": "user", "content": "And 3+3?"}
    for reasoning in (None, "Two plus two\nis four."):
        answer = {"role": "assistant", "content": content(reasoning, "It is 4.")}
        finished = tok.apply_chat_template([*user, answer, follow], tokenize=False, **kwargs)
        assert isinstance(finished, str)
        assert finished.startswith(prompt + completion_text(fmt, reasoning, "It is 4."))


def test_structured_content_a_template_prints_as_text_is_not_read_as_reasoning(tmp_path: Path) -> None:
    """A template that prints whatever content it is given shows a chunk list's reasoning before its text, as the
    list's repr: that is not a layout. It renders the list without reasoning unlike the plain answer, so it is
    not tried, and the format stays one without reasoning."""
    text = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = F.load(F.qwen3_dir_with_template(tmp_path / "printing", text))
    fmt = derive_format(tok, {})
    assert not fmt.has_reasoning and fmt.end_of_turn == "<|im_end|>"
    assert not check_format("auto", tok, {}).reasoning_visible


@pytest.mark.parametrize("effort", ["low", "minimal"])
def test_a_prompt_that_closes_the_block_with_part_of_a_multi_token_close_leaves_the_rest_to_the_model(
    effort: str,
) -> None:
    """Solar-Open with reasoning_effort low or minimal ends its prompt with an empty, closed reasoning message
    (`<|begin|>assistant<|think|><|end|><|begin|>assistant`); its close is `<|end|><|begin|>assistant<|content|>`, so
    the model writes `<|content|>` and the answer, as the template renders every answer after `<|begin|>assistant`.
    Derivation refused the template at these efforts. An answer that carries reasoning is refused per row."""
    kwargs = {"reasoning_effort": effort}
    tok = F.shared("solar_open_100b")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert not fmt.has_reasoning and fmt.content_separator == "<|content|>" and fmt.end_of_turn == "<|end|>"
    assert "<|content|>" in fmt.special_tokens()
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_prompt(tok, user, kwargs)
    assert prompt.endswith("<|begin|>assistant<|think|><|end|><|begin|>assistant")
    finished = tok.apply_chat_template([*user, {"role": "assistant", "content": "It is 4."}], tokenize=False, **kwargs)
    assert isinstance(finished, str)
    answer = finished[finished.rindex("<|begin|>assistant") + len("<|begin|>assistant") :]
    for content in ("It is 4.", "<|content|>It is 4."):
        assert completion_text(fmt, None, content) == answer == "<|content|>It is 4.<|end|>"
    with pytest.raises(ValueError, match="has no reasoning, but the response carries reasoning text"):
        completion_text(fmt, "Two and two.", "It is 4.")
    assert resolve_format("auto", tok, {}).reasoning_close == "<|end|><|begin|>assistant<|content|>"


def reconstructed_and_validated(
    cfg: PipelineConfig, fmt: CompletionFormat, conversations: list[list[Message]], responses: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Part 0 of these answers through reconstruct and validate: (tokens rows, validation rows) by sample id."""
    write_inputs(cfg.run_dir, 0, conversations, responses)
    reconstruct_part(cfg, 0, fmt)
    validate_part(cfg, 0, fmt)
    rows = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "tokens", 0)).to_pylist()}
    checked = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()}
    return rows, checked


def family_cfg(tmp_path: Path, family: str, kwargs: dict[str, Any] | None = None) -> PipelineConfig:
    """A run over `family`'s shared tokenizer, with the chat-template kwargs the server renders with."""
    return PipelineConfig(
        run_dir=tmp_path,
        datasets=[DatasetConfig(name="d", path=tmp_path / "in.jsonl")],
        endpoint=EndpointConfig(model="tiny"),
        tokenizer=TokenizerConfig(path=F.shared_dir(family), chat_template_kwargs=kwargs or {}),
    )


def assert_template_rows(
    rows: dict[str, dict[str, Any]],
    checked: dict[str, dict[str, Any]],
    conversations: list[list[Message]],
    finished: list[list[int]],
    model_row: int,
) -> None:
    """Every row holds the template's own rendering of its answer, carries loss on every completion token and
    passes validation; the row answered with the model's ids stores them and matches that reference exactly."""
    for conv, expected in zip(conversations, finished, strict=True):
        row, check = rows[sid_of(conv)], checked[sid_of(conv)]
        assert row["input_ids"] == expected
        assert all(row["loss_mask"][row["prompt_len"] :])
        assert (check["verdict"], check["structural_issues"]) == ("pass", []), check
    assert rows[sid_of(conversations[model_row])]["token_source"] == "model"
    assert checked[sid_of(conversations[model_row])]["reference_match"] == "exact"


def rows_from_three_sources(
    tmp_path: Path,
    family: str,
    kwargs: dict[str, Any],
    fmt: CompletionFormat,
    conversations: list[list[Message]],
    answered: tuple[str | None, list[str]],
    unstripped: tuple[str | None, str],
    finished: list[list[int]],
) -> dict[str, dict[str, Any]]:
    """The same answers as text alone (an OpenAI-style endpoint, reasoning stripped), as the model's ids, and as
    a server returned the last one with what it strips left in (`unstripped`: reasoning, content), through
    reconstruct and validate: all three must give `finished`."""
    reasoning, answers = answered
    tok = F.shared(family)
    prompt_len = len(
        tok.encode(render_prompt(tok, [dict(m) for m in conversations[1]], kwargs), add_special_tokens=False)
    )
    responses = [
        response_row(sid_of(conversations[0]), reasoning, answers[0]),
        response_row(sid_of(conversations[1]), reasoning, answers[1], output_ids=finished[1][prompt_len:]),
        response_row(sid_of(conversations[2]), *unstripped),
    ]
    rows, checked = reconstructed_and_validated(family_cfg(tmp_path, family, kwargs), fmt, conversations, responses)
    assert_template_rows(rows, checked, conversations, finished, model_row=1)
    return rows


def test_a_template_that_writes_a_newline_before_its_end_of_turn_derives_it(tmp_path: Path) -> None:
    """NVIDIA-Nemotron-Nano-v2 renders an answer as its stripped content, then `\\n<SPECIAL_12>`: the model writes
    the newline. Derivation refused the template ("followed by '\\n<SPECIAL_12>...', not a special token"). Servers
    return the content with that newline (vLLM, unstripped) or without it (an API that strips): both give the ids
    of the template's own rendering, every completion token carries loss, and validation passes them. A
    truncated answer keeps a trailing newline as its own."""
    tok = F.shared("nemotron_nano_v2")
    fmt = resolve_format("auto", tok, {})
    verify_special_tokens(tok, fmt)
    assert (fmt.end_of_turn, fmt.content_end, fmt.has_reasoning) == ("<SPECIAL_12>", "\n", False)
    assert fmt.describe()["content_end"] == "\n" and "content_end" not in PRESETS["qwen3_thinking"].describe()
    layout = completion_layout(fmt, None, "It is 4.")
    assert (layout.text, layout.content_start, layout.end_of_turn_start) == ("It is 4.\n<SPECIAL_12>", 0, 9)
    assert completion_layout(fmt, None, "It is 4.\n", truncated=True).text == "It is 4.\n"

    conversations = [
        [Message(role="system", content="/no_think"), Message(role="user", content=f"What is {i}+{i}?")]
        for i in range(2)
    ]
    answers = ["It is 0.", f"It is 2.{fmt.content_end}"]
    cfg = make_cfg(tmp_path, F.shared_dir("nemotron_nano_v2"))
    responses = [response_row(sid_of(c), None, a) for c, a in zip(conversations, answers, strict=True)]
    rows, checked = reconstructed_and_validated(cfg, fmt, conversations, responses)
    for conv, answer in zip(conversations, answers, strict=True):
        messages = [dict(m) for m in conv]
        finished = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": answer}], tokenize=False, continue_final_message=False
        )
        assert isinstance(finished, str) and finished.endswith("\n<SPECIAL_12>\n\n")
        assert render_prompt(tok, messages, {}).endswith("<SPECIAL_11>Assistant\n<think></think>")
        row = rows[sid_of(conv)]
        expected = tok.encode(finished.removesuffix("\n\n"), add_special_tokens=False)
        assert row["input_ids"] == expected
        completion = row["loss_mask"][row["prompt_len"] :]
        assert all(completion) and tok.decode(row["input_ids"][-1:]) == "<SPECIAL_12>"
        assert checked[sid_of(conv)]["structural_issues"] == [] and checked[sid_of(conv)]["verdict"] == "pass"


def test_a_written_format_must_say_the_newline_the_template_writes_before_its_end_of_turn() -> None:
    """A format written out for such a template without `content_end` would drop the model's newline from every
    answer: the template shows it, so the check refuses it; whitespace only is accepted there."""
    tok = F.shared("nemotron_nano_v2")
    check = check_format(CompletionFormatSpec(end_of_turn="<SPECIAL_12>", content_end=""), tok, {})
    assert check.differences["content_end"] == ("", "\n")
    with pytest.raises(ValidationError, match="content_end"):
        CompletionFormatSpec(end_of_turn="<SPECIAL_12>", content_end="x")


K3_CLOSING = "<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "instruct"])
def test_kimi_k3s_closing_tags_are_written_before_its_end_of_turn(tmp_path: Path, thinking: bool) -> None:
    """Kimi-K3 (llama.cpp's published template) ends every answer with `<|close|>response<|sep|><|close|>message
    <|sep|><|end_of_msg|>` and stops at `<|end_of_msg|>`. Derivation took the first control token after the content
    for the end of turn: every row stored `...content<|close|>` and lost the rest of what the model wrote, rows
    without a reference passed with a 6-token billing delta, and with thinking on every row failed as
    `doubled_open_tag` (its reasoning opens with `<|open|>think<|sep|>`, and `<|sep|>` alone ends every tag). Now
    the stored ids are the template's own rendering of the answer, from text and from the model's ids alike, every
    completion token carries loss, and validation passes them."""
    kwargs = {} if thinking else {"thinking": False}
    tok = F.shared("kimi_k3")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert (fmt.end_of_turn, fmt.content_end) == ("<|end_of_msg|>", K3_CLOSING)
    if thinking:
        assert (fmt.reasoning_open, fmt.open_in_prompt) == ("<|open|>think<|sep|>", True)
        assert fmt.reasoning_close == "<|close|>think<|sep|><|open|>response<|sep|>"
    else:
        assert not fmt.has_reasoning
    truncated = completion_layout(fmt, "Plan." if thinking else None, "It is", truncated=True)
    assert not truncated.text.endswith(("<|sep|>", "<|end_of_msg|>"))

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(3)]
    reasoning = "Add them." if thinking else None
    answers = [f"It is {2 * i}." for i in range(3)]
    finished = []
    for conv, answer in zip(conversations, answers, strict=True):
        messages = [dict(m) for m in conv]
        text = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": answer, "reasoning_content": reasoning}],
            tokenize=False,
            **kwargs,
        )
        assert isinstance(text, str) and text.endswith(f"{answer}{K3_CLOSING}<|end_of_msg|>")
        finished.append(tok.encode(text, add_special_tokens=False))
    # The last server returned the closing tags with the content.
    unstripped = (reasoning, answers[2] + K3_CLOSING)
    rows_from_three_sources(tmp_path, "kimi_k3", kwargs, fmt, conversations, (reasoning, answers), unstripped, finished)


def test_a_written_format_for_kimi_k3_must_say_its_closing_tags() -> None:
    """Written out without the closing tags, a format for Kimi-K3 would drop them from every answer: the template
    shows them, so the check names them; closing tags are accepted in `content_end`, other text is not."""
    tok = F.shared("kimi_k3")
    written = {"end_of_turn": "<|end_of_msg|>", "reasoning_open": "<|open|>think<|sep|>", "open_in_prompt": True}
    written["reasoning_close"] = "<|close|>think<|sep|><|open|>response<|sep|>"
    check = check_format(CompletionFormatSpec(**written), tok, {})
    assert check.differences == {"content_end": ("", K3_CLOSING)}
    assert check_format(CompletionFormatSpec(**written, content_end=K3_CLOSING), tok, {}).agrees
    with pytest.raises(ValidationError, match="content_end"):
        CompletionFormatSpec(**written, content_end="response message")


COHERE_KWARGS: list[dict[str, Any]] = [{}, {"reasoning": False}]


@pytest.mark.parametrize("kwargs", COHERE_KWARGS, ids=["reasoning", "no_reasoning"])
def test_cohere_ends_an_answer_with_two_control_tokens_and_stops_at_its_eos(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    """Cohere's Command template (llama.cpp's Cohere2MoE) ends every answer `<|END_TEXT|><|END_OF_TURN_TOKEN|>`,
    and the model stops at its eos `<|END_OF_TURN_TOKEN|>`. Derivation took the first control token after the
    content for the end of turn: every row stored `...content<|END_TEXT|>`, one id short of what the model wrote
    (a model-ids row failed its reference, a text row passed one token under its bill). Now `<|END_TEXT|>` is
    the content's closing tag and the eos the end of turn: the stored ids are the template's own rendering, from
    text (with or without the tag returned) and from the model's ids alike, and validation passes them."""
    tok = F.shared("cohere2moe")
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert (fmt.end_of_turn, fmt.content_end) == ("<|END_OF_TURN_TOKEN|>", "<|END_TEXT|>")
    reasoning = "Add them." if not kwargs else None
    if reasoning:
        assert (fmt.reasoning_open, fmt.open_in_prompt) == ("<|START_THINKING|>", True)
        assert fmt.reasoning_close == "<|END_THINKING|><|START_TEXT|>"
    else:
        assert not fmt.has_reasoning and fmt.content_separator == "<|START_TEXT|>"
    assert not completion_layout(fmt, reasoning, "It is", truncated=True).text.endswith("<|END_TEXT|>")

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(3)]
    answers = [f"It is {2 * i}." for i in range(3)]
    prompts = [render_prompt(tok, [dict(m) for m in c], kwargs) for c in conversations]
    finished = []
    for prompt, answer in zip(prompts, answers, strict=True):
        assistant = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        text = tok.apply_chat_template([{"role": "user", "content": "x"}, assistant], tokenize=False, **kwargs)
        assert isinstance(text, str)
        turn = text[text.index("<|CHATBOT_TOKEN|>", len(text) - 200) + len("<|CHATBOT_TOKEN|>") :]
        if reasoning is None:  # the prompt already holds the closed block the history leaves out
            turn = turn.removeprefix("<|START_THINKING|><|END_THINKING|>")
            assert prompt.endswith("<|START_THINKING|><|END_THINKING|>")
        else:
            assert prompt.endswith("<|START_THINKING|>") and turn.startswith("<|START_THINKING|>")
            turn = turn.removeprefix("<|START_THINKING|>")
        assert turn.endswith(f"{answer}<|END_TEXT|><|END_OF_TURN_TOKEN|>")
        finished.append(tok.encode(prompt + turn, add_special_tokens=False))
    unstripped = (reasoning, answers[2] + "<|END_TEXT|>")
    rows = rows_from_three_sources(
        tmp_path, "cohere2moe", kwargs, fmt, conversations, (reasoning, answers), unstripped, finished
    )
    for conv in conversations:
        ends = tok.convert_ids_to_tokens(rows[sid_of(conv)]["input_ids"][-2:])
        assert ends == ["<|END_TEXT|>", "<|END_OF_TURN_TOKEN|>"]


def test_a_run_of_control_tokens_that_starts_with_the_eos_ends_the_turn_there() -> None:
    """The eos closes the turn only from inside the run after the content: where it comes first and the next
    turn's tokens follow (DeepSeek `<｜end▁of▁sentence｜><｜User｜>`, Llama `<|eot_id|><|start_header_id|>`), or the
    run holds no eos (Kimi-K2's `<|im_end|><|im_user|>`, its eos `[EOS]`), the end of turn stays the first token."""
    controls = {"<e>", "<u>", "<t>", "<eos>"}
    assert _closed_before_eos("<t><eos><u>x", controls, "<eos>") == ("<t>", "<eos>")
    assert _closed_before_eos("<eos><u>x", controls, "<eos>") is None
    assert _closed_before_eos("<e><u>x", controls, "<eos>") is None
    assert _closed_before_eos("<t>\n<eos>", controls, "<eos>") is None
    assert _closed_before_eos("<t><eos>", controls, None) is None
    for family, kwargs in (("deepseek_v32", {"thinking": True}), ("kimi_k2_instruct", {}), ("qwen3", {})):
        assert derive_format(F.shared(family), kwargs).content_end == ""


ENDS_CONVERSATION_WITH_EOS = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "{%- if not loop.last or add_generation_prompt %}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}"
)


def test_an_eos_written_only_at_the_end_of_a_conversation_is_not_the_end_of_turn(tmp_path: Path) -> None:
    """A template may write the eos right after the last turn of a finished conversation only (as Phi-3.5 does,
    here with no newline between: `<|im_end|><|endoftext|>`). Between turns it writes `<|im_end|>` alone, so that
    is where the model stops; the run before the eos counts as closing tokens only where it is written between
    turns too (Cohere's is)."""
    path = F.qwen3_dir_with_template(tmp_path / "tok", ENDS_CONVERSATION_WITH_EOS)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|endoftext|>"}))
    tok = F.load(path)
    finished = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert tok.decode(finished).endswith("Yo<|im_end|><|endoftext|>")
    fmt = resolve_format("auto", tok, {})
    assert (fmt.end_of_turn, fmt.content_end) == ("<|im_end|>", "")


LAGUNA_THINKING = {"enable_thinking": True}


def test_a_prompt_that_ends_at_the_open_tag_leaves_the_pad_to_the_model(tmp_path: Path) -> None:
    """poolside Laguna-XS.2 with thinking on ends its generation prompt `<assistant>\\n<think>` and renders a turn
    `<think>\\n` reasoning `\\n</think>\\n` content `\\n</assistant>`: the model writes the newline after the tag.
    Derivation read the layout as Qwen3-2507's (`<think>\\n` in the prompt): a server that strips the reasoning's
    leading newline (SGLang's parser, most APIs) gave rows one id short of what the model wrote, and a server
    that does not gave the right ones. Now the pad is the model's (`model_writes_pad`): removed once from what is
    returned and written once, so both give the template's own rendering, as do the model's ids."""
    tok = F.shared("laguna_xs2")
    fmt = resolve_format("auto", tok, LAGUNA_THINKING)
    verify_special_tokens(tok, fmt)
    assert (fmt.reasoning_open, fmt.open_in_prompt, fmt.model_writes_pad) == ("<think>", True, True)
    assert (fmt.reasoning_pad, fmt.reasoning_close, fmt.content_separator) == ("\n", "</think>", "\n")
    assert (fmt.content_end, fmt.end_of_turn) == ("\n", "</assistant>")
    assert fmt.describe()["model_writes_pad"] is True and "model_writes_pad" not in PRESETS["qwen3_thinking"].describe()
    assert completion_layout(fmt, "Plan", None, truncated=True).text == "\nPlan"

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(3)]
    answers = [f"It is {2 * i}." for i in range(3)]
    prompts = [render_prompt(tok, [dict(m) for m in c], LAGUNA_THINKING) for c in conversations]
    assert all(p.endswith("<assistant>\n<think>") for p in prompts)
    finished = []
    for conv, answer in zip(conversations, answers, strict=True):
        messages = [dict(m) for m in conv]
        assistant = {"role": "assistant", "content": answer, "reasoning_content": "Add them."}
        text = tok.apply_chat_template([*messages, assistant], tokenize=False, **LAGUNA_THINKING)
        assert isinstance(text, str) and text.endswith(f"<think>\nAdd them.\n</think>\n{answer}\n</assistant>\n")
        finished.append(tok.encode(text.removesuffix("\n"), add_special_tokens=False))
    prompt_lens = [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    unstripped = ("\nAdd them.\n", f"\n{answers[2]}\n")
    rows = rows_from_three_sources(
        tmp_path, "laguna_xs2", LAGUNA_THINKING, fmt, conversations, ("Add them.", answers), unstripped, finished
    )
    for conv, prompt_len in zip(conversations, prompt_lens, strict=True):
        assert tok.decode(rows[sid_of(conv)]["input_ids"][prompt_len : prompt_len + 2]) == "\nAdd"


QWQ_THINKING = {"enable_thinking": True}


def test_a_template_that_hides_the_separator_is_refused_naming_the_presets_that_fit_it(tmp_path: Path) -> None:
    """QwQ-32B's prompt opens the reasoning (`<|im_start|>assistant\n<think>\n`) and earlier answers render without
    it, so the template never shows what the model writes after `</think>`: `auto` refuses rather than guess, and
    now names the one preset that fits what the template does show, Qwen3-2507-Thinking (same prompt, end of turn
    and ids; the hybrid `qwen3_thinking`, whose prompt opens no block, does not fit). With that preset, rows hold
    QwQ's layout (`...\n</think>\n\n` content `<|im_end|>`) from stripped text, unstripped text and the model's
    ids alike, and validation passes them."""
    tok = F.shared("qwq_32b")
    with pytest.raises(ConfigError) as refused:
        resolve_format("auto", tok, QWQ_THINKING)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("where the model writes their layout: qwen3_2507_thinking")
    fmt = resolve_format("qwen3_2507_thinking", tok, QWQ_THINKING)
    verify_special_tokens(tok, fmt)

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(3)]
    answers = [f"It is {2 * i}." for i in range(3)]
    prompts = [render_prompt(tok, [dict(m) for m in c], QWQ_THINKING) for c in conversations]
    assert all(p.endswith("<|im_start|>assistant\n<think>\n") for p in prompts)
    turns = [f"Add them.\n</think>\n\n{answer}<|im_end|>" for answer in answers]
    finished = [tok.encode(p + t, add_special_tokens=False) for p, t in zip(prompts, turns, strict=True)]
    unstripped = ("Add them.\n", f"\n\n{answers[2]}")
    rows_from_three_sources(
        tmp_path, "qwq_32b", QWQ_THINKING, fmt, conversations, ("Add them.", answers), unstripped, finished
    )


def test_a_written_format_says_who_writes_the_pad() -> None:
    """A format written out for Laguna-XS.2 as if its prompt held the pad is refused by the template (which shows
    the prompt ending at the tag); `model_writes_pad` is only taken with an open tag in the prompt and a pad."""
    tok = F.shared("laguna_xs2")
    written: dict[str, Any] = {"reasoning_open": "<think>", "open_in_prompt": True, "reasoning_close": "</think>"}
    written |= {"reasoning_pad": "\n", "content_separator": "\n", "content_end": "\n", "end_of_turn": "</assistant>"}
    check = check_format(CompletionFormatSpec(**written), tok, LAGUNA_THINKING)
    assert check.differences == {"model_writes_pad": (False, True)}
    assert check_format(CompletionFormatSpec(**written, model_writes_pad=True), tok, LAGUNA_THINKING).agrees
    with pytest.raises(ValidationError, match="model_writes_pad needs open_in_prompt"):
        CompletionFormatSpec(**{**written, "open_in_prompt": False}, model_writes_pad=True)
    with pytest.raises(ValidationError, match="model_writes_pad needs open_in_prompt"):
        CompletionFormatSpec(**{**written, "reasoning_pad": ""}, model_writes_pad=True)


def test_an_answer_without_reasoning_gets_the_close_tag_alone_where_the_template_writes_it(tmp_path: Path) -> None:
    """MiniMax-M3 in its default adaptive mode opens no block in the prompt; the model decides whether to think,
    and the template renders an answer without reasoning as `</mm:think>` then the content (what its disabled
    mode's prompt writes). Such answers were laid out with an empty block, `<mm:think></mm:think>`: one id the
    model never wrote, and a row without reasoning was failed as hidden reasoning. Now the close tag alone is
    written for them (`empty_reasoning_close_only`), answers with reasoning keep the whole block, and both are the
    template's own rendering and pass; reasoning tokens billed for an answer returned without any still fail it."""
    tok = F.shared("minimax_m3")
    fmt = resolve_format("auto", tok, {})
    verify_special_tokens(tok, fmt)
    assert (fmt.reasoning_open, fmt.open_in_prompt, fmt.reasoning_close) == ("<mm:think>", False, "</mm:think>")
    assert (fmt.end_of_turn, fmt.empty_reasoning_close_only, fmt.omit_empty_reasoning) == ("[e~[", True, False)
    assert completion_text(fmt, None, "Hi.") == "</mm:think>Hi.[e~["
    assert completion_text(fmt, "Plan.", "Hi.") == "<mm:think>Plan.</mm:think>Hi.[e~["
    enabled = resolve_format("auto", tok, {"thinking_mode": "enabled"})
    assert (enabled.open_in_prompt, enabled.empty_reasoning_close_only) == (True, False)
    assert not resolve_format("auto", tok, {"thinking_mode": "disabled"}).has_reasoning

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(3)]
    answers = [("Add them.", "It is 0."), (None, "It is 2."), (None, "It is 4.")]
    finished = []
    for conv, (reasoning, content) in zip(conversations, answers, strict=True):
        assistant = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        text = tok.apply_chat_template([*(dict(m) for m in conv), assistant], tokenize=False)
        assert isinstance(text, str)
        finished.append(tok.encode(text.removesuffix("\n"), add_special_tokens=False))
    billed = [
        len(f) - len(tok.encode(render_prompt(tok, c, {}), add_special_tokens=False))
        for f, c in zip(finished, conversations, strict=True)
    ]
    responses = [
        response_row(sid_of(conversations[0]), *answers[0]),
        response_row(sid_of(conversations[1]), *answers[1], reasoning_tokens=0, completion_tokens=billed[1]),
        response_row(sid_of(conversations[2]), *answers[2], reasoning_tokens=40, completion_tokens=billed[2] + 40),
    ]
    cfg = family_cfg(tmp_path, "minimax_m3")
    rows, checked = reconstructed_and_validated(cfg, fmt, conversations, responses)
    for conv, expected in zip(conversations, finished, strict=True):
        assert rows[sid_of(conv)]["input_ids"] == expected
    assert tok.decode(finished[1]).endswith("ai\n</mm:think>It is 2.[e~[")
    for conv in conversations[:2]:
        assert (checked[sid_of(conv)]["verdict"], checked[sid_of(conv)]["structural_issues"]) == ("pass", [])
    assert checked[sid_of(conversations[2])]["verdict"] == "fail"


def test_a_written_format_says_how_an_answer_without_reasoning_is_written() -> None:
    """Written out without the flag, a format for MiniMax-M3 would give answers without reasoning an open tag the
    template never shows: the check names the field. It is refused with an open tag in the prompt, or with
    `omit_empty_reasoning`."""
    tok = F.shared("minimax_m3")
    written: dict[str, Any] = {"reasoning_open": "<mm:think>", "reasoning_close": "</mm:think>", "end_of_turn": "[e~["}
    check = check_format(CompletionFormatSpec(**written), tok, {})
    assert check.differences == {"empty_reasoning_close_only": (False, True)}
    assert check_format(CompletionFormatSpec(**written, empty_reasoning_close_only=True), tok, {}).agrees
    for clash in ({"open_in_prompt": True}, {"omit_empty_reasoning": True}):
        with pytest.raises(ValidationError, match="empty_reasoning_close_only needs"):
            CompletionFormatSpec(**written, **clash, empty_reasoning_close_only=True)


@pytest.mark.parametrize(
    ("family", "kwargs", "tail"),
    [("gpt_oss", {}, "<|channel|>final<|message|>"), ("solar_open_100b", {"reasoning_effort": "high"}, "<|content|>")],
    ids=["gpt_oss", "solar_open_high"],
)
def test_an_answer_without_reasoning_opens_its_own_message_where_the_close_ends_by_opening_one(
    tmp_path: Path, family: str, kwargs: dict[str, Any], tail: str
) -> None:
    """gpt-oss closes its analysis `<|end|><|start|>assistant<|channel|>final<|message|>`, and its template renders
    an answer without analysis as `<|channel|>final<|message|>` and the content right after the generation prompt
    `<|start|>assistant`; Solar-Open with reasoning high closes `<|end|><|begin|>assistant<|content|>` and renders
    such an answer `<|content|>` and the content. Laid out with an empty analysis block, each such row held ids
    the model never wrote (6 more for gpt-oss than it was billed) and failed `empty_reasoning`: a paid answer
    thrown away. Now the row is the template's own rendering, from text, from the model's ids and from a raw
    completion split on the format's markers, and passes at its bill with no reasoning tokens counted; an answer
    billed for reasoning it did not return still fails."""
    tok = F.shared(family)
    fmt = resolve_format("auto", tok, kwargs)
    verify_special_tokens(tok, fmt)
    assert (fmt.empty_reasoning_close_only, fmt.empty_reasoning_close_tail) == (True, tail)
    assert fmt.reasoning_close is not None and fmt.reasoning_close.endswith(tail) != (fmt.reasoning_close == tail)
    if family == "gpt_oss":
        assert resolve_format("gpt_oss_harmony", tok, kwargs).empty_reasoning_close_tail == tail
    assert completion_text(fmt, None, "Hi.") == f"{tail}Hi.{fmt.end_of_turn}"

    conversations = [[Message(role="user", content=f"What is {i}+{i}?")] for i in range(4)]
    answers = [f"It is {2 * i}." for i in range(4)]
    prompt_lens, finished = [], []
    for conv, answer in zip(conversations, answers, strict=True):
        user = [dict(m) for m in conv]
        prompt = render_prompt(tok, user, kwargs)
        text = tok.apply_chat_template([*user, {"role": "assistant", "content": answer}], tokenize=False, **kwargs)
        assert isinstance(text, str) and text == f"{prompt}{tail}{answer}{fmt.end_of_turn}"
        prompt_lens.append(len(tok.encode(prompt, add_special_tokens=False)))
        finished.append(tok.encode(text, add_special_tokens=False))
    billed = [len(f) - n for f, n in zip(finished, prompt_lens, strict=True)]
    split = split_completion(tok.decode(finished[2][prompt_lens[2] :]), CompletionMarkers.of(fmt))
    assert split == (None, answers[2])
    responses = [
        response_row(sid_of(conversations[0]), None, answers[0], completion_tokens=billed[0], reasoning_tokens=0),
        response_row(
            sid_of(conversations[1]),
            None,
            answers[1],
            completion_tokens=billed[1],
            output_ids=finished[1][prompt_lens[1] :],
        ),
        response_row(sid_of(conversations[2]), *split, completion_tokens=billed[2]),
        response_row(sid_of(conversations[3]), None, answers[3], completion_tokens=billed[3] + 40, reasoning_tokens=40),
    ]
    cfg = family_cfg(tmp_path, family, kwargs)
    rows, checked = reconstructed_and_validated(cfg, fmt, conversations, responses)
    assert_template_rows(rows, checked, conversations[:3], finished[:3], model_row=1)
    for conv in conversations[:3]:
        assert (checked[sid_of(conv)]["billing_delta_tokens"], checked[sid_of(conv)]["our_reasoning_tokens"]) == (0, 0)
    assert checked[sid_of(conversations[3])]["verdict"] == "fail"


def test_a_written_format_names_the_tail_of_the_close_an_answer_without_reasoning_starts_with() -> None:
    """Written out without it, a format for gpt-oss gives answers without analysis an empty analysis block the
    template never shows: the check names both fields. The tail must be a shorter end of the close, and only
    with `empty_reasoning_close_only`."""
    tok = F.shared("gpt_oss")
    close = "<|end|><|start|>assistant<|channel|>final<|message|>"
    written: dict[str, Any] = {
        "reasoning_open": "<|channel|>analysis<|message|>",
        "reasoning_close": close,
        "end_of_turn": "<|return|>",
    }
    check = check_format(CompletionFormatSpec(**written), tok, {})
    assert check.differences == {
        "empty_reasoning_close_only": (False, True),
        "empty_reasoning_close_tail": ("", "<|channel|>final<|message|>"),
    }
    tail = {"empty_reasoning_close_only": True, "empty_reasoning_close_tail": "<|channel|>final<|message|>"}
    assert check_format(CompletionFormatSpec(**written, **tail), tok, {}).agrees
    for wrong in (
        {"empty_reasoning_close_tail": "<|channel|>final<|message|>"},
        {"empty_reasoning_close_only": True, "empty_reasoning_close_tail": "<|channel|>commentary<|message|>"},
        {"empty_reasoning_close_only": True, "empty_reasoning_close_tail": close},
    ):
        with pytest.raises(ValidationError, match="empty_reasoning_close_tail needs"):
            CompletionFormatSpec(**written, **wrong)
