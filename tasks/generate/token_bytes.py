"""Exact token ids from an endpoint's per-token log-probabilities: the OpenAI `logprobs` shape, streamed or not.

An OpenAI-compatible answer with `logprobs: true` lists every generated token as `{"token", "logprob", "bytes"}`.
The bytes identify the token: a model's vocabulary maps each id to one byte string (byte-level BPE maps its
token strings to bytes one character per byte; tiktoken stores the bytes; SentencePiece byte fallback spells
single bytes `<0xAB>`). So the ids the model emitted, a non-canonical split included (`ĊĊ` where re-encoding the
text gives `Ċ Ċ`), and a multi-byte character cut across two tokens, are recovered exactly from the bytes, where
re-encoding the returned text gives the tokenizer's canonical split instead.

`LogprobTokens` accumulates entries in order from a non-streamed choice or from the chunks of a stream (the SSE
assembler calls `feed` with each chunk's `logprobs` object); `TokenBytesIndex.ids` maps them to ids and refuses a
byte string no single token has. An entry without `bytes` falls back to its token string, which is only exact for
tokens that are whole characters.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.common.errors import DatagenError
from tasks.reconstruct.completion_format import CUT_CHARACTER, CompletionFormat, completion_layout
from tasks.reconstruct.tokenizer_loading import added_tokens


class TokenBytesError(DatagenError):
    """A logprobs entry whose bytes are no token of the tokenizer's vocabulary (another model answered)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _tiktoken_bytes(tokenizer: PreTrainedTokenizerBase) -> Any:
    import tiktoken

    for value in vars(tokenizer).values():
        if isinstance(value, tiktoken.Encoding):
            return value
    return None


def _piece_bytes(piece: str, byte_level: bool) -> bytes | None:
    if byte_level:
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        except KeyError:
            return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


@dataclass
class TokenBytesIndex:
    """bytes -> id over the ordinary vocabulary, and string -> id over the added (control) tokens."""

    by_bytes: dict[bytes, int]
    by_added: dict[str, int]
    bytes_of: dict[int, bytes]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase) -> TokenBytesIndex:
        added = {text: i for i, text in added_tokens(tokenizer).items()}
        bytes_of: dict[int, bytes] = {}
        encoding = _tiktoken_bytes(tokenizer)
        if encoding is not None:
            for token_id in range(encoding.n_vocab):
                try:
                    bytes_of[token_id] = encoding.decode_single_token_bytes(token_id)
                except KeyError:
                    continue
        else:
            byte_level = _is_byte_level(tokenizer)
            for piece, token_id in tokenizer.get_vocab().items():
                raw = _piece_bytes(piece, byte_level)
                if raw is not None:
                    bytes_of[int(token_id)] = raw
        for text, token_id in added.items():
            bytes_of[token_id] = text.encode()
        control_ids = set(added.values())
        by_bytes: dict[bytes, int] = {}
        for token_id, raw in sorted(bytes_of.items()):
            if token_id not in control_ids:
                by_bytes.setdefault(raw, token_id)
        return cls(by_bytes, added, bytes_of)

    def ids(self, entries: Sequence[tuple[str, bytes]]) -> list[int]:
        """The id of each (token string, bytes) entry: a control token by its string, any other by its bytes."""
        out = []
        for at, (token, raw) in enumerate(entries):
            found = self.by_added.get(token)
            if found is None:
                found = self.by_bytes.get(raw)
            if found is None:
                raise TokenBytesError(
                    f"logprobs token {at} ({token!r}, bytes {list(raw)}) is no token of this vocabulary"
                )
            out.append(found)
        return out


_INDEXES: dict[tuple[str, str, int, int], TokenBytesIndex] = {}


def token_bytes_index(tokenizer: PreTrainedTokenizerBase) -> TokenBytesIndex:
    """Built once per tokenizer (a vocabulary walk); the client and a simulator in the same process load the same
    directory as two objects, so the key is the tokenizer's class, directory, size and added tokens."""
    added = tuple(sorted(added_tokens(tokenizer).items()))
    key = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer), hash(added))
    found = _INDEXES.get(key)
    if found is None:
        if len(_INDEXES) > 8:
            _INDEXES.clear()
        found = _INDEXES[key] = TokenBytesIndex.build(tokenizer)
    return found


@dataclass
class LogprobTokens:
    """(token, bytes) of every generated token the endpoint reported, in order."""

    entries: list[tuple[str, bytes]] = field(default_factory=list)
    seen: bool = False

    def feed(self, logprobs: Any) -> None:
        """One choice's (or one chunk's) `logprobs` object: `{"content": [...]}`, plus `reasoning` where a provider
        reports the reasoning tokens apart (they come first)."""
        if not isinstance(logprobs, dict):
            return
        for key in ("reasoning", "content"):
            items = logprobs.get(key)
            if not isinstance(items, list):
                continue
            self.seen = True
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("token"), str):
                    continue
                raw = item.get("bytes")
                token = item["token"]
                if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
                    self.entries.append((token, bytes(raw)))
                else:
                    self.entries.append((token, token.encode()))

    def wire(self) -> dict[str, Any]:
        """The accumulated entries as one non-streamed `logprobs` object."""
        return {"content": [{"token": t, "bytes": list(raw)} for t, raw in self.entries]}


def entry(token: str, raw: bytes, logprob: float) -> dict[str, Any]:
    """One OpenAI-shaped logprobs entry (no alternatives: `top_logprobs` is 0)."""
    return {"token": token, "logprob": logprob, "bytes": list(raw), "top_logprobs": []}


