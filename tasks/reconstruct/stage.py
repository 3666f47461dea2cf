"""prompts + responses parts -> `tokens` part: the exact ids the target model saw and produced + a loss mask.

input_ids = encode(prompt rendered with the chat template + generation prompt) + encode(completion laid out as
the model emitted it). The two are encoded separately because their boundary is a token boundary the model saw
(generation starts there); the finished conversation is never re-rendered, since templates rewrite history.
Where the endpoint recorded the prompt ids it sent, ours must equal them, or the part fails naming the sample.

Encoding goes through `tasks.reconstruct.tokenizer_backend` in batches (Rust `tokenizers`, tiktoken's threaded core, or,
for other Python tokenizers, their own `encode`); per-row Python is limited to bookkeeping so that
reconstruction runs near raw `tokenizers` throughput (`bench/reconstruct_throughput.py`).

A response regenerated turn by turn (`sampling.regenerate: every_turn`) carries the final request's `history`;
its row is the template's rendering of that history (the context the target saw last) plus the final
completion, masked over every span the target wrote (`tasks.reconstruct.multiturn`). Those rows are built one by one,
the others in the batch path; output rows keep prompt order either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig, ReconstructConfig
from tasks.common.errors import ConfigError, ReconstructionError
from tasks.common.messages import Message, prompt_messages
from tasks.common.shards import PartRef, expected_build, is_current, read_marker, read_part, write_part
from tasks.common.state_inputs import IDS_STAT, ids_digest
from tasks.reconstruct.completion_format import (
    PRESETS,
    CompletionFormat,
    CompletionLayout,
    check_format,
    completion_layout,
    loss_mask_values,
    without_cut_character,
)
from tasks.reconstruct.model_ids import model_completion, token_at
from tasks.reconstruct.multiturn import ConversationTurn, build_multiturn_sequence
from tasks.reconstruct.repair import RepairTable, learn_from_run
from tasks.reconstruct.special_tokens import verify_special_tokens
from tasks.reconstruct.template_clock import send_times, template_prints_date, with_clock
from tasks.reconstruct.tokenizer_backend import TokenBackend, backend_for, describe_backend, first_difference
from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt, tokenizer_hash, tokenizer_provenance

RESPONSE_COLUMNS = [
    "sample_id",
    "dataset",
    "status",
    "reasoning",
    "content",
    "finish_reason",
    "prompt_ids",
    "history",
    "output_ids",
    "completion_tokens",
    "generation_id",
]
TOKEN_STATS = (
    "rows",
    "tokens",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "loss_tokens",
    "model_rows",
    "reencoded_rows",
    "repaired_rows",
    "repairs_refused_by_bill",
    "endpoint_prompt_rows",
)
TOKEN_SOURCES = ("model", "reencoded", "repaired")
"""`tokens.token_source`: the ids the endpoint reported the model generated, the returned text re-encoded, or
re-encoded and then rewritten with the splits reference answers show (`tasks.reconstruct.repair`)."""


@dataclass(frozen=True)
class SampleText:
    """One finished generation as text, paired with its prompt.

    `history`: the turns of the final request before the answer, when the conversation was regenerated turn by
    turn; None when the request was the prompt's own messages.
    """

    sample_id: str
    dataset: str
    messages: list[Message]
    reasoning: str | None
    content: str | None
    finish_reason: str | None
    prompt_ids: list[int] | None
    history: list[ConversationTurn] | None = None
    output_ids: list[int] | None = None
    billed_completion_tokens: int | None = None
    generation_id: str | None = None
    sent_at_s: float | None = None
    """When the request was sent, for a template that prints the date (`template_clock`); None: not needed."""
    prompt_rendered_by_endpoint: bool = False
    """`prompt_ids` are the endpoint's own rendering of the messages (a chat endpoint's `prompt_token_ids`), not
    ids this tool rendered and sent: they are what the target read, so they are the row's prompt."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def turns(self) -> list[ConversationTurn]:
        """The regenerated conversation, ending with the final answer."""
        final = ConversationTurn(role="assistant", content=self.content or "", reasoning=self.reasoning, generated=True)
        return [*(self.history or []), final]


