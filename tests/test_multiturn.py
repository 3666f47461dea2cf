"""Turn-by-turn regenerated conversations: the last turn's context as the template renders it, plus the final
completion, with masks over every span the target generated, over real tokenizers and templates that rewrite
history (Qwen3, Kimi-K2, DeepSeek-V3.1, gpt-oss)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from tasks.reconstruct.completion_format import PRESETS, completion_text
from tasks.reconstruct.multiturn import ConversationTurn, build_multiturn_sequence
from tasks.reconstruct.tokenizer_loading import render_prompt
from tests.fixtures import families as F

CONVERSATION: list[ConversationTurn] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven.", "reasoning": "Small primes: 2, 3, 5, 7.", "generated": True},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Thirteen, from the dataset.", "generated": False},
    {"role": "user", "content": "And one more, in words?"},
    {"role": "assistant", "content": "Eleven.", "reasoning": "Next after 7 is 11.", "generated": True},
]

FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3": ({}, "qwen3_thinking"),
    "kimi_k2_thinking": ({}, "kimi_k2_thinking"),
    "deepseek_v31": ({"thinking": True}, "deepseek_v31_thinking"),
    "gpt_oss": ({}, "gpt_oss_harmony"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[Any, ...]:
    kwargs, preset = FAMILIES[request.param]
    return request.param, F.shared(request.param), kwargs, PRESETS[preset]


def decode(tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tok.decode(ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def test_sequence_is_the_last_context_plus_the_final_completion(family: tuple[Any, ...]) -> None:
    _, tok, kwargs, fmt = family
    seq = build_multiturn_sequence(tok, fmt, CONVERSATION, template_kwargs=kwargs)
    context = render_prompt(tok, [{"role": t["role"], "content": t["content"]} for t in CONVERSATION[:-1]], kwargs)
    final = CONVERSATION[-1]
    assert decode(tok, seq.input_ids) == context + completion_text(fmt, final["reasoning"], final["content"])
    assert decode(tok, seq.input_ids[: seq.prompt_len]) == context
    assert len(seq.loss_mask) == len(seq.input_ids)
    # Earlier reasoning is dropped by every one of these templates: the context holds none of it.
    assert "Small primes" not in context


def test_masks_cover_exactly_the_regenerated_spans(family: tuple[Any, ...]) -> None:
    name, tok, kwargs, fmt = family
    seq = build_multiturn_sequence(tok, fmt, CONVERSATION, template_kwargs=kwargs)
    masked = decode(tok, [t for t, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m])
    final = completion_text(fmt, "Next after 7 is 11.", "Eleven.")
    # The earlier generated answer keeps its end-of-turn token where the template renders the format's own
    # (gpt-oss renders <|end|> in history where the model wrote <|return|>: not what the model generated).
    history_eot = "" if name == "gpt_oss" else fmt.end_of_turn
    assert masked == "Seven." + history_eot + final
    kinds = {(s.turn, s.kind) for s in seq.spans}
    assert (2, "history_content") in kinds and (6, "completion_content") in kinds
    assert not any(s.turn == 4 for s in seq.spans)  # the dataset's own answer is context, never a target
    for span in seq.spans:
        assert all(seq.loss_mask[span.start : span.end])


def test_loss_options_apply_to_history_and_completion(family: tuple[Any, ...]) -> None:
    _, tok, kwargs, fmt = family
    seq = build_multiturn_sequence(
        tok, fmt, CONVERSATION, template_kwargs=kwargs, loss_on_reasoning=False, loss_on_end_of_turn=False
    )
    masked = decode(tok, [t for t, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m])
    assert masked == "Seven.Eleven."


def test_history_reasoning_is_masked_where_the_template_keeps_it() -> None:
    """Qwen3 keeps reasoning for assistant turns after the last user query (a tool-free agentic tail)."""
    tok = F.shared("qwen3")
    turns: list[ConversationTurn] = [
        {"role": "user", "content": "Think twice."},
        {"role": "assistant", "content": "First pass.", "reasoning": "Draft.", "generated": True},
        {"role": "assistant", "content": "Second pass.", "reasoning": "Refine.", "generated": True},
    ]
    seq = build_multiturn_sequence(tok, PRESETS["qwen3_thinking"], turns)
    kinds = [(s.turn, s.kind, decode(tok, seq.input_ids[s.start : s.end])) for s in seq.spans]
    # "." and the template's "\n" before </think> are one token, which joins the later (unmasked) span.
    assert (1, "history_reasoning", "Draft") in kinds
    assert (1, "history_content", "First pass.") in kinds


def test_conversation_must_end_with_the_generated_turn() -> None:
    tok = F.shared("qwen3")
    with pytest.raises(ValueError, match="must end with"):
        build_multiturn_sequence(tok, PRESETS["qwen3_thinking"], CONVERSATION[:-1])
    bad: list[ConversationTurn] = [{"role": "user", "content": "x", "generated": True}, CONVERSATION[-1]]
    with pytest.raises(ValueError, match="marked generated"):
        build_multiturn_sequence(tok, PRESETS["qwen3_thinking"], bad)


@pytest.mark.parametrize("empty", ["", "  \n"])
def test_an_empty_earlier_answer_masks_nothing_instead_of_stopping_the_part(empty: str) -> None:
    """GLM renders an earlier assistant turn's content only `if content.strip()`: an empty earlier answer (the
    engine feeds back whatever the target wrote) made the span search raise a ConfigError that stopped the whole
    reconstruct part without naming the sample. Nothing the model wrote there can be masked; the rest is."""
    from tasks.reconstruct.completion_format import resolve_format

    kwargs = {"enable_thinking": True}
    tok = F.shared("glm_46")
    fmt = resolve_format("auto", tok, kwargs)
    turns: list[ConversationTurn] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": empty, "reasoning": "Nothing to say.", "generated": True},
        {"role": "user", "content": "Now name a prime."},
        {"role": "assistant", "content": "Seven.", "reasoning": "Small.", "generated": True},
    ]
    seq = build_multiturn_sequence(tok, fmt, turns, template_kwargs=kwargs)
    assert not any(s.turn == 2 and s.kind == "history_content" for s in seq.spans)
    masked = decode(tok, [t for t, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m])
    assert masked.endswith(completion_text(fmt, "Small.", "Seven.")) and "Be brief" not in masked
