"""Each estimator owns its contract: typed decisions, early step checks, its own definition.

* ``result.decisions`` (and ``sur.decisions``) is a frozen, typed record per estimator,
  the one the estimator's ``definition`` re-evaluates; its fields are also in ``info``.
* ``check_steps(N)`` refuses options that need more steps, before any model call, for
  every caller (``estimate``, ``surrogate``, ``gradest finetune``).
* ``definition_gradient`` asks the estimator (no table of names): a plugin that defines
  ``definition`` is checked like a built-in, one that does not gets None.
* A plugin without attrs takes its options as constructor keyword arguments.
* A noise gradient asked for is given or refused naming the estimator, never a silent
  None.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import gradest
from gradest import registry
from gradest.base import EstimatorBase, estimated_surrogate
from gradest.protocol import Decisions
from gradest.reference import definition_gradient, dense_chain, relative_error
from gradest.strategies.jagg import JaggDecisions
from gradest.strategies.refl import ReflDecisions
from gradest.strategies.sdo import SdoDecisions
from gradest.strategies.telescope import TelescopeDecisions
from gradest.strategies.truncated import TruncatedDecisions
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH, STEPS = 3, 2, 6


@pytest.fixture(scope="module")
def problem():
    model = tiny_mlp(DIM)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    return model, flow, noise, smooth_terminal_objective(DIM)


@pytest.mark.parametrize(
    ("spec", "record", "fields"),
    [
        ("exact", Decisions, {}),
        ("jagg:window=3,tau=1.0", JaggDecisions, {"fallback_groups": (0, 1)}),
        ("sdo:samples=2", SdoDecisions, {"scale": 3.0}),
        ("truncated:k=4", TruncatedDecisions, {"k": 4}),
        ("telescope:mean_depth=6", TelescopeDecisions, {"depth": 6, "noise_weight": 1.0}),
        ("refl:last_steps=1", ReflDecisions, {"step": 5, "window": 1}),
    ],
)
def test_decisions_are_typed_frozen_records(problem, spec, record, fields):
    model, flow, noise, objective = problem
    est = gradest.estimator(spec)
    result = est.estimate(model, flow, objective, noise=noise, generator=torch.Generator())
    assert type(result.decisions) is record
    for name, value in fields.items():
        assert getattr(result.decisions, name) == value
        assert result.info[name] == (list(value) if isinstance(value, tuple) else value)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.decisions.extra = 1  # type: ignore[union-attr]
    sur = est.surrogate(model, flow, objective, noise=noise, generator=torch.Generator())
    assert type(sur.decisions) is record


def test_the_definition_re_evaluates_the_reported_decisions(problem):
    """Change a decision and the definition changes: it reads the record, not the options."""
    model, flow, noise, objective = problem
    est = gradest.estimator("sdo:samples=2")
    trajectory = gradest.rollout(model, flow, noise)
    result = est.estimate(model, flow, objective, trajectory=trajectory)
    chain = dense_chain(model, flow, trajectory)
    assert relative_error(result.flat(), definition_gradient(est, chain, objective, result)) < 1e-12
    other = (set(range(STEPS)) - set(result.decisions.sampled_steps)).pop()
    moved = attrs.evolve(result, decisions=SdoDecisions(sampled_steps=(other,), scale=3.0))
    assert relative_error(result.flat(), definition_gradient(est, chain, objective, moved)) > 0.01


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sdo:samples=7", r"samples=7 exceeds the sampler's N=6 steps"),
        ("truncated:k=7", r"k=7 exceeds the sampler's N=6 steps"),
        ("truncated:random=0.5/0.1/0.1/0.1/0.1/0.05/0.05", r"random has 7 probabilities"),
    ],
)
def test_check_steps_refuses_before_any_model_call(problem, spec, message):
    model, flow, noise, objective = problem
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        est = gradest.estimator(spec)
        with pytest.raises(ValueError, match=message):
            est.check_steps(STEPS)
        for call in (est.estimate, est.surrogate):
            with pytest.raises(ValueError, match=message):
                call(model, flow, objective, noise=noise)
    finally:
        hook.remove()
    assert calls == []
    est.check_steps(7)  # fine on a longer chain


class Halved:
    """A protocol-only plugin (no attrs, no EstimatorBase): half of exact's gradient."""

    name = "halved"

    def __init__(self, factor: float = 0.5, checkpoint: bool = False):
        self.factor = factor
        self.checkpoint = checkpoint

    def estimate(self, model, flow, objective, **kwargs):
        result = gradest.estimator("exact", checkpoint=self.checkpoint).estimate(
            model, flow, objective, **kwargs
        )
        grads = {name: self.factor * g for name, g in result.grads.items()}
        return attrs.evolve(result, grads=grads, decisions=None)

    def surrogate(self, model, flow, objective, **kwargs):
        return estimated_surrogate(self, model, flow, objective, **kwargs)


