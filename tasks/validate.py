"""tokens + responses parts -> `validation` part: is each sample's token sequence the one the model produced?

Per sample, three independent checks:
- reference: when the endpoint returned the generated ids (`output_ids`, SGLang), compare them with ours:
  "exact"; "bpe_artifact" (ids differ, decoded text identical: the model sampled a non-canonical split that
  re-encoding cannot recover); "real_difference" (the text differs: index of the first differing id + a
  window of token strings each side); "no_reference". A reference lacking the trailing end-of-turn id still
  counts as exact.
- structure: what the text says about the reasoning/content split, markers, finish reason and tool-call text.
- billing: billed completion tokens vs our completion length (delta tokens and fraction of ours).

Verdict policy (a "fail" sample is excluded from extraction when `extract.skip_failed_validation`):
- fail: a real_difference, or an issue that corrupts the training sequence: the close/open tag or another
  think marker inside reasoning or content (the split between them is wrong), a special-token string inside
  the text (it encodes to a control id the model did not emit as text), a finish_reason outside
  `validation.allowed_finish_reasons` (the sequence is not a complete turn), or ids that do not decode back
  to the completion text (`roundtrip_mismatch`).
- warn: a bpe_artifact, empty reasoning (format has reasoning) or empty content, malformed tool-call text (it
  is still what the model wrote), or a billing delta beyond `validation.billing_tolerance_frac`.
- pass: everything else.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from tasks.completion_format import (
    KNOWN_REASONING_TAGS,
    CompletionFormat,
    CompletionLayout,
    completion_layout,
    normalized_parts,
)
from tasks.config import PipelineConfig, ValidationConfig
from tasks.errors import ConfigError, ReconstructionError, ValidationGateError
from tasks.schemas import VALIDATION
from tasks.shards import PartRef, done_parts, read_marker, read_part, write_part
from tasks.tokenizer_loading import added_tokens, backend_tokenizer, load_tokenizer, tokenizer_provenance

FAIL_ISSUES = frozenset(
    {
        "close_tag_in_content",
        "close_tag_in_reasoning",
        "open_tag_in_content",
        "open_tag_in_reasoning",
        "think_marker_in_content",
        "think_marker_in_reasoning",
        "special_token_in_content",
        "special_token_in_reasoning",
        "finish_reason",
        "roundtrip_mismatch",
    }
)
WARN_ISSUES = frozenset({"empty_reasoning", "empty_content", "tool_call_unclosed", "tool_call_invalid_json"})
THINK_MARKERS = tuple(tag for pair in KNOWN_REASONING_TAGS for tag in pair)
DIVERGENCE_WINDOW = 3
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_COLUMNS = [
    "sample_id",
    "status",
    "reasoning",
    "content",
    "finish_reason",
    "completion_tokens",
    "provider",
    "output_ids",
]


def issue_code(issue: str) -> str:
    """Issues are `code` or `code:detail`; verdicts and summaries key on the code."""
    return issue.split(":", 1)[0]


def _marker_issues(fmt: CompletionFormat, text: str, where: str) -> list[str]:
    issues = []
    if fmt.reasoning_close and fmt.reasoning_close in text:
        issues.append(f"close_tag_in_{where}")
    if fmt.reasoning_open and fmt.reasoning_open in text:
        issues.append(f"open_tag_in_{where}")
    for marker in THINK_MARKERS:
        if marker not in (fmt.reasoning_open, fmt.reasoning_close) and marker in text:
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


def text_issues(
    fmt: CompletionFormat,
    reasoning: str | None,
    content: str | None,
    finish_reason: str | None,
    allowed: Sequence[str],
) -> list[str]:
    reasoning, content = normalized_parts(fmt, reasoning, content)
    issues = []
    if fmt.has_reasoning and not reasoning.strip():
        issues.append("empty_reasoning")
    if not content.strip():
        issues.append("empty_content")
    issues += _marker_issues(fmt, reasoning, "reasoning")
    issues += _marker_issues(fmt, content, "content")
    if finish_reason not in allowed:
        issues.append(f"finish_reason:{finish_reason}")
    issues += tool_call_issues(content)
    return issues


@dataclass(frozen=True)
class ControlIds:
    """The tokenizer's added-token ids, and the ones a completion of this format legitimately contains."""

    added: dict[int, str]
    added_array: np.ndarray
    open_id: int | None
    close_id: int | None
    end_of_turn_id: int

    @classmethod
    def build(cls, backend: Tokenizer, added: dict[int, str], fmt: CompletionFormat) -> ControlIds:
        def one(s: str | None) -> int | None:
            return None if s is None else backend.token_to_id(s)

        eot = one(fmt.end_of_turn)
        if eot is None:
            raise ConfigError(f"end-of-turn {fmt.end_of_turn!r} is not in the tokenizer's vocabulary")
        return cls(added, np.fromiter(added, np.int64), one(fmt.reasoning_open), one(fmt.reasoning_close), eot)


