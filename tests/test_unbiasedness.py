"""Unbiasedness of the randomized estimators, tested statistically (gradest.testing.means).

Each test draws independent estimates on one recorded path (common random numbers: only
the estimator's own draws differ), accepts the expectation its definition states with
the five-standard-error norm bound and, for power, rejects a wrong target with the same
bound. Where the expectation is the *exact* gradient the wrong target is the biased
estimator it corrects (jagg without debias, truncation without reweighting); the draws'
distributions are checked with chi-square tests. ``sdo`` (unbiased for its one-step sum,
biased for exact) and ``truncated:random`` are tested the same way in test_sdo.py and
test_truncated.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from recorded_problem import STEPS, objective_of, problem, run
from torch import Tensor

import gradest
from gradest.reference import exact_gradient
from gradest.reference.jagg import jagg_definition
from gradest.reference.refl import refl_definition
from gradest.reference.telescope import reference_survival, telescope_definition
from gradest.reference.truncated import truncated_expectation
from gradest.testing import SE_BOUND, assert_biased, assert_unbiased, fits_distribution

DRAWS = 400
SETUP = ("rectified", True, True)


def exact_flat(kind: str) -> Tensor:
    p = problem(*SETUP)
    grads, _ = exact_gradient(
        p.model, p.flow, objective_of(kind), p.trajectory, p.cond, chain=p.chain
    )
    return torch.cat([g.reshape(-1) for g in grads.values()])


@functools.cache
def draws(spec: str, kind: str) -> tuple[Tensor, tuple]:
    """``DRAWS`` estimates of ``spec`` on the shared recorded path, and their decisions."""
    p = problem(*SETUP)
    est, objective = gradest.estimator(spec), objective_of(kind)
    results = [run(est, p, objective, "trajectory", seed=2000 + i) for i in range(DRAWS)]
    return torch.stack([r.flat() for r in results]), tuple(r.decisions for r in results)


# -- jagg:debias: unbiased for exact, gate or not ---------------------------------------------

# window 3 on 6 steps: groups (0,1,2) and (3,4,5), nodes at their ends, steps 1 and 4
# interpolated. The gate cosines on this path are 0.99964 and 0.99983, so tau=0.9997 fails
# the first group (exact there, no correction) and passes the second.
JAGG = "jagg:window=3,debias={m},{gate}"
GATES = {"off": ("gate=off", ()), "one-group-fails": ("gate=min,tau=0.9997", (0,))}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("m", [1, 2])
def test_debiased_jagg_is_unbiased_for_exact(m, gate, kind):
    p = problem(*SETUP)
    option, fallbacks = GATES[gate]
    samples, decisions = draws(JAGG.format(m=m, gate=option), kind)
    assert all(d.fallback_groups == fallbacks for d in decisions)
    assert_unbiased(samples, exact_flat(kind))
    # Power: the same draws reject the interpolated (biased) jagg gradient.
    first = decisions[0]
    passed = [i not in first.fallback_groups for i in range(len(first.groups))]
    biased = jagg_definition(p.chain, objective_of(kind), first.groups, first.nodes, passed)
    assert_biased(samples, biased)
    # Every step drawn alike: m of N per call, uniformly.
    counts = [step for d in decisions for step in d.debias_steps]
    assert all(len(d.debias_steps) == m for d in decisions)
    assert fits_distribution(counts, [1 / STEPS] * STEPS)


# -- telescope: unbiased for exact -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize(("mean_depth", "min_depth"), [(2.0, 1), (3.5, 2)])
def test_telescope_is_unbiased_for_exact(mean_depth, min_depth, kind):
    p = problem(*SETUP)
    spec = f"telescope:mean_depth={mean_depth},min_depth={min_depth}"
    samples, decisions = draws(spec, kind)
    assert_unbiased(samples, exact_flat(kind))
    # Power: without the 1/q_j weights the same depths estimate a truncated expectation.
    survival = reference_survival(STEPS, mean_depth, min_depth)
    masses = [a - b for a, b in zip(survival, [*survival[1:], 0.0], strict=True)]
    unweighted = truncated_expectation(p.chain, objective_of(kind), masses)
    assert_biased(samples, unweighted)
    assert fits_distribution([d.depth - 1 for d in decisions], masses)


def test_telescope_depth_mean_matches_the_option():
    _, decisions = draws("telescope:mean_depth=2.0,min_depth=1", "terminal")
    depths = torch.tensor([d.depth for d in decisions], dtype=torch.float64)
    se = float(depths.std() / DRAWS**0.5)
    assert abs(float(depths.mean()) - 2.0) <= SE_BOUND * se


# -- AlignProp min-max truncation and ReFL: unbiased for their own expectations ---------------


@pytest.mark.slow
def test_min_max_truncation_is_unbiased_for_its_expectation():
    p = problem(*SETUP)
    objective = objective_of("terminal")
    samples, decisions = draws("truncated:random=uniform,k_min=3,k=5", "terminal")
    probabilities = [0.0, 0.0, 1 / 3, 1 / 3, 1 / 3]
    assert_unbiased(samples, truncated_expectation(p.chain, objective, probabilities))
    assert fits_distribution([d.k - 1 for d in decisions], probabilities)
    # Power: uniform on 1..5 (k_min ignored) is a different expectation.
    wrong = truncated_expectation(p.chain, objective, [0.2] * 5)
    assert_biased(samples, wrong)


@pytest.mark.slow
def test_refl_is_unbiased_for_the_mean_over_its_window():
    p = problem(*SETUP)
    objective = objective_of("terminal")
    samples, decisions = draws("refl:last_steps=4", "terminal")
    window = range(STEPS - 4, STEPS)
    expectation = sum(refl_definition(p.chain, objective, s)[0] for s in window) / 4
    assert_unbiased(samples, expectation)
    assert fits_distribution([d.step for d in decisions], [0.0, 0.0, 0.25, 0.25, 0.25, 0.25])
    # Power: a window of the last two steps only.
    wrong = sum(refl_definition(p.chain, objective, s)[0] for s in window[2:]) / 2
    assert_biased(samples, wrong)


def test_telescope_definition_at_every_depth_is_what_the_draws_average():
    # The expectation identity behind the statistical test, exactly: sum_K P(K) g_K = exact.
    p = problem(*SETUP)
    objective = objective_of("terminal")
    survival = reference_survival(STEPS, 2.0, 1)
    masses = [a - b for a, b in zip(survival, [*survival[1:], 0.0], strict=True)]
    mixture = sum(
        mass * telescope_definition(p.chain, objective, depth, survival)
        for depth, mass in enumerate(masses, start=1)
    )
    assert torch.allclose(mixture, exact_flat("terminal"), rtol=1e-10, atol=1e-14)
