"""How a model writes one completion as text, so its token ids can be rebuilt from what an API returns.

APIs return `reasoning` and `content` separately, never ids. The ids the model produced are recovered as
`encode(rendered prompt) + encode(completion_text(fmt, reasoning, content))`: the completion is laid out
exactly as the model emits it (reasoning-open tag unless the generation prompt already holds it, reasoning,
close tag, separator, content, end-of-turn token). The finished conversation is never re-rendered: chat
templates rewrite history (the demo template and Kimi-K2 drop reasoning from assistant turns), so a re-render
is not what the model saw.

A preset is only trusted after it agrees with what the tokenizer's own chat template shows (`resolve_format`):
a format/template mismatch corrupts every sample in the same way, so it must fail before the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.errors import ConfigError
from tasks.tokenizer_loading import added_tokens

KNOWN_REASONING_TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))


@dataclass(frozen=True)
class CompletionFormat:
    """The literal text around reasoning and content in one generated turn.

    `open_in_prompt`: the generation prompt already ends with `reasoning_open + reasoning_pad`, so the model's
    output starts directly with the reasoning. `reasoning_pad`: whitespace the model writes inside the tags on
    both sides of the reasoning (Qwen3 writes `<think>\\n...\\n</think>`). `content_separator`: text between
    the close tag and the content. `pinned_ids`: ids known from the model card; a tokenizer that disagrees is
    rejected (Kimi-K2's `<|im_end|>` is 163586; assuming 163533, which decodes to "chas", once corrupted a run
    silently).
    """

    name: str
    reasoning_open: str | None
    open_in_prompt: bool
    reasoning_close: str | None
    end_of_turn: str
    reasoning_pad: str = ""
    content_separator: str = ""
    pinned_ids: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if (self.reasoning_open is None) != (self.reasoning_close is None):
            raise ConfigError(f"completion format {self.name!r}: reasoning_open and reasoning_close go together")
        if self.reasoning_open is None and (self.open_in_prompt or self.reasoning_pad or self.content_separator):
            raise ConfigError(f"completion format {self.name!r}: reasoning fields set on a format without reasoning")
        if not self.end_of_turn:
            raise ConfigError(f"completion format {self.name!r}: end_of_turn is empty")

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning_close is not None

    def special_tokens(self) -> tuple[str, ...]:
        """The control-token strings this format relies on; each must encode to exactly one id."""
        tags = (self.reasoning_open, self.reasoning_close) if self.has_reasoning else ()
        return tuple(t for t in (*tags, self.end_of_turn) if t is not None)

    def markers(self) -> tuple[str, str]:
        """(reasoning_close, end_of_turn), as `tasks.generate.endpoints.CompletionMarkers` takes them: what a
        raw-text endpoint splits a completion on; an empty reasoning_close means the format has no reasoning."""
        return (self.reasoning_close or "", self.end_of_turn)

    def pinned(self) -> dict[str, int]:
        return dict(self.pinned_ids)

    def describe(self) -> dict[str, Any]:
        """JSON-safe field view, for provenance and error messages."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS: dict[str, CompletionFormat] = {
    f.name: f
    for f in (
        CompletionFormat(
            name="deepseek_v31_thinking",
            reasoning_open="<think>",
            open_in_prompt=True,
            reasoning_close="</think>",
            end_of_turn="<｜end▁of▁sentence｜>",
        ),
        CompletionFormat(
            name="qwen3_thinking",
            reasoning_open="<think>",
            open_in_prompt=False,
            reasoning_close="</think>",
            end_of_turn="<|im_end|>",
            reasoning_pad="\n",
            content_separator="\n\n",
        ),
        CompletionFormat(
            name="kimi_k2_thinking",
            reasoning_open="<think>",
            open_in_prompt=False,
            reasoning_close="</think>",
            end_of_turn="<|im_end|>",
            pinned_ids=(("<|im_end|>", 163586),),
        ),
        CompletionFormat(
            name="kimi_k2_instruct",
            reasoning_open=None,
            open_in_prompt=False,
            reasoning_close=None,
            end_of_turn="<|im_end|>",
            pinned_ids=(("<|im_end|>", 163586),),
        ),
    )
}


