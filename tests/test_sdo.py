"""`sdo` against its dense definition, its known truths, and its expectation.

The statistical tests bound the error of a mean of ``n`` independent draws by five
standard errors in norm: with ``se^2 = tr(Cov)/n``, ``||mean - E||^2 / se^2`` is (by the
CLT) a weighted sum of chi-square(1) variables with weights summing to 1, and above a
threshold of about 1.5 such a tail is largest when one weight carries everything
(Szekely and Bakirov, 2003), so ``P(||mean - E|| > 5 se) <= P(|Z| > 5) ~ 6e-7``. Each of
those tests also checks that the same bound *rejects* a wrong target, so it has power.
"""

from __future__ import annotations

import functools
import math

import attrs
import pytest
import scipy.stats
import torch
from recorded_problem import (
    BATCH,
    DIM,
    STEPS,
    objective_of,
    problem,
    run,
)
from torch import Tensor

import gradest
from gradest.reference import exact_gradient, relative_error
from gradest.reference.sdo import (
    sdo_definition,
    sdo_full_sum_definition,
    sdo_noise_grad_definition,
)
from gradest.strategies.sdo import ShortcutDiffusion
from gradest.testing import standard_error
from gradest.testing.problems import (
    AffineVelocity,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

# The number of independent draws in the statistical tests.
DRAWS = 400


SETUPS = [("rectified", False, False), ("rectified", True, True), ("noisy", True, False)]
OPTIONS = [{}, {"samples": 3}, {"samples": 2, "scale": "none"}, {"full_sum": True}]


# -- 1. the estimator is its definition ------------------------------------------------------


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "noisy-sampler"])
def test_sdo_matches_its_dense_definition(setup, source, objective_kind, options):
    p = problem(*setup)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    est = ShortcutDiffusion(**options)
    result = run(est, p, objective, source, noise_grad=terminal)

    steps, factor = result.info["sampled_steps"], result.info["scale"]
    if options.get("full_sum"):
        assert steps == list(range(STEPS)) and factor == 1.0
    else:
        samples = options.get("samples", 1)
        assert len(steps) == samples == len(set(steps)) and steps == sorted(steps)
        assert factor == (
            STEPS / samples if options.get("scale", "unbiased") == "unbiased" else 1.0
        )
    assert list(result.grads) == [n for n, q in p.model.named_parameters() if q.requires_grad]
    truth = sdo_definition(p.chain, objective, steps, factor)
    assert relative_error(result.flat(), truth) <= 1e-10
    if terminal:
        truth_noise = sdo_noise_grad_definition(p.chain, objective)
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10
    else:
        assert result.noise_grad is None


# -- 2. known truths -------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_sdo_full_sum_on_a_stepwise_objective_is_exact(source):
    # Stepwise cotangents do not involve the chain, so the full one-step sum is the gradient.
    p = problem("rectified", True, True)
    objective = objective_of("stepwise")
    result = run(ShortcutDiffusion(full_sum=True), p, objective, source)
    truth, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, p.cond, chain=p.chain)
    assert relative_error(result.grads, truth) <= 1e-10
    exact = run(gradest.estimator("exact"), p, objective, source)
    assert relative_error(result.grads, exact.grads) <= 1e-12


@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("scale", ["none", "unbiased"])
def test_sdo_with_every_step_sampled_is_the_full_sum(objective_kind, scale):
    p = problem("noisy", True, False)
    objective = objective_of(objective_kind)
    full = run(ShortcutDiffusion(full_sum=True), p, objective, "trajectory")
    every = run(ShortcutDiffusion(samples=STEPS, scale=scale), p, objective, "trajectory")
    assert every.info["sampled_steps"] == list(range(STEPS)) and every.info["scale"] == 1.0
    assert relative_error(every.grads, full.grads) <= 1e-12


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_sdo_full_sum_is_exact_when_the_velocity_ignores_the_state(source):
    # With dv/dz = 0 the model-detached chain *is* the chain: a_k = a_N, c~_k = c_k.
    model = AffineVelocity(DIM, seed=4)
    with torch.no_grad():
        model.weight.zero_()
    model.weight.requires_grad_(False)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), seed=12)
    objective = smooth_terminal_objective(DIM)
    inputs = (
        {"noise": noise}
        if source == "noise"
        else {"trajectory": gradest.rollout(model, flow, noise)}
    )
    exact = gradest.estimator("exact").estimate(model, flow, objective, noise_grad=True, **inputs)
    full = ShortcutDiffusion(full_sum=True).estimate(
        model, flow, objective, noise_grad=True, **inputs
    )
    assert relative_error(full.grads, exact.grads) <= 1e-12
    assert relative_error(full.noise_grad, exact.noise_grad) <= 1e-12


# -- 3. statistics: unbiased for the one-step sum, biased against exact ----------------------


@functools.cache
def sdo_draws(samples: int) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
    """``DRAWS`` independent terminal estimates on the shared path, and their subsets."""
    p = problem()
    objective = objective_of("terminal")
    results = [
        run(ShortcutDiffusion(samples=samples), p, objective, "trajectory", seed=1000 + i)
        for i in range(DRAWS)
    ]
    return (
        torch.stack([r.flat() for r in results]),
        tuple(tuple(r.info["sampled_steps"]) for r in results),
    )