def _without_end_of_turn(entries: list[tuple[str, bytes]], end_of_turn: str) -> list[tuple[str, bytes]]:
    if not entries or not end_of_turn:
        return entries
    token, raw = entries[-1]
    return entries[:-1] if token in (end_of_turn, "") and raw in (b"", end_of_turn.encode()) else entries


CUT_CHARACTER_BYTES = CUT_CHARACTER.encode()
"""U+FFFD in an entry's bytes: a provider that builds `bytes` from the decoded token string (not the token's raw
bytes) reports every token that holds part of a character this way, so the entry no longer names the token the
model emitted; the answer's last such entry still spells a truncated content that ends in U+FFFD. Such answers
are re-encoded (a model that emits U+FFFD itself is re-encoded too, to the same id)."""


@dataclass(frozen=True)
class ExactIds:
    """The model's ids for an answer, and the text of its last tokens that the endpoint held back (`held_back`):
    an incremental detokenizer (vLLM's, streamed or not) writes nothing for a token that ends inside a character,
    so an answer cut by the token limit there lacks that token's text while its logprobs entry is present. The
    ids are still the model's; the answer's text is the content (or the reasoning) plus `held_back`, which ends
    in U+FFFD as the same answer from SGLang does."""

    ids: list[int]
    held_back: str = ""


def _held_back(pieces: Sequence[bytes], whole: set[str]) -> str | None:
    """The text of the trailing tokens an incremental detokenizer withholds, when the pieces up to them spell one
    of `whole` exactly: the spelling must end inside a character, and no token boundary after `whole` may fall
    between characters (a detokenizer emits the text at every such boundary)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    spelled, clean_at, clean_text = "", 0, ""
    try:
        for k, raw in enumerate(pieces):
            spelled += decoder.decode(raw)
            if not decoder.getstate()[0]:
                clean_at, clean_text = k + 1, spelled
    except UnicodeDecodeError:
        return None
    if clean_at == len(pieces) or clean_text not in whole:
        return None
    return b"".join(pieces[clean_at:]).decode("utf-8", errors="replace")


def exact_ids(
    tokens: LogprobTokens,
    tokenizer: PreTrainedTokenizerBase,
    reasoning: str | None,
    content: str | None,
    reasoning_close: str,
    end_of_turn: str = "",
    fmt: CompletionFormat | None = None,
    truncated: bool = False,
) -> ExactIds | None:
    """The model's ids for this answer, when the logprobs cover all of it: their bytes must spell the content
    (no reasoning) or reasoning + close marker + content, or, given the completion format, the completion as
    reconstruct lays it out (the reasoning-open tag the model writes, pads and separators included: Qwen3, Kimi-K2
    thinking and Harmony answers spell those too). None otherwise (no logprobs, only the content's of a reasoning
    answer, bytes that are not the tokens' own, or text the provider changed after sampling): the row is then
    re-encoded. The text is spelled by the ids the entries resolve to (a control token found by its string spells
    its string, whatever bytes the entry carries). A last entry for the end-of-turn token (vLLM lists the stop
    token, by its string or as an empty one) is not part of the text; it is left out, as reconstruct adds that
    id itself. A `truncated` answer may lack the text of its last tokens (`ExactIds.held_back`)."""
    entries = _without_end_of_turn(tokens.entries, end_of_turn)
    if not entries or any(CUT_CHARACTER_BYTES in raw for _, raw in entries):
        return None
    index = token_bytes_index(tokenizer)
    try:
        ids = index.ids(entries)
    except TokenBytesError:
        return None
    return _spelling(ids, index, reasoning, content, reasoning_close, fmt, truncated)


def reported_ids(
    ids: Sequence[int],
    tokenizer: PreTrainedTokenizerBase,
    reasoning: str | None,
    content: str | None,
    reasoning_close: str,
    end_of_turn: str = "",
    fmt: CompletionFormat | None = None,
    truncated: bool = False,
) -> ExactIds | None:
    """The model's ids as the endpoint reported them (vLLM's `token_ids`), when they spell this answer as
    `exact_ids` requires of logprobs; None otherwise (the row is then re-encoded, and validation compares the
    re-encoding with these ids). A last id for the end of turn (vLLM lists the stop token) is left out, as
    reconstruct adds that id itself; an id the vocabulary does not have spells nothing, so the ids are refused."""
    index = token_bytes_index(tokenizer)
    eot = index.by_added.get(end_of_turn) if end_of_turn else None
    body = list(ids[:-1]) if eot is not None and ids[-1:] == [eot] else list(ids)
    if not body or any(i not in index.bytes_of for i in body):
        return None
    return _spelling(body, index, reasoning, content, reasoning_close, fmt, truncated)


def _spelling(
    ids: list[int],
    index: TokenBytesIndex,
    reasoning: str | None,
    content: str | None,
    reasoning_close: str,
    fmt: CompletionFormat | None,
    truncated: bool,
) -> ExactIds | None:
    """`ids` when their bytes spell the content (no reasoning), reasoning + close marker + content, or the
    completion as reconstruct lays it out; with `truncated`, also when they spell it up to text the endpoint
    held back (`ExactIds.held_back`)."""
    pieces = [index.bytes_of[i] for i in ids]
    whole = {content or ""} if not reasoning else set()
    if reasoning_close:
        whole.add(f"{reasoning or ''}{reasoning_close}{content or ''}")
    if fmt is not None:
        try:
            layout = completion_layout(fmt, reasoning, content, truncated)
        except ValueError:  # reasoning text from a format without reasoning: validation names it
            return None
        whole.add(layout.text[: layout.end_of_turn_start])
    if b"".join(pieces).decode("utf-8", errors="replace") in whole:
        return ExactIds(ids)
    held = _held_back(pieces, whole) if truncated else None
    return None if held is None else ExactIds(ids, held)
