"""`telescope` against its dense definition, `exact`, its survival law and its cost.

Its unbiasedness for the exact gradient is tested statistically in test_unbiasedness.py.
"""

from __future__ import annotations

import pytest
import torch
from recorded_problem import BATCH, DIM, STEPS, objective_of, problem, run, surrogate_flat

import gradest
from gradest.errors import InvalidValue
from gradest.reference import exact_gradient, relative_error
from gradest.reference.telescope import (
    reference_survival,
    telescope_definition,
    telescope_expectation,
    telescope_noise_grad_definition,
)
from gradest.strategies.telescope import Telescope, survival_probabilities
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

SETUPS = [("rectified", False, False), ("rectified", True, True), ("noisy", True, False)]
OPTIONS = [{}, {"mean_depth": 3.5, "min_depth": 2}, {"mean_depth": 1.0}]


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "min2-mean3.5", "mean1"])
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
# A stochastic sampler samples the recorded path from noise only with its own seed (None);
# on the recording any seed draws a depth.
@pytest.mark.parametrize(
    ("source", "seed"), [("noise", None), ("trajectory", None), ("trajectory", 5)]
)
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "noisy-sampler"])
def test_telescope_matches_its_dense_definition(setup, source, objective_kind, options, seed):
    p = problem(*setup)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    est = Telescope(**options)
    result = run(est, p, objective, source, seed=seed, noise_grad=terminal)
    depth = result.decisions.depth
    survival = reference_survival(STEPS, est.mean_depth, est.min_depth)
    assert est.min_depth <= depth <= STEPS
    truth = telescope_definition(p.chain, objective, depth, survival)
    assert relative_error(result.flat(), truth) <= 1e-10
    if terminal:
        noise_truth = telescope_noise_grad_definition(p.chain, objective, depth, survival)
        if depth < STEPS:
            assert torch.equal(result.noise_grad, torch.zeros_like(result.noise_grad))
        else:
            assert relative_error(result.noise_grad, noise_truth) <= 1e-10


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_full_mean_depth_is_exact(source, objective_kind, engine):
    p = problem("noisy", True, False)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    result = run(
        Telescope(mean_depth=STEPS), p, objective, source, noise_grad=terminal, engine=engine
    )
    truth, truth_noise = exact_gradient(
        p.model, p.flow, objective, p.trajectory, p.cond, chain=p.chain
    )
    assert result.decisions.depth == STEPS
    assert relative_error(result.grads, truth) <= 1e-10
    if terminal:
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10


def test_engines_and_surrogate_agree_at_every_depth():
    p = problem()
    objective = objective_of("terminal")
    for seed in range(6):
        autograd = run(Telescope(mean_depth=3.0), p, objective, "noise", seed=seed)
        func = run(Telescope(mean_depth=3.0), p, objective, "noise", seed=seed, engine="func")
        assert func.decisions == autograd.decisions
        assert relative_error(func.flat(), autograd.flat()) <= 1e-12
        flat, _ = surrogate_flat(Telescope(mean_depth=3.0), p, objective, seed=seed)
        assert relative_error(flat, autograd.flat()) <= 1e-12


@pytest.mark.parametrize(
    ("steps", "mean_depth", "min_depth"), [(6, 4.0, 1), (6, 3.5, 2), (50, 4.0, 1), (50, 49.9, 3)]
)
def test_survival_law_has_the_asked_mean_and_both_solvers_agree(steps, mean_depth, min_depth):
    survival = survival_probabilities(steps, mean_depth, min_depth)
    assert survival[:min_depth] == [1.0] * min_depth
    assert sum(survival) == pytest.approx(mean_depth, rel=1e-12)
    assert all(a >= b for a, b in zip(survival, survival[1:], strict=False))
    reference = reference_survival(steps, mean_depth, min_depth)
    assert max(abs(a / b - 1) for a, b in zip(survival, reference, strict=True)) <= 1e-10


def test_the_survival_law_makes_the_expectation_exact():
    p = problem("rectified", True, True)
    objective = objective_of("terminal")
    survival = reference_survival(STEPS, 2.5, 1)
    truth, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, p.cond, chain=p.chain)
    flat = torch.cat([g.reshape(-1) for g in truth.values()])
    assert relative_error(telescope_expectation(p.chain, objective, survival), flat) <= 1e-10


def test_cost_follows_the_drawn_depth():
    steps = 10
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=steps)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    for seed in range(8):
        for noise_grad in (False, True):
            result = Telescope(mean_depth=3.0).estimate(
                model,
                flow,
                objective,
                noise=noise,
                noise_grad=noise_grad,
                generator=torch.Generator().manual_seed(seed),
            )
            depth = result.decisions.depth
            cost = result.cost
            assert cost.forwards_without_graph == steps - depth
            assert cost.forwards_with_graph == depth
            assert cost.param_vjps == depth
            needs_first = noise_grad and depth == steps
            assert cost.state_vjps == depth - 1 + needs_first


def test_bad_options_name_the_fix():
    with pytest.raises(InvalidValue, match="min_depth=3 exceeds mean_depth=2"):
        Telescope(mean_depth=2.0, min_depth=3)
    with pytest.raises(InvalidValue, match=r"mean_depth=9 exceeds the sampler's N=6"):
        run(Telescope(mean_depth=9.0), problem(), objective_of("terminal"), "noise")
    with pytest.raises(InvalidValue, match="mean_depth"):
        gradest.estimator("telescope:mean_depth=0.5")
