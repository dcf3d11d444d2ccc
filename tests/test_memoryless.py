"""The memoryless sampler's marginals on N(0, 1) data, with the exact velocity field.

For ``x ~ N(0, 1)`` and ``z_t = (1 - t) x + t eps``, ``Var z_t = (1 - t)^2 + t^2`` and
``v(z, t) = E[eps - x | z_t] = Cov(eps - x, z_t) / Var(z_t) z = (2t - 1) / ((1 - t)^2 + t^2) z``
(jointly Gaussian, zero means). Sampled with that field, the memoryless SDE has the
flow's marginals, so the sampled std at every grid time must be close to
``sqrt((1 - t)^2 + t^2)``: within 5% (the sampler's own discretisation error) plus a few
standard errors of the sample std (``std / sqrt(2 n)`` for ``n`` Gaussian samples).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import gradest
from gradest import rl
from gradest.rl.adjoint_matching import MemorylessFlow

SAMPLES = 40_000  # per grid time: rel. standard error of the std 1/sqrt(2n) = 0.35%
SE = 5.0  # standard errors of slack on top of the 5% band


class StandardNormalVelocity(nn.Module):
    """The exact rectified-flow velocity for ``N(0, 1)`` data."""

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        variance = (1 - t) ** 2 + t**2
        return ((2 * t - 1) / variance)[:, None] * z


def sampled_stds(sampler, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(sampled std, true std)`` at every grid time ``t_0 .. t_N``."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(SAMPLES // 4, 4, generator=generator, dtype=torch.float64)
    path = gradest.rollout(StandardNormalVelocity(), sampler, noise, generator=generator)
    sampled = path.states.reshape(path.states.shape[0], -1).std(dim=1)
    times = sampler.times
    return sampled, torch.sqrt((1 - times) ** 2 + times**2)


def _tolerance(n: int) -> float:
    return 0.05 + SE / math.sqrt(2 * n)


@pytest.mark.parametrize("steps", [20, 50, 100])
def test_memoryless_marginals_are_right_at_every_grid_time(steps):
    sampled, truth = sampled_stds(rl.memoryless_flow(steps))
    relative = (sampled / truth - 1).abs()
    assert float(relative.max()) <= _tolerance(SAMPLES), list(
        zip(rl.memoryless_flow(steps).times.tolist(), relative.tolist(), strict=True)
    )


def test_memoryless_first_marginals_are_right_on_a_coarse_grid():
    # The grid: 10 steps, where Euler-Maruyama gave 1.42 / 1.36 at t = 0.9 / 0.8.
    sampled, truth = sampled_stds(rl.memoryless_flow(10))
    assert float((sampled[1:3] / truth[1:3] - 1).abs().max()) <= _tolerance(SAMPLES)


def test_euler_maruyama_memoryless_steps_fail_the_same_test():
    # Power: the old sampler (FlowSDE at sqrt(2)) is far outside the band.
    sampled, truth = sampled_stds(gradest.FlowSDE(10, noise_level=math.sqrt(2)))
    assert sampled[1].item() == pytest.approx(1.42, abs=0.02)
    assert sampled[2].item() == pytest.approx(1.36, abs=0.03)
    assert float((sampled / truth - 1).abs().max()) > 0.4


def test_memoryless_flow_is_a_flow_sde_at_sqrt_2_with_positive_noise():
    flow = rl.memoryless_flow(20)
    assert isinstance(flow, MemorylessFlow) and isinstance(flow, gradest.FlowSDE)
    assert flow.noise_level == rl.MEMORYLESS_NOISE_LEVEL
    alpha, beta, scale = flow.coefficients()
    assert bool((scale > 0).all()) and bool((beta < 0).all())
    # The first step forgets z_0 except through its data prediction z_0 - v_0.
    assert alpha[0].item() == pytest.approx(0.05) and beta[0].item() == pytest.approx(-0.05)
    # Where it switches to Euler-Maruyama (|h| <= 0.2 (1 - t)) the two forms agree to
    # O(h^2) (the exact step given x^ is Euler-Maruyama's to that order).
    steps = 2000
    fine = rl.memoryless_flow(steps)
    em = gradest.FlowSDE(steps, noise_level=math.sqrt(2)).coefficients()
    ours = fine.coefficients()
    exact_steps = (1 - fine.times[:-1]) < (1 / steps) / 0.2
    assert 0 < int(exact_steps.sum()) < 10
    assert all(torch.equal(a[~exact_steps], b[~exact_steps]) for a, b in zip(ours, em, strict=True))
    t, tn = fine.times[:-1], fine.times[1:]
    r = (1 - t) / (1 - tn)
    c = tn**2 * r / t**2
    middle = slice(500, 1500)
    exact_alpha = ((1 - tn) + c * t)[middle]
    exact_beta = (-(1 - tn) * t + c * (1 - t) * t)[middle]
    h = 1 / steps
    assert float((exact_alpha - em[0][middle]).abs().max()) <= 100 * h**2  # O(h^2 / (1 - t)^2)
    assert float((exact_beta - em[1][middle]).abs().max()) <= 100 * h**2  # O(h^2 / (1 - t)^2)
