"""``est.surrogate(...)``: a loss whose autograd gradient is the estimate, for training code.

Checked in float64 for every built-in estimator and option family, terminal and stepwise
objectives, from noise and on a recorded trajectory, on rectified flow and on a general
affine sampler (alpha != 1, recorded noise):

* ``torch.autograd.grad(surrogate(...).loss, params)`` equals ``estimate(...)`` to 1e-12
  relative (measured: <= 3e-16), with the same random and gate decisions, the same value
  and (except where the docstrings say the surrogate recomputes) the same cost;
* ``estimate()`` with the autograd and the torch.func engines agree (and each equals the
  dense definitions in ``tests/test_properties.py``);
* ``surrogate()`` itself writes no ``.grad`` (the cotangent work differentiates states
  only); ``loss.backward()`` writes exactly the estimate; gradients accumulate over
  micro-batches like any loss;
* a loss that does not depend on the sample is refused, as autograd refuses it.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from check_table import check_rows

import gradest
from gradest.base import surrogate_from_estimate
from gradest.reference import relative_error
from gradest.testing.problems import (
    NoisyAffineSampler,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS, CLASSES = 3, 2, 6, 2
# float64: both sides evaluate the same VJPs, only the order of a few sums may differ.
EXACTNESS = 1e-12

# Every built-in estimator and option family.
SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=3,order=2,tau=0.9",
    "jagg:window=4,shared_knots=true,gate=mean",
    "jagg:window=4,tau=1.0",  # every group falls back
    "jagg:window=3,gate=off",
    "sdo",
    "sdo:samples=3,scale=none",
    "sdo:full_sum=true",
    "truncated",
    "truncated:k=3",
    "truncated:random=uniform",
    "truncated:random=0.25/0.25/0.5",
]
# Where the surrogate does more work than estimate() for the same memory (docstrings of
# exact and EstimationContext.backprop_tail): checkpointed steps are recomputed in the
# caller's backward.
RECOMPUTES = {"exact:checkpoint=true"}


@attrs.frozen(eq=False)
class Problem:
    model: torch.nn.Module
    flow: object
    noise: torch.Tensor
    cond: dict
    trajectory: gradest.Trajectory
    objectives: dict


def problem(sampler: str) -> Problem:
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
    flow = gradest.RectifiedFlow(steps=STEPS) if sampler == "euler" else NoisyAffineSampler(STEPS)
    noise = seeded_normal((BATCH, DIM), 10)
    cond = {"y": torch.tensor([0, 1])}
    trajectory = gradest.rollout(
        model, flow, noise, cond=cond, generator=torch.Generator().manual_seed(3)
    )
    objectives = {
        "terminal": smooth_terminal_objective(DIM),
        "stepwise": random_stepwise_objective(STEPS, (BATCH, DIM)),
    }
    return Problem(model, flow, noise, cond, trajectory, objectives)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def decisions(info: dict) -> dict:
    keys = ("sampled_steps", "scale", "k", "fallback_groups", "node_steps", "gate_cosines")
    return {key: info[key] for key in keys if key in info}


@pytest.mark.parametrize("sampler", ["euler", "affine"])
@pytest.mark.parametrize("objective", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("spec", SPECS)
def test_surrogate_gradient_is_the_estimate(spec, source, objective, sampler):
    p = problem(sampler)
    inputs = {"noise": p.noise} if source == "noise" else {"trajectory": p.trajectory}
    est = gradest.estimator(spec)
    common = dict(cond=p.cond, **inputs)
    results = {
        engine: est.estimate(
            p.model,
            p.flow,
            p.objectives[objective],
            generator=torch.Generator().manual_seed(5),
            engine=engine,
            **common,
        )
        for engine in ("autograd", "func")
    }
    sur = est.surrogate(
        p.model,
        p.flow,
        p.objectives[objective],
        generator=torch.Generator().manual_seed(5),
        **common,
    )
    assert sur.loss.ndim == 0 and sur.loss.requires_grad
    assert all(param.grad is None for param in p.model.parameters()), "surrogate() wrote .grad"
    got = flat(torch.autograd.grad(sur.loss, trainable(p.model)))
    want = results["autograd"].flat()
    assert relative_error(got, want) <= EXACTNESS
    assert relative_error(results["func"].flat(), want) <= EXACTNESS
    assert sur.value == pytest.approx(results["autograd"].info["loss"], rel=1e-14)
    assert decisions(sur.info) == decisions(results["autograd"].info)
    if spec not in RECOMPUTES and not (spec == "exact" and source == "trajectory"):
        assert sur.cost == results["autograd"].cost


@pytest.mark.parametrize("spec", ["exact", "exact:checkpoint=true", "jagg:window=3", "sdo"])
def test_loss_backward_writes_the_estimate_and_accumulates_over_micro_batches(spec):
    """Two half-batch surrogates of a mean loss, each scaled by 1/2, backpropagated into
    ``.grad`` one after the other, give the full-batch estimate (a deterministic estimator;
    sdo with full_sum is deterministic, with one sample it draws per micro-batch)."""
    if spec == "sdo":
        spec = "sdo:full_sum=true"
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((4, DIM), 10)
    labels = torch.tensor([0, 1, 1, 0])
    weights = seeded_normal((DIM,), 1)

    def mean_loss(z):
        return (torch.sin(z * weights).pow(2).sum(-1) + 0.1 * z.pow(2).sum(-1)).mean()

    objective = gradest.TerminalObjective(mean_loss)
    est = gradest.estimator(spec)
    full = est.estimate(model, flow, objective, noise=noise, cond={"y": labels})
    for half in (slice(0, 2), slice(2, 4)):
        sur = est.surrogate(model, flow, objective, noise=noise[half], cond={"y": labels[half]})
        (sur.loss / 2).backward()
    accumulated = flat(p.grad for p in trainable(model))
    assert relative_error(accumulated, full.flat()) <= EXACTNESS


def test_estimate_never_writes_grad_with_either_engine():
    p = problem("euler")
    for engine in ("autograd", "func"):
        for spec in SPECS:
            gradest.estimator(spec).estimate(
                p.model,
                p.flow,
                p.objectives["terminal"],
                noise=p.noise,
                cond=p.cond,
                generator=torch.Generator().manual_seed(0),
                engine=engine,
            )
    assert all(param.grad is None for param in p.model.parameters())


def test_surrogate_works_inside_no_grad_and_refuses_inference_mode():
    p = problem("euler")
    est = gradest.estimator("exact")
    with torch.no_grad():
        sur = est.surrogate(p.model, p.flow, p.objectives["terminal"], noise=p.noise, cond=p.cond)
        result = est.estimate(p.model, p.flow, p.objectives["terminal"], noise=p.noise, cond=p.cond)
    got = flat(torch.autograd.grad(sur.loss, trainable(p.model)))
    assert relative_error(got, result.flat()) <= EXACTNESS
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        est.surrogate(p.model, p.flow, p.objectives["terminal"], noise=p.noise, cond=p.cond)


def test_engine_argument_is_validated():
    p = problem("euler")
    with pytest.raises(ValueError, match=r"engine must be one of \('autograd', 'func'\)"):
        gradest.estimator("exact").estimate(
            p.model, p.flow, p.objectives["terminal"], noise=p.noise, cond=p.cond, engine="jax"
        )


def test_the_fallback_surrogate_of_an_estimate_has_the_estimate_as_gradient():
    p = problem("euler")
    result = gradest.estimator("jagg:window=3").estimate(
        p.model, p.flow, p.objectives["terminal"], noise=p.noise, cond=p.cond
    )
    loss = surrogate_from_estimate(p.model, result)
    got = flat(torch.autograd.grad(loss, trainable(p.model)))
    assert relative_error(got, result.flat()) <= EXACTNESS


def test_a_plugin_combining_gradients_outside_the_engine_gets_a_clear_error():
    from gradest.base import EstimatorBase

    @attrs.frozen
    class DoublesByHand(EstimatorBase):
        name = "doubles_by_hand"

        def _stepwise(self, ctx):
            trajectory = ctx.trajectory()
            velocities, pull = ctx.field.param_pullback(trajectory.states[:1], ctx.times[:1])
            grads = pull(ctx.step_cotangent(0, velocities[0])[None])
            return {name: 2 * g for name, g in grads.items()}  # not through scale_grads

    p = problem("euler")
    est = DoublesByHand()
    est.estimate(p.model, p.flow, p.objectives["stepwise"], trajectory=p.trajectory)
    with pytest.raises(TypeError, match="add_grads / scale_grads"):
        est.surrogate(p.model, p.flow, p.objectives["stepwise"], trajectory=p.trajectory)


# -- losses that do not depend on the sample ------------------------------------------------------

UNRELATED_TERMINAL = {
    "detached": lambda z: z.detach().pow(2).sum(),
    "integer": lambda z: (z > 0).sum(),
    "constant": lambda z: torch.tensor(1.0, dtype=torch.float64, requires_grad=True) * 2,
}


@pytest.mark.parametrize("kind", sorted(UNRELATED_TERMINAL))
@pytest.mark.parametrize("spec", ["exact", "exact:checkpoint=true", "jagg:window=3", "sdo"])
@pytest.mark.parametrize("call", ["estimate", "surrogate"])
def test_a_terminal_loss_unrelated_to_the_sample_is_refused(kind, spec, call):
    p = problem("euler")
    objective = gradest.TerminalObjective(UNRELATED_TERMINAL[kind])
    est = gradest.estimator(spec)
    with pytest.raises(ValueError, match="does not depend on it"):
        getattr(est, call)(p.model, p.flow, objective, noise=p.noise, cond=p.cond)


@pytest.mark.parametrize("spec", ["exact", "jagg:window=3", "sdo", "truncated:k=2"])
@pytest.mark.parametrize("call", ["estimate", "surrogate"])
def test_a_stepwise_loss_unrelated_to_every_velocity_is_refused(spec, call):
    p = problem("euler")
    objective = gradest.StepwiseObjective(lambda k, v, trajectory: v.detach().sum())
    with pytest.raises(ValueError, match="does not depend on the velocities"):
        getattr(gradest.estimator(spec), call)(
            p.model, p.flow, objective, trajectory=p.trajectory, cond=p.cond
        )


def test_a_stepwise_loss_that_skips_some_steps_is_fine():
    """A loss that ignores some steps (zero advantage, a masked step) still trains the rest."""
    p = problem("euler")
    objective = gradest.StepwiseObjective(
        lambda k, v, trajectory: v.pow(2).sum() if k % 2 else torch.zeros(())
    )
    result = gradest.estimator("exact").estimate(
        p.model, p.flow, objective, trajectory=p.trajectory, cond=p.cond
    )
    assert float(result.flat().norm()) > 0


def test_gradest_check_fails_an_estimator_whose_surrogate_is_wrong(monkeypatch, capsys):
    """``gradest check`` compares every estimator's surrogate with its estimate, so a
    plugin whose surrogate loss is off (here by a factor 2) fails the check."""
    from gradest import check
    from gradest.strategies.exact import Exact

    @attrs.frozen
    class DoubledSurrogate(Exact):
        name = "exact"  # checked against exact's definition, which its estimate meets

        def surrogate(self, *args, **kwargs):
            sur = super().surrogate(*args, **kwargs)
            return attrs.evolve(sur, loss=2 * sur.loss)

    monkeypatch.setattr(check, "estimator", lambda spec: DoubledSurrogate())
    assert not check.run_check(["exact"], steps=3, show_progress=False)
    rows = check_rows(capsys.readouterr().out)["exact"]
    assert len(rows) == 2 and all("FAIL" in row for row in rows)
    monkeypatch.undo()
    assert check.run_check(["exact"], steps=3, show_progress=False)
