"""The public API's shape: the two verbs (``surrogate`` to train, ``estimate`` to measure)
take the same arguments and return results with the same shared fields, ``sampler`` is the
sampler's keyword everywhere, and the samplers share one construction style."""

from __future__ import annotations

import pytest
import torch

import gradest
from gradest.models import MLPVelocity

STEPS, BATCH, DIM = 4, 3, 2


def _problem():
    torch.manual_seed(0)
    model = MLPVelocity(dim=DIM, hidden=16).double()
    sampler = gradest.RectifiedFlow(steps=STEPS)
    objective = gradest.TerminalObjective(lambda z: (z**2).sum(-1).mean())
    noise = torch.randn(BATCH, DIM, dtype=torch.float64)
    return model, sampler, objective, noise


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("spec", ["exact", "jagg:window=2", "sdo"])
def test_func_engine_on_surrogate_equals_autograd(spec):
    model, sampler, objective, noise = _problem()
    est = gradest.estimator(spec)
    grads = {}
    for engine in ("autograd", "func"):
        model.zero_grad(set_to_none=True)
        sur = est.surrogate(
            model,
            sampler,
            objective,
            noise=noise,
            engine=engine,
            generator=torch.Generator().manual_seed(1),
        )
        sur.loss.backward()
        grads[engine] = _grads(model)
    for name in grads["autograd"]:
        torch.testing.assert_close(
            grads["func"][name], grads["autograd"][name], rtol=1e-12, atol=1e-14
        )
    with pytest.raises(ValueError, match="engine must be one of"):
        est.surrogate(model, sampler, objective, noise=noise, engine="jax")


def test_both_results_share_value_cost_info_decisions_usable():
    model, sampler, objective, noise = _problem()
    est = gradest.estimator("sdo")
    result = est.estimate(model, sampler, objective, noise=noise)
    sur = est.surrogate(model, sampler, objective, noise=noise)
    for record in (result, sur):
        assert isinstance(record.value, float)
        assert isinstance(record.cost, gradest.Cost)
        assert isinstance(record.info, dict)
        assert isinstance(record.decisions, gradest.Decisions)
        assert record.usable is True
    assert result.value == pytest.approx(sur.value, rel=1e-12)
    assert result.value == pytest.approx(float(result.info["loss"]))


def test_sampler_is_the_keyword_of_the_public_api():
    import inspect

    from gradest.rl import (
        adjoint_matching_objective,
        grpo_objective,
        lean_adjoint,
        reference_velocities,
        regression_objective,
        step_kl,
    )

    functions = [
        gradest.EstimatorBase.estimate,
        gradest.EstimatorBase.surrogate,
        gradest.TrajectoryGradientEstimator.estimate,
        gradest.TrajectoryGradientEstimator.surrogate,
        type(gradest.estimator("auto")).estimate,
        type(gradest.estimator("auto")).surrogate,
        gradest.rollout,
        gradest.compare,
        gradest.flow_matching_trajectory,
        adjoint_matching_objective,
        grpo_objective,
        lean_adjoint,
        reference_velocities,
        regression_objective,
        step_kl,
    ]
    for function in functions:
        parameters = inspect.signature(function).parameters
        assert "sampler" in parameters and "flow" not in parameters, function
    for verb in ("estimate", "surrogate"):
        assert "engine" in inspect.signature(getattr(gradest.EstimatorBase, verb)).parameters
    # One way to train: est.surrogate(...).loss.backward().
    for cls in (gradest.TrajectoryGradientEstimator, gradest.EstimatorBase, gradest.Surrogate):
        assert not hasattr(cls, "backward"), cls


def test_samplers_share_one_construction_style():
    from gradest.samplers import StochasticFlowMatch

    times = torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float64)
    levels = torch.linspace(0.1, 1.0, STEPS + 1, dtype=torch.float64)
    pairs = [
        (gradest.RectifiedFlow(steps=STEPS), gradest.RectifiedFlow(times=times)),
        (gradest.FlowSDE(steps=STEPS), gradest.FlowSDE(times=times)),
        (StochasticFlowMatch(steps=STEPS), StochasticFlowMatch(times=times)),
        (
            gradest.DDIM(steps=STEPS, alphas_cumprod=levels),
            gradest.DDIM(times=times, alphas_cumprod=levels),
        ),
    ]
    for by_steps, by_times in pairs:
        assert torch.equal(by_steps.times, by_times.times)
        for a, b in zip(by_steps.coefficients(), by_times.coefficients(), strict=True):
            assert torch.equal(a, b)
    # A sampler reads no diffusers object: the diffusers adapter builds it from one.
    for cls in (gradest.RectifiedFlow, gradest.FlowSDE, StochasticFlowMatch, gradest.DDIM):
        assert not hasattr(cls, "from_scheduler"), cls
    with pytest.raises(ValueError, match="DDIM needs exactly one of steps=N"):
        gradest.DDIM(alphas_cumprod=levels)


def test_flow_samplers_from_a_flow_matching_scheduler():
    diffusers = pytest.importorskip("diffusers")
    from gradest.integrations.diffusers import sampler_from_scheduler
    from gradest.samplers import StochasticFlowMatch

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sampler = sampler_from_scheduler(scheduler, 6)
    assert type(sampler) is gradest.RectifiedFlow
    stochastic = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    assert type(sampler_from_scheduler(stochastic, 6)) is StochasticFlowMatch
