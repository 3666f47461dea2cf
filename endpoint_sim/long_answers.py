"""Long reasoning answers and the exact OpenRouter SSE bytes that carry them, rendered once per answer.

Why rendered once: a paced server holding 10,000 streams on a small machine must spend per event a slice and a
share of one socket write, not a JSON encode, or the server and not the client becomes what is measured. So an
answer's whole event stream is one bytes object with a placeholder generation id, cut into groups of chunks that
each fall due at a known second; `long_streams` writes the due groups and swaps in each stream's own id.

An answer is a sequence of "tokens" (vocabulary pieces of about four characters, including what JSON must escape
and what UTF-8 makes wide: quotes, backslashes, newlines, tabs, accents, CJK, emoji) sent in chunks of 1-8 tokens:
reasoning deltas (with OpenRouter's `reasoning_details` repeating the text), then content deltas, a finish chunk,
a usage chunk with the cost, and `[DONE]`, with `: OPENROUTER PROCESSING` comments before the first token and
between chunks. Odd pool entries are rendered ASCII-escaped, as a Python server does, and there a chunk that ends in
an emoji leaves the low half of its UTF-16 surrogate pair to the next chunk, as a server that cuts strings by UTF-16
code units does: a client must still assemble the same text as the non-streamed answer. Everything is a pure
function of (config, pool index).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

COMMENT = b": OPENROUTER PROCESSING\n\n"
DONE = b"data: [DONE]\n\n"
ENDING_EVENTS = 3  # finish, usage, [DONE]
# Every stream's events carry this id; the server replaces it with the stream's own id, of the same length.
ID_PLACEHOLDER = "gen-0000000000-@@@@@@@@@@@@@@@@@@@@"
CREATED = 1_760_000_000

_WORD_TEXT = """
    the a model token answer so we need to check compute value sum first then finally because therefore is of and
    in for with that it this let me think about step wait actually maybe yes no case count total result
"""
_WORDS = tuple(_WORD_TEXT.split())
_SPECIAL = (
    ",",
    ".",
    ":",
    "\n",
    "\n\n",
    ' "',
    '"',
    " \\",
    "\\n",
    "\t",
    " 42",
    " 3.14",
    " x**2",
    " f(x)",
    " {",
    "}",
    " </",
    " é",
    " naïve",
    " café",
    "—",
    "’",
    " 北京",
    " 東京",
    " 🙂",
    " Zürich",
    " ∑",
)
# Mostly plain words with a leading space, as real reasoning is; one token in ~6 is one of the specials.
VOCAB: tuple[str, ...] = tuple(" " + word for word in _WORDS) + _SPECIAL
_WEIGHTS = (5,) * len(_WORDS) + (1,) * len(_SPECIAL)


class LongStreamConfig(BaseModel):
    """The answers a long-stream server gives and the pace it sends them at."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    pool: int = Field(default=64, ge=1, description="distinct answers; a prompt's hash picks one")
    tokens_min: int = Field(default=2000, ge=2)
    tokens_max: int = Field(default=30000, ge=2, description="answer lengths are log-uniform in [min, max]")
    chunk_tokens_min: int = Field(default=1, ge=1)
    chunk_tokens_max: int = Field(default=8, ge=1)
    reasoning_share: float = Field(default=0.85, gt=0, lt=1, description="of an answer's tokens")
    tokens_per_s: float = Field(default=50.0, gt=0, description="steady rate of every stream")
    stream_s: float | None = Field(
        default=None, gt=0, description="when set, every answer is spread evenly over this long (not tokens_per_s)"
    )
    pace_spread: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="each stream's schedule is stretched by its own factor in [1 - spread, 1], so streams of one "
        "answer do not all end in the same instant",
    )
    first_token_s: float = Field(default=0.5, ge=0, description="before the first token only a comment is sent")
    write_interval_s: float = Field(default=0.25, gt=0, description="a stream's due chunks go out in one write")
    comment_every: int = Field(default=32, ge=1, description="data chunks between keep-alive comments")
    split_surrogate_pairs: bool = Field(
        default=True, description="ASCII-escaped answers cut emoji between chunks as two UTF-16 halves"
    )
    price_prompt_usd_per_mtok: float = Field(default=0.6, ge=0)
    price_completion_usd_per_mtok: float = Field(default=2.5, ge=0)
    provider: str = "Moonshot AI"
    model_name: str = "moonshotai/kimi-k2.5"

    @model_validator(mode="after")
    def _check(self) -> LongStreamConfig:
        if self.tokens_min > self.tokens_max or self.chunk_tokens_min > self.chunk_tokens_max:
            raise ValueError("tokens_min/chunk_tokens_min must not exceed their max")
        return self


