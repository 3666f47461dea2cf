"""One chat answer in OpenRouter's wire formats: the JSON completion and the SSE stream, whole or broken.

Kept apart from the HTTP routes so the exact bytes a client sees for each failure kind are defined in one place.
Streams are rendered as a list of frames at once (a few string joins per chunk), because the benchmark keeps
thousands of them in flight on two cores.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from endpoint_sim.responder import Responder, SimConfig, SimSample
from tasks.generate.token_bytes import entry, token_bytes_index

COMMENT = ": OPENROUTER PROCESSING\n\n"
DONE = "data: [DONE]\n\n"
# A keep-alive comment between every this many data chunks, as OpenRouter does while a provider is slow.
COMMENT_EVERY = 8
MIDSTREAM_ERROR = {"code": 502, "message": "Provider disconnected"}

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """What the assistant message says and what it is billed: the part of a sample the client receives."""

    reasoning: str
    content: str
    completion_tokens: int
    reasoning_tokens: int
    finish: str


@dataclass(frozen=True, slots=True)
class ChatMeta:
    """The per-request envelope fields every chunk repeats."""

    id: str
    provider: str
    model: str
    created: int


def chat_answer(responder: Responder, sample: SimSample, ids: tuple[int, ...], finish: str) -> ChatAnswer:
    """The answer for the ids actually generated: the whole sample, or the texts of a max_tokens cut."""
    if finish == "stop" and sample.finished:
        return ChatAnswer(sample.reasoning, sample.content, len(ids), sample.reasoning_tokens, finish)
    close = responder.reasoning_close_id
    if close is None:
        return ChatAnswer("", responder.decode(ids), len(ids), 0, finish)
    if close in ids:
        cut = ids.index(close)
        return ChatAnswer(responder.decode(ids[:cut]), responder.decode(ids[cut + 1 :]), len(ids), cut, finish)
    return ChatAnswer(responder.decode(ids), "", len(ids), len(ids), finish)


def partial_answer(responder: Responder, answer: ChatAnswer) -> ChatAnswer:
    """A provider that died halfway through the content: reasoning intact, half the content, billed for that."""
    if not answer.content:
        return replace(answer, finish="error")
    content = answer.content[: len(answer.content) // 2]
    close = 1 if responder.reasoning_close_id is not None else 0
    tokens = answer.reasoning_tokens + close + len(responder.prompt_ids_for_text(content))
    return ChatAnswer(answer.reasoning, content, tokens, answer.reasoning_tokens, "error")


def empty_answer() -> ChatAnswer:
    return ChatAnswer("", "", 0, 0, "stop")


def without_reasoning(answer: ChatAnswer) -> ChatAnswer:
    """Reasoning withheld by the provider; it was still generated, so usage stays as billed."""
    return replace(answer, reasoning="")


def cost_usd(cfg: SimConfig, prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * cfg.price_prompt_usd_per_mtok + completion_tokens * cfg.price_completion_usd_per_mtok) / 1e6


def usage(cfg: SimConfig, prompt_tokens: int, answer: ChatAnswer) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": prompt_tokens + answer.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
    }
    if cfg.report_cost:
        price = cost_usd(cfg, prompt_tokens, answer.completion_tokens)
        if cfg.byok_fee_fraction is None:
            out["cost"] = _encoded(cfg, price)
        else:  # the user's own provider key: OpenRouter charges its fee, the provider bills the inference
            out["cost"] = _encoded(cfg, price * cfg.byok_fee_fraction)
            out["is_byok"] = True
            out["cost_details"] = {"upstream_inference_cost": _encoded(cfg, price)}
    return out


def _encoded(cfg: SimConfig, usd: float) -> float | str:
    if cfg.cost_encoding == "string":
        return repr(usd)
    if cfg.cost_encoding == "nan":
        return math.nan
    if cfg.cost_encoding == "negative":
        return -usd
    return usd


def spent_usd(cfg: SimConfig, prompt_tokens: int, completion_tokens: int) -> float:
    """What one generation cost its user: the price, plus OpenRouter's fee on a BYOK request, times the billing
    drift (`generation_cost_factor`) that the answer's own usage.cost does not show."""
    price = cost_usd(cfg, prompt_tokens, completion_tokens)
    spent = price if cfg.byok_fee_fraction is None else price * (1.0 + cfg.byok_fee_fraction)
    return spent * cfg.generation_cost_factor


