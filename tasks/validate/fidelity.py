"""What the API's text cannot show by itself: the prompt the provider really saw, the structure of the ids around
the prompt/completion boundary, tool-call markup, and whitespace a serving stack stripped.

- Prompt tokens: `usage.prompt_tokens` against the rebuilt prompt's length, per row: "exact", "within_tolerance"
  (|delta| <= `validation.prompt_tolerance_tokens`: a provider counting BOS differently), "drift" (the provider
  rendered another prompt: a default system prompt, an injected date, another template revision), "no_usage".
- Boundary: a reasoning format opens its reasoning exactly once. A generation prompt that already ends in the
  open tag plus a completion that writes it again is a doubled `<think>` (a preset that does not match the
  served template, under `format_disagreement: warn`); a format that expects the tag in the prompt when the
  prompt lacks it leaves the reasoning unopened. Both are read off the ids.
- Tool calls: markup of every supported family, in reasoning or content. This pipeline sends no tools, so such
  text is the model calling a tool nobody offered; `validation.tool_call_policy` fails, keeps or drops it.
- Whitespace: some stacks strip leading/trailing whitespace of reasoning and content (SGLang before PR #24251).
  Against reference ids that is a real difference whose only cause is whitespace (`whitespace_stripped`); without
  reference ids, a provider none of whose answers has boundary whitespace while another provider's answers do
  is flagged by that signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Tool-call markup by family: Qwen/Hermes, Kimi-K2/K2.5, DeepSeek-V3.x, gpt-oss (harmony recipient / call end).
TOOL_CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "qwen": ("<tool_call>",),
    "kimi": ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    "gpt_oss": ("to=functions.", "<|call|>"),
}
PROMPT_MATCHES = ("exact", "within_tolerance", "drift", "no_usage")


def tool_call_markup(reasoning: str, content: str) -> list[str]:
    """`tool_call_markup:<family> in <where>` for every family whose markup the texts contain."""
    found = []
    for where, text in (("reasoning", reasoning), ("content", content)):
        for family, markers in TOOL_CALL_MARKERS.items():
            if any(m in text for m in markers):
                found.append(f"tool_call_markup:{family} in {where}")
    return found


def prompt_match(billed: int | None, ours: int, tolerance_tokens: int) -> tuple[str, int | None]:
    """(class, billed - ours)."""
    if billed is None:
        return "no_usage", None
    delta = billed - ours
    if delta == 0:
        return "exact", 0
    return ("within_tolerance" if abs(delta) <= tolerance_tokens else "drift"), delta


def last_control(prompt_tail: np.ndarray, added: np.ndarray) -> int | None:
    """The last added-token id in the prompt's tail, or None."""
    hits = prompt_tail[np.isin(prompt_tail, added)]
    return int(hits[-1]) if len(hits) else None


def boundary_issues(
    open_in_prompt: bool,
    open_ids: tuple[int, ...],
    close_ids: tuple[int, ...],
    prompt_last_control: int | None,
    reasoning_section: np.ndarray,
) -> list[str]:
    """`doubled_open_tag` / `open_tag_missing` across the prompt/completion boundary (reasoning formats only).

    The opener is the open literal's last control id; the close literal may hold it too (gpt-oss reopens a
    channel with `<|message|>`), so its occurrences there are not counted as openings.
    """
    if not open_ids:
        return []
    opener = open_ids[-1]
    prompt_opens = prompt_last_control == opener
    written = int(np.count_nonzero(reasoning_section == opener))
    if close_ids and np.any(reasoning_section == close_ids[-1]):
        written -= close_ids.count(opener)
    issues = []
    if prompt_opens + written > 1 and (prompt_opens or not open_in_prompt):
        issues.append("doubled_open_tag")
    if open_in_prompt and not prompt_opens and written == 0:
        issues.append("open_tag_missing")
    return issues


def whitespace_only(ours: str, reference: str) -> bool:
    """The texts differ, and only in whitespace."""
    return ours != reference and "".join(ours.split()) == "".join(reference.split())


def has_boundary_whitespace(reasoning: str, content: str) -> bool:
    """Leading or trailing whitespace on the reasoning or the content (after the format's own padding)."""
    return any(t and (t[0].isspace() or t[-1].isspace()) for t in (reasoning, content))


@dataclass
class WhitespaceTally:
    """One serving key's boundary-whitespace counts."""

    answers: int = 0
    with_whitespace: int = 0
    referenced: int = 0
    stripped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        if row.get("boundary_whitespace") is None:
            return
        self.answers += 1
        self.with_whitespace += bool(row["boundary_whitespace"])
        self.referenced += row["reference_match"] != "no_reference"
        self.stripped += any(i.startswith("whitespace_stripped") for i in row["structural_issues"])

    @property
    def fraction(self) -> float:
        return self.with_whitespace / self.answers if self.answers else 0.0


def whitespace_findings(tallies: dict[str, WhitespaceTally], min_samples: int) -> list[dict[str, Any]]:
    """Per serving key: the counts and what they say ("stripped", "suspect", "ok", "too_few_answers")."""
    fractions = {k: t.fraction for k, t in tallies.items() if t.answers >= min_samples}
    out = []
    for key, t in sorted(tallies.items()):
        others = [f for k, f in fractions.items() if k != key]
        if t.stripped:
            finding = "stripped"
            detail = f"{t.stripped}/{t.referenced} referenced answers differ from the reference ids only in whitespace"
        elif t.answers < min_samples:
            finding, detail = "too_few_answers", f"{t.answers} answers (< {min_samples})"
        elif t.with_whitespace == 0 and others and max(others) >= 0.05:
            finding = "suspect"
            detail = (
                f"no boundary whitespace in {t.answers} answers while other providers have it in up to "
                f"{max(others):.1%}: the stack looks like it strips reasoning/content"
            )
        elif t.with_whitespace == 0 and not t.referenced:
            finding = "unverified"
            detail = f"no boundary whitespace in {t.answers} answers and no reference ids to tell stripping apart"
        else:
            finding, detail = "ok", f"{t.fraction:.1%} of {t.answers} answers have boundary whitespace"
        out.append(
            {
                "serving": key,
                "answers": t.answers,
                "boundary_whitespace_rate": t.fraction,
                "referenced": t.referenced,
                "whitespace_stripped": t.stripped,
                "finding": finding,
                "detail": detail,
            }
        )
    return out


def count_by(values: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
