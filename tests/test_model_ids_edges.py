"""Where an answer's ids are easy to get wrong without noticing: an answer cut inside a multi-byte character, a
logprobs list that includes the stop token, and SGLang's finish reason at exactly `max_new_tokens`.

A real model found each of these (SmolLM2-135M through an independent server, 2026-12-03): text decoding is lossy
for part of a character (any partial bytes decode to U+FFFD), so a check that compares decoded text accepts ids
the model never emitted. Here with the real DeepSeek-V4 tokenizer: "ü" is the two byte tokens C3 and BC, and
U+FFFD has a token of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.config import (
    DatasetConfig,
    EndpointConfig,
    PipelineConfig,
    ReconstructConfig,
    TokenizerConfig,
    ValidationConfig,
)
from tasks.common.schemas import RESPONSES
from tasks.generate import CompletionMarkers
from tasks.generate.endpoints import parse_response
from tasks.generate.token_bytes import ExactIds, LogprobTokens, exact_ids, token_bytes_index
from tasks.reconstruct.completion_format import resolve_format
from tasks.reconstruct.repair import RepairTable
from tasks.reconstruct.stage import SampleText, build_tokens_table
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.validate.checks import _Tally, validate_tables

EOS = "<｜end▁of▁sentence｜>"
USER: Any = [{"role": "user", "content": "Spell Zürich."}]


def byte_ids(tokenizer: PreTrainedTokenizerBase, *pieces: bytes) -> list[int]:
    index = token_bytes_index(tokenizer)
    return [index.by_bytes[p] for p in pieces]


def logprobs(pieces: list[tuple[str, bytes]]) -> LogprobTokens:
    tokens = LogprobTokens()
    tokens.feed({"content": [{"token": t, "logprob": -0.1, "bytes": list(raw)} for t, raw in pieces]})
    return tokens


def test_bytes_built_from_the_token_string_are_never_taken_for_the_models_ids(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """An answer cut after the first byte of "ü": its content ends in U+FFFD. A provider that reports each
    token's raw bytes gives the model's ids; one that builds `bytes` from the decoded token string reports EF BF
    BD, which is U+FFFD's own token: that answer is re-encoded, not stored as the model's."""
    z, c3 = byte_ids(tokenizer, b"Z", b"\xc3")
    raw = logprobs([("Z", b"Z"), ("\ufffd", b"\xc3")])
    assert exact_ids(raw, tokenizer, None, "Z\ufffd", "", EOS) == ExactIds([z, c3])
    lossy = logprobs([("Z", b"Z"), ("\ufffd", "\ufffd".encode())])
    assert (
        token_bytes_index(tokenizer).ids(lossy.entries)[-1]
        == tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\ufffd"))[-1]
    )
    assert exact_ids(lossy, tokenizer, None, "Z\ufffd", "", EOS) is None


def test_a_reencoded_answer_cut_inside_a_character_ends_before_its_last_word(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Re-encoding the U+FFFD a cut leaves would store U+FFFD's token, which the model never emitted, and the
    model's last token may hold whole characters before the partial one (a space and half an emoji): the row
    ends before the cut word instead, a prefix of the model's answer, and validation checks it against the same
    text. With the model's ids, those are stored, partial byte included. U+FFFD inside a re-encoded answer (a
    broken character the model went on after) fails validation: no re-encoding gives back the model's bytes."""
    kwargs = {"thinking": False}
    fmt = resolve_format("auto", tokenizer, kwargs)
    assert not fmt.has_reasoning
    head = tokenizer.encode("It is", add_special_tokens=False)
    emitted = [*head, *byte_ids(tokenizer, b" ", b"Z", b"\xc3")]
    samples = [
        SampleText("cut", "d", USER, None, "It is Z\ufffd", "length", None),
        SampleText("model", "d", USER, None, "It is Z\ufffd", "length", None, output_ids=emitted),
        SampleText("broken", "d", USER, None, "It is Z\ufffd!", "stop", None),
        SampleText("cjk", "d", USER, None, "\u4f60\u597d\u4e16\ufffd", "length", None),
    ]
    tokens, stats = build_tokens_table(tokenizer, fmt, samples, ReconstructConfig(), kwargs)
    completions = {r["sample_id"]: r["input_ids"][r["prompt_len"] :] for r in tokens.to_pylist()}
    assert completions["cut"] == head
    assert completions["model"] == emitted and stats["model_rows"] == 1
    replacement = tokenizer.encode("\ufffd", add_special_tokens=False)
    assert replacement[0] in completions["broken"]

    # What the provider bills: every token the model emitted, the cut word's and the partial byte's included.
    cjk_emitted = [*tokenizer.encode("\u4f60\u597d\u4e16", add_special_tokens=False), *byte_ids(tokenizer, b"\xe7")]
    billed = {"cut": len(emitted), "model": len(emitted), "broken": None, "cjk": len(cjk_emitted)}
    rows = [
        {"sample_id": s.sample_id, "dataset": "d", "status": "done", "content": s.content}
        | {"finish_reason": s.finish_reason, "attempts": 1, "output_ids": s.output_ids}
        | {"completion_tokens": billed[s.sample_id]}
        for s in samples
    ]
    responses = pa.Table.from_pylist(rows, schema=RESPONSES)
    vcfg = ValidationConfig(allowed_finish_reasons=["stop", "length"])
    table, _ = validate_tables(tokens, responses, fmt, backend_for(tokenizer), vcfg)
    checks = {r["sample_id"]: r for r in table.to_pylist()}
    # The bill is checked against the whole answer as re-encoding counts it, not against the kept prefix: the cut
    # word and the cut character were billed and emitted, only not stored.
    for sid, text in (("cut", "It is Z\ufffd"), ("cjk", "\u4f60\u597d\u4e16\ufffd")):
        whole = len(tokenizer.encode(text, add_special_tokens=False))
        assert checks[sid]["billing_delta_tokens"] == billed[sid] - whole, (sid, checks[sid])
        assert abs(checks[sid]["billing_delta_tokens"]) <= 1 < billed[sid] - len(completions[sid])
    assert checks["model"]["billing_delta_tokens"] == 0
    tally = _Tally()
    for row in table.to_pylist():
        tally.add_row(row, vcfg)
    billing = tally.billing()
    assert billing["billed_completion_tokens"] == sum(n for n in billed.values() if n is not None)
    assert billing["delta_tokens"] == sum(checks[sid]["billing_delta_tokens"] for sid in ("cut", "model", "cjk"))
    assert checks["cut"]["verdict"] == "warn" and checks["model"]["verdict"] != "fail", checks
    assert checks["cut"]["structural_issues"] == ["cut_inside_character:5 of 8 characters kept"]
    assert "replacement_character" in checks["broken"]["structural_issues"]
    assert checks["broken"]["verdict"] == "fail"
    # A CJK answer has no space to end before: nothing is left to train on, and it is dropped, not kept empty.
    assert completions["cjk"] == []
    assert checks["cjk"]["verdict"] == "drop" and "nothing_kept_after_cut" in checks["cjk"]["structural_issues"]