def _check_prompt_ids(sample: SampleText, ours: list[int]) -> None:
    sent = sample.prompt_ids
    if sent is None or list(sent) == ours:
        return
    at = first_difference(ours, sent)
    raise ReconstructionError(
        sample.sample_id,
        f"rendered prompt ids differ from the ids the endpoint recorded at position {at} "
        f"(ours {ours[max(0, at - 2) : at + 3]} vs endpoint {list(sent[max(0, at - 2) : at + 3])}; "
        f"lengths {len(ours)} vs {len(sent)}): the prompt the target read was rendered with another chat template "
        "or other template kwargs than tokenizer.path and tokenizer.chat_template_kwargs give now; make them those "
        "it was rendered with and rerun (the answers are kept)",
    )


def _layouts(fmt: CompletionFormat, samples: Sequence[SampleText]) -> list[CompletionLayout]:
    layouts = []
    for s in samples:
        try:
            layouts.append(completion_layout(fmt, s.reasoning, s.content, truncated=s.truncated))
        except ValueError as exc:
            raise ReconstructionError(s.sample_id, str(exc)) from exc
    return layouts


def _boundary_ids(backend: TokenBackend, fmt: CompletionFormat) -> tuple[int | None, int, int] | None:
    """(id that ends the reasoning section, how often the layout writes it before the content, end-of-turn id)
    when span boundaries can be read off the ids.

    Control tokens are split off before BPE runs, so a boundary right after one is always a token boundary:
    with no content separator and a close literal ending in a control token, the content starts right after
    that token's last expected occurrence, and the end of turn is the last token. Otherwise (Qwen3's
    `</think>\\n\\n`) None: offsets decide.
    """
    end_of_turn = backend.token_to_id(fmt.end_of_turn)
    if end_of_turn is None or fmt.content_separator:
        return None
    if fmt.reasoning_close is None:
        return None, 0, end_of_turn
    last = next((c for c in fmt.special_tokens() if fmt.reasoning_close.endswith(c)), None)
    close = backend.token_to_id(last) if last else None
    if last is None or close is None:
        return None
    written = ("" if fmt.open_in_prompt else fmt.reasoning_open or "") + fmt.reasoning_close
    return close, written.count(last), end_of_turn


def _nth(row: list[int], token: int, n: int) -> int:
    at = -1
    for _ in range(n):
        at = row.index(token, at + 1)
    return at


def encode_completions(
    backend: TokenBackend, fmt: CompletionFormat, layouts: Sequence[CompletionLayout]
) -> tuple[list[list[int]], np.ndarray]:
    """Completion ids and, per row, the token index where the content and the end of turn start.

    Read off the ids where the format allows it (`_boundary_ids`: no offsets to compute, the fast batch
    path), and from character offsets for the rows where that is ambiguous (the close tag also inside the
    text) and for formats that need them; both give the same indices where both apply.
    """
    texts = [lay.text for lay in layouts]
    bounds = [(lay.content_start, lay.end_of_turn_start) for lay in layouts]
    by_id = _boundary_ids(backend, fmt)
    if by_id is None:
        return backend.encode_with_boundaries(texts, bounds)
    close, written, eot = by_id
    ids = backend.encode_batch(texts)
    at = np.zeros((len(texts), 2), dtype=np.int64)
    redo = []
    for i, (row, lay) in enumerate(zip(ids, layouts, strict=True)):
        n, text_len = len(row), len(lay.text)
        eot_at = n if lay.end_of_turn_start >= text_len else n - 1
        if lay.content_start >= text_len:
            content_at = n
        elif lay.content_start == 0 or close is None:
            content_at = 0
        else:
            content_at = _nth(row, close, written) + 1 if row.count(close) == written else -1
        if content_at < 0 or (eot_at < n and row[-1] != eot):
            redo.append(i)
        at[i] = (content_at, eot_at)
    if redo:
        again, again_at = backend.encode_with_boundaries([texts[i] for i in redo], [bounds[i] for i in redo])
        for k, i in enumerate(redo):
            ids[i], at[i] = again[k], again_at[k]
    return ids, at


