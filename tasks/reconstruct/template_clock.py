"""The date a chat template printed into the prompt the server rendered.

Some published templates print today's date (gpt-oss's `Current date: {{ strftime_now("%Y-%m-%d") }}`,
Mistral-Small-3.1's system prompt). The server rendered it at the request's time; rendering it again at
reconstruct time gives another date on another day, the same number of tokens (so no count check sees it), and
wrong prompt ids for every row of a rebuild a day later. So for such a template the prompt is rendered at the
time the request was sent: the spend ledger's `s` record of the attempt that delivered the stored answer
(matched by generation id, else the sample's last answered attempt), and where a run directory has no ledger
record for a sample (a host that never ran generate and has no copy of it), the responses part's completion
time, which a later run of the same part only moves later. Dates are UTC, as a container's clock is.

Where the endpoint was sent the prompt ids themselves (SGLang `/generate`), those stored ids are the prompt: no
clock is needed at all (`stage._final_turn_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

CLOCK_FUNCTION = "strftime_now"


class _Sample(Protocol):
    @property
    def sample_id(self) -> str: ...
    @property
    def generation_id(self) -> str | None: ...


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
"""Where a tokenizer directory keeps its chat templates (transformers reads them from these)."""


def template_prints_date(tokenizer_dir: Path) -> bool:
    """Whether the directory's chat template calls `strftime_now`, read from its files: the flow asks before it
    loads the tokenizer (`flows.pipeline.pull_send_times`)."""
    return any(
        (tokenizer_dir / name).is_file() and CLOCK_FUNCTION in (tokenizer_dir / name).read_text(errors="replace")
        for name in TEMPLATE_FILES
    )


def clock_at(at_s: float) -> dict[str, Callable[[str], str]]:
    """Template variables that make `strftime_now` read `at_s` (UTC) instead of this machine's clock."""
    moment = datetime.fromtimestamp(at_s, tz=UTC)
    return {CLOCK_FUNCTION: moment.strftime}


def send_times(run_dir: Path, samples: Sequence[_Sample], part_finished_s: float) -> dict[str, float]:
    """sample_id -> when the request behind its stored answer was sent (see the module docstring)."""
    by_generation, last_answered = _send_index(run_dir, _ledger_signature(run_dir))
    out = {}
    for s in samples:
        found = by_generation.get(s.generation_id or "") or last_answered.get(s.sample_id)
        out[s.sample_id] = found if found is not None else part_finished_s
    return out


def _ledger_signature(run_dir: Path) -> tuple[tuple[str, int, int], ...]:
    from tasks.generate.ledger import ledger_dir

    folder = ledger_dir(run_dir)
    paths = sorted(folder.glob("ledger-*.log")) if folder.is_dir() else []
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in paths)


@lru_cache(maxsize=2)
def _send_index(
    run_dir: Path, signature: tuple[tuple[str, int, int], ...]
) -> tuple[dict[str, float], dict[str, float]]:
    """Send times by generation id and each sample's last answered attempt, read once per ledger state (every
    part of a run asks; `signature` changes when a segment does)."""
    from tasks.generate.ledger import SpendLedger

    by_generation: dict[str, float] = {}
    last_answered: dict[str, float] = {}
    for attempt in SpendLedger.load(run_dir).attempts.values():
        if attempt.sent_at is None or attempt.state == "unsent":
            continue
        if attempt.generation_id:
            by_generation[attempt.generation_id] = attempt.sent_at
        if attempt.state in ("answered", "settled"):
            last_answered[attempt.sample_id] = max(attempt.sent_at, last_answered.get(attempt.sample_id, 0.0))
    return by_generation, last_answered


def with_clock(template_kwargs: Mapping[str, Any] | None, at_s: float | None) -> dict[str, Any]:
    """The template variables for one sample's prompt: the run's own, plus the clock when one is set."""
    return {**(template_kwargs or {}), **(clock_at(at_s) if at_s is not None else {})}
