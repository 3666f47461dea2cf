"""Provider parity: does the target score one provider's answers worse than the other providers' answers?

The unit is the sample: its mean NLL per answer token and its top-1 agreement rate (`scores.py`). A provider is
compared with the rest of the run (every other provider pooled) within each dataset, so a provider that happened
to serve the harder dataset is not blamed for it; the per-dataset differences are combined weighted by the
provider's samples in each (a stratified difference of means). "Worse" is a higher mean NLL, or a lower top-1
rate. Each comparison says how sure it is: the standard error of the difference (Welch, unequal variances), a
two-sided 95% interval, and one-sided p-values for "worse at all" and "worse by more than the margin", by the
normal approximation (reliable from a few dozen samples a side; `parity_min_samples` keeps a provider with fewer
from being named). A provider is named when either metric is worse beyond its margin with `parity_confidence`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

NORMAL = NormalDist()
METRICS: dict[str, int] = {"mean_nll": 1, "top1_rate": -1}
"""Metric -> the sign that makes a positive difference mean "the provider is worse"."""


@dataclass(frozen=True)
class Comparison:
    """One provider against the rest on one metric; `difference` > 0 means the provider is worse."""

    metric: str
    samples: int
    rest_samples: int
    mean: float | None
    rest_mean: float | None
    difference: float | None
    std_error: float | None
    ci95_low: float | None
    ci95_high: float | None
    margin: float
    p_worse: float | None
    p_worse_beyond_margin: float | None
    datasets: int

    def beyond_margin(self, confidence: float, min_samples: int) -> bool:
        return (
            self.samples >= min_samples
            and self.rest_samples >= min_samples
            and self.p_worse_beyond_margin is not None
            and self.p_worse_beyond_margin < 1 - confidence
        )

    def to_dict(self) -> dict[str, float | int | str | None]:
        return asdict(self)


def _mean_var(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, var


def _p_above(difference: float, threshold: float, std_error: float) -> float:
    """P(a difference this large or larger | the true difference is `threshold`), one-sided."""
    if std_error == 0:
        return 0.0 if difference > threshold else 1.0
    return 1 - NORMAL.cdf((difference - threshold) / std_error)


def compare(
    metric: str,
    provider: Mapping[str, Sequence[float]],
    rest: Mapping[str, Sequence[float]],
    margin: float,
) -> Comparison:
    """`provider` and `rest`: dataset -> per-sample values. Datasets where either side has fewer than two samples
    inform the means but not the stratified difference (no variance to weigh them by)."""
    sign = METRICS[metric]
    all_p = [v for vs in provider.values() for v in vs]
    all_r = [v for vs in rest.values() for v in vs]
    usable = [d for d in provider if len(provider[d]) >= 2 and len(rest.get(d, ())) >= 2]
    weight_total = sum(len(provider[d]) for d in usable)
    difference = std_error = None
    if weight_total:
        diff = var = 0.0
        for d in usable:
            w = len(provider[d]) / weight_total
            mean_p, var_p = _mean_var(provider[d])
            mean_r, var_r = _mean_var(rest[d])
            diff += w * sign * (mean_p - mean_r)
            var += w * w * (var_p / len(provider[d]) + var_r / len(rest[d]))
        difference, std_error = diff, math.sqrt(var)
    half = None if std_error is None else NORMAL.inv_cdf(0.975) * std_error
    return Comparison(
        metric=metric,
        samples=len(all_p),
        rest_samples=len(all_r),
        mean=sum(all_p) / len(all_p) if all_p else None,
        rest_mean=sum(all_r) / len(all_r) if all_r else None,
        difference=difference,
        std_error=std_error,
        ci95_low=None if difference is None or half is None else difference - half,
        ci95_high=None if difference is None or half is None else difference + half,
        margin=margin,
        p_worse=None if difference is None or std_error is None else _p_above(difference, 0.0, std_error),
        p_worse_beyond_margin=(
            None if difference is None or std_error is None else _p_above(difference, margin, std_error)
        ),
        datasets=len(usable),
    )


def quantiles(values: Sequence[float], qs: Sequence[float] = (0.1, 0.5, 0.9)) -> list[float | None]:
    """Nearest-rank quantiles (None for no values)."""
    if not values:
        return [None for _ in qs]
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in qs]