def _tokens_table(
    fmt: CompletionFormat,
    samples: Sequence[SampleText],
    row_offsets: np.ndarray,
    flat: np.ndarray,
    mask: np.ndarray,
    lens: np.ndarray,
    sources: Sequence[str],
    repairs_refused: int = 0,
    endpoint_prompts: int = 0,
) -> tuple[pa.Table, dict[str, int]]:
    """`lens`: per row (prompt_len, completion_len, reasoning_len); `sources`: per row, a `TOKEN_SOURCES` value."""
    offsets = pa.array(row_offsets.astype(np.int32))
    n = len(samples)
    table = pa.table(
        {
            "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
            "dataset": pa.array([s.dataset for s in samples], pa.string()),
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat, pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask, pa.uint8())),
            "prompt_len": pa.array(lens[:, 0].astype(np.int32)),
            "completion_len": pa.array(lens[:, 1].astype(np.int32)),
            "reasoning_len": pa.array(lens[:, 2].astype(np.int32)),
            "completion_format": pa.array([fmt.name] * n, pa.string()),
            "token_source": pa.array(list(sources), pa.string()),
        }
    )
    stats = {
        "rows": n,
        "tokens": int(row_offsets[-1]),
        "prompt_tokens": int(lens[:, 0].sum()),
        "completion_tokens": int(lens[:, 1].sum()),
        "reasoning_tokens": int(lens[:, 2].sum()),
        "loss_tokens": int(mask.sum(dtype=np.int64)),
        "model_rows": sum(s == "model" for s in sources),
        "reencoded_rows": sum(s == "reencoded" for s in sources),
        "repaired_rows": sum(s == "repaired" for s in sources),
        "repairs_refused_by_bill": repairs_refused,
        "endpoint_prompt_rows": endpoint_prompts,
    }
    return table, stats


