"""tokens + responses parts -> `validation` part: is each sample's token sequence the one the model produced?

Per sample, three independent checks:
- reference: when the endpoint returned the generated ids (`output_ids`, SGLang), compare them with ours:
  "exact"; "bpe_artifact" (ids differ, decoded text identical: the model sampled a non-canonical split that
  re-encoding cannot recover); "real_difference" (the text differs: index of the first differing id + a
  window of token strings each side); "no_reference". A reference lacking the trailing end-of-turn id still
  counts as exact.
- structure: what the text says about the reasoning/content split, markers, finish reason and tool-call text.
  A conversation regenerated turn by turn also has the target's earlier answers in its sequence, with loss:
  their markers and special-token strings are checked too (`history_<code>:turn N` issues).
- billing: billed completion tokens vs our completion length, and billed reasoning tokens vs ours (the
  reasoning section's tokens other than the format's control tokens); delta tokens and fraction of ours.
  A row beyond `validation.billing_tolerance_frac` on either is flagged.
Reference and billing are about the final request: its completion is the tokens row from `prompt_len` on,
whether the context before it is a prompt or a whole regenerated conversation.

Per dataset (`summarize_validation`): rates, billing aggregates and a breakdown by serving provider and
quantization; a dataset served by more than one of them is flagged (`mixed_serving`): providers differ in
quantization and serving stacks, and a drafter trained on a mix learns a target that no single deployment is.
Gates (`gate_violations`) turn the summary into a pass/fail decision, after the report is written.

Also per sample (`tasks.validate.fidelity`): prompt-token reconciliation (usage.prompt_tokens vs the rebuilt
prompt: exact / within_tolerance / drift / no_usage), the open tag across the prompt/completion boundary
(doubled or missing), tool-call markup of every supported family, and whether the answer has boundary
whitespace (per provider, against reference ids where there are some, it tells a stack that strips).

Verdict policy (a "fail" or "drop" sample is excluded from extraction when `extract.skip_failed_validation`,
the default; a "drop" is not counted as a failure):
- fail: a real_difference of a row that stores the re-encoding (one that stores the model's ids is checked
  against the endpoint's by `model_ids_mismatch`; its re-encoding's difference is reported, not failed), or an
  issue that corrupts the training sequence: the close/open tag or another think marker inside reasoning or
  content (the split between them is wrong; in a row of the model's ids, the format's own tag only where that
  section's ids hold its control id: else the model wrote its characters), a special-token id inside
  the reasoning or content beyond the format's own (`<|im_end|>` in the content, a doubled `<think>` across
  the prompt boundary, ...), in the final answer or an earlier regenerated one (`history_*`), a finish_reason
  outside `validation.allowed_finish_reasons` (the sequence is not a complete turn), ids that do not decode
  back to the completion text (`roundtrip_mismatch`), re-encoded text holding U+FFFD (`replacement_character`:
  the model emitted the bytes of a broken character there, which no re-encoding gives back); empty reasoning in
  a thinking format (hidden reasoning, `validation.empty_reasoning`), tool-call markup under
  `validation.tool_call_policy: fail`.
- drop: tool-call markup under `tool_call_policy: drop` (excluded, not counted as a failure); an answer cut
  inside a character of which nothing is left once its last word goes (`nothing_kept_after_cut`: a CJK or emoji
  answer without a space; its row has no completion token to train on).
- warn: a bpe_artifact, empty content, an answer cut inside a character (stored up to its last whole word),
  malformed tool-call text, tool-call markup under `keep`, empty reasoning under `empty_reasoning: warn`,
  prompt-token drift, or a billing delta beyond `validation.billing_tolerance_frac`.
- pass: everything else.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.common.config import PipelineConfig, ValidationConfig
from tasks.common.errors import ConfigError, ReconstructionError, ValidationGateError
from tasks.common.schemas import VALIDATION
from tasks.common.shards import PartRef, done_parts, expected_build, is_current, read_marker, read_part, write_part
from tasks.common.state_inputs import EXCLUDED_STAT, excluded_ids_digest, left_out
from tasks.reconstruct.completion_format import (
    CUT_CHARACTER,
    KNOWN_REASONING_TAGS,
    CompletionFormat,
    CompletionLayout,
    completion_layout,
    control_sequence,
    normalized_parts,
    without_cut_character,
)
from tasks.reconstruct.stage import TOKEN_SOURCES, tokens_cut_off
from tasks.reconstruct.tokenizer_backend import TokenBackend, backend_for, describe_backend, first_difference
from tasks.reconstruct.tokenizer_loading import load_tokenizer, tokenizer_hash, tokenizer_provenance
from tasks.validate.failure_gates import FailedResponses, failed_gate_violations
from tasks.validate.fidelity import (
    PROMPT_MATCHES,
    TOOL_CALL_MARKERS,
    WhitespaceTally,
    boundary_issues,
    has_boundary_whitespace,
    last_control,
    prompt_match,
    tool_call_markup,
    whitespace_findings,
    whitespace_only,
)

TEXT_FAIL_ISSUES = frozenset(
    {
        "close_tag_in_content",
        "close_tag_in_reasoning",
        "open_tag_in_content",
        "open_tag_in_reasoning",
        "think_marker_in_content",
        "think_marker_in_reasoning",
        "special_token_in_content",
        "special_token_in_reasoning",
    }
)
FAIL_ISSUES = (
    TEXT_FAIL_ISSUES
    | {"finish_reason", "roundtrip_mismatch", "doubled_open_tag", "open_tag_missing", "model_ids_mismatch"}
    | {"replacement_character"}
    | {f"history_{c}" for c in TEXT_FAIL_ISSUES}
)
WARN_ISSUES = frozenset(
    {"empty_content", "tool_call_unclosed", "tool_call_invalid_json", "prompt_drift", "cut_inside_character"}
)
THINK_MARKERS = tuple(tag for pair in KNOWN_REASONING_TAGS for tag in pair)
# Single control tokens of tool-call markup (every family): handled by `validation.tool_call_policy`, not as stray
# special tokens.
TOOL_CALL_TOKENS = frozenset(
    {
        *(m for markers in TOOL_CALL_MARKERS.values() for m in markers if not m.startswith("to=")),
        "</tool_call>",
        "<|tool_calls_section_end|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    }
)
PROMPT_TAIL = 32
DIVERGENCE_WINDOW = 3
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_COLUMNS = [
    "sample_id",
    "status",
    "prompt_tokens",
    "reasoning",
    "content",
    "finish_reason",
    "completion_tokens",
    "reasoning_tokens",
    "provider",
    "quantization",
    "output_ids",
    "history",
]


def issue_code(issue: str) -> str:
    """Issues are `code` or `code:detail`; verdicts and summaries key on the code."""
    return issue.split(":", 1)[0]


def _marker_issues(fmt: CompletionFormat, text: str, where: str, controls: Collection[str]) -> list[str]:
    """The format's own tags by text, and any family's reasoning markers: with a reasoning format, a reasoning
    section the parse mixed up; without one, only markers that are control tokens of this tokenizer (a model
    whose answer shows `<think>`-tagged reasoning). For a model that has no such tokens, `<think>` is text it may
    write (SmolLM2 explaining what think tags are: every such answer was failed)."""
    issues = []
    if fmt.reasoning_close and fmt.reasoning_close in text:
        issues.append(f"close_tag_in_{where}")
    if fmt.reasoning_open and fmt.reasoning_open in text:
        issues.append(f"open_tag_in_{where}")
    for marker in THINK_MARKERS:
        if marker in (fmt.reasoning_open, fmt.reasoning_close) or marker not in text:
            continue
        if fmt.has_reasoning or marker in controls:
            issues.append(f"think_marker_in_{where}:{marker}")
    return issues


def tool_call_issues(content: str) -> list[str]:
    """Raw tool-call text (`<tool_call>{json}</tool_call>`) that a parser would choke on."""
    issues: list[str] = []
    at = content.find(TOOL_OPEN)
    while at >= 0:
        end = content.find(TOOL_CLOSE, at)
        if end < 0:
            issues.append("tool_call_unclosed")
            break
        body = content[at + len(TOOL_OPEN) : end].strip()
        try:
            json.loads(body)
        except ValueError:
            issues.append("tool_call_invalid_json")
        at = content.find(TOOL_OPEN, end)
    return sorted(set(issues))


def hidden_reasoning(fmt: CompletionFormat, reasoning: str, billed_reasoning_tokens: int | None) -> bool:
    """A reasoning format's answer came back without the reasoning the model wrote. Where the layout writes an
    empty think block for it, that block is made up, so any answer without reasoning counts; where the template
    writes such an answer as content alone (`omit_empty_reasoning`, e.g. a thinking-off run), it is a real answer,
    and only reasoning tokens the provider billed say the model wrote reasoning that is missing; so where it writes
    the close tag, or its tail, alone for it (`empty_reasoning_close_only`: MiniMax-M3 in adaptive mode, gpt-oss
    opening its final channel at once)."""
    if not fmt.has_reasoning or reasoning.strip():
        return False
    return not (fmt.omits_block(reasoning) or fmt.closes_only(reasoning)) or bool(billed_reasoning_tokens)


def text_issues(
    fmt: CompletionFormat,
    reasoning: str | None,
    content: str | None,
    finish_reason: str | None,
    allowed: Sequence[str],
    controls: Collection[str],
    billed_reasoning_tokens: int | None = None,
) -> list[str]:
    reasoning, content = normalized_parts(fmt, reasoning, content)
    issues = []
    if hidden_reasoning(fmt, reasoning, billed_reasoning_tokens):
        issues.append("empty_reasoning")
    if not content.strip():
        issues.append("empty_content")
    issues += _marker_issues(fmt, reasoning, "reasoning", controls)
    issues += _marker_issues(fmt, content, "content", controls)
    if finish_reason not in allowed:
        issues.append(f"finish_reason:{finish_reason}")
    issues += tool_call_issues(content)
    return issues


def _trie_pattern(strings: set[str]) -> str:
    """A regex matching any of `strings`, longest first, that branches one character at a time: an alternation
    of a thousand added tokens would try every one at each `<` of code or HTML text."""
    trie: dict[str, Any] = {}
    for text in strings:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


@dataclass(frozen=True)
class ControlIds:
    """The tokenizer's added-token ids, and the ones a completion of this format legitimately contains.

    `open_ids`/`close_ids`: ids of the control tokens inside the open and close literals, each as often as the
    literal holds it (one each for `<think>`/`</think>`, several for gpt-oss's channel switches, `<|sep|>` twice in
    Kimi-K3's close). `content_end_ids`: those of closing tags between the content and the end of turn (Kimi-K3,
    Cohere's `<|END_TEXT|>`). `separator_ids`: those of a separator the model writes before the content (Cohere
    with reasoning off opens `<|START_TEXT|>` after the closed block in its prompt).
    """

    added: dict[int, str]
    added_array: np.ndarray
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    end_of_turn_id: int
    format_ids: np.ndarray
    added_pattern: re.Pattern[str]
    content_end_ids: tuple[int, ...] = ()
    separator_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, backend: TokenBackend, fmt: CompletionFormat) -> ControlIds:
        controls = set(backend.added.values())

        def ids_of(literal: str | None) -> tuple[int, ...]:
            found = [backend.token_to_id(c) for c in control_sequence(literal or "", controls)]
            return tuple(i for i in found if i is not None)

        eot = backend.token_to_id(fmt.end_of_turn)
        if eot is None:
            raise ConfigError(f"end-of-turn {fmt.end_of_turn!r} is not in the tokenizer's vocabulary")
        open_ids, close_ids = ids_of(fmt.reasoning_open), ids_of(fmt.reasoning_close)
        end_ids, separator_ids = ids_of(fmt.content_end), ids_of(fmt.content_separator)
        format_ids = np.asarray(sorted({*open_ids, *close_ids, *end_ids, *separator_ids, eot}), dtype=np.int64)
        added = backend.added
        pattern = re.compile(_trie_pattern({s for s in added.values() if s}) or "(?!)")
        ids_array = np.fromiter(added, np.int64, count=len(added))
        return cls(added, ids_array, open_ids, close_ids, eot, format_ids, pattern, end_ids, separator_ids)


def _text_checked_tokens(fmt: CompletionFormat) -> set[str]:
    """Control strings whose misplacement another check names (think markers and the format's own open/close
    tags by text, tool-call markup by policy); every other control id in reasoning or content, the format's
    end of turn included, is a `special_token_in_*` issue."""
    return {*THINK_MARKERS, *TOOL_CALL_TOKENS, *(t for t in (fmt.reasoning_open, fmt.reasoning_close) if t)}


def _section_controls(
    fmt: CompletionFormat, completion: np.ndarray, reasoning_len: int, layout: CompletionLayout, ids: ControlIds
) -> dict[str, Counter[int]]:
    """Per section, the control ids in it beyond the format's own literals (the layout's open and close tags are
    in the reasoning section)."""
    eot_len = 1 if layout.ends_turn else 0
    sections = {
        "reasoning": completion[:reasoning_len],
        "content": completion[reasoning_len : len(completion) - eot_len],
    }
    expected: Counter[int] = Counter()
    if not fmt.open_in_prompt:
        expected.update(ids.open_ids)
    if layout.content_start < len(layout.text):
        expected.update(ids.close_ids)
    if fmt.content_separator and layout.text[: layout.content_start].endswith(fmt.content_separator):
        expected.update(ids.separator_ids)
    found = {
        where: Counter(int(t) for t in section[np.isin(section, ids.added_array)])
        for where, section in sections.items()
    }
    found["reasoning"] -= expected
    if layout.ends_turn:
        found["content"] -= Counter(ids.content_end_ids)
    return found


def special_token_issues(
    fmt: CompletionFormat,
    completion: np.ndarray,
    reasoning_len: int,
    layout: CompletionLayout,
    ids: ControlIds,
) -> list[str]:
    """Control ids inside reasoning or content beyond the format's own literals (caught by id, so every
    special string of the tokenizer is covered at the cost of one vectorised membership test)."""
    tags = _text_checked_tokens(fmt)
    issues = []
    for where, found in _section_controls(fmt, completion, reasoning_len, layout, ids).items():
        issues += [f"special_token_in_{where}:{ids.added[t]}" for t in sorted(found) if ids.added[t] not in tags]
    return issues


def written_tag_issues(
    fmt: CompletionFormat, completion: np.ndarray, reasoning_len: int, layout: CompletionLayout, ids: ControlIds
) -> set[str]:
    """The format-tag issues found by text (`open_tag_in_*`, `close_tag_in_*`) that a row of the model's own ids
    shows to be characters the model wrote: that section's ids hold none of the tag's control ids beyond the
    layout's own. A thinking model explaining `</think>` writes it as ordinary tokens; the reasoning ends at the
    close id, and failing the row for the text threw a correct row away. A tag that is no control token has only
    its text to go by, and stays an issue."""
    written = set()
    for where, found in _section_controls(fmt, completion, reasoning_len, layout, ids).items():
        for name, tag_ids in (("open", ids.open_ids), ("close", ids.close_ids)):
            if tag_ids and not any(found[t] for t in tag_ids):
                written.add(f"{name}_tag_in_{where}")
    return written


def history_issues(fmt: CompletionFormat, history: Sequence[dict[str, Any]] | None, ids: ControlIds) -> list[str]:
    """Marker and special-token issues in the target's earlier answers of a turn-by-turn conversation.

    Those answers carry loss like the final one, so the same text corrupts the sequence there; found by text
    (the tokens row has no per-turn spans), each named `history_<code>:turn N` plus the code's own detail.
    """
    tags = _text_checked_tokens(fmt)
    issues = []
    for turn, message in enumerate(history or ()):
        if not message["generated"]:
            continue
        reasoning, content = normalized_parts(fmt, message["reasoning"], message["content"])
        for where, text in (("reasoning", reasoning), ("content", content)):
            found = _marker_issues(fmt, text, where, ids.added.values())
            specials = dict.fromkeys(ids.added_pattern.findall(text))
            found += [f"special_token_in_{where}:{token}" for token in specials if token not in tags]
            for issue in found:
                code, _, detail = issue.partition(":")
                issues.append(f"history_{code}:turn {turn}" + (f" {detail}" if detail else ""))
    return issues


@dataclass(frozen=True)
class ReferenceMatch:
    match: str
    first_divergence: int | None = None
    ours: str | None = None
    reference: str | None = None


def _window(backend: TokenBackend, ids: Sequence[int], at: int) -> str:
    piece = ids[max(0, at - DIVERGENCE_WINDOW) : at + DIVERGENCE_WINDOW + 1]
    return json.dumps([backend.piece(int(t)) for t in piece], ensure_ascii=False)


def compare_reference(
    backend: TokenBackend, ours: list[int], reference: list[int] | None, end_of_turn_id: int, ends_turn: bool
) -> ReferenceMatch:
    """exact / bpe_artifact / real_difference, with the first divergence and the tokens on each side of it.

    `ends_turn`: the layout added the end-of-turn id, which a reference may lack; only then is our last id
    dropped for the comparison. An answer cut by `max_tokens` has none, and an end-of-turn id last in its ids is
    the re-encoding of characters the model wrote (`<|im_end|>` as ordinary tokens): dropping it made the
    re-encoding miss that text and a model-exact row fail."""
    if reference is None:
        return ReferenceMatch("no_reference")
    if ends_turn and ours and ours[-1] == end_of_turn_id and (not reference or reference[-1] != end_of_turn_id):
        ours = ours[:-1]
    if ours == reference:
        return ReferenceMatch("exact")
    at = first_difference(ours, reference)
    same_text = backend.decode(ours) == backend.decode(reference)
    return ReferenceMatch(
        "bpe_artifact" if same_text else "real_difference",
        at,
        _window(backend, ours, at),
        _window(backend, reference, at),
    )


def billing_delta(billed: int | None, ours: int, tolerance: float) -> tuple[int | None, float | None, bool]:
    """(billed - ours, that as a fraction of ours, beyond tolerance?)."""
    if billed is None:
        return None, None, False
    delta = billed - ours
    frac = delta / max(ours, 1)
    return delta, frac, abs(frac) > tolerance


def verdict(
    match: str,
    issues: Sequence[str],
    billing_flagged: bool,
    vcfg: ValidationConfig | None = None,
    stored_exact: bool = False,
) -> str:
    """`stored_exact`: the row stores the model's own ids, so a difference of the re-encoding (`match`), BPE artifact
    or real, is only what re-encoding would have got wrong, not a flaw of the row: those ids equal the endpoint's
    (else `model_ids_mismatch` fails it) and decode to the answer's text."""
    vcfg = vcfg or ValidationConfig()
    codes = {issue_code(i) for i in issues}
    hidden = "empty_reasoning" in codes and vcfg.empty_reasoning == "fail"
    tools = "tool_call_markup" in codes
    real = match == "real_difference" and not stored_exact
    if real or codes & FAIL_ISSUES or hidden or (tools and vcfg.tool_call_policy == "fail"):
        return "fail"
    if (tools and vcfg.tool_call_policy == "drop") or "nothing_kept_after_cut" in codes:
        return "drop"
    artifact = match == "bpe_artifact" and not stored_exact
    if artifact or codes & WARN_ISSUES or billing_flagged or tools or "empty_reasoning" in codes:
        return "warn"
    return "pass"


