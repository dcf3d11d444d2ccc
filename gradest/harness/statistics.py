"""Bias, variance and agreement of gradient estimates against a reference gradient.

All quantities are relative to the reference norm so problems of different scale
compare: for one trajectory with reference ``g`` and ``n`` draws ``g^_i`` of a
(possibly stochastic) estimator with mean ``m``:

* ``variance = (1 / (n - 1)) sum_i ||g^_i - m||^2 / ||g||^2`` (unbiased; 0 for one draw
  of a deterministic estimator),
* ``bias^2 = max(0, ||m - g||^2 / ||g||^2 - variance / n)``: ``||m - g||^2`` over-states
  the squared bias by ``variance / n`` because ``m`` is itself noisy, so that is removed,
* ``mse = bias^2 + variance`` (the expected squared relative error of one draw).

Across trajectories (seeds) each quantity is averaged and reported with its standard
error ``std / sqrt(seeds)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor


@attrs.frozen
class Estimate:
    """A mean with its standard error."""

    mean: float
    stderr: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Estimate:
        data = torch.tensor(list(values), dtype=torch.float64)
        if data.numel() == 0:
            return cls(math.nan, math.nan)
        stderr = (
            float(data.std(unbiased=True) / math.sqrt(data.numel())) if data.numel() > 1 else 0.0
        )
        return cls(float(data.mean()), stderr)


@attrs.frozen
class TrajectoryStats:
    """Agreement of one estimator's draws with the reference on one trajectory."""

    cosine: float
    relative_error: float
    norm_ratio: float
    bias_squared: float
    variance: float

    @property
    def mse(self) -> float:
        return self.bias_squared + self.variance


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def trajectory_stats(draws: Sequence[Tensor], reference: Tensor) -> TrajectoryStats:
    """Statistics of ``draws`` (flat gradients) against one ``reference`` gradient."""
    stacked = torch.stack([d.to(torch.float64) for d in draws])
    ref = reference.to(torch.float64)
    scale = float(ref.norm().clamp_min(1e-300)) ** 2
    mean = stacked.mean(0)
    count = stacked.shape[0]
    variance = (
        float((stacked - mean).pow(2).sum(1).sum() / (count - 1)) / scale if count > 1 else 0.0
    )
    bias_squared = max(0.0, float((mean - ref).pow(2).sum()) / scale - variance / count)
    return TrajectoryStats(
        cosine=sum(_cosine(d, ref) for d in stacked) / count,
        relative_error=sum(float((d - ref).norm()) for d in stacked) / count / math.sqrt(scale),
        norm_ratio=sum(float(d.norm()) for d in stacked) / count / math.sqrt(scale),
        bias_squared=bias_squared,
        variance=variance,
    )