@dataclass(frozen=True, slots=True)
class TokenPiece:
    """One generated token as a stream chunk carries it: the text it completes (a token ending inside a multi-byte
    character completes none; the next one carries the character) and its logprobs entry."""

    field: str
    text: str
    entry: dict[str, Any]
    token_id: int


@dataclass(frozen=True, slots=True)
class ReportedIds:
    """What vLLM's `return_token_ids` adds to an answer: the prompt ids it rendered, and after the pieces' ids the
    stop token that ended the turn (none for an answer cut by the token limit)."""

    prompt: list[int]
    end: list[int]


def token_pieces(responder: Responder, sample: SimSample, ids: tuple[int, ...], finish: str) -> list[TokenPiece]:
    """The answer's generated ids (the end of turn left out, as OpenAI-style logprobs do) as per-token pieces: the
    reasoning's, then `</think>` (its entry in an empty content delta), then the content's."""
    index = token_bytes_index(responder.tokenizer)
    body = ids[:-1] if finish == "stop" and ids and ids[-1] == responder.eos_id else ids
    close = responder.reasoning_close_id
    cut = body.index(close) if close is not None and close in body else (len(body) if close is not None else -1)
    lps = sample.logprobs
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for j, token_id in enumerate(body):
        raw = index.bytes_of.get(token_id, b"")
        field = "reasoning" if j < cut else "content"
        text = "" if j == cut else decoder.decode(raw)
        token = raw.decode("utf-8", errors="replace")
        pieces.append(TokenPiece(field, text, entry(token, raw, lps[j] if lps is not None else 0.0), token_id))
    tail = decoder.decode(b"", final=True)
    if tail and pieces:
        last = pieces[-1]
        pieces[-1] = TokenPiece(last.field, last.text + tail, last.entry, last.token_id)
    return pieces


def reported_ids(
    responder: Responder, prompt_ids: tuple[int, ...] | list[int], ids: tuple[int, ...], finish: str
) -> ReportedIds:
    """The ids vLLM reports beside `token_pieces`' own: the prompt's, and the end of turn the model stopped on."""
    ended = finish == "stop" and bool(ids) and ids[-1] == responder.eos_id
    return ReportedIds(list(prompt_ids), [ids[-1]] if ended else [])