@pytest.mark.parametrize("stop_entry", [(EOS, EOS.encode()), ("", b""), (EOS, b"")])
def test_a_stop_token_listed_in_the_logprobs_keeps_the_exact_ids(
    tokenizer: PreTrainedTokenizerBase, stop_entry: tuple[str, bytes]
) -> None:
    """vLLM lists the stop token among the logprobs (by its string, or empty); it is not part of the text, and
    used to make every answer that stopped fall back to re-encoding. Only a last entry is taken for it."""
    pieces = [(p.decode("utf-8", "replace"), p) for p in (b"Z", b"\xc3", b"\xbc", b"rich")]
    expected = byte_ids(tokenizer, *(p for _, p in pieces))
    assert exact_ids(logprobs([*pieces, stop_entry]), tokenizer, None, "Zürich", "", EOS) == ExactIds(expected)
    assert exact_ids(logprobs([stop_entry, *pieces]), tokenizer, None, "Zürich", "", EOS) is None


def test_sglang_length_with_the_end_of_turn_last_is_a_finished_answer(
    tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path
) -> None:
    """SGLang checks `max_new_tokens` before the stop token: an answer whose last allowed token ends the turn
    comes back as "length". It is laid out as finished (else the model's ids do not spell it and the row fails)."""
    cfg = PipelineConfig(
        run_dir=Path("unused"),
        datasets=[DatasetConfig(name="d", path=tokenizer_dir)],
        endpoint=EndpointConfig(model="m", kind="sglang_generate"),
        tokenizer=TokenizerConfig(path=tokenizer_dir),
    )
    markers = CompletionMarkers("", EOS)
    ids = tokenizer.encode("Zurich", add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids(EOS)

    def finish(text: str, output_ids: list[int]) -> str | None:
        body = {"text": text, "output_ids": output_ids, "meta_info": {"finish_reason": {"type": "length"}}}
        return parse_response(cfg, body, markers, None, tokenizer).finish_reason

    assert finish("Zurich", [*ids, eos]) == "stop"
    assert finish("Zurich" + EOS, [*ids, eos]) == "stop"
    assert finish("Zurich", ids) == "length"


def test_a_cut_character_never_becomes_a_repair_rule(tokenizer: PreTrainedTokenizerBase) -> None:
    """Re-encoding a cut answer gives U+FFFD's token where the model emitted a partial byte; both decode to
    U+FFFD, so a text comparison took them for the same text and learned a rule that rewrites real U+FFFDs."""
    backend = backend_for(tokenizer)
    z, c3, c3b = byte_ids(tokenizer, b"Z", b"\xc3", b"\xc3")
    replacement = tokenizer.encode("\ufffd", add_special_tokens=False)
    assert len(replacement) == 1 and c3 == c3b
    pairs = [([z, *replacement], [z, c3])] * 5
    assert RepairTable.learn(backend, pairs).rules == {}
