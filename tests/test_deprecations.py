"""Deprecated doors and names still work, warn once with the replacement, and the two verbs
(``surrogate`` to train, ``estimate`` to measure) take the same arguments and return
results with the same shared fields."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradest
from gradest.errors import GradestDeprecationWarning
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


def _surrogate_grads(est, model, sampler, objective, noise):
    model.zero_grad(set_to_none=True)
    est.surrogate(model, sampler, objective, noise=noise).loss.backward()
    out = _grads(model)
    model.zero_grad(set_to_none=True)
    return out


def test_the_warning_is_a_deprecation_and_a_future_warning():
    assert issubclass(GradestDeprecationWarning, DeprecationWarning)
    assert issubclass(GradestDeprecationWarning, FutureWarning)
    assert gradest.GradestDeprecationWarning is GradestDeprecationWarning


@pytest.mark.parametrize("spec", ["exact", "sdo:samples=4"])
def test_estimator_backward_warns_with_the_replacement_and_gives_the_surrogate_gradient(spec):
    model, sampler, objective, noise = _problem()
    est = gradest.estimator(spec)
    want = _surrogate_grads(est, model, sampler, objective, noise)
    with pytest.deprecated_call(
        match=r"est\.surrogate\(model, sampler, objective, \.\.\.\)\.loss\.backward\(\)"
    ):
        est.backward(model, sampler, objective, noise=noise)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14)


def test_surrogate_backward_warns_with_the_replacement_and_gives_the_same_gradient():
    model, sampler, objective, noise = _problem()
    est = gradest.estimator("exact")
    want = _surrogate_grads(est, model, sampler, objective, noise)
    sur = est.surrogate(model, sampler, objective, noise=noise)
    with pytest.warns(FutureWarning, match=r"sur\.loss\.backward\(\)"):
        sur.backward()
    got = _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_the_warning_points_at_the_caller():
    model, sampler, objective, noise = _problem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradest.estimator("exact").backward(model, sampler, objective, noise=noise)
        gradest.rollout(model, flow=sampler, noise=noise)
    assert [w.filename for w in caught] == [__file__, __file__]


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


def test_flow_keyword_is_deprecated_everywhere_and_both_is_an_error():
    model, sampler, objective, noise = _problem()
    est = gradest.estimator("exact")
    want = est.estimate(model, sampler, objective, noise=noise).flat()
    with pytest.deprecated_call(match=r"pass sampler=\.\.\. instead"):
        got = est.estimate(model, flow=sampler, objective=objective, noise=noise).flat()
    assert torch.equal(got, want)
    with pytest.deprecated_call(match="flow="):
        est.surrogate(model, flow=sampler, objective=objective, noise=noise)
    with pytest.deprecated_call(match="flow="):
        trajectory = gradest.rollout(model, flow=sampler, noise=noise)
    assert torch.equal(trajectory.states, gradest.rollout(model, sampler, noise).states)
    with pytest.raises(TypeError, match=r"both sampler= and the deprecated flow="):
        est.estimate(model, sampler, objective, flow=sampler, noise=noise)
    with pytest.raises(TypeError, match=r"both sampler= and the deprecated flow="):
        gradest.rollout(model, sampler=sampler, flow=sampler, noise=noise)
    with pytest.deprecated_call():
        gradest.flow_matching_trajectory(flow=sampler, data=noise, noise=noise)
    with pytest.deprecated_call():
        gradest.rl.step_kl(
            flow=gradest.FlowSDE(steps=STEPS),
            k=1,
            velocity=noise,
            reference=noise,
        )


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
    assert not hasattr(gradest.TrajectoryGradientEstimator, "backward")


def test_old_sampler_and_condition_names_warn_and_are_the_new_classes():
    from gradest import diffusion_samplers, samplers
    from gradest.integrations import diffusers as integration

    with pytest.deprecated_call(match=r"gradest\.DDIM"):
        assert gradest.DDIMSampler is gradest.DDIM
    with pytest.deprecated_call(match="DDIM"):
        assert diffusion_samplers.DDIMSampler is gradest.DDIM
    with pytest.deprecated_call(match="DDIM"):
        assert integration.DDIMSampler is gradest.DDIM
    with pytest.deprecated_call(match="StochasticFlowMatch"):
        assert samplers.StochasticFlowMatchSampler is samplers.StochasticFlowMatch
    with pytest.deprecated_call(match="StochasticFlowMatch"):
        assert integration.StochasticFlowMatchSampler is samplers.StochasticFlowMatch
    with pytest.deprecated_call(match=r"gradest\.SharedCondition"):
        assert gradest.Shared is gradest.SharedCondition
    with pytest.raises(AttributeError):
        gradest.NoSuchName  # noqa: B018


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
    for cls in (gradest.RectifiedFlow, StochasticFlowMatch, gradest.DDIM):
        assert callable(getattr(cls, "from_scheduler", None)), cls
    with pytest.raises(ValueError, match="DDIM needs exactly one of steps=N"):
        gradest.DDIM(alphas_cumprod=levels)


def test_ddim_from_scheduler_is_a_deprecated_alias():
    diffusers = pytest.importorskip("diffusers")
    from gradest.integrations.diffusers import ddim_from_scheduler

    scheduler = diffusers.DDIMScheduler(clip_sample=False)
    want = gradest.DDIM.from_scheduler(scheduler, 5, eta=0.3)
    with pytest.deprecated_call(match=r"gradest\.DDIM\.from_scheduler"):
        got = ddim_from_scheduler(scheduler, 5, eta=0.3)
    assert torch.equal(got.times, want.times) and got.eta == want.eta
    assert torch.equal(got.alphas_cumprod, want.alphas_cumprod)


def test_flow_samplers_from_a_flow_matching_scheduler():
    diffusers = pytest.importorskip("diffusers")
    from gradest.integrations.diffusers import flow_from_scheduler
    from gradest.samplers import StochasticFlowMatch

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow = gradest.RectifiedFlow.from_scheduler(scheduler, 6)
    assert torch.equal(flow.times, flow_from_scheduler(scheduler, 6).times)
    with pytest.raises(ValueError, match=r"use RectifiedFlow\.from_scheduler"):
        StochasticFlowMatch.from_scheduler(scheduler, 6)
