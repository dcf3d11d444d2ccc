"""`refl` (ReFL) against its dense definition, DRaFT-1, its draws, cost and refusals."""

from __future__ import annotations

import pytest
import torch
from recorded_problem import BATCH, DIM, STEPS, objective_of, problem, run, surrogate_flat

import gradest
from gradest.errors import InvalidType, InvalidValue
from gradest.reference import relative_error
from gradest.reference.refl import refl_definition
from gradest.strategies.refl import Refl
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

SETUPS = [("rectified", False, False), ("rectified", True, True), ("sde", True, False)]


@pytest.mark.parametrize("options", [{}, {"last_steps": STEPS}], ids=["default", "whole-chain"])
@pytest.mark.parametrize(
    ("source", "seed"), [("noise", None), ("trajectory", None), ("trajectory", 7)]
)
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "flow-sde"])
def test_refl_matches_its_dense_definition(setup, source, seed, options):
    p = problem(*setup)
    objective = objective_of("terminal")
    est = Refl(**options)
    result = run(est, p, objective, source, seed=seed, noise_grad=True)
    step, window = result.decisions.step, result.decisions.window
    assert window == options.get("last_steps", 2)  # ceil(6 / 4)
    assert STEPS - window <= step <= STEPS - 1
    truth, noise_truth = refl_definition(p.chain, objective, step)
    assert relative_error(result.flat(), truth) <= 1e-10
    assert torch.equal(result.noise_grad, noise_truth.to(result.noise_grad.dtype))
    assert result.info["step"] == step


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_refl_from_the_last_step_is_draft_1(source):
    # The one-step prediction from z_{N-1} is the Euler step itself: z^ = z_N.
    p = problem("rectified", True, True)
    objective = objective_of("terminal")
    refl = run(Refl(last_steps=1), p, objective, source)
    draft = run(gradest.estimator("truncated:k=1"), p, objective, source)
    assert refl.decisions.step == STEPS - 1
    assert relative_error(refl.flat(), draft.flat()) <= 1e-12
    assert refl.info["loss"] == pytest.approx(draft.info["loss"], rel=1e-12)


def test_refl_stops_sampling_at_its_step():
    steps = 12
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=steps)
    noise = seeded_normal((BATCH, DIM), seed=11)
    for seed in range(6):
        result = Refl(last_steps=steps).estimate(
            model,
            flow,
            smooth_terminal_objective(DIM),
            noise=noise,
            generator=torch.Generator().manual_seed(seed),
        )
        cost = result.cost
        # (s + 3)F: s forwards without a graph, one with its graph and one parameter VJP.
        assert cost.forwards_without_graph == result.decisions.step
        assert (cost.forwards_with_graph, cost.param_vjps, cost.state_vjps) == (1, 1, 0)


def test_the_surrogate_gives_the_estimate():
    p = problem("sde", True, False)
    objective = objective_of("terminal")
    result = run(Refl(), p, objective, "noise")
    flat, sur = surrogate_flat(Refl(), p, objective)
    assert sur.decisions == result.decisions
    assert relative_error(flat, result.flat()) <= 1e-12


def test_refusals_name_the_problem():
    p = problem("noisy")
    with pytest.raises(InvalidType, match="needs the sampler's interpolant"):
        run(Refl(), p, objective_of("terminal"), "trajectory")
    with pytest.raises(InvalidValue, match="terminal objectives only, got a stepwise"):
        run(Refl(), problem(), objective_of("stepwise"), "trajectory")
    with pytest.raises(InvalidValue, match=r"last_steps=7 exceeds the sampler's N=6"):
        run(Refl(last_steps=7), problem(), objective_of("terminal"), "trajectory")