def _final_turn_rows(
    tokenizer: PreTrainedTokenizerBase,
    fmt: CompletionFormat,
    samples: Sequence[SampleText],
    rcfg: ReconstructConfig,
    template_kwargs: Mapping[str, Any] | None,
    repair: RepairTable | None = None,
) -> tuple[pa.Table, dict[str, int]]:
    backend = backend_for(tokenizer)
    sample_ids = [s.sample_id for s in samples]
    prompts = [
        render_prompt(tokenizer, prompt_messages(s.messages), with_clock(template_kwargs, s.sent_at_s)) for s in samples
    ]
    layouts = _layouts(fmt, samples)
    encoded = [without_cut_character(fmt, lay) for lay in layouts]
    texts = [lay.text for lay in encoded]
    prompt_ids = backend.encode_batch(prompts)
    completion_ids, at = encode_completions(backend, fmt, encoded)
    backend.spot_check(prompts, sample_ids, prompt_ids)
    backend.spot_check(texts, sample_ids, completion_ids)
    endpoint_prompts = 0
    for i, s in enumerate(samples):
        if s.prompt_ids is None:
            continue
        if s.prompt_rendered_by_endpoint:
            endpoint_prompts += list(s.prompt_ids) != prompt_ids[i]
            prompt_ids[i] = list(s.prompt_ids)
        elif s.sent_at_s is not None:  # a dated template, sent as ids: those are the prompt
            prompt_ids[i] = list(s.prompt_ids)
    sources = ["reencoded"] * len(samples)
    eot = backend.token_to_id(fmt.end_of_turn)
    if rcfg.token_ids == "model" and eot is not None:
        for i, s in enumerate(samples):
            exact = None if s.output_ids is None else model_completion(backend, layouts[i], s.output_ids, eot)
            if exact is not None:
                completion_ids[i], at[i] = exact[0], exact[1:]
                sources[i] = "model"
    refused = 0
    cut_off = tokens_cut_off(backend, layouts, encoded) if repair is not None else {}
    for i, source in enumerate(sources):
        if repair is None or source != "reencoded":
            continue
        fixed, applied = repair.apply(backend, completion_ids[i])
        cut = cut_off.get(i, 0)
        if applied and not no_further_from_bill(
            len(completion_ids[i]) + cut, len(fixed) + cut, samples[i].billed_completion_tokens
        ):
            refused += 1
        elif applied:
            layout = encoded[i]
            completion_ids[i] = fixed
            content_at = token_at(backend, fixed, layout.content_start, len(layout.text))
            at[i] = (content_at, len(fixed) - 1 if layout.ends_turn else len(fixed))
            sources[i] = "repaired"
    for sample, ids in zip(samples, prompt_ids, strict=True):
        _check_prompt_ids(sample, ids)

    n = len(samples)
    segments = np.zeros((n, 4), dtype=np.int64)
    segments[:, 0] = [len(p) for p in prompt_ids]
    if n:
        completion_lens = np.fromiter((len(c) for c in completion_ids), np.int64, count=n)
        segments[:, 1] = at[:, 0]
        segments[:, 2] = at[:, 1] - at[:, 0]
        segments[:, 3] = completion_lens - at[:, 1]
    row_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(segments.sum(axis=1), out=row_offsets[1:])
    pairs = zip(prompt_ids, completion_ids, strict=True)
    interleaved = itertools.chain.from_iterable(itertools.chain.from_iterable(pairs))
    flat = np.fromiter(interleaved, dtype=np.int32, count=int(row_offsets[-1]))
    values = np.tile(np.asarray(loss_mask_values(rcfg.loss_on_reasoning, rcfg.loss_on_end_of_turn), np.uint8), n)
    mask = np.repeat(values, segments.ravel())
    lens = np.stack([segments[:, 0], segments[:, 1:].sum(axis=1), segments[:, 1]], axis=1)
    return _tokens_table(fmt, samples, row_offsets, flat, mask, lens, sources, refused, endpoint_prompts)


def tokens_cut_off(
    backend: TokenBackend, wholes: Sequence[CompletionLayout], kept: Sequence[CompletionLayout]
) -> dict[int, int]:
    """Per row that `without_cut_character` cut: how many tokens the cut took off, as re-encoding counts them (the
    whole answer's text, its U+FFFD included, less the kept prefix).

    The provider bills the whole answer, so a check against the bill must add these back: compared with the kept
    prefix alone, every such row looked under-counted, and a CJK answer dropped with nothing kept counted all of
    its billed tokens as a billing discrepancy (+11% on a 16-answer SmolLM2 run with one such answer)."""
    rows = [i for i, (whole, part) in enumerate(zip(wholes, kept, strict=True)) if whole is not part]
    if not rows:
        return {}
    whole_ids = backend.encode_batch([wholes[i].text for i in rows])
    kept_ids = backend.encode_batch([kept[i].text for i in rows])
    return {i: len(w) - len(k) for i, w, k in zip(rows, whole_ids, kept_ids, strict=True)}


def no_further_from_bill(reencoded: int, repaired: int, billed: int | None) -> bool:
    """Whether a repair keeps the completion's length at least as close to the billed count (which counts the
    end-of-turn token, as validation's billing check does): the rules are learned over all answers, and where this
    answer's re-encoding already has the model's count, a rule that changes the count made the row wrong (a
    reference answer's `Ċ Ċ` before a code fence, rewritten to `ĊĊ`). Without a bill, the rules decide alone."""
    return billed is None or abs(repaired - billed) <= abs(reencoded - billed)


