"""Every control token a completion format relies on must encode to exactly its own single id, checked before
any sample is built.

A wrong id here is invisible downstream: the ids are still valid integers, the data still trains, and the
drafter learns to emit "chas" instead of end-of-turn (an implementation that assumed Kimi's `<|im_end|>` was
163533 instead of 163586 did exactly that). So the check compares three independent views of each string:
the id the tokenizer's vocabulary gives it, the id pinned by the format (or the caller), and what encoding and
decoding actually produce.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tasks.common.errors import SpecialTokenError
from tasks.reconstruct.completion_format import CompletionFormat
from tasks.reconstruct.tokenizer_backend import backend_for


@dataclass(frozen=True)
class SpecialTokenCheck:
    """One control string: the id it must have, what it encodes to, and what the expected id decodes to."""

    string: str
    expected_id: int | None
    vocab_id: int | None
    encoded_ids: tuple[int, ...]
    decoded: str
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


def _problem(
    string: str, expected: int | None, vocab_id: int | None, encoded: tuple[int, ...], decoded: str
) -> str | None:
    if vocab_id is None:
        return "not in the tokenizer's vocabulary"
    if expected != vocab_id:
        return f"expected id {expected}, but the vocabulary maps it to {vocab_id}"
    if len(encoded) != 1:
        return f"encodes to {len(encoded)} ids, expected exactly 1"
    if encoded[0] != expected:
        return f"encodes to id {encoded[0]}, expected {expected}"
    if decoded != string:
        return f"id {expected} decodes to {decoded!r}"
    return None


def check_special_tokens(
    tokenizer: PreTrainedTokenizerBase, fmt: CompletionFormat, expected_ids: Mapping[str, int] | None = None
) -> list[SpecialTokenCheck]:
    """The table of checks, without raising. Expected id: caller's table, else format's pin, else vocab.

    Encoding and decoding go through the same backend reconstruction uses (Rust, tiktoken or the tokenizer's
    own Python), so the table describes the ids the data will actually carry.
    """
    backend = backend_for(tokenizer)
    pinned = {**fmt.pinned(), **(expected_ids or {})}
    rows = []
    for string in fmt.special_tokens():
        vocab_id = backend.token_to_id(string)
        expected = pinned.get(string, vocab_id)
        encoded = tuple(backend.encode(string))
        decoded = _decode_one(backend.decode, expected)
        rows.append(
            SpecialTokenCheck(
                string,
                expected,
                vocab_id,
                encoded,
                decoded,
                _problem(string, expected, vocab_id, encoded, decoded),
            )
        )
    return rows


def _decode_one(decode: Callable[[list[int]], str], token_id: int | None) -> str:
    if token_id is None:
        return ""
    try:
        return decode([token_id])
    except (KeyError, ValueError, OverflowError) as exc:
        return f"<undecodable: {type(exc).__name__}>"


def format_table(rows: list[SpecialTokenCheck]) -> str:
    header = ("token", "expected_id", "vocab_id", "encoded_ids", "expected_decodes_to", "status")
    body = [
        (
            repr(r.string),
            str(r.expected_id),
            str(r.vocab_id),
            str(list(r.encoded_ids)),
            repr(r.decoded),
            "ok" if r.problem is None else f"FAIL: {r.problem}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in (header, *body)
    )


def verify_special_tokens(
    tokenizer: PreTrainedTokenizerBase, fmt: CompletionFormat, expected_ids: Mapping[str, int] | None = None
) -> list[SpecialTokenCheck]:
    """Fail fast, with the whole table, if any control string of `fmt` is not exactly its own single id."""
    rows = check_special_tokens(tokenizer, fmt, expected_ids)
    if any(not r.ok for r in rows):
        raise SpecialTokenError(
            f"completion format {fmt.name!r}: special tokens do not map to their own single id:\n{format_table(rows)}"
        )
    return rows