def special_token_issues(
    fmt: CompletionFormat,
    completion: np.ndarray,
    reasoning_len: int,
    layout: CompletionLayout,
    ids: ControlIds,
) -> list[str]:
    """Control ids inside reasoning or content beyond the format's own tags (caught by id, so every special
    string of the tokenizer is covered at the cost of one vectorised membership test)."""
    eot_len = 1 if layout.end_of_turn_start < len(layout.text) else 0
    sections = {
        "reasoning": completion[:reasoning_len],
        "content": completion[reasoning_len : len(completion) - eot_len],
    }
    expected: Counter[int] = Counter()
    if ids.open_id is not None and not fmt.open_in_prompt:
        expected[ids.open_id] += 1
    if ids.close_id is not None and layout.content_start < len(layout.text):
        expected[ids.close_id] += 1
    tags = {fmt.reasoning_open, fmt.reasoning_close, *THINK_MARKERS}
    issues = []
    for where, section in sections.items():
        found = Counter(int(t) for t in section[np.isin(section, ids.added_array)])
        if where == "reasoning":
            found -= expected
        issues += [f"special_token_in_{where}:{ids.added[t]}" for t in sorted(found) if ids.added[t] not in tags]
    return issues


@dataclass(frozen=True)
class ReferenceMatch:
    match: str
    first_divergence: int | None = None
    ours: str | None = None
    reference: str | None = None


def _window(backend: Tokenizer, ids: Sequence[int], at: int) -> str:
    piece = ids[max(0, at - DIVERGENCE_WINDOW) : at + DIVERGENCE_WINDOW + 1]
    return json.dumps([backend.decode([int(t)], skip_special_tokens=False) for t in piece], ensure_ascii=False)


def compare_reference(
    backend: Tokenizer, ours: list[int], reference: list[int] | None, end_of_turn_id: int
) -> ReferenceMatch:
    if reference is None:
        return ReferenceMatch("no_reference")
    if ours and ours[-1] == end_of_turn_id and (not reference or reference[-1] != end_of_turn_id):
        ours = ours[:-1]
    if ours == reference:
        return ReferenceMatch("exact")
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b),
        min(len(ours), len(reference)),
    )
    same_text = backend.decode(ours, skip_special_tokens=False) == backend.decode(reference, skip_special_tokens=False)
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


def verdict(match: str, issues: Sequence[str], billing_flagged: bool) -> str:
    codes = {issue_code(i) for i in issues}
    if match == "real_difference" or codes & FAIL_ISSUES:
        return "fail"
    if match == "bpe_artifact" or codes & WARN_ISSUES or billing_flagged:
        return "warn"
    return "pass"


def validate_tables(
    tokens: pa.Table,
    responses: pa.Table,
    fmt: CompletionFormat,
    backend: Tokenizer,
    added: dict[int, str],
    vcfg: ValidationConfig,
) -> tuple[pa.Table, dict[str, Any]]:
    """One validation row per tokens row, in the same order."""
    formats = set(tokens.column("completion_format").to_pylist())
    if formats - {fmt.name}:
        raise ConfigError(f"tokens built with completion format(s) {sorted(formats)}, validating with {fmt.name!r}")
    control = ControlIds.build(backend, added, fmt)
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
    decoded = backend.decode_batch([c.tolist() for c in completions], skip_special_tokens=False)

    rows: list[dict[str, Any]] = []
    for i, sid in enumerate(sample_ids):
        r = by_id.get(sid)
        if r is None:
            raise ReconstructionError(sid, "tokens row has no done response in the responses part")
        reasoning, content, finish = resp["reasoning"][r], resp["content"][r], resp["finish_reason"][r]
        layout = completion_layout(fmt, reasoning, content, truncated=finish == "length")
        issues = text_issues(fmt, reasoning, content, finish, vcfg.allowed_finish_reasons)
        issues += special_token_issues(fmt, completions[i], reasoning_lens[i], layout, control)
        if decoded[i] != layout.text:
            issues.append("roundtrip_mismatch")
        reference = output_ids[r].as_py() if has_output[r] else None
        ref = compare_reference(backend, completions[i].tolist(), reference, control.end_of_turn_id)
        ours_len = len(completions[i])
        delta, frac, flagged = billing_delta(resp["completion_tokens"][r], ours_len, vcfg.billing_tolerance_frac)
        rows.append(
            {
                "sample_id": sid,
                "dataset": datasets[i],
                "verdict": verdict(ref.match, issues, flagged),
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
            }
        )
    verdicts = Counter(row["verdict"] for row in rows)
    matches = Counter(row["reference_match"] for row in rows)
    stats: dict[str, Any] = {
        "rows": len(rows),
        **{v: verdicts.get(v, 0) for v in ("pass", "warn", "fail")},
        **{m: matches.get(m, 0) for m in ("exact", "bpe_artifact", "real_difference", "no_reference")},
    }
    return pa.Table.from_pylist(rows, schema=VALIDATION), stats