@dataclass(frozen=True, slots=True)
class LongAnswer:
    """What the non-streamed answer says; `pieces` are the streamed deltas as (field, text, tokens)."""

    reasoning: str
    content: str
    reasoning_tokens: int
    completion_tokens: int
    pieces: tuple[tuple[str, str, int], ...]
    ascii_escaped: bool


@dataclass(frozen=True, slots=True)
class RenderedStream:
    """An answer's event stream up to its last delta: group g is `blob[starts[g]:starts[g + 1]]`, due `due_s[g]`
    after the request arrived, and holds `events_before[g + 1] - events_before[g]` `data:` events. The ending
    (`ending`) goes out with the last group; it names the prompt's length, so it is rendered per stream."""

    blob: bytes
    starts: tuple[int, ...]
    due_s: tuple[float, ...]
    events_before: tuple[int, ...]
    envelope: str
    ascii_escaped: bool

    @property
    def groups(self) -> int:
        return len(self.due_s)

    @property
    def data_events(self) -> int:
        return self.events_before[-1] + ENDING_EVENTS

    @property
    def duration_s(self) -> float:
        return self.due_s[-1]

    def due_through(self, elapsed_s: float, first: int) -> int:
        """One past the last group due `elapsed_s` after arrival, searching from group `first`."""
        return bisect.bisect_right(self.due_s, elapsed_s, lo=first)

    def ending(self, usage_: dict[str, Any]) -> bytes:
        """The finish chunk, the usage chunk and [DONE] (with the placeholder id)."""
        finish = (
            f'data: {self.envelope}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
            '"finish_reason":"stop","native_finish_reason":"stop","logprobs":null}]}\n\n'
        )
        tail = f'data: {self.envelope}"choices":[],"usage":{_dumps(usage_, self.ascii_escaped)}}}\n\n'
        return finish.encode() + tail.encode() + DONE


def pool_index(cfg: LongStreamConfig, prompt: str) -> int:
    """Which answer a prompt gets: a stable hash, so a rerun and the non-streamed request see the same one."""
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % cfg.pool


def prompt_tokens(prompt: str) -> int:
    """A stand-in prompt length: this server has no tokenizer, and only needs one that is stable."""
    return 8 + len(prompt.encode("utf-8", "surrogatepass")) // 4


def long_answer(cfg: LongStreamConfig, index: int) -> LongAnswer:
    rng = random.Random(f"{cfg.seed}:{index}")
    total = round(math.exp(rng.uniform(math.log(cfg.tokens_min), math.log(cfg.tokens_max))))
    reasoning_tokens = min(total - 1, max(1, round(total * cfg.reasoning_share)))
    pieces: list[tuple[str, str, int]] = []
    texts = {}
    for field, count in (("reasoning", reasoning_tokens), ("content", total - reasoning_tokens)):
        tokens = rng.choices(VOCAB, _WEIGHTS, k=count)
        texts[field] = "".join(tokens)
        at = 0
        while at < count:
            size = min(count - at, rng.randint(cfg.chunk_tokens_min, cfg.chunk_tokens_max))
            pieces.append((field, "".join(tokens[at : at + size]), size))
            at += size
    escaped = index % 2 == 1
    if escaped and cfg.split_surrogate_pairs:
        pieces = _split_surrogate_pairs(pieces)
    return LongAnswer(texts["reasoning"], texts["content"], reasoning_tokens, total, tuple(pieces), escaped)


