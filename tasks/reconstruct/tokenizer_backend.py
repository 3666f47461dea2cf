"""One batch-encoding interface over the three kinds of tokenizer a local model directory can hold.

Reconstruction and validation need three things from a tokenizer: ids for many texts at once, the token index
where a character boundary falls (to place loss-mask spans), and decoding. The fastest way to get them differs:

- `RustBackend`: a `tokenizers.Tokenizer` (every `tokenizer.json` model). Batch encoding runs on all cores in
  Rust and carries character offsets.
- `TiktokenBackend`: a Python tokenizer class that wraps a `tiktoken.Encoding` (Kimi-K2/K2.5 ship
  `tiktoken.model` + such a class behind `trust_remote_code`). Encoding goes straight to tiktoken's threaded
  Rust core; boundaries come from a per-id byte-length table, so no per-token Python runs.
- `SlowTokenizerBackend`: any other Python tokenizer, through its own `encode`/`decode` (correct, slow).

A shortcut is only taken after it has been shown to give the ids the tokenizer itself gives (`PROBES`, and
the control tokens): a backend that disagreed with its tokenizer would corrupt every sample the same way.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import tiktoken
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase

from tasks.common.errors import ReconstructionError
from tasks.reconstruct.tokenizer_loading import added_tokens

PROBES: tuple[str, ...] = (
    "Hello world! NOR gate 12345 x = café",
    "  leading spaces\n\n\ttabs and\r\nwindows newlines   ",
    "你好，世界。日本語のテキスト 한국어",
    "emoji 👋🏽 and combining é vs é",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "numbers 3.14159 1,000,000 2024-01-31",
)
SPOT_CHECK_ROWS = 4


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing id (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class TokenBackend(ABC):
    """Batch encode/decode with span boundaries; `kind` is recorded in provenance."""

    kind: ClassVar[str]

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.added: dict[int, str] = added_tokens(tokenizer)

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, special-token strings encoded as their control ids, nothing added."""

    @abstractmethod
    def encode_with_boundaries(
        self, texts: Sequence[str], boundaries: Sequence[Sequence[int]]
    ) -> tuple[list[list[int]], np.ndarray]:
        """Ids of each text and, per text, the index of the first token ending after each character boundary
        (a token straddling a boundary joins the later span; a boundary at or past the end maps to len(ids))."""

    @abstractmethod
    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Text of each id sequence, control tokens kept as their strings, no whitespace clean-up."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The vocabulary's id for a whole string (None when the string is not one token)."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_batch([ids])[0]

    def piece(self, token_id: int) -> str:
        return self.decode([token_id])

    def spot_check(self, texts: Sequence[str], sample_ids: Sequence[str], ids: Sequence[Sequence[int]]) -> None:
        """The first rows' ids must equal the tokenizer's own `encode` (only shortcuts need this)."""
        for text, sid, ours in list(zip(texts, sample_ids, ids, strict=True))[:SPOT_CHECK_ROWS]:
            own = list(self.tokenizer.encode(text, add_special_tokens=False))
            if list(ours) != own:
                at = first_difference(ours, own)
                raise ReconstructionError(
                    sid,
                    f"{self.kind} backend ids differ from {type(self.tokenizer).__name__}.encode at token {at} "
                    f"(backend {list(ours[at : at + 3])} vs tokenizer {own[at : at + 3]})",
                )


def _token_at(encoding: Encoding, char: int, text_len: int) -> int:
    if char >= text_len:
        return len(encoding.ids)
    index = encoding.char_to_token(char)
    if index is not None:
        return int(index)
    for i, (_, end) in enumerate(encoding.offsets):
        if end > char:
            return i
    return len(encoding.ids)


class RustBackend(TokenBackend):
    kind = "tokenizers"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.backend = backend

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if hasattr(self.backend, "encode_batch_fast"):
            return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_boundaries(
        self, texts: Sequence[str], boundaries: Sequence[Sequence[int]]
    ) -> tuple[list[list[int]], np.ndarray]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        width = max((len(b) for b in boundaries), default=0)
        at = np.zeros((len(texts), width), dtype=np.int64)
        for i, (enc, text, bounds) in enumerate(zip(encodings, texts, boundaries, strict=True)):
            at[i, : len(bounds)] = [_token_at(enc, c, len(text)) for c in bounds]
        return [e.ids for e in encodings], at

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return list(self.backend.decode_batch([list(x) for x in ids], skip_special_tokens=False))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def spot_check(self, texts: Sequence[str], sample_ids: Sequence[str], ids: Sequence[Sequence[int]]) -> None:
        """The Rust tokenizer is the tokenizer's own encoder: nothing to compare."""


