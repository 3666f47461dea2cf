"""Repairing re-encoded ids with the splits the target's own answers show, for endpoints that give neither ids
nor logprobs.

Re-encoding is wrong in systematic places: the target writes a paragraph break as one `ĊĊ` token where the
tokenizer's pre-tokenizer splits `\\n\\n` before a word into `Ċ Ċ`; it writes `je ur` where BPE merges `j eur`.
Reference answers (rows whose ids the endpoint reported) show each such place twice: the re-encoding's ids and
the model's ids for the same text. `RepairTable.learn` aligns the two (difflib over ids), keeps every minimal
replacement whose two sides decode to the same text, and counts, for each re-encoded id sequence, how often the
model replaced it and how often it kept it as is. A rule is kept when the model replaced it in most of the places
the re-encoding produced it (`min_share`, two in three: a split the model chooses by context, such as `Ċ Ċ`
before a code fence and `ĊĊ` before prose at 13 to 9, is a coin toss that an independent probe found wrong in all
7 places it fired) and at least `min_count` times. Answers cut by `max_tokens` teach nothing: their last word's
split depends on text the model had not written yet. Where a row's bill counts its tokens, a repair that moves
the length away from that count is refused (`stage.no_further_from_bill`). `apply` rewrites a re-encoded sequence
left to right with the longest matching rule. Byte-level decoding concatenates token bytes, so a rule never
changes the text; `apply` checks that anyway. Decoding is lossy only for part of a character (any partial bytes
decode to the same U+FFFD): a replacement whose text holds U+FFFD may change the bytes, so it never becomes a
rule (an answer cut inside a character once taught `�` -> another `�`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.reconstruct.completion_format import CUT_CHARACTER
from tasks.reconstruct.tokenizer_backend import TokenBackend

if TYPE_CHECKING:
    from tasks.common.shards import PartRef
    from tasks.reconstruct.completion_format import CompletionFormat

MIN_SHARE = 2 / 3
MIN_COUNT = 2
MAX_RULE_TOKENS = 4
APPLY_VERSION = 2
"""2: a repair that moves a row's length away from its billed count is refused."""


@dataclass
class RepairTable:
    """Rules re-encoded ids -> model ids, learned from reference answers."""

    rules: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    replaced: dict[tuple[int, ...], int] = field(default_factory=dict)
    kept: dict[tuple[int, ...], int] = field(default_factory=dict)
    pairs: int = 0

    @classmethod
    def learn(
        cls,
        backend: TokenBackend,
        pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
        min_share: float = MIN_SHARE,
        min_count: int = MIN_COUNT,
    ) -> RepairTable:
        """`pairs`: (re-encoded ids, model ids) of the same completion text."""
        replaced: Counter[tuple[int, ...]] = Counter()
        targets: dict[tuple[int, ...], Counter[tuple[int, ...]]] = {}
        equal_runs: list[list[int]] = []
        n = 0
        for ours, model in pairs:
            n += 1
            a, b = list(ours), list(model)
            matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
            for op, i1, i2, j1, j2 in matcher.get_opcodes():
                if op == "equal":
                    equal_runs.append(a[i1:i2])
                    continue
                src, dst = tuple(a[i1:i2]), tuple(b[j1:j2])
                if not src or not dst or len(src) > MAX_RULE_TOKENS or len(dst) > MAX_RULE_TOKENS:
                    continue
                text = backend.decode(list(src))
                if CUT_CHARACTER in text or text != backend.decode(list(dst)):
                    continue
                replaced[src] += 1
                targets.setdefault(src, Counter())[dst] += 1
        kept: Counter[tuple[int, ...]] = Counter()
        for run in equal_runs:
            for src in replaced:
                kept[src] += _count(run, src)
        rules = {}
        for src, count in replaced.items():
            share = count / (count + kept[src])
            if count >= min_count and share >= min_share:
                rules[src] = targets[src].most_common(1)[0][0]
        return cls(rules, dict(replaced), dict(kept), n)

    def apply(self, backend: TokenBackend, ids: Sequence[int]) -> tuple[list[int], int]:
        """(repaired ids, rules applied); the decoded text is unchanged."""
        if not self.rules:
            return list(ids), 0
        lengths = sorted({len(src) for src in self.rules}, reverse=True)
        out: list[int] = []
        applied = 0
        at = 0
        while at < len(ids):
            for size in lengths:
                dst = self.rules.get(tuple(ids[at : at + size]))
                if dst is not None:
                    out.extend(dst)
                    at += size
                    applied += 1
                    break
            else:
                out.append(int(ids[at]))
                at += 1
        if applied and backend.decode(out) != backend.decode(list(ids)):
            raise ValueError("a repair rule changed the decoded text")
        return out, applied

    def digest(self) -> str:
        """Identifies the rules and how they are applied (recorded in the tokens recipe: new rules, or a change
        in applying them, rebuild the repaired parts and no others)."""
        body = json.dumps([APPLY_VERSION, sorted((list(k), list(v)) for k, v in self.rules.items())])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def describe(self, backend: TokenBackend, limit: int = 10) -> list[dict[str, object]]:
        """The most used rules, as token strings, with how often the model replaced and kept each source."""
        top = sorted(self.rules, key=lambda s: -self.replaced.get(s, 0))[:limit]
        return [
            {
                "reencoded": [backend.piece(t) for t in src],
                "model": [backend.piece(t) for t in self.rules[src]],
                "replaced": self.replaced.get(src, 0),
                "kept": self.kept.get(src, 0),
            }
            for src in top
        ]