def _split_surrogate_pairs(pieces: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """A piece ending in an astral character keeps its high surrogate and hands the low one to the next piece of
    the same field: each chunk is then valid JSON holding a lone surrogate escape."""
    out = list(pieces)
    for i in range(len(out) - 1):
        field, text, tokens = out[i]
        following = out[i + 1]
        if text and ord(text[-1]) > 0xFFFF and following[0] == field:
            units = text[-1].encode("utf-16-le")
            high = units[:2].decode("utf-16-le", "surrogatepass")
            low = units[2:].decode("utf-16-le", "surrogatepass")
            out[i] = (field, text[:-1] + high, tokens)
            out[i + 1] = (following[0], low + following[1], following[2])
    return out


def usage(cfg: LongStreamConfig, answer: LongAnswer, n_prompt: int) -> dict[str, Any]:
    cost = (
        n_prompt * cfg.price_prompt_usd_per_mtok + answer.completion_tokens * cfg.price_completion_usd_per_mtok
    ) / 1e6
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": n_prompt + answer.completion_tokens,
        "cost": cost,
        "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
    }


def _dumps(value: Any, ascii_escaped: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_escaped, separators=(",", ":"))


def _envelope(cfg: LongStreamConfig, gen_id: str, ascii_escaped: bool) -> str:
    return (
        f'{{"id":"{gen_id}","provider":{_dumps(cfg.provider, ascii_escaped)},'
        f'"model":{_dumps(cfg.model_name, ascii_escaped)},"object":"chat.completion.chunk","created":{CREATED},'
    )


def completion_body(cfg: LongStreamConfig, answer: LongAnswer, gen_id: str, n_prompt: int) -> bytes:
    """The same answer as one non-streamed chat completion."""
    body = {
        "id": gen_id,
        "provider": cfg.provider,
        "model": cfg.model_name,
        "object": "chat.completion",
        "created": CREATED,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer.content, "reasoning": answer.reasoning},
                "finish_reason": "stop",
                "native_finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": usage(cfg, answer, n_prompt),
    }
    return _dumps(body, answer.ascii_escaped).encode()


def _delta_event(envelope: str, field: str, text: str, ascii_escaped: bool) -> str:
    piece = _dumps(text, ascii_escaped)
    if field == "reasoning":
        delta = (
            f'{{"role":"assistant","content":"","reasoning":{piece},"reasoning_details":'
            f'[{{"type":"reasoning.text","text":{piece},"format":"unknown","index":0}}]}}'
        )
    else:
        delta = f'{{"role":"assistant","content":{piece},"reasoning":null}}'
    return (
        f'data: {envelope}"choices":[{{"index":0,"delta":{delta},"finish_reason":null,'
        '"native_finish_reason":null,"logprobs":null}]}\n\n'
    )


def render_stream(cfg: LongStreamConfig, answer: LongAnswer) -> RenderedStream:
    """The answer's SSE body (after the HTTP head) up to its last delta, cut into groups due at the configured
    pace: a comment at once, then each delta when its last token is due."""
    escaped = answer.ascii_escaped
    envelope = _envelope(cfg, ID_PLACEHOLDER, escaped)
    rate = cfg.tokens_per_s if cfg.stream_s is None else answer.completion_tokens / cfg.stream_s
    parts: list[bytes] = [COMMENT]
    starts, due, events_before = [0], [0.0], [0]
    offset, sent_tokens = len(COMMENT), 0
    for i, (field, text, tokens) in enumerate(answer.pieces):
        event = _delta_event(envelope, field, text, escaped).encode("utf-8")
        if i and i % cfg.comment_every == 0:
            event = COMMENT + event
        sent_tokens += tokens
        starts.append(offset)
        due.append(cfg.first_token_s + sent_tokens / rate)
        events_before.append(i)
        parts.append(event)
        offset += len(event)
    starts.append(offset)
    events_before.append(len(answer.pieces))
    return RenderedStream(b"".join(parts), tuple(starts), tuple(due), tuple(events_before), envelope, escaped)
