"""Bootstrap confidence intervals over seeds: the race's primary statistics.

A race (:mod:`gradest_lab.race.plain_race`) runs every estimator on the same seeds, so the
natural comparison is **paired**: per seed the difference ``d_s = a_s - b_s`` between an
estimator and the baseline (``exact``), and its mean over seeds with a percentile
bootstrap interval that resamples *seeds* (with replacement, ``resamples >= 2000``, from a
fixed generator seed so that a report is reproducible number for number).

No significance test is made on deterministic quantities (FLOPs): those are reported as
they are. Identical estimators give every ``d_s = 0`` and the interval ``[0, 0]``.

Values may be ``+inf`` ("not reached", as in the compute an estimator needs to reach a
reward): a resample's mean is then ``+inf`` and the interval's upper end can be
``+inf``, which is what it should say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from gradest import InvalidValue

RESAMPLES = 4000
MIN_RESAMPLES = 2000
BOOTSTRAP_SEED = 20_240_601
LEVEL = 0.95

__all__ = [
    "BOOTSTRAP_SEED",
    "RESAMPLES",
    "Interval",
    "bootstrap_mean",
    "paired_bootstrap",
    "paired_ratio_bootstrap",
]


@attrs.frozen
class Interval:
    """A mean over seeds with its percentile bootstrap interval.

    Attributes:
        mean: the mean of the values (``+inf`` when one is ``+inf``).
        low, high: the ``level`` percentile interval of resampled means.
        n: the number of seeds.
        level: the interval's coverage (0.95).
        resamples: how many bootstrap resamples it used.
    """

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL
    resamples: int = RESAMPLES

    def to_json(self) -> dict[str, float | int | None]:
        def safe(x: float) -> float | None:
            return None if math.isnan(x) else x  # JSON has no NaN; +inf stays a float

        return {
            "mean": safe(self.mean),
            "low": safe(self.low),
            "high": safe(self.high),
            "n": self.n,
            "level": self.level,
            "resamples": self.resamples,
        }


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < MIN_RESAMPLES:
        raise InvalidValue(
            f"resamples must be an int >= {MIN_RESAMPLES} (a percentile interval needs many), "
            f"got {resamples!r}"
        )
    if not 0 < level < 1:
        raise InvalidValue(f"level must be in (0, 1), got {level!r}; e.g. 0.95")


def bootstrap_mean(
    values: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The mean of ``values`` (one per seed) and its percentile bootstrap interval.

    Seeds are resampled with replacement ``resamples`` times from a generator seeded with
    ``seed``; the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    the resampled means. One value gives the interval ``[v, v]``; none gives NaNs.
    """
    _check(resamples, level)
    data = torch.tensor([float(v) for v in values], dtype=torch.float64)
    n = int(data.numel())
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level, resamples)
    if bool(torch.isnan(data).any()):
        raise InvalidValue("bootstrap values contain NaN; use +inf for 'not reached'")
    mean = float(data.mean())
    if n == 1 or bool((data == data[0]).all()):
        return Interval(mean, mean, mean, n, level, resamples)
    # +inf values make a resample's mean +inf; quantile handles infinities when sorted.
    means = data[_resampled_seeds(n, resamples, seed)].mean(1)
    return _percentile_interval(mean, means, n, level, resamples)


def _resampled_seeds(n: int, resamples: int, seed: int) -> torch.Tensor:
    """``[resamples, n]`` seed indices drawn with replacement from a fixed generator."""
    return torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def _percentile_interval(
    point: float, resampled: torch.Tensor, n: int, level: float, resamples: int
) -> Interval:
    """``point`` with the ``level`` percentile interval of the resampled statistics."""
    ordered, _ = torch.sort(resampled)
    low = _quantile(ordered, (1 - level) / 2)
    high = _quantile(ordered, (1 + level) / 2)
    return Interval(point, low, high, n, level, resamples)


def _check_pairs(values: Sequence[float], baseline: Sequence[float]) -> None:
    if len(values) != len(baseline):
        raise InvalidValue(
            f"paired values need one per seed each; got {len(values)} and {len(baseline)}"
        )


def _quantile(ordered: torch.Tensor, q: float) -> float:
    """Linear-interpolated quantile of sorted values (infinities allowed)."""
    position = q * (ordered.numel() - 1)
    lower = math.floor(position)
    upper = min(lower + 1, ordered.numel() - 1)
    a, b = float(ordered[lower]), float(ordered[upper])
    if a == b or math.isinf(a) or math.isinf(b):
        return b if position > lower and math.isinf(b) and not math.isinf(a) else a
    return a + (b - a) * (position - lower)


def paired_bootstrap(
    values: Sequence[float],
    baseline: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The mean paired difference ``values - baseline`` over seeds and its bootstrap interval.

    ``values[i]`` and ``baseline[i]`` come from the same seed; seeds (pairs) are
    resampled together, so what the seeds share (the initial noise, the data) cancels.
    """
    _check_pairs(values, baseline)
    diffs = [float(a) - float(b) for a, b in zip(values, baseline, strict=True)]
    return bootstrap_mean(diffs, resamples=resamples, level=level, seed=seed)


def paired_ratio_bootstrap(
    values: Sequence[float],
    baseline: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The ratio of means ``mean(values) / mean(baseline)`` and its paired bootstrap
    interval: seeds (pairs) are resampled together and the ratio of the resample's means
    taken. Finite positive values only (a compute to reach a target that every seed
    reached): a "not reached" seed has no ratio to speak of.
    """
    _check(resamples, level)
    _check_pairs(values, baseline)
    if not values:
        raise InvalidValue("a ratio of means needs at least one seed")
    a = torch.tensor([float(v) for v in values], dtype=torch.float64)
    b = torch.tensor([float(v) for v in baseline], dtype=torch.float64)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())) or bool(
        (b <= 0).any() or (a < 0).any()
    ):
        raise InvalidValue("a ratio of means needs finite values and a positive baseline")
    n = int(a.numel())
    ratio = float(a.mean() / b.mean())
    if n == 1:
        return Interval(ratio, ratio, ratio, n, level, resamples)
    index = _resampled_seeds(n, resamples, seed)
    return _percentile_interval(ratio, a[index].mean(1) / b[index].mean(1), n, level, resamples)