def _count(run: Sequence[int], src: tuple[int, ...]) -> int:
    size, found, at = len(src), 0, 0
    while at + size <= len(run):
        if tuple(run[at : at + size]) == src:
            found += 1
            at += size
        else:
            at += 1
    return found


_LEARNED: dict[tuple[str, str, str], RepairTable] = {}


def reference_pairs(
    refs: Iterable[PartRef], backend: TokenBackend, fmt: CompletionFormat
) -> list[tuple[list[int], list[int]]]:
    """(re-encoded ids, model ids) of every done, finished (not cut by `max_tokens`) final-turn response in these
    responses parts that carries the model's ids spelling its text."""
    from tasks.common.shards import read_part
    from tasks.reconstruct.completion_format import completion_layout
    from tasks.reconstruct.model_ids import model_completion

    eot = backend.token_to_id(fmt.end_of_turn)
    pairs = []
    columns = ["status", "reasoning", "content", "finish_reason", "output_ids", "history"]
    for ref in refs:
        for row in read_part(ref, columns=columns).to_pylist():
            if row["status"] != "done" or row["output_ids"] is None or row["history"] is not None or eot is None:
                continue
            if row["finish_reason"] == "length":
                continue
            try:
                layout = completion_layout(fmt, row["reasoning"], row["content"], False)
            except ValueError:
                continue
            exact = model_completion(backend, layout, row["output_ids"], eot)
            if exact is not None:
                pairs.append((backend.encode(layout.text), exact[0]))
    return pairs


def learn_from_run(run_dir: Path, backend: TokenBackend, fmt: CompletionFormat, tokenizer_digest: str) -> RepairTable:
    """The table the done responses of `run_dir` that carry the model's ids teach (cached per run directory state,
    tokenizer and format: a finished part's marker changes when the part does)."""
    from tasks.common.errors import ConfigError
    from tasks.common.shards import done_parts, read_marker

    if not (Path(run_dir) / "responses").is_dir():
        raise ConfigError(f"reconstruct.repair_from {run_dir} holds no responses stage: name a run directory")
    refs = done_parts(Path(run_dir), "responses")
    state = hashlib.sha256(json.dumps([read_marker(r) for r in refs], sort_keys=True, default=str).encode())
    key = (str(Path(run_dir).resolve()), tokenizer_digest, state.hexdigest() + json.dumps(fmt.describe()))
    cached = _LEARNED.get(key)
    if cached is not None:
        return cached
    pairs = reference_pairs(refs, backend, fmt)
    if not pairs:
        raise ConfigError(f"reconstruct.repair_from {run_dir}: no finished response there carries the model's ids")
    table = _LEARNED[key] = RepairTable.learn(backend, pairs)
    return table
