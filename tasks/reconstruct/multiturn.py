"""Turn-by-turn regenerated conversations: the full sequence the target saw at its last turn, with loss masks over
every span the target itself generated.

When a conversation is regenerated turn by turn (each assistant turn answered by the target, then fed back as
history), the last request's context is the chat template's rendering of the whole history. That rendering is
what the target saw, so it is the prefix here; it is *not* what the target wrote: templates rewrite history
(Kimi-K2 and DeepSeek-V3.1 drop earlier reasoning, Qwen3 drops reasoning before the last user query, gpt-oss
turns the final `<|return|>` into `<|end|>`). So history spans are located in the rendered context itself, by
rendering it again with one turn's text replaced by a sentinel and diffing, and only text the target wrote
(reasoning where the template still shows it, content, and the end-of-turn token where it is the format's own)
is masked. The final turn is laid out from the generation prompt plus the generated text (`completion_layout`),
never by re-rendering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from transformers import PreTrainedTokenizerBase

from tasks.common.errors import ConfigError
from tasks.reconstruct.completion_format import (
    REASONING_KEYS,
    CompletionFormat,
    completion_layout,
    loss_mask_values,
    without_cut_character,
)
from tasks.reconstruct.model_ids import model_completion
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.reconstruct.tokenizer_loading import template_message

SENTINEL = "RegeneratedSpanSentinelQx7"


class ConversationTurn(TypedDict, total=False):
    """One message; `generated` marks an assistant turn the target produced (its reasoning in `reasoning`)."""

    role: str
    content: str
    reasoning: str | None
    generated: bool


@dataclass(frozen=True)
class RegeneratedSpan:
    """Token range [start, end) of text the target generated; `kind` says which part of which turn."""

    turn: int
    kind: str
    start: int
    end: int


@dataclass(frozen=True)
class MultiturnSequence:
    """`context`/`completion`: the texts encoded into input_ids[:prompt_len] and input_ids[prompt_len:]."""

    input_ids: list[int]
    loss_mask: list[int]
    prompt_len: int
    spans: list[RegeneratedSpan]
    context: str
    completion: str
    model_ids: bool = False
    """The final completion is the ids the model generated (`output_ids`), not the re-encoded text."""

    @property
    def reasoning_len(self) -> int:
        """Tokens of the final completion's reasoning section (open tag, reasoning, close tag, separator)."""
        return sum(s.end - s.start for s in self.spans if s.kind == "completion_reasoning")


def template_messages(turns: Sequence[ConversationTurn]) -> list[dict[str, Any]]:
    """Chat-template messages of `turns`, shaped as `render_prompt` shapes them (an assistant turn's reasoning
    under every key templates read it from), so the request an engine renders has our context exactly."""
    return [
        template_message({"role": t["role"], "content": t.get("content") or "", "reasoning": t.get("reasoning")})
        for t in turns
    ]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any]
) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    if not isinstance(text, str):
        raise ConfigError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def _locate(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    context: str,
    turn: int,
    keys: Sequence[str],
    template_kwargs: Mapping[str, Any],
) -> tuple[int, int] | None:
    """Character span of `messages[turn][keys]` inside `context`, or None when the template does not render it.

    The turn's text is replaced by a sentinel and the context rendered again: everything before the sentinel
    and after it must be unchanged, so the span is exactly what the template made of that text.
    """
    probe = [dict(m) for m in messages]
    probe[turn].update({key: SENTINEL for key in keys})
    rendered = _render(tokenizer, probe, template_kwargs)
    at = rendered.find(SENTINEL)
    if at < 0:
        return None
    if rendered.count(SENTINEL) > 1:
        raise ConfigError(f"chat template renders turn {turn}'s {keys[0]} more than once")
    tail = len(rendered) - at - len(SENTINEL)
    end = len(context) - tail
    if end < at or context[:at] != rendered[:at] or context[end:] != rendered[at + len(SENTINEL) :]:
        raise ConfigError(f"chat template renders turn {turn}'s {keys[0]} in a way that depends on its text")
    return at, end


