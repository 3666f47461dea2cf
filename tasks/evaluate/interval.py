"""How far an acceptance figure could move with other held-out prompts: a bootstrap interval over prompts.

A mean accepted length from 48 held-out prompts is one draw: prompts differ far more from each other (a Python
task, a list, a short fact) than the drafters differ on any one of them, so a ratio of two drafters' figures
means little without the spread that the choice of prompts alone gives it. Both drafters walk the same prompts
along the same target decodes, so the prompts are resampled together (a paired bootstrap): each resample draws
prompts with replacement and recomputes both figures from the drawn prompts' summed accepted drafts and verify
steps, exactly as the walk computes them over all prompts. The interval is the percentile interval of the
resampled values. It says nothing about the spread that training itself adds (another seed moves the demo's own
drafter by ~0.04); that is measured separately by training again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95


class IntervalError(ValueError):
    """The two walks cannot be paired: a different number of prompts, or a prompt with no verify step count."""


def _counts(per_prompt: Sequence[Sequence[int]], name: str) -> np.ndarray:
    counts = np.asarray(per_prompt, dtype=np.float64).reshape(-1, 2)
    if len(counts) == 0:
        raise IntervalError(f"{name}: no prompt walked")
    if (counts < 0).any():
        raise IntervalError(f"{name}: negative counts {counts[(counts < 0).any(axis=1)][0].tolist()}")
    return counts


def _resampled_sums(counts: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """[resamples, 2]: accepted drafts and verify steps summed over each resample's drawn prompts."""
    return counts[draws].sum(axis=1)


def _rate(sums: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / np.maximum(sums[:, 1], 1), 0.0)


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail], method="inverted_cdf")  # drawn values, no inf - inf
    return float(low), float(high)


def _draws(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def accepted_length_interval(
    per_prompt: Sequence[Sequence[int]], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of one walk's mean accepted length (accepted drafts per verify step) over prompts."""
    counts = _counts(per_prompt, "walk")
    return _percentiles(_rate(_resampled_sums(counts, _draws(len(counts), resamples, seed))), confidence)


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
    draws = _draws(len(a), resamples, seed)
    top, bottom = _rate(_resampled_sums(a, draws)), _rate(_resampled_sums(b, draws))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.inf)
    return _percentiles(ratio, confidence)


def format_interval(low: float, high: float, digits: int = 1, suffix: str = "") -> str:
    def one(v: float) -> str:
        return "unbounded" if not np.isfinite(v) else f"{v:.{digits}f}{suffix}"

    return f"{one(low)}-{one(high)}"