@attrs.frozen
class NoDefinition(EstimatorBase):
    name = "nodefinition"

    def _terminal(self, ctx):
        return gradest.estimator("exact")._terminal(ctx)


@pytest.fixture
def with_plugins(monkeypatch):
    real = registry.available_estimators()
    monkeypatch.setattr(
        registry,
        "available_estimators",
        lambda: {**real, "halved": Halved, "nodefinition": NoDefinition},
    )


def test_a_plugin_without_attrs_takes_constructor_options(with_plugins):
    est = gradest.estimator("halved:factor=0.25,checkpoint=true")
    assert est.factor == 0.25 and est.checkpoint is True
    assert gradest.estimator("halved", factor=2.0).factor == 2.0
    with pytest.raises(TypeError, match=r"'halved' has no option 'scale'; valid options: factor"):
        gradest.estimator("halved:scale=2")
    with pytest.raises(TypeError, match=r"cannot read option factor='x' as float"):
        gradest.estimator("halved:factor=x")
    names = [row[0] for row in registry.describe("halved")]
    assert names == ["factor", "checkpoint"]


def test_plugins_without_a_definition_get_none(problem, with_plugins):
    model, flow, noise, objective = problem
    trajectory = gradest.rollout(model, flow, noise)
    chain = dense_chain(model, flow, trajectory)
    for spec in ("halved", "nodefinition"):
        est = gradest.estimator(spec)
        result = est.estimate(model, flow, objective, trajectory=trajectory)
        assert definition_gradient(est, chain, objective, result) is None


def test_compare_takes_any_always_exact_estimator_as_reference(problem):
    model, flow, _, objective = problem

    @attrs.frozen
    class MyExact(type(gradest.estimator("exact"))):
        name = "myexact"

    report = gradest.compare(
        model,
        flow,
        objective,
        ["sdo"],
        reference=MyExact(),
        noise_fn=lambda seed: seeded_normal((BATCH, DIM), seed),
        seeds=1,
        draws=1,
        measure_cost=False,
        show_progress=False,
    )
    assert report.rows
    with pytest.raises(ValueError, match="not exact-capable"):
        gradest.compare(
            model, flow, objective, ["sdo"], reference="sdo", noise_fn=lambda s: None, seeds=1
        )


@attrs.frozen
class LastStepOnly(EstimatorBase):
    """Gives no noise gradient: its _terminal returns None for it."""

    name = "laststeponly"

    def _terminal(self, ctx):
        k = ctx.num_steps - 1
        cotangent = ctx.host_coefficients[1][k] * ctx.terminal_adjoint()
        state = ctx.trajectory().states[k : k + 1]
        return ctx.field.param_vjp(state, [ctx.host_times[k]], cotangent[None]), None

    def definition(self, chain, objective, decisions):
        from gradest.protocol import Definition
        from gradest.reference import exact_cotangents

        last = chain.num_steps - 1
        return Definition(grad=chain.gradient(exact_cotangents(chain, objective), [last]))


class SilentNone(Halved):
    """A protocol-only plugin that answers noise_grad=True with None."""

    def estimate(self, model, flow, objective, **kwargs):
        return attrs.evolve(super().estimate(model, flow, objective, **kwargs), noise_grad=None)

    def definition(self, chain, objective, decisions):
        from gradest.protocol import Definition
        from gradest.reference import exact_cotangents

        return Definition(grad=self.factor * chain.gradient(exact_cotangents(chain, objective)))


def test_a_noise_gradient_asked_for_is_given_or_refused_naming_the_estimator(problem):
    from gradest.plugin import NoNoiseGradient
    from gradest.testing import assert_matches_definition, definition_errors

    model, flow, noise, objective = problem
    est = LastStepOnly()
    with pytest.raises(NoNoiseGradient, match=r"estimator LastStepOnly\(\) gives no noise "
                       r"gradient .* noise_grad=True was asked; leave noise_grad out"):  # fmt: skip
        est.estimate(model, flow, objective, noise=noise, noise_grad=True)
    assert est.estimate(model, flow, objective, noise=noise).noise_grad is None
    # The checks compare the rest for it ...
    assert_matches_definition(est, model, flow, objective, noise=noise)
    # ... and name a plugin that answers with a silent None.
    silent = SilentNone()
    assert (
        "noise_grad=True returned None"
        in definition_errors(silent, model, flow, objective, noise=noise)["problems"][0]
    )
    with pytest.raises(AssertionError, match="never answers with a silent None"):
        assert_matches_definition(silent, model, flow, objective, noise=noise)
    # Every built-in gives one.
    for name in registry.builtin_estimators():
        result = gradest.estimator(name).estimate(
            model, flow, objective, noise=noise, noise_grad=True,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        assert result.noise_grad is not None and result.noise_grad.shape == noise.shape, name