def _multiturn_rows(
    tokenizer: PreTrainedTokenizerBase,
    fmt: CompletionFormat,
    samples: Sequence[SampleText],
    rcfg: ReconstructConfig,
    template_kwargs: Mapping[str, Any] | None,
) -> tuple[pa.Table, dict[str, int]]:
    """Rows of turn-by-turn regenerated conversations; prompt_len is the final request's context."""
    seqs = []
    for s in samples:
        try:
            seq = build_multiturn_sequence(
                tokenizer,
                fmt,
                s.turns(),
                loss_on_reasoning=rcfg.loss_on_reasoning,
                loss_on_end_of_turn=rcfg.loss_on_end_of_turn,
                truncated=s.truncated,
                template_kwargs=with_clock(template_kwargs, s.sent_at_s),
                output_ids=s.output_ids if rcfg.token_ids == "model" else None,
            )
        except (ValueError, ConfigError) as exc:  # the template's view of this conversation: named by sample
            raise ReconstructionError(s.sample_id, str(exc)) from exc
        _check_prompt_ids(s, seq.input_ids[: seq.prompt_len])
        seqs.append(seq)
    backend = backend_for(tokenizer)
    sample_ids = [s.sample_id for s in samples]
    backend.spot_check([q.context for q in seqs], sample_ids, [q.input_ids[: q.prompt_len] for q in seqs])
    reencoded = [(q, sid) for q, sid in zip(seqs, sample_ids, strict=True) if not q.model_ids]
    backend.spot_check(
        [q.completion for q, _ in reencoded],
        [sid for _, sid in reencoded],
        [q.input_ids[q.prompt_len :] for q, _ in reencoded],
    )

    row_offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(q.input_ids) for q in seqs], out=row_offsets[1:])
    total = int(row_offsets[-1])
    flat = np.fromiter(itertools.chain.from_iterable(q.input_ids for q in seqs), np.int32, count=total)
    mask = np.fromiter(itertools.chain.from_iterable(q.loss_mask for q in seqs), np.uint8, count=total)
    lens = np.array(
        [(q.prompt_len, len(q.input_ids) - q.prompt_len, q.reasoning_len) for q in seqs], dtype=np.int64
    ).reshape(-1, 3)
    sources = ["model" if q.model_ids else "reencoded" for q in seqs]
    return _tokens_table(fmt, samples, row_offsets, flat, mask, lens, sources)


def build_tokens_table(
    tokenizer: PreTrainedTokenizerBase,
    fmt: CompletionFormat,
    samples: Sequence[SampleText],
    rcfg: ReconstructConfig,
    template_kwargs: Mapping[str, Any] | None = None,
    repair: RepairTable | None = None,
) -> tuple[pa.Table, dict[str, int]]:
    """The `tokens` rows for `samples`, in order, and their token totals."""
    multi = [i for i, s in enumerate(samples) if s.history is not None]
    if not multi:
        table, stats = _final_turn_rows(tokenizer, fmt, samples, rcfg, template_kwargs, repair)
        return table, {**stats, "multiturn_rows": 0}
    single = [i for i, s in enumerate(samples) if s.history is None]
    singles = [samples[i] for i in single]
    first, first_stats = _final_turn_rows(tokenizer, fmt, singles, rcfg, template_kwargs, repair)
    rest, rest_stats = _multiturn_rows(tokenizer, fmt, [samples[i] for i in multi], rcfg, template_kwargs)
    at = np.empty(len(samples), dtype=np.int64)
    at[single] = np.arange(len(single))
    at[multi] = len(single) + np.arange(len(multi))
    table = pa.concat_tables([first, rest]).take(pa.array(at)).combine_chunks()
    stats = {key: first_stats[key] + rest_stats[key] for key in TOKEN_STATS}
    return table, {**stats, "multiturn_rows": len(multi)}


def _messages(raw: list[dict[str, Any]]) -> list[Message]:
    return [Message(role=m["role"], content=m["content"] or "") for m in raw]


