"""prompts + responses parts -> `tokens` part: the exact ids the target model saw and produced + a loss mask.

input_ids = encode(prompt rendered with the chat template + generation prompt) + encode(completion laid out as
the model emitted it). The two are encoded separately because their boundary is a token boundary the model saw
(generation starts there); the finished conversation is never re-rendered, since templates rewrite history.
Where the endpoint recorded the prompt ids it sent, ours must equal them, or the part fails naming the sample.

Encoding goes through the Rust backend in batches; per-row Python is limited to slicing and bookkeeping so
that reconstruction runs near raw `tokenizers` throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase

from tasks.completion_format import (
    CompletionFormat,
    CompletionLayout,
    TokenSpans,
    completion_layout,
    loss_mask_values,
)
from tasks.config import PipelineConfig, ReconstructConfig
from tasks.errors import ConfigError, ReconstructionError
from tasks.messages import Message, prompt_messages
from tasks.shards import PartRef, read_marker, read_part, read_provenance, write_part
from tasks.special_tokens import verify_special_tokens
from tasks.tokenizer_loading import backend_tokenizer, load_tokenizer, render_prompt, tokenizer_provenance

RESPONSE_COLUMNS = ["sample_id", "dataset", "status", "reasoning", "content", "finish_reason", "prompt_ids"]


@dataclass(frozen=True)
class SampleText:
    """One finished generation as text, paired with its prompt."""

    sample_id: str
    dataset: str
    messages: list[Message]
    reasoning: str | None
    content: str | None
    finish_reason: str | None
    prompt_ids: list[int] | None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _token_at(encoding: Encoding, char: int, text_len: int) -> int:
    """Index of the first token ending after `char`: a token straddling a span boundary joins the later."""
    if char >= text_len:
        return len(encoding.ids)
    index = encoding.char_to_token(char)
    if index is not None:
        return int(index)
    for i, (_, end) in enumerate(encoding.offsets):
        if end > char:
            return i
    return len(encoding.ids)


def token_spans(encoding: Encoding, layout: CompletionLayout) -> TokenSpans:
    n = len(layout.text)
    content_at = _token_at(encoding, layout.content_start, n)
    end_of_turn_at = _token_at(encoding, layout.end_of_turn_start, n)
    return TokenSpans(content_at, end_of_turn_at - content_at, len(encoding.ids) - end_of_turn_at)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _check_prompt_ids(sample: SampleText, ours: list[int]) -> None:
    sent = sample.prompt_ids
    if sent is None or list(sent) == ours:
        return
    at = _first_difference(ours, sent)
    raise ReconstructionError(
        sample.sample_id,
        f"rendered prompt ids differ from the ids the endpoint recorded at position {at} "
        f"(ours {ours[max(0, at - 2) : at + 3]} vs endpoint {list(sent[max(0, at - 2) : at + 3])}; "
        f"lengths {len(ours)} vs {len(sent)})",
    )


def _layouts(fmt: CompletionFormat, samples: Sequence[SampleText]) -> list[CompletionLayout]:
    layouts = []
    for s in samples:
        try:
            layouts.append(completion_layout(fmt, s.reasoning, s.content, truncated=s.truncated))
        except ValueError as exc:
            raise ReconstructionError(s.sample_id, str(exc)) from exc
    return layouts


def _encode(backend: Tokenizer, texts: list[str], offsets: bool) -> list[Encoding]:
    if not offsets and hasattr(backend, "encode_batch_fast"):
        return list(backend.encode_batch_fast(texts, add_special_tokens=False))
    return list(backend.encode_batch(texts, add_special_tokens=False))


def build_tokens_table(
    tokenizer: PreTrainedTokenizerBase,
    fmt: CompletionFormat,
    samples: Sequence[SampleText],
    rcfg: ReconstructConfig,
) -> tuple[pa.Table, dict[str, int]]:
    """The `tokens` rows for `samples`, in order, and their token totals."""
    backend = backend_tokenizer(tokenizer)
    prompts = [render_prompt(tokenizer, prompt_messages(s.messages)) for s in samples]
    layouts = _layouts(fmt, samples)
    prompt_encs = _encode(backend, prompts, offsets=False)
    completion_encs = _encode(backend, [lay.text for lay in layouts], offsets=True)

    flat_ids: list[int] = []
    row_offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    segments = np.zeros((len(samples), 4), dtype=np.int64)
    for i, (sample, p_enc, c_enc, layout) in enumerate(
        zip(samples, prompt_encs, completion_encs, layouts, strict=True)
    ):
        prompt_ids = p_enc.ids
        _check_prompt_ids(sample, prompt_ids)
        spans = token_spans(c_enc, layout)
        flat_ids.extend(prompt_ids)
        flat_ids.extend(c_enc.ids)
        segments[i] = (len(prompt_ids), spans.reasoning, spans.content, spans.end_of_turn)
        row_offsets[i + 1] = len(flat_ids)

    values = np.tile(
        np.asarray(loss_mask_values(rcfg.loss_on_reasoning, rcfg.loss_on_end_of_turn), np.uint8), len(samples)
    )
    mask = np.repeat(values, segments.ravel())
    offsets = pa.array(row_offsets.astype(np.int32))
    completion_len = segments[:, 1:].sum(axis=1)
    table = pa.table(
        {
            "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
            "dataset": pa.array([s.dataset for s in samples], pa.string()),
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.asarray(flat_ids, dtype=np.int32))),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
            "prompt_len": pa.array(segments[:, 0].astype(np.int32)),
            "completion_len": pa.array(completion_len.astype(np.int32)),
            "reasoning_len": pa.array(segments[:, 1].astype(np.int32)),
            "completion_format": pa.array([fmt.name] * len(samples), pa.string()),
        }
    )
    stats = {
        "rows": len(samples),
        "tokens": len(flat_ids),
        "prompt_tokens": int(segments[:, 0].sum()),
        "completion_tokens": int(completion_len.sum()),
        "reasoning_tokens": int(segments[:, 1].sum()),
        "loss_tokens": int(mask.sum(dtype=np.int64)),
    }
    return table, stats


def _messages(raw: list[dict[str, Any]]) -> list[Message]:
    return [Message(role=m["role"], content=m["content"] or "") for m in raw]


def pair_samples(prompts: pa.Table, responses: pa.Table) -> tuple[list[SampleText], int]:
    """Done responses joined to their prompts, in prompt order; also the count of responses not done."""
    index = {sid: i for i, sid in enumerate(prompts.column("sample_id").to_pylist())}
    messages = prompts.column("messages").to_pylist()
    cols = {name: responses.column(name).to_pylist() for name in RESPONSE_COLUMNS if name != "prompt_ids"}
    prompt_ids = responses.column("prompt_ids")
    has_prompt_ids = prompt_ids.is_valid().to_pylist()
    chosen: dict[int, SampleText] = {}
    not_done = 0
    for row in range(responses.num_rows):
        sid = cols["sample_id"][row]
        if cols["status"][row] != "done":
            not_done += 1
            continue
        at = index.get(sid)
        if at is None:
            raise ReconstructionError(sid, "response has no prompt in the prompts part with the same index")
        if at in chosen:
            raise ReconstructionError(sid, "more than one done response in this part")
        chosen[at] = SampleText(
            sample_id=sid,
            dataset=cols["dataset"][row],
            messages=_messages(messages[at]),
            reasoning=cols["reasoning"][row],
            content=cols["content"][row],
            finish_reason=cols["finish_reason"][row],
            prompt_ids=prompt_ids[row].as_py() if has_prompt_ids[row] else None,
        )
    return [chosen[i] for i in sorted(chosen)], not_done


def reconstruct_part(cfg: PipelineConfig, part: int, fmt: CompletionFormat) -> dict[str, Any]:
    """Build `tokens/part-NNNNN` from the prompts and responses parts with the same index (idempotent)."""
    out = PartRef(cfg.run_dir, "tokens", part)
    if out.is_done():
        built_with = read_provenance(out.path).get("completion_format")
        if built_with != fmt.name:
            raise ConfigError(
                f"{out} was built with completion format {built_with!r}, this run uses {fmt.name!r}; "
                f"remove {out.run_dir / out.stage} to rebuild it"
            )
        return {**read_marker(out)["stats"], "reused": True}
    tokenizer = load_tokenizer(cfg.tokenizer)
    verify_special_tokens(tokenizer, fmt)
    prompts = read_part(out.with_stage("prompts"), columns=["sample_id", "messages"])
    responses = read_part(out.with_stage("responses"), columns=RESPONSE_COLUMNS)
    samples, not_done = pair_samples(prompts, responses)
    table, counts = build_tokens_table(tokenizer, fmt, samples, cfg.reconstruct)
    stats: dict[str, Any] = {**counts, "responses_not_done": not_done, "completion_format": fmt.name}
    provenance = {
        **cfg.provenance(),
        **tokenizer_provenance(cfg.tokenizer),
        "completion_format": fmt.name,
        "completion_format_spec": fmt.describe(),
        "reconstruct": cfg.reconstruct.model_dump(mode="json"),
    }
    write_part(out, table, provenance, stats)
    return {**stats, "reused": False}