def completion_body(
    meta: ChatMeta,
    answer: ChatAnswer,
    usage_: dict[str, Any] | None,
    pieces: list[TokenPiece] | None = None,
    logprobs: bool = True,
    ids: ReportedIds | None = None,
) -> dict[str, Any]:
    """`pieces` carry the per-token logprobs (with `logprobs`) and, with `ids`, vLLM's `token_ids`."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": answer.content, "reasoning": answer.reasoning},
        "finish_reason": answer.finish,
        "native_finish_reason": answer.finish,
    }
    if pieces is not None and logprobs:
        choice["logprobs"] = {"content": [p.entry for p in pieces], "refusal": None}
    if pieces is not None and ids is not None:
        choice["token_ids"] = [p.token_id for p in pieces] + ids.end
    return {
        "id": meta.id,
        "provider": meta.provider,
        "model": meta.model,
        "object": "chat.completion",
        "created": meta.created,
        "choices": [choice],
        **({"usage": usage_} if usage_ is not None else {}),
        **({"prompt_token_ids": ids.prompt} if ids is not None else {}),
    }


def split_pieces(text: str, n: int) -> list[str]:
    """`text` in about `n` near-equal pieces (fewer when it is shorter than `n` characters); joins back exactly."""
    size = len(text)
    cuts = [size * i // n for i in range(n + 1)]
    return [text[a:b] for a, b in itertools.pairwise(cuts) if a < b]


def piece_counts(key: str) -> tuple[int, int]:
    """How many pieces the reasoning and the content are streamed in: 6-12 each, fixed per prompt key."""
    return 6 + int(key[0:2], 16) % 7, 6 + int(key[2:4], 16) % 7


@dataclass(frozen=True, slots=True)
class StreamFrames:
    """An SSE answer cut where the failure kinds need it: the delta chunks, then the ending.

    Comments are not in `deltas`; `frames` interleaves them.
    """

    prefix: str
    deltas: list[str]
    finish: str
    usage: str | None

    def frames(self, deltas: list[str], ending: list[str]) -> list[str]:
        out = [COMMENT]
        for i, chunk in enumerate(deltas):
            if i and i % COMMENT_EVERY == 0:
                out.append(COMMENT)
            out.append(chunk)
        out.extend(ending)
        return out

    def complete(self) -> list[str]:
        ending = [self.finish, *([self.usage] if self.usage is not None else []), DONE]
        return self.frames(self.deltas, ending)

    def without_done(self) -> list[str]:
        """The whole answer, its finish and usage chunks, and no `[DONE]`."""
        return self.frames(self.deltas, [self.finish, *([self.usage] if self.usage is not None else [])])

    def without_usage(self) -> list[str]:
        """The whole answer and its finish chunk; the connection goes before the usage chunk and `[DONE]`."""
        return self.frames(self.deltas, [self.finish])

    def midstream_error(self) -> list[str]:
        error = self.prefix + '"error":' + _dumps(MIDSTREAM_ERROR)
        error += ',"choices":[{"index":0,"delta":{"content":""},"finish_reason":"error"}]}\n\n'
        return self.frames(self.deltas[: len(self.deltas) // 2], [error])

    def first_half(self) -> list[str]:
        return self.frames(self.deltas[: len(self.deltas) // 2], [])

    def truncated(self) -> list[str]:
        """Half the deltas, then half of the next data line: the connection ends with no finish and no [DONE]."""
        half = len(self.deltas) // 2
        following = self.deltas[half] if half < len(self.deltas) else self.finish
        return self.frames(self.deltas[:half], [following[: len(following) // 2]])


def stream_frames(
    meta: ChatMeta,
    answer: ChatAnswer,
    usage_: dict[str, Any] | None,
    key: str,
    pieces: list[TokenPiece] | None = None,
    logprobs: bool = True,
    ids: ReportedIds | None = None,
) -> StreamFrames:
    """With `pieces` (logprobs or token ids requested) one chunk per generated token, each with its logprobs entry
    (`logprobs`) and, with `ids`, its `token_ids` as vLLM streams them: the first chunk also carries the
    `prompt_token_ids`, the finish chunk the stop token's id. Otherwise 6-12 text pieces per field."""
    prefix = (
        f'data: {{"id":{_dumps(meta.id)},"provider":{_dumps(meta.provider)},"model":{_dumps(meta.model)},'
        f'"object":"chat.completion.chunk","created":{meta.created},'
    )
    if pieces is not None:
        deltas = []
        for i, p in enumerate(pieces):
            per_token = f',"logprobs":{{"content":[{_dumps(p.entry)}]}}' if logprobs else ""
            per_token += (
                f',"finish_reason":null,"token_ids":[{p.token_id}]' if ids is not None else ',"finish_reason":null'
            )
            prompt = f',"prompt_token_ids":{_dumps(ids.prompt)}' if ids is not None and i == 0 else ""
            deltas.append(
                f'{prefix}"choices":[{{"index":0,"delta":{{{_dumps(p.field)}:{_dumps(p.text)}}}{per_token}}}]'
                f"{prompt}}}\n\n"
            )
    else:
        n_reasoning, n_content = piece_counts(key)
        deltas = [
            f'{prefix}"choices":[{{"index":0,"delta":{{"role":"assistant","reasoning":{_dumps(piece)}}},'
            '"finish_reason":null}]}\n\n'
            for piece in split_pieces(answer.reasoning, n_reasoning)
        ]
        deltas += [
            f'{prefix}"choices":[{{"index":0,"delta":{{"content":{_dumps(piece)}}},"finish_reason":null}}]}}\n\n'
            for piece in split_pieces(answer.content, n_content)
        ]
    reason = _dumps(answer.finish)
    end = f',"token_ids":{_dumps(ids.end)}' if ids is not None and pieces is not None else ""
    finish = (
        f'{prefix}"choices":[{{"index":0,"delta":{{}},"finish_reason":{reason},"native_finish_reason":{reason}'
        f"{end}}}]}}\n\n"
    )
    tail = None if usage_ is None else f'{prefix}"choices":[],"usage":{_dumps(usage_)}}}\n\n'
    return StreamFrames(prefix, deltas, finish, tail)