def exclusion_reasons(
    issues: Sequence[str], match: str, vcfg: ValidationConfig, stored_exact: bool = False
) -> list[str]:
    """The codes that made a fail/drop verdict (what the report counts as why a sample was excluded)."""
    codes = dict.fromkeys(issue_code(i) for i in issues)
    out = ["real_difference"] if match == "real_difference" and not stored_exact else []
    for code in codes:
        if (
            code in FAIL_ISSUES
            or (code == "empty_reasoning" and vcfg.empty_reasoning == "fail")
            or (code == "tool_call_markup" and vcfg.tool_call_policy != "keep")
            or code == "nothing_kept_after_cut"
        ):
            out.append(code)
    return out


def validate_tables(
    tokens: pa.Table,
    responses: pa.Table,
    fmt: CompletionFormat,
    backend: TokenBackend,
    vcfg: ValidationConfig,
    allowed_finish_reasons: Sequence[str] | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """One validation row per tokens row, in the same order.

    The reference comparison is always the re-encoded text against the endpoint's ids: for a row that stores the
    model's ids (`token_source` "model") or repaired ids the text is re-encoded here, so the report still says how
    often re-encoding alone would have been wrong; stored model ids must equal the reference."""
    allowed = list(vcfg.allowed_finish_reasons if allowed_finish_reasons is None else allowed_finish_reasons)
    formats = set(tokens.column("completion_format").to_pylist())
    if formats - {fmt.name}:
        raise ConfigError(f"tokens built with completion format(s) {sorted(formats)}, validating with {fmt.name!r}")
    control = ControlIds.build(backend, fmt)
    resp = {name: responses.column(name).to_pylist() for name in RESPONSE_COLUMNS if name != "output_ids"}
    by_id = {sid: i for i, (sid, st) in enumerate(zip(resp["sample_id"], resp["status"], strict=True)) if st == "done"}
    output_ids = responses.column("output_ids")
    has_output = output_ids.is_valid().to_pylist()
    input_ids = tokens.column("input_ids").combine_chunks()
    flat = input_ids.values.to_numpy()
    offsets = input_ids.offsets.to_numpy()
    sample_ids = tokens.column("sample_id").to_pylist()
    datasets = tokens.column("dataset").to_pylist()
    prompt_lens = tokens.column("prompt_len").to_pylist()
    reasoning_lens = tokens.column("reasoning_len").to_pylist()
    completions = [flat[offsets[i] + prompt_lens[i] : offsets[i + 1]] for i in range(tokens.num_rows)]
    prompt_tails = [
        flat[max(offsets[i], offsets[i] + prompt_lens[i] - PROMPT_TAIL) : offsets[i] + prompt_lens[i]]
        for i in range(tokens.num_rows)
    ]
    decoded = backend.decode_batch([c.tolist() for c in completions])
    tol = vcfg.billing_tolerance_frac
    sources = tokens.column("token_source").to_pylist()
    layouts = []
    wholes = []
    for sid, source in zip(sample_ids, sources, strict=True):
        r = by_id.get(sid)
        if r is None:
            raise ReconstructionError(sid, "tokens row has no done response in the responses part")
        truncated = resp["finish_reason"][r] == "length"
        layout = completion_layout(fmt, resp["reasoning"][r], resp["content"][r], truncated=truncated)
        stored = layout if source == "model" else without_cut_character(fmt, layout)
        wholes.append(layout)
        layouts.append(stored)
    not_reencoded = [i for i, src in enumerate(sources) if src in ("model", "repaired")]
    reencoded = dict(zip(not_reencoded, backend.encode_batch([layouts[i].text for i in not_reencoded]), strict=True))
    cut_off = tokens_cut_off(backend, wholes, layouts)

    rows: list[dict[str, Any]] = []
    for i, sid in enumerate(sample_ids):
        r = by_id[sid]
        reasoning, content, finish = resp["reasoning"][r], resp["content"][r], resp["finish_reason"][r]
        layout = layouts[i]
        billed_reasoning = resp["reasoning_tokens"][r]
        issues = text_issues(fmt, reasoning, content, finish, allowed, control.added.values(), billed_reasoning)
        if sources[i] == "model":
            written = written_tag_issues(fmt, completions[i], reasoning_lens[i], layout, control)
            issues = [issue for issue in issues if issue not in written]
        issues += special_token_issues(fmt, completions[i], reasoning_lens[i], layout, control)
        if fmt.has_reasoning:
            issues += boundary_issues(
                fmt.open_in_prompt,
                control.open_ids,
                control.close_ids,
                last_control(prompt_tails[i], control.added_array),
                completions[i][: reasoning_lens[i]],
            )
        norm_reasoning, norm_content = normalized_parts(fmt, reasoning, content)
        issues += tool_call_markup(norm_reasoning, norm_content)
        issues += history_issues(fmt, resp["history"][r], control)
        if decoded[i] != layout.text:
            issues.append("roundtrip_mismatch")
        if sources[i] != "model" and CUT_CHARACTER in layout.text:
            issues.append("replacement_character")
        if wholes[i] is not layout:
            issues.append(f"cut_inside_character:{len(layout.text)} of {len(wholes[i].text)} characters kept")
            if not layout.text:
                issues.append("nothing_kept_after_cut")
        reference = output_ids[r].as_py() if has_output[r] else None
        stored = completions[i].tolist()
        eot_id, ends_turn = control.end_of_turn_id, layout.ends_turn
        ref = compare_reference(backend, reencoded.get(i, stored), reference, eot_id, ends_turn)
        stored_exact = sources[i] == "model"
        if stored_exact and compare_reference(backend, stored, reference, eot_id, ends_turn).match != "exact":
            issues.append("model_ids_mismatch")
        if ref.match == "real_difference" and reference is not None:
            eot = fmt.end_of_turn
            ours_text, ref_text = decoded[i].removesuffix(eot), backend.decode(reference).removesuffix(eot)
            if whitespace_only(ours_text, ref_text):
                issues.append("whitespace_stripped")
        p_match, p_delta = prompt_match(resp["prompt_tokens"][r], prompt_lens[i], vcfg.prompt_tolerance_tokens)
        if p_match == "drift":
            issues.append(f"prompt_drift:{p_delta:+d} tokens")
        ours_len = len(completions[i])
        section = completions[i][: reasoning_lens[i]]
        own_reasoning = int(len(section) - np.isin(section, control.format_ids).sum())
        # a tail of the close before an answer without reasoning is the format's text (gpt-oss's `final`)
        ours_reasoning = 0 if fmt.closes_only(norm_reasoning) else own_reasoning
        cut_tokens = cut_off.get(i, 0)
        cut_reasoning = cut_tokens if wholes[i].content_start >= len(wholes[i].text) else 0
        delta, frac, flagged = billing_delta(resp["completion_tokens"][r], ours_len + cut_tokens, tol)
        r_delta, _, r_flagged = billing_delta(billed_reasoning, ours_reasoning + cut_reasoning, tol)
        rows.append(
            {
                "sample_id": sid,
                "dataset": datasets[i],
                "verdict": verdict(ref.match, issues, flagged or r_flagged, vcfg, stored_exact),
                "reference_match": ref.match,
                "first_divergence": ref.first_divergence,
                "divergence_ours": ref.ours,
                "divergence_reference": ref.reference,
                "structural_issues": issues,
                "finish_reason": finish,
                "provider": resp["provider"][r],
                "billed_completion_tokens": resp["completion_tokens"][r],
                "our_completion_tokens": ours_len,
                "billing_delta_tokens": delta,
                "billing_delta_frac": frac,
                "billed_reasoning_tokens": resp["reasoning_tokens"][r],
                "our_reasoning_tokens": ours_reasoning,
                "reasoning_delta_tokens": r_delta,
                "billing_flagged": flagged or r_flagged,
                "quantization": resp["quantization"][r],
                "billed_prompt_tokens": resp["prompt_tokens"][r],
                "our_prompt_tokens": prompt_lens[i],
                "prompt_delta_tokens": p_delta,
                "prompt_match": p_match,
                "boundary_whitespace": has_boundary_whitespace(norm_reasoning, norm_content),
                "token_source": sources[i],
            }
        )
    verdicts = Counter(row["verdict"] for row in rows)
    matches = Counter(row["reference_match"] for row in rows)
    stats: dict[str, Any] = {
        "rows": len(rows),
        **{v: verdicts.get(v, 0) for v in ("pass", "warn", "fail", "drop")},
        **{m: matches.get(m, 0) for m in ("exact", "bpe_artifact", "real_difference", "no_reference")},
        "billing_flagged": sum(row["billing_flagged"] for row in rows),
        "prompt_drift": sum(row["prompt_match"] == "drift" for row in rows),
        **{f"{src}_rows": sources.count(src) for src in TOKEN_SOURCES},
    }
    return pa.Table.from_pylist(rows, schema=VALIDATION), stats


VALIDATE_CODE_VERSION = 7
"""Bump when a code change alters the validation rows computed from the same inputs."""


def validation_recipe(cfg: PipelineConfig, fmt: CompletionFormat) -> dict[str, Any]:
    """What shapes a validation part besides its tokens and responses parts; gate limits are not in it (the
    gates read the parts, they do not change them)."""
    vcfg = cfg.validation
    return {
        "stage": "validation",
        "code_version": VALIDATE_CODE_VERSION,
        "tokenizer_hash": tokenizer_hash(cfg.tokenizer.path),
        "completion_format": fmt.describe(),
        "billing_tolerance_frac": vcfg.billing_tolerance_frac,
        "allowed_finish_reasons": cfg.allowed_finish_reasons,
    }


def validate_part(cfg: PipelineConfig, part: int, fmt: CompletionFormat) -> dict[str, Any]:
    """Write `validation/part-NNNNN` for the tokens part with the same index (idempotent; rebuilt when its tokens
    or responses part changed or its recipe did)."""
    out = PartRef(cfg.run_dir, "validation", part)
    build = expected_build(out, validation_recipe(cfg, fmt))
    if is_current(out, build):
        return {**read_marker(out)["stats"], "reused": True}
    tokenizer = load_tokenizer(cfg.tokenizer)
    tokens = read_part(out.with_stage("tokens"))
    responses = read_part(out.with_stage("responses"), columns=RESPONSE_COLUMNS)
    table, stats = validate_tables(
        tokens, responses, fmt, backend_for(tokenizer), cfg.validation, cfg.allowed_finish_reasons
    )
    provenance = {
        **cfg.provenance(),
        **tokenizer_provenance(cfg.tokenizer),
        **describe_backend(tokenizer),
        "completion_format": fmt.name,
        "validation": cfg.validation.model_dump(mode="json"),
    }
    excluded = left_out(table.column("sample_id").to_pylist(), table.column("verdict").to_pylist())
    stats[EXCLUDED_STAT] = excluded_ids_digest(excluded)
    write_part(out, table, provenance, stats, build)
    return {**stats, "reused": False}


def _rate(n: int, d: int) -> float:
    return n / d if d else 0.0


def serving_key(provider: str | None, quantization: str | None) -> str:
    """`provider` or `provider/quantization`; an endpoint that names neither (a local server) is `unreported`."""
    name = provider or "unreported"
    return f"{name}/{quantization}" if quantization else name


@dataclass
class _Tally:
    """Running counts for one dataset, or for one serving provider within it."""

    responses: int = 0
    failed_responses: int = 0
    samples: int = 0
    verdicts: Counter[str] | None = None
    matches: Counter[str] | None = None
    issues: Counter[str] | None = None
    billed: int = 0
    ours_billed: int = 0
    billed_reasoning: int = 0
    ours_reasoning: int = 0
    flagged: int = 0
    completion_tokens: int = 0
    prompt: Counter[str] | None = None
    prompt_delta: int = 0
    excluded: Counter[str] | None = None
    whitespace: WhitespaceTally | None = None
    sources: Counter[str] | None = None
    stored_matches: Counter[str] | None = None
    """`matches` of the rows whose stored ids are not the model's own (re-encoded or repaired): what the
    re-encoding gates judge, as only there a difference of the re-encoding is a flaw of the stored data."""

    def __post_init__(self) -> None:
        self.verdicts, self.matches, self.issues, self.sources = Counter(), Counter(), Counter(), Counter()
        self.stored_matches = Counter()
        self.prompt, self.excluded, self.whitespace = Counter(), Counter(), WhitespaceTally()

    def add_row(self, row: dict[str, Any], vcfg: ValidationConfig) -> None:
        assert self.verdicts is not None and self.matches is not None and self.issues is not None
        assert self.prompt is not None and self.excluded is not None and self.whitespace is not None
        self.prompt[row["prompt_match"] or "no_usage"] += 1
        self.prompt_delta += row["prompt_delta_tokens"] or 0
        if row["verdict"] in ("fail", "drop"):
            model = row["token_source"] == "model"
            self.excluded.update(exclusion_reasons(row["structural_issues"], row["reference_match"], vcfg, model))
        self.whitespace.add(row)
        assert self.sources is not None
        self.sources[row["token_source"]] += 1
        self.samples += 1
        self.verdicts[row["verdict"]] += 1
        self.matches[row["reference_match"]] += 1
        if row["token_source"] != "model":
            assert self.stored_matches is not None
            self.stored_matches[row["reference_match"]] += 1
        self.issues.update(issue_code(i) for i in row["structural_issues"])
        self.completion_tokens += row["our_completion_tokens"]
        if row["billed_completion_tokens"] is not None:
            self.billed += row["billed_completion_tokens"]
            self.ours_billed += row["billed_completion_tokens"] - row["billing_delta_tokens"]
        if row["billed_reasoning_tokens"] is not None:
            self.billed_reasoning += row["billed_reasoning_tokens"]
            self.ours_reasoning += row["billed_reasoning_tokens"] - row["reasoning_delta_tokens"]
        self.flagged += bool(row["billing_flagged"])

    def rates(self) -> dict[str, Any]:
        assert self.verdicts is not None and self.matches is not None and self.issues is not None
        matches = self.matches
        referenced = self.samples - matches["no_reference"]
        return {
            "responses": self.responses,
            "failed_responses": self.failed_responses,
            "failed_rate": _rate(self.failed_responses, self.responses),
            "samples": self.samples,
            **{v: self.verdicts[v] for v in ("pass", "warn", "fail", "drop")},
            "fail_rate": _rate(self.verdicts["fail"], self.samples),
            "excluded": self.verdicts["fail"] + self.verdicts["drop"],
            "referenced": referenced,
            **{m: matches[m] for m in ("exact", "bpe_artifact", "real_difference", "no_reference")},
            "exact_rate": _rate(matches["exact"], referenced),
            "bpe_artifact_rate": _rate(matches["bpe_artifact"], referenced),
            "real_difference_rate": _rate(matches["real_difference"], referenced),
            "gated": self.gated_matches(),
            "no_reference_rate": _rate(matches["no_reference"], self.samples),
            "mean_completion_tokens": _rate(self.completion_tokens, self.samples),
        }

    def gated_matches(self) -> dict[str, Any]:
        """The re-encoding gates' view: the rows that store re-encoded or repaired ids. A row of the model's own
        ids whose re-encoding differs (text the model wrote that spells a control token) passed, yet crossed a
        `max_real_difference_rate` of 0 and stopped the run."""
        stored = self.stored_matches or Counter()
        referenced = sum(stored.values()) - stored["no_reference"]
        return {
            "referenced": referenced,
            "real_difference": stored["real_difference"],
            "bpe_artifact": stored["bpe_artifact"],
            "real_difference_rate": _rate(stored["real_difference"], referenced),
            "bpe_artifact_rate": _rate(stored["bpe_artifact"], referenced),
        }

    def prompt_reconciliation(self) -> dict[str, Any]:
        """usage.prompt_tokens vs the rebuilt prompt: counts per class, drift rate over rows with usage."""
        assert self.prompt is not None
        with_usage = self.samples - self.prompt["no_usage"]
        return {
            **{m: self.prompt[m] for m in PROMPT_MATCHES},
            "with_usage": with_usage,
            "drift_rate": _rate(self.prompt["drift"], with_usage),
            "mean_delta_tokens": _rate(self.prompt_delta, with_usage),
        }

    def exclusions(self) -> dict[str, int]:
        """Why fail/drop samples are left out of extraction: reason code -> samples (one sample may have several)."""
        assert self.excluded is not None
        return dict(sorted(self.excluded.items()))

    def billing(self) -> dict[str, Any]:
        return {
            "billed_completion_tokens": self.billed,
            "our_completion_tokens": self.ours_billed,
            "delta_tokens": self.billed - self.ours_billed,
            "delta_frac": _rate(self.billed - self.ours_billed, self.ours_billed),
            "billed_reasoning_tokens": self.billed_reasoning,
            "our_reasoning_tokens": self.ours_reasoning,
            "reasoning_delta_tokens": self.billed_reasoning - self.ours_reasoning,
            "reasoning_delta_frac": _rate(self.billed_reasoning - self.ours_reasoning, self.ours_reasoning),
            "flagged_samples": self.flagged,
            "flagged_rate": _rate(self.flagged, self.samples),
            "has_billing": self.ours_billed > 0,
        }


VALIDATION_SUMMARY_COLUMNS = [
    "dataset",
    "verdict",
    "reference_match",
    "structural_issues",
    "our_completion_tokens",
    "billed_completion_tokens",
    "billing_delta_tokens",
    "billed_reasoning_tokens",
    "our_reasoning_tokens",
    "reasoning_delta_tokens",
    "billing_flagged",
    "provider",
    "quantization",
    "prompt_match",
    "prompt_delta_tokens",
    "boundary_whitespace",
    "token_source",
]


def summarize_validation(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Per dataset: verdicts, reference matches, structural issues, billing, and the same per serving provider.

    Reference rates (exact/bpe_artifact/real_difference) are over samples that had a reference;
    `no_reference_rate` and `fail_rate` over validated samples; `failed_rate` (failures the next run retries) and
    `deterministic_failed_rate` over all responses (a failed generation never reaches validation, but it counts
    against the run; `tasks.validate.failure_gates`).
    """
    per: dict[str, _Tally] = {}
    serving: dict[str, dict[str, _Tally]] = {}
    done_serving: dict[str, set[str]] = {}
    failed: dict[str, FailedResponses] = {}

    columns = ["sample_id", "dataset", "status", "failure_reason", "provider", "quantization"]
    for ref in done_parts(cfg.run_dir, "responses"):
        t = read_part(ref, columns=columns)
        for sid, dataset, status, reason, provider, quant in zip(
            *(t.column(c).to_pylist() for c in columns), strict=True
        ):
            failed.setdefault(dataset, FailedResponses()).add(sid, status, reason)
            key = serving_key(provider, quant)
            for tally in (per.setdefault(dataset, _Tally()), serving.setdefault(dataset, {}).setdefault(key, _Tally())):
                tally.responses += 1
                tally.failed_responses += status == "failed"
            if status == "done":
                done_serving.setdefault(dataset, set()).add(key)
    for ref in done_parts(cfg.run_dir, "validation"):
        for row in read_part(ref, columns=VALIDATION_SUMMARY_COLUMNS).to_pylist():
            key = serving_key(row["provider"], row["quantization"])
            per.setdefault(row["dataset"], _Tally()).add_row(row, cfg.validation)
            serving.setdefault(row["dataset"], {}).setdefault(key, _Tally()).add_row(row, cfg.validation)
    summary = []
    for dataset in sorted(per):
        tally = per[dataset]
        assert tally.issues is not None
        by_server = serving.get(dataset, {})
        keys = sorted(done_serving.get(dataset, set()) or by_server)
        summary.append(
            {
                "dataset": dataset,
                **tally.rates(),
                **failed.get(dataset, FailedResponses()).to_dict(),
                "structural_issues": dict(sorted(tally.issues.items())),
                "billing": tally.billing(),
                "providers": {k: v.responses for k, v in sorted(by_server.items(), key=lambda kv: -kv[1].responses)},
                "mixed_serving": len(keys) > 1,
                "serving": [
                    {
                        "serving": k,
                        **by_server[k].rates(),
                        "billing_delta_frac": by_server[k].billing()["delta_frac"],
                        "prompt_tokens": by_server[k].prompt_reconciliation(),
                    }
                    for k in sorted(by_server)
                ],
                "prompt_tokens": tally.prompt_reconciliation(),
                "prompt_tolerance_tokens": cfg.validation.prompt_tolerance_tokens,
                "exclusion_reasons": tally.exclusions(),
                "token_sources": {src: (tally.sources or Counter())[src] for src in TOKEN_SOURCES},
                "whitespace": whitespace_findings(
                    {k: v.whitespace for k, v in by_server.items() if v.whitespace is not None},
                    cfg.validation.whitespace_min_samples,
                ),
            }
        )
    return summary


def gate_violations(
    summary: list[dict[str, Any]], vcfg: ValidationConfig, retry_failed: str = "transient"
) -> list[str]:
    """Every dataset and gate crossed (strictly above the maximum), as sentences naming the numbers; the
    failed-responses gates also name the samples and what the next run does about them."""
    crossed = []
    for s in summary:
        name = f"dataset {s['dataset']!r}"
        crossed += failed_gate_violations(s["dataset"], s, vcfg, retry_failed)
        gated = s.get("gated") or s  # a summary written before the gated view: every row is re-encoded
        stored = "referenced samples" if gated["referenced"] == s["referenced"] else "referenced re-encoded samples"
        rate_gates = (
            (gated, "real_difference_rate", "real_difference", "referenced", stored, "max_real_difference_rate"),
            (gated, "bpe_artifact_rate", "bpe_artifact", "referenced", stored, "max_bpe_artifact_rate"),
            (s, "fail_rate", "fail", "samples", "validated samples", "max_fail_verdict_rate"),
        )
        for of, rate, num, den, what, limit_name in rate_gates:
            limit = getattr(vcfg, limit_name)
            if of[rate] > limit:
                crossed.append(f"{name}: {rate} {of[rate]:.4f} ({of[num]}/{of[den]} {what}) > {limit_name} {limit}")
        billing = s["billing"]
        if billing["flagged_rate"] > vcfg.max_billing_flagged_rate:
            crossed.append(
                f"{name}: billing flagged_rate {billing['flagged_rate']:.4f} ({billing['flagged_samples']}/"
                f"{s['samples']} beyond ±{vcfg.billing_tolerance_frac}) > max_billing_flagged_rate "
                f"{vcfg.max_billing_flagged_rate}"
            )
        limit = vcfg.max_billing_delta_frac
        if limit is not None and billing["has_billing"] and abs(billing["delta_frac"]) > limit:
            crossed.append(
                f"{name}: billed completion tokens {billing['billed_completion_tokens']} vs ours "
                f"{billing['our_completion_tokens']} (delta {billing['delta_frac']:+.4%}) > max_billing_delta_frac "
                f"{limit}"
            )
        prompt = s.get("prompt_tokens")
        if prompt and prompt["drift_rate"] > vcfg.max_prompt_drift_rate:
            crossed.append(
                f"{name}: prompt-token drift_rate {prompt['drift_rate']:.4f} ({prompt['drift']}/{prompt['with_usage']} "
                f"rows whose usage.prompt_tokens differs from the rebuilt prompt by more than "
                f"{vcfg.prompt_tolerance_tokens} tokens; mean delta {prompt['mean_delta_tokens']:+.1f}) > "
                f"max_prompt_drift_rate {vcfg.max_prompt_drift_rate}"
            )
        if vcfg.fail_on_mixed_providers and s["mixed_serving"]:
            crossed.append(f"{name}: served by a mix of providers/quantizations {s['providers']}")
    return crossed


HEADLINE_CHARS = 240
"""The most a gate error's first line holds: the Prefect UI shows a state message's first line in the run's
sidebar and run list (and cuts even that), so it must be whole and short; the full sentences follow it."""

_GATE_NUMBERS = re.compile(r"^dataset (?P<dataset>'.*?'): (?P<measure>.*?) \(.*?\) > (?P<limit>max_\w+ [^;\s]+)")
"""A `gate_violations` sentence's dataset, measured value and limit, without the counts, examples and outlook
between and after them."""


def gate_brief(sentence: str) -> str:
    """One crossed gate in a few words (`'B3' real_difference_rate 0.5000 > max_real_difference_rate 0.01`): the
    gate and its numbers, for the error's first line; a sentence of another shape is cut at its first `;`."""
    found = _GATE_NUMBERS.match(sentence)
    if found is not None:
        return f"{found['dataset']} {found['measure']} > {found['limit']}"
    short = sentence.removeprefix("dataset ").split(";", 1)[0]
    return short if len(short) <= 80 else short[:77] + "..."


def gate_headline(crossed: Sequence[str], limit: int = HEADLINE_CHARS) -> str:
    """The first line of a gate error: how many gates, which, with their numbers; those that do not fit within
    `limit` characters are counted ("+2 more"), never cut mid-gate (the first is always shown)."""
    head = f"validation gates crossed ({len(crossed)}): "  # the CLI's "error: validation gates crossed" too
    briefs = [gate_brief(c) for c in crossed]

    def line(shown: int) -> str:
        more = f"; +{len(briefs) - shown} more" if shown < len(briefs) else ""
        return f"{head}{'; '.join(briefs[:shown])}{more} (details below)"

    shown = 1
    while shown < len(briefs) and len(line(shown + 1)) <= limit:
        shown += 1
    return line(shown)


def check_gates(summary: list[dict[str, Any]], vcfg: ValidationConfig, retry_failed: str = "transient") -> None:
    """Raise ValidationGateError naming every dataset and gate crossed: a one-line headline (`gate_headline`),
    then one line per gate with its counts, examples and what the next run does about it."""
    crossed = gate_violations(summary, vcfg, retry_failed)
    if crossed:
        raise ValidationGateError(gate_headline(crossed) + "\n  " + "\n  ".join(crossed))