def validate_part(cfg: PipelineConfig, part: int, fmt: CompletionFormat) -> dict[str, Any]:
    """Write `validation/part-NNNNN` for the tokens part with the same index (idempotent)."""
    out = PartRef(cfg.run_dir, "validation", part)
    if out.is_done():
        return {**read_marker(out)["stats"], "reused": True}
    tokenizer = load_tokenizer(cfg.tokenizer)
    tokens = read_part(out.with_stage("tokens"))
    responses = read_part(out.with_stage("responses"), columns=RESPONSE_COLUMNS)
    table, stats = validate_tables(
        tokens, responses, fmt, backend_tokenizer(tokenizer), added_tokens(tokenizer), cfg.validation
    )
    provenance = {
        **cfg.provenance(),
        **tokenizer_provenance(cfg.tokenizer),
        "completion_format": fmt.name,
        "validation": cfg.validation.model_dump(mode="json"),
    }
    write_part(out, table, provenance, stats)
    return {**stats, "reused": False}


def _rate(n: int, d: int) -> float:
    return n / d if d else 0.0


def summarize_validation(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Per dataset: verdicts, reference matches, structural issues, billing and provider mix.

    Reference rates (exact/bpe_artifact/real_difference) are over samples that had a reference;
    `no_reference_rate` and `fail_rate` over validated samples; `failed_rate` over all responses (a failed
    generation never reaches validation, but it counts against the run).
    """
    tol = cfg.validation.billing_tolerance_frac
    per: dict[str, dict[str, Any]] = {}

    def entry(dataset: str) -> dict[str, Any]:
        return per.setdefault(
            dataset,
            {
                "responses": 0,
                "failed_responses": 0,
                "verdicts": Counter(),
                "matches": Counter(),
                "issues": Counter(),
                "providers": Counter(),
                "billed": 0,
                "ours_billed": 0,
                "flagged": 0,
                "samples": 0,
            },
        )

    for ref in done_parts(cfg.run_dir, "responses"):
        t = read_part(ref, columns=["dataset", "status", "provider"])
        for dataset, status, provider in zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True):
            e = entry(dataset)
            e["responses"] += 1
            e["failed_responses"] += status == "failed"
            e["providers"][provider or "unknown"] += 1
    cols = [
        "dataset",
        "verdict",
        "reference_match",
        "structural_issues",
        "billed_completion_tokens",
        "our_completion_tokens",
        "billing_delta_frac",
    ]
    for ref in done_parts(cfg.run_dir, "validation"):
        t = read_part(ref, columns=cols)
        for dataset, v, m, issues, billed, ours, frac in zip(*(t.column(c).to_pylist() for c in cols), strict=True):
            e = entry(dataset)
            e["samples"] += 1
            e["verdicts"][v] += 1
            e["matches"][m] += 1
            e["issues"].update(issue_code(i) for i in issues)
            if billed is not None:
                e["billed"] += billed
                e["ours_billed"] += ours
                e["flagged"] += abs(frac) > tol
    summary = []
    for dataset in sorted(per):
        e = per[dataset]
        samples, matches = e["samples"], e["matches"]
        referenced = samples - matches["no_reference"]
        summary.append(
            {
                "dataset": dataset,
                "responses": e["responses"],
                "failed_responses": e["failed_responses"],
                "failed_rate": _rate(e["failed_responses"], e["responses"]),
                "samples": samples,
                **{v: e["verdicts"][v] for v in ("pass", "warn", "fail")},
                "fail_rate": _rate(e["verdicts"]["fail"], samples),
                "referenced": referenced,
                **{m: matches[m] for m in ("exact", "bpe_artifact", "real_difference", "no_reference")},
                "exact_rate": _rate(matches["exact"], referenced),
                "bpe_artifact_rate": _rate(matches["bpe_artifact"], referenced),
                "real_difference_rate": _rate(matches["real_difference"], referenced),
                "no_reference_rate": _rate(matches["no_reference"], samples),
                "structural_issues": dict(sorted(e["issues"].items())),
                "billing": {
                    "billed_completion_tokens": e["billed"],
                    "our_completion_tokens": e["ours_billed"],
                    "delta_tokens": e["billed"] - e["ours_billed"],
                    "delta_frac": _rate(e["billed"] - e["ours_billed"], e["ours_billed"]),
                    "flagged_samples": e["flagged"],
                },
                "providers": dict(e["providers"].most_common()),
            }
        )
    return summary


def check_gates(summary: list[dict[str, Any]], vcfg: ValidationConfig) -> None:
    """Raise ValidationGateError naming every dataset and gate crossed (strictly above the maximum)."""
    crossed = []
    for s in summary:
        if s["real_difference_rate"] > vcfg.max_real_difference_rate:
            crossed.append(
                f"dataset {s['dataset']!r}: real_difference_rate {s['real_difference_rate']:.4f} "
                f"({s['real_difference']}/{s['referenced']} referenced samples) > max_real_difference_rate "
                f"{vcfg.max_real_difference_rate}"
            )
        if s["failed_rate"] > vcfg.max_failed_rate:
            crossed.append(
                f"dataset {s['dataset']!r}: failed_rate {s['failed_rate']:.4f} "
                f"({s['failed_responses']}/{s['responses']} responses) > "
                f"max_failed_rate {vcfg.max_failed_rate}"
            )
    if crossed:
        raise ValidationGateError("validation gates crossed:\n  " + "\n  ".join(crossed))
