"""How far an acceptance figure could move with other held-out prompts: a bootstrap interval over prompts.

A mean accepted length from 48 held-out prompts is one draw: prompts differ far more from each other (a Python
task, a list, a short fact) than the drafters differ on any one of them, so a ratio of two drafters' figures
means little without the spread that the choice of prompts alone gives it. Both drafters walk the same prompts
along the same target decodes, so the prompts are resampled together (a paired bootstrap): each resample draws
prompts with replacement and recomputes both figures from the drawn prompts' summed accepted drafts and verify
steps, exactly as the walk computes them over all prompts. The interval is the percentile interval of the
resampled values. It says nothing about the spread that training itself adds (another seed moves the demo's own
drafter by ~0.05); that is measured separately by training again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95
CHUNK_DRAWS = 1 << 20


class IntervalError(ValueError):
    """No prompt to resample, negative counts, or two walks that cannot be paired (a different number of prompts,
    or a prompt with verify steps in one walk and none in the other)."""


def _counts(per_prompt: Sequence[Sequence[int]], name: str) -> np.ndarray:
    counts = np.asarray(per_prompt, dtype=np.float64).reshape(-1, 2)
    if len(counts) == 0:
        raise IntervalError(f"{name}: no prompt walked")
    if (counts < 0).any():
        raise IntervalError(f"{name}: negative counts {counts[(counts < 0).any(axis=1)][0].tolist()}")
    return counts


def _resampled_rates(walks: Sequence[np.ndarray], resamples: int, seed: int) -> list[np.ndarray]:
    """Each walk's mean accepted length in each resample, every walk over the same drawn prompts. Drawn in chunks
    of about a million prompt draws, so a walk over many thousands of prompts does not hold
    resamples x prompts indices at once."""
    n = len(walks[0])
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, CHUNK_DRAWS // n))
    rates: list[list[np.ndarray]] = [[] for _ in walks]
    for start in range(0, resamples, chunk):
        draws = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        for out, counts in zip(rates, walks, strict=True):
            sums = counts[draws].sum(axis=1)
            out.append(np.where(sums[:, 1] > 0, sums[:, 0] / np.maximum(sums[:, 1], 1), 0.0))
    return [np.concatenate(parts) for parts in rates]


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail], method="inverted_cdf")  # drawn values, no inf - inf
    return float(low), float(high)


def accepted_length_interval(
    per_prompt: Sequence[Sequence[int]], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of one walk's mean accepted length (accepted drafts per verify step) over prompts."""
    (rates,) = _resampled_rates([_counts(per_prompt, "walk")], resamples, seed)
    return _percentiles(rates, confidence)


def paired_ratio_interval(
    numerator: Sequence[Sequence[int]],
    denominator: Sequence[Sequence[int]],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of numerator's mean accepted length over denominator's, the same prompts drawn for
    both. A resample where the denominator accepted nothing has an unbounded ratio (`inf`), so the upper end is
    `inf` when more than the tail's share of resamples do."""
    a, b = _counts(numerator, "numerator"), _counts(denominator, "denominator")
    if len(a) != len(b):
        raise IntervalError(f"walks of {len(a)} and {len(b)} prompts cannot be paired")
    unpaired = np.flatnonzero((a[:, 1] == 0) != (b[:, 1] == 0))
    if len(unpaired):
        raise IntervalError(f"prompt {int(unpaired[0])} has verify steps in one walk and none in the other")
    top, bottom = _resampled_rates([a, b], resamples, seed)
    ratio = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.inf)
    return _percentiles(ratio, confidence)


def format_interval(low: float, high: float, digits: int = 1, suffix: str = "") -> str:
    def one(v: float) -> str:
        return "unbounded" if not np.isfinite(v) else f"{v:.{digits}f}{suffix}"

    return f"{one(low)}-{one(high)}"