@dataclass(frozen=True)
class CompletionLayout:
    """A completion's text and the character offsets where its loss-mask spans start.

    Spans: [0, content_start) reasoning section (open tag if emitted, reasoning, close tag, separator),
    [content_start, end_of_turn_start) content, [end_of_turn_start, len(text)) end-of-turn token.
    """

    text: str
    content_start: int
    end_of_turn_start: int


def normalized_parts(fmt: CompletionFormat, reasoning: str | None, content: str | None) -> tuple[str, str]:
    """Reasoning and content as they sit between the format's literal markers.

    A raw-text endpoint leaves the reasoning-open tag the model emitted at the start of the reasoning; it is part
    of the layout, not of the reasoning, so it is removed here (only where the model emits it: with the tag in
    the generation prompt, a second one is an anomaly that validation reports). Newlines at the tag boundaries
    follow the model's own template (Qwen3 strips them inside `<think>` and before content).
    """
    reasoning, content = reasoning or "", content or ""
    if fmt.reasoning_open and not fmt.open_in_prompt and reasoning.lstrip().startswith(fmt.reasoning_open):
        reasoning = reasoning.lstrip()[len(fmt.reasoning_open) :]
    if fmt.reasoning_pad:
        reasoning = reasoning.strip(fmt.reasoning_pad)
    if fmt.content_separator:
        content = content.lstrip(fmt.content_separator)
    return reasoning, content


def completion_layout(
    fmt: CompletionFormat, reasoning: str | None, content: str | None, truncated: bool = False
) -> CompletionLayout:
    """The completion exactly as the model emitted it.

    Reasoning and content are first normalised (`normalized_parts`), so an API that returns boundary newlines
    or the emitted open tag, or not, gives the same ids. A truncated generation (finish_reason "length") never
    emitted its end-of-turn token, and, if it stopped inside the reasoning, never emitted the close tag either:
    neither is invented.
    """
    reasoning, content = normalized_parts(fmt, reasoning, content)
    if not fmt.has_reasoning:
        if reasoning.strip():
            raise ValueError(f"format {fmt.name!r} has no reasoning, but the response carries reasoning text")
        head = ""
    else:
        opening = "" if fmt.open_in_prompt else f"{fmt.reasoning_open}{fmt.reasoning_pad}"
        if truncated and not content:
            text = opening + reasoning
            return CompletionLayout(text, len(text), len(text))
        head = f"{opening}{reasoning}{fmt.reasoning_pad}{fmt.reasoning_close}{fmt.content_separator}"
    body = head + content
    text = body if truncated else body + fmt.end_of_turn
    return CompletionLayout(text, len(head), len(body))


def completion_text(fmt: CompletionFormat, reasoning: str | None, content: str | None) -> str:
    return completion_layout(fmt, reasoning, content).text


@dataclass(frozen=True)
class TokenSpans:
    """Token counts of a completion's spans, in order: reasoning section, content, end-of-turn."""

    reasoning: int
    content: int
    end_of_turn: int


def loss_mask_values(loss_on_reasoning: bool, loss_on_end_of_turn: bool) -> tuple[int, int, int, int]:
    """Mask value of (prompt, reasoning section, content, end-of-turn): the prompt never carries loss."""
    return (0, int(loss_on_reasoning), 1, int(loss_on_end_of_turn))


SENTINEL_USER = "SentinelUserTurnQx7"
SENTINEL_REASONING = "SentinelReasoningQx7"
SENTINEL_CONTENT = "SentinelContentQx7"


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as exc:
        raise ConfigError(f"cannot render the tokenizer's chat template with sentinel messages: {exc}") from exc
    if not isinstance(text, str):
        raise ConfigError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def _longest_prefix(text: str, candidates: set[str]) -> str | None:
    hits = [c for c in candidates if c and text.startswith(c)]
    return max(hits, key=len) if hits else None