def _history(sid: str, raw: list[dict[str, Any]], messages: list[Message]) -> list[ConversationTurn]:
    """The final request's turns before the answer; its dataset turns must be the prompt's own (same order)."""
    turns = [
        ConversationTurn(role=t["role"], content=t["content"] or "", reasoning=t["reasoning"], generated=t["generated"])
        for t in raw
    ]
    sent = [(t["role"], t["content"]) for t in turns if not t["generated"] and t["role"] != "assistant"]
    asked = [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]
    if sent != asked:
        at = next((i for i, (a, b) in enumerate(zip(sent, asked, strict=False)) if a != b), min(len(sent), len(asked)))
        raise ReconstructionError(
            sid,
            f"history's dataset turns differ from the prompt's at non-assistant turn {at} "
            f"({len(sent)} sent, {len(asked)} in the prompt)",
        )
    return turns


def pair_samples(prompts: pa.Table, responses: pa.Table) -> tuple[list[SampleText], int]:
    """Done responses joined to their prompts, in prompt order; also the count of responses not done."""
    index = {sid: i for i, sid in enumerate(prompts.column("sample_id").to_pylist())}
    messages = prompts.column("messages").to_pylist()
    cols = {
        name: responses.column(name).to_pylist()
        for name in RESPONSE_COLUMNS
        if name not in ("prompt_ids", "output_ids")
    }
    histories = cols["history"]
    prompt_ids = responses.column("prompt_ids")
    has_prompt_ids = prompt_ids.is_valid().to_pylist()
    output_ids = responses.column("output_ids")
    has_output_ids = output_ids.is_valid().to_pylist()
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
        conversation = _messages(messages[at])
        history = histories[row]
        chosen[at] = SampleText(
            sample_id=sid,
            dataset=cols["dataset"][row],
            messages=conversation,
            reasoning=cols["reasoning"][row],
            content=cols["content"][row],
            finish_reason=cols["finish_reason"][row],
            prompt_ids=prompt_ids[row].as_py() if has_prompt_ids[row] else None,
            history=None if history is None else _history(sid, history, conversation),
            output_ids=output_ids[row].as_py() if has_output_ids[row] else None,
            billed_completion_tokens=cols["completion_tokens"][row],
            generation_id=cols["generation_id"][row],
        )
    return [chosen[i] for i in sorted(chosen)], not_done


RECONSTRUCT_CODE_VERSION = 2
"""Bump when a code change alters the tokens rows built from the same inputs: every tokens part is rebuilt."""


def tokens_recipe(cfg: PipelineConfig, fmt: CompletionFormat, repair: RepairTable | None = None) -> dict[str, Any]:
    """What shapes a tokens part besides its prompts and responses parts (its lineage recipe); with
    `reconstruct.repair_from`, the digest of the rules learned there."""
    recipe = {
        "stage": "tokens",
        "code_version": RECONSTRUCT_CODE_VERSION,
        "tokenizer_hash": tokenizer_hash(cfg.tokenizer.path),
        "chat_template_kwargs": dict(cfg.tokenizer.chat_template_kwargs),
        "completion_format": fmt.describe(),
        "reconstruct": cfg.reconstruct.model_dump(mode="json"),
    }
    if repair is not None:
        recipe["repair_rules"] = repair.digest()
    return recipe


def model_ids_notice(cfg: PipelineConfig, stats: Sequence[Mapping[str, Any]]) -> str | None:
    """One line when the config asks the endpoint for the model's ids and some rows store a re-encoding anyway:
    an endpoint that ignores the request (OpenRouter has no `return_token_ids`, many providers no logprobs) falls
    back to re-encoding row by row, which the report counts but nothing else says."""
    ep = cfg.endpoint
    asked = [
        name
        for name, on in (
            ("endpoint.kind sglang_generate", ep.kind == "sglang_generate"),
            ("endpoint.return_token_ids", ep.return_token_ids),
            ("endpoint.logprobs", ep.logprobs),
        )
        if on
    ]
    reencoded = sum(int(s.get("reencoded_rows") or 0) for s in stats)
    if not asked or cfg.reconstruct.token_ids != "model" or not reencoded:
        return None
    rows = sum(int(s.get("rows") or 0) for s in stats)
    return (
        f"{reencoded} of {rows} rows store a re-encoding of their text although {' and '.join(asked)} asks the "
        "endpoint for the model's ids: it returned none for them, or ids that do not spell the text they came with "
        "(per dataset in the report's token_source counts)"
    )