def build_multiturn_sequence(
    tokenizer: PreTrainedTokenizerBase,
    fmt: CompletionFormat,
    turns: Sequence[ConversationTurn],
    *,
    loss_on_reasoning: bool = True,
    loss_on_end_of_turn: bool = True,
    truncated: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    output_ids: Sequence[int] | None = None,
) -> MultiturnSequence:
    """ids and mask of the last turn's context + completion; masks over every regenerated span.

    `turns` ends with the final generated assistant turn; earlier assistant turns with `generated` are the
    target's earlier answers (masked where the template shows them), others are context (never masked).
    `output_ids`, the final answer's ids as the endpoint reported them, are its completion when they spell it
    (`model_completion`); the context is what the engine rendered and tokenized from the history's text, so it
    is encoded here as the engine encoded it.
    """
    kwargs = dict(template_kwargs or {})
    if not turns or turns[-1]["role"] != "assistant" or not turns[-1].get("generated"):
        raise ValueError("the conversation must end with the target's generated assistant turn")
    history = list(turns[:-1])
    for i, t in enumerate(history):
        if t.get("generated") and t["role"] != "assistant":
            raise ValueError(f"turn {i} is marked generated but its role is {t['role']!r}")
    messages = template_messages(history)
    context = _render(tokenizer, messages, kwargs)
    if SENTINEL in context:
        raise ValueError("the conversation contains the span sentinel text")

    value = {"reasoning": int(loss_on_reasoning), "content": 1, "end_of_turn": int(loss_on_end_of_turn)}
    char_spans: list[tuple[int, str, int, int]] = []
    for i, t in enumerate(history):
        if not t.get("generated"):
            continue
        if t.get("reasoning"):
            found = _locate(tokenizer, messages, context, i, REASONING_KEYS, kwargs)
            if found is not None:
                char_spans.append((i, "reasoning", *found))
        if not (t.get("content") or "").strip():
            continue  # an empty earlier answer: nothing to mask, and templates drop it (GLM's `content.strip()`)
        found = _locate(tokenizer, messages, context, i, ("content",), kwargs)
        if found is None:
            raise ConfigError(f"chat template does not render turn {i}'s content")
        char_spans.append((i, "content", *found))
        if context.startswith(fmt.end_of_turn, found[1]):
            char_spans.append((i, "end_of_turn", found[1], found[1] + len(fmt.end_of_turn)))

    final = turns[-1]
    answered = completion_layout(fmt, final.get("reasoning"), final.get("content"), truncated=truncated)
    layout = without_cut_character(fmt, answered)
    backend = backend_for(tokenizer)
    bounds = [c for _, _, a, b in char_spans for c in (a, b)]
    (context_ids, completion_ids), at = backend.encode_with_boundaries(
        [context, layout.text], [bounds, [layout.content_start, layout.end_of_turn_start]]
    )
    eot_id = backend.token_to_id(fmt.end_of_turn)
    exact = None if output_ids is None or eot_id is None else model_completion(backend, answered, output_ids, eot_id)
    if exact is not None:
        completion_ids, layout = exact[0], answered
        at[1, 0], at[1, 1] = exact[1], exact[2]
    mask = [0] * len(context_ids)
    spans = []
    for n, (turn, kind, _, _) in enumerate(char_spans):
        start, end = int(at[0, 2 * n]), int(at[0, 2 * n + 1])
        mask[start:end] = [value[kind]] * (end - start)
        spans.append(RegeneratedSpan(turn, f"history_{kind}", start, end))

    p = len(context_ids)
    reasoning_end, content_end = p + int(at[1, 0]), p + int(at[1, 1])
    _, on_reasoning, on_content, on_eot = loss_mask_values(loss_on_reasoning, loss_on_end_of_turn)
    total = p + len(completion_ids)
    mask += [on_reasoning] * (reasoning_end - p) + [on_content] * (content_end - reasoning_end)
    mask += [on_eot] * (total - content_end)
    last = len(turns) - 1
    spans += [
        RegeneratedSpan(last, kind, a, b)
        for kind, a, b in (
            ("completion_reasoning", p, reasoning_end),
            ("completion_content", reasoning_end, content_end),
            ("completion_end_of_turn", content_end, total),
        )
        if b > a
    ]
    return MultiturnSequence([*context_ids, *completion_ids], mask, p, spans, context, layout.text, exact is not None)