class TiktokenBackend(TokenBackend):
    kind = "tiktoken"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, encoding: tiktoken.Encoding) -> None:
        super().__init__(tokenizer)
        self.encoding = encoding
        self.threads = max(1, os.cpu_count() or 1)
        lengths = np.zeros(encoding.n_vocab, dtype=np.int64)
        for token_id in range(encoding.n_vocab):
            try:
                lengths[token_id] = len(encoding.decode_single_token_bytes(token_id))
            except KeyError:
                continue
        self.byte_lengths = lengths

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_batch(list(texts), num_threads=self.threads, allowed_special="all")

    def encode_with_boundaries(
        self, texts: Sequence[str], boundaries: Sequence[Sequence[int]]
    ) -> tuple[list[list[int]], np.ndarray]:
        ids = self.encode_batch(texts)
        width = max((len(b) for b in boundaries), default=0)
        at = np.zeros((len(texts), width), dtype=np.int64)
        for i, (row, text, bounds) in enumerate(zip(ids, texts, boundaries, strict=True)):
            ends = np.cumsum(self.byte_lengths[np.asarray(row, dtype=np.int64)]) if row else np.zeros(0, np.int64)
            byte_at = [len(text[:c].encode()) if c < len(text) else -1 for c in bounds]
            at[i, : len(bounds)] = [len(row) if b < 0 else int(np.searchsorted(ends, b, side="right")) for b in byte_at]
        return ids, at

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.encoding.decode(list(x), errors="replace") for x in ids]

    def token_to_id(self, token: str) -> int | None:
        try:
            return int(self.encoding.encode_single_token(token))
        except KeyError:
            return None


class SlowTokenizerBackend(TokenBackend):
    kind = "python"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, reason: str) -> None:
        super().__init__(tokenizer)
        self.reason = reason

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def encode_with_boundaries(
        self, texts: Sequence[str], boundaries: Sequence[Sequence[int]]
    ) -> tuple[list[list[int]], np.ndarray]:
        ids = self.encode_batch(texts)
        width = max((len(b) for b in boundaries), default=0)
        at = np.zeros((len(texts), width), dtype=np.int64)
        for i, (row, text, bounds) in enumerate(zip(ids, texts, boundaries, strict=True)):
            at[i, : len(bounds)] = [self._token_at(row, c, len(text)) for c in bounds]
        return ids, at

    def _token_at(self, ids: list[int], char: int, text_len: int) -> int:
        """Smallest k whose prefix ids[:k+1] decodes past `char` (binary search over prefix decodes)."""
        if char >= text_len:
            return len(ids)
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[: mid + 1])) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        out = []
        for x in ids:
            text = self.tokenizer.decode(list(x), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            out.append(text if isinstance(text, str) else "".join(text))
        return out

    def token_to_id(self, token: str) -> int | None:
        added = self.tokenizer.get_added_vocab()
        if token in added:
            return int(added[token])
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        found = self.tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and ids == [found]:
            return found
        return None


def _tiktoken_encoding(tokenizer: PreTrainedTokenizerBase) -> tiktoken.Encoding | None:
    for value in vars(tokenizer).values():
        if isinstance(value, tiktoken.Encoding):
            return value
    return None


def _disagreement(backend: TokenBackend, control: Sequence[str]) -> str | None:
    """Where `backend` and the tokenizer's own encode/decode differ on the probes, or None."""
    tok = backend.tokenizer
    texts = [*PROBES, *(f"a{c}b {c}\n" for c in control)]
    for text, ours in zip(texts, backend.encode_batch(texts), strict=True):
        own = list(tok.encode(text, add_special_tokens=False))
        if ours != own:
            return f"encode({text!r}): backend {ours} vs tokenizer {own}"
        decoded = tok.decode(own, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if backend.decode(ours) != decoded:
            return f"decode of {text!r}: backend {backend.decode(ours)!r} vs tokenizer {decoded!r}"
    return None


_BACKENDS: dict[int, TokenBackend] = {}


def backend_for(tokenizer: PreTrainedTokenizerBase) -> TokenBackend:
    """The fastest backend that gives exactly the tokenizer's own ids (cached per tokenizer object)."""
    cached = _BACKENDS.get(id(tokenizer))
    if cached is not None and cached.tokenizer is tokenizer:
        return cached
    backend: TokenBackend
    rust = getattr(tokenizer, "backend_tokenizer", None)
    encoding = _tiktoken_encoding(tokenizer)
    if isinstance(rust, Tokenizer):
        backend = RustBackend(tokenizer, rust)
    elif encoding is not None:
        candidate = TiktokenBackend(tokenizer, encoding)
        problem = _disagreement(candidate, list(candidate.added.values()))
        refused = f"tiktoken shortcut refused: {problem}"
        backend = candidate if problem is None else SlowTokenizerBackend(tokenizer, refused)
    else:
        backend = SlowTokenizerBackend(tokenizer, "no Rust backend and no tiktoken encoding")
    if len(_BACKENDS) > 8:
        _BACKENDS.clear()
    _BACKENDS[id(tokenizer)] = backend
    return backend


def describe_backend(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Provenance: which encoder produced the ids, and the tokenizer class behind it."""
    backend = backend_for(tokenizer)
    out: dict[str, Any] = {"tokenizer_backend": backend.kind, "tokenizer_class": type(tokenizer).__name__}
    if isinstance(backend, SlowTokenizerBackend):
        out["tokenizer_backend_reason"] = backend.reason
    return out