@pytest.mark.slow  # DRAWS estimates, computed once and shared by these tests
@pytest.mark.parametrize("samples", [1, 3])
def test_sdo_mean_of_draws_converges_to_the_full_sum_not_to_exact(samples):
    p = problem()
    objective = objective_of("terminal")
    draws, _ = sdo_draws(samples)
    mean, se = draws.mean(0), standard_error(draws)
    full_sum = sdo_full_sum_definition(p.chain, objective)
    exact, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)
    exact_flat = torch.cat([g.reshape(-1) for g in exact.values()])
    assert float((mean - full_sum).norm()) <= 5 * se
    # The one-step sum is biased on a nonlinear chain, and these draws resolve the bias.
    assert float((mean - exact_flat).norm()) > 5 * se


@pytest.mark.slow  # DRAWS estimates, computed once and shared by these tests
def test_sdo_draws_steps_uniformly():
    _, sampled = sdo_draws(1)
    counts = torch.bincount(torch.tensor([s[0] for s in sampled]), minlength=STEPS).double()
    expected = DRAWS / STEPS
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square <= scipy.stats.chi2.ppf(1 - 1e-6, df=STEPS - 1)


@pytest.mark.slow  # DRAWS estimates, computed once and shared by these tests
def test_sdo_subsets_have_the_right_pair_inclusion_rate():
    # Without replacement every pair of steps is in a subset of size m with probability
    # m(m-1) / (N(N-1)); with replacement or per-step coin flips this would differ.
    samples = 3
    _, sampled = sdo_draws(samples)
    assert all(len(set(s)) == samples for s in sampled)
    count = len(sampled)
    both = sum(1 for s in sampled if 0 in s and 1 in s)
    rate = samples * (samples - 1) / (STEPS * (STEPS - 1))
    assert abs(both - count * rate) <= 5 * math.sqrt(count * rate * (1 - rate))


# -- 4. cost ---------------------------------------------------------------------------------


def _cost(result) -> tuple[int, int, int, int]:
    c = result.cost
    return c.forwards_without_graph, c.forwards_with_graph, c.param_vjps, c.state_vjps


def test_sdo_cost_counts_are_exact():
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=10)
    noise = seeded_normal((BATCH, DIM), seed=11)
    terminal = smooth_terminal_objective(DIM)
    stepwise = random_stepwise_objective(10, (BATCH, DIM))
    trajectory = gradest.rollout(model, flow, noise)
    gen = torch.Generator().manual_seed(0)
    sdo = ShortcutDiffusion()
    # Terminal from noise, m=1: N no-graph forwards, 1 forward with graph, 1 VJP (NF + 3F).
    assert _cost(sdo.estimate(model, flow, terminal, noise=noise, generator=gen)) == (10, 1, 1, 0)
    assert _cost(
        sdo.estimate(model, flow, terminal, noise=noise, generator=gen, noise_grad=True)
    ) == (10, 2, 1, 1)
    assert _cost(sdo.estimate(model, flow, terminal, trajectory=trajectory, generator=gen)) == (
        0,
        1,
        1,
        0,
    )
    assert _cost(
        ShortcutDiffusion(samples=3).estimate(
            model, flow, stepwise, trajectory=trajectory, generator=gen
        )
    ) == (0, 3, 3, 0)
    assert _cost(
        ShortcutDiffusion(full_sum=True).estimate(model, flow, terminal, trajectory=trajectory)
    ) == (0, 10, 10, 0)


# -- 5. randomness only from the generator ---------------------------------------------------


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_sdo_same_generator_state_gives_identical_results(source):
    p = problem("noisy", True, False)  # from noise, the sampler noise comes from it too
    objective = objective_of("terminal")
    est = ShortcutDiffusion(samples=2)
    first = run(est, p, objective, source, seed=7, noise_grad=True)
    second = run(est, p, objective, source, seed=7, noise_grad=True)
    assert first.info == second.info
    assert all(torch.equal(first.grads[n], second.grads[n]) for n in first.grads)
    assert torch.equal(first.noise_grad, second.noise_grad)
    subsets = {
        tuple(run(est, p, objective, source, seed=s).info["sampled_steps"]) for s in range(10)
    }
    assert len(subsets) > 1


def test_sdo_without_a_generator_uses_torchs_default_generator():
    p = problem()
    objective = objective_of("terminal")
    est = ShortcutDiffusion(samples=2)
    steps = []
    for _ in range(2):
        torch.manual_seed(123)
        steps.append(
            est.estimate(p.model, p.flow, objective, trajectory=p.trajectory).info["sampled_steps"]
        )
    assert steps[0] == steps[1]


# -- 6. options and errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"samples": 0}, "samples"),
        ({"samples": 1.5}, "samples"),
        ({"scale": "biased"}, "scale"),
        ({"full_sum": "x"}, "full_sum"),
    ],
)
def test_sdo_rejects_bad_options_naming_them(options, name):
    with pytest.raises((TypeError, ValueError), match=name):
        ShortcutDiffusion(**options)


def test_sdo_more_samples_than_steps_is_an_error_at_estimate_time():
    p = problem()
    with pytest.raises(ValueError, match=f"samples=7.*N={STEPS}"):
        run(ShortcutDiffusion(samples=7), p, objective_of("terminal"), "trajectory")


def test_sdo_spec_strings_and_attrs():
    est = gradest.estimator("sdo:samples=2,scale=none")
    assert est == ShortcutDiffusion(samples=2, scale="none")
    assert gradest.estimator("sdo:full_sum=true").full_sum is True
    assert gradest.estimator("sdo") == ShortcutDiffusion()
    assert attrs.evolve(est, samples=3).samples == 3
    assert hash(est) == hash(ShortcutDiffusion(samples=2, scale="none"))
    assert "samples=2" in repr(est)