def endpoint_prompt_notice(stats: Sequence[Mapping[str, Any]]) -> str | None:
    """One line when rows store prompt ids the endpoint rendered otherwise than the configured chat template does:
    they are what the target read, so they are kept, and a template that differs from the server's is worth
    knowing before the next run (and before the drafter is served behind another template)."""
    differing = sum(int(s.get("endpoint_prompt_rows") or 0) for s in stats)
    if not differing:
        return None
    rows = sum(int(s.get("rows") or 0) for s in stats)
    return (
        f"{differing} of {rows} rows store the prompt ids the endpoint rendered (prompt_token_ids), which differ "
        "from tokenizer.path's chat template with tokenizer.chat_template_kwargs: the target read the endpoint's, "
        "so those are kept; make the configured template the server's if the difference is not meant"
    )


def repair_table(cfg: PipelineConfig, fmt: CompletionFormat) -> RepairTable | None:
    if cfg.reconstruct.repair_from is None:
        return None
    tokenizer = load_tokenizer(cfg.tokenizer)
    return learn_from_run(cfg.reconstruct.repair_from, backend_for(tokenizer), fmt, tokenizer_hash(cfg.tokenizer.path))


def reconstruct_part(cfg: PipelineConfig, part: int, fmt: CompletionFormat) -> dict[str, Any]:
    """Build `tokens/part-NNNNN` from the prompts and responses parts with the same index (idempotent).

    A tokens part built from other inputs (the responses part was retried) or another recipe (completion
    format, tokenizer) is rebuilt; the old file stays until the new one replaces it."""
    out = PartRef(cfg.run_dir, "tokens", part)
    repair = repair_table(cfg, fmt)
    build = expected_build(out, tokens_recipe(cfg, fmt, repair))
    if is_current(out, build):
        return {**read_marker(out)["stats"], "reused": True}
    tokenizer = load_tokenizer(cfg.tokenizer)
    verify_special_tokens(tokenizer, fmt)
    kwargs = cfg.tokenizer.chat_template_kwargs
    prompts = read_part(out.with_stage("prompts"), columns=["sample_id", "messages"])
    responses = read_part(out.with_stage("responses"), columns=RESPONSE_COLUMNS)
    samples, not_done = pair_samples(prompts, responses)
    if cfg.endpoint.kind == "openai_chat":  # prompt ids there are only ever the endpoint's own (`prompt_token_ids`)
        samples = [replace(s, prompt_rendered_by_endpoint=True) if s.prompt_ids is not None else s for s in samples]
    if template_prints_date(cfg.tokenizer.path):
        finished = float(read_marker(out.with_stage("responses")).get("finished_at") or 0.0)
        sent = send_times(cfg.run_dir, samples, finished)
        samples = [replace(s, sent_at_s=sent[s.sample_id]) for s in samples]
    table, counts = build_tokens_table(tokenizer, fmt, samples, cfg.reconstruct, kwargs, repair)
    stats: dict[str, Any] = {**counts, "responses_not_done": not_done, "completion_format": fmt.name}
    stats[IDS_STAT] = ids_digest(table)
    provenance = {
        **cfg.provenance(),
        **tokenizer_provenance(cfg.tokenizer),
        **describe_backend(tokenizer),
        "completion_format": fmt.name,
        "completion_format_spec": fmt.describe(),
        "reconstruct": cfg.reconstruct.model_dump(mode="json"),
    }
    configured = cfg.tokenizer.completion_format
    checked = configured if configured != "auto" else fmt.name if fmt.name in PRESETS else None
    if checked is not None and getattr(tokenizer, "chat_template", None) is not None:
        provenance["completion_format_check"] = check_format(checked, tokenizer, kwargs).describe()
    write_part(out, table, provenance, stats, build)
    return {**stats, "reused": False}
