"""The bootstrap interval over held-out prompts (`tasks.evaluate.interval`), checked against exact enumeration."""

from __future__ import annotations

import itertools

import pytest

from tasks.evaluate.interval import (
    IntervalError,
    accepted_length_interval,
    format_interval,
    paired_ratio_interval,
)


def _rate(rows: list[list[int]]) -> float:
    return sum(a for a, _ in rows) / sum(s for _, s in rows)


def test_three_prompts_interval_is_the_extremes_of_every_possible_draw() -> None:
    """With 3 prompts each of the 27 equally likely draws has 3.7% > 2.5% of the mass, so the exact 95% percentile
    interval is the smallest and largest value any draw gives; 10,000 resamples find both."""
    own = [[2, 4], [3, 5], [6, 6]]
    other = [[1, 5], [2, 5], [2, 7]]
    draws = list(itertools.product(range(3), repeat=3))
    ratios = [_rate([own[i] for i in d]) / _rate([other[i] for i in d]) for d in draws]
    rates = [_rate([own[i] for i in d]) for d in draws]
    assert paired_ratio_interval(own, other) == pytest.approx((min(ratios), max(ratios)))
    assert accepted_length_interval(own) == pytest.approx((min(rates), max(rates)))


def test_resamples_drawn_in_chunks_cover_the_same_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk over many prompts draws its resamples in chunks; a chunk of 2 resamples (and a last one of 1) must
    still give every possible draw its share, so the enumeration's extremes come out again."""
    import tasks.evaluate.interval as interval

    own = [[2, 4], [3, 5], [6, 6]]
    other = [[1, 5], [2, 5], [2, 7]]
    whole = paired_ratio_interval(own, other, resamples=10_001)
    monkeypatch.setattr(interval, "CHUNK_DRAWS", 7)
    assert paired_ratio_interval(own, other, resamples=10_001) == pytest.approx(whole)
    assert accepted_length_interval(own, resamples=10_001) == pytest.approx((0.5, 1.0))  # 2/4 and 6/6


def test_the_point_figure_lies_inside_and_identical_walks_give_one() -> None:
    own = [[a % 7 + 1, 5 + a % 3] for a in range(48)]
    other = [[a % 3, 6 + a % 2] for a in range(48)]
    low, high = paired_ratio_interval(own, other)
    assert low < _rate(own) / _rate(other) < high
    assert paired_ratio_interval(own, own) == (1.0, 1.0)
    assert paired_ratio_interval(own, other, seed=3) != (low, high)
    assert paired_ratio_interval(own, other) == (low, high)


def test_prompts_that_agree_give_a_narrow_interval_and_prompts_that_differ_a_wide_one() -> None:
    even = [[3, 10]] * 40
    assert accepted_length_interval(even) == (0.3, 0.3)
    spread = [[0, 10], [6, 10]] * 20
    low, high = accepted_length_interval(spread)
    assert low < 0.25 and high > 0.35


def test_a_denominator_that_accepted_nothing_is_unbounded() -> None:
    low, high = paired_ratio_interval([[3, 4], [1, 3]], [[0, 4], [0, 3]])
    assert low == high == float("inf")
    assert format_interval(2.0, float("inf"), suffix="x") == "2.0x-unbounded"


def test_walks_that_cannot_be_paired_are_refused() -> None:
    with pytest.raises(IntervalError, match="3 and 2 prompts"):
        paired_ratio_interval([[1, 2]] * 3, [[1, 2]] * 2)
    with pytest.raises(IntervalError, match="prompt 1 has verify steps in one walk"):
        paired_ratio_interval([[1, 2], [0, 0]], [[1, 2], [1, 3]])
    with pytest.raises(IntervalError, match="no prompt"):
        accepted_length_interval([])