def _derive(tokenizer: PreTrainedTokenizerBase) -> tuple[CompletionFormat, frozenset[str]]:
    """Read the format off the chat template; also return which fields the template actually showed.

    A template that drops reasoning from assistant turns hides the padding (and, if it shows no tags at all,
    whether the model reasons): those fields are not claimed, so a cross-check only compares what was seen.
    """
    user = [{"role": "user", "content": SENTINEL_USER}]
    base = _render(tokenizer, user, False)
    gen = _render(tokenizer, user, True)
    assistant = {"role": "assistant", "content": SENTINEL_CONTENT, "reasoning_content": SENTINEL_REASONING}
    full = _render(tokenizer, [*user, assistant], False)
    if not gen.startswith(base) or not full.startswith(base):
        raise ConfigError("chat template: the generation prompt / assistant turn does not extend the user turn")
    header, turn = gen[len(base) :], full[len(base) :]
    at = turn.find(SENTINEL_CONTENT)
    if at < 0:
        raise ConfigError(f"chat template does not render assistant content; rendered turn: {turn!r}")
    after = turn[at + len(SENTINEL_CONTENT) :]
    end_of_turn = _longest_prefix(after, set(added_tokens(tokenizer).values()))
    if end_of_turn is None:
        raise ConfigError(f"chat template: assistant content is followed by {after[:40]!r}, not a special token")
    before = turn[:at]
    seen = {"end_of_turn", "has_reasoning", "reasoning_open", "reasoning_close", "open_in_prompt"}
    r = before.find(SENTINEL_REASONING)
    if r >= 0:
        pre, mid = before[:r], before[r + len(SENTINEL_REASONING) :]
        for opening, closing in KNOWN_REASONING_TAGS:
            open_at, close_at = pre.rfind(opening), mid.find(closing)
            if open_at < 0 or close_at < 0:
                continue
            pad, close_pad = pre[open_at + len(opening) :], mid[:close_at]
            if pad != close_pad or pad.strip():
                raise ConfigError(
                    f"chat template pads reasoning unlike any supported format ({pad!r} after {opening!r}, "
                    f"{close_pad!r} before {closing!r})"
                )
            fmt = CompletionFormat(
                name="derived",
                reasoning_open=opening,
                open_in_prompt=header.endswith(opening + pad),
                reasoning_close=closing,
                end_of_turn=end_of_turn,
                reasoning_pad=pad,
                content_separator=mid[close_at + len(closing) :],
            )
            return fmt, frozenset(seen | {"reasoning_pad", "content_separator"})
        raise ConfigError(f"chat template shows reasoning without known reasoning tags: {before!r}")
    for opening, closing in KNOWN_REASONING_TAGS:
        in_prompt = header.endswith(opening)
        close_at = before.find(closing)
        if close_at < 0 and not in_prompt:
            continue
        fmt = CompletionFormat(
            name="derived",
            reasoning_open=opening,
            open_in_prompt=in_prompt,
            reasoning_close=closing,
            end_of_turn=end_of_turn,
            content_separator=before[close_at + len(closing) :] if close_at >= 0 else "",
        )
        return fmt, frozenset(seen | ({"content_separator"} if close_at >= 0 else set()))
    fmt = CompletionFormat(
        name="derived",
        reasoning_open=None,
        open_in_prompt=False,
        reasoning_close=None,
        end_of_turn=end_of_turn,
    )
    return fmt, frozenset(seen)


def format_differences(a: CompletionFormat, b: CompletionFormat, compared: frozenset[str]) -> dict[str, Any]:
    """field -> (a's value, b's value) for every compared field that differs."""
    return {
        name: (getattr(a, name), getattr(b, name)) for name in sorted(compared) if getattr(a, name) != getattr(b, name)
    }


def derive_format(tokenizer: PreTrainedTokenizerBase) -> CompletionFormat:
    """The format the tokenizer's chat template implies; a matching preset is returned under its own name."""
    derived, seen = _derive(tokenizer)
    for preset in PRESETS.values():
        if not format_differences(preset, derived, seen):
            return preset
    return derived


def resolve_format(name: str, tokenizer: PreTrainedTokenizerBase) -> CompletionFormat:
    """`auto` -> derived from the template; a preset -> that preset, refused if the template contradicts it.

    A tokenizer without a chat template cannot contradict a preset, so the preset is used as given; `auto`
    then has nothing to derive from and fails.
    """
    if name == "auto":
        return derive_format(tokenizer)
    if name not in PRESETS:
        raise ConfigError(f"unknown completion_format {name!r}; choose 'auto' or one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    if getattr(tokenizer, "chat_template", None) is None:
        return preset
    derived, seen = _derive(tokenizer)
    diff = format_differences(preset, derived, seen)
    if diff:
        detail = "; ".join(f"{k}: preset {v[0]!r} vs template {v[1]!r}" for k, v in diff.items())
        raise ConfigError(
            f"completion_format preset {name!r} disagrees with the format derived from the tokenizer's chat "
            f"template ({derived.describe()}): {detail}"
        )
    return preset
