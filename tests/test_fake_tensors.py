"""Every built-in estimator runs on fake and meta tensors (issue 22, item 2).

Under ``torch._subclasses.FakeTensorMode`` (the model's parameters converted with the
mode's ``from_tensor``, the noise created inside the mode) and on the meta device, the
engine takes no data-dependent decision: finiteness is not checked, ``value`` and the
``info`` numbers are NaN, and only the sampler's schedule and the CPU generator (real host
objects) are read. ``estimate`` returns gradients shaped like the parameters and
``surrogate(...).loss.backward()`` runs, so a training step's cost can be traced without
data or weights: FlopCounterMode counts the same FLOPs as on real tensors. jagg's gate
(cosines of velocities) and ``auto`` (it measures) refuse in one line.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import gradest
from gradest._checks import is_symbolic
from gradest.errors import InvalidValue
from gradest.registry import builtin_estimators
from gradest.testing.problems import tiny_mlp

DIM, BATCH, STEPS = 4, 3, 4

SPECS = [
    "jagg:gate=off" if spec == "jagg" else spec
    for spec in sorted(builtin_estimators())
    if spec != "auto"
] + ["exact:checkpoint=true", "sdo:samples=3", "truncated:k=2"]
CASES = [
    (spec, kind)
    for spec in SPECS
    for kind in ("terminal", "stepwise")
    if kind in type(gradest.estimator(spec)).objectives
]


def _objective(kind: str):
    if kind == "terminal":
        return gradest.TerminalObjective(lambda z: (z**2).sum())
    return gradest.StepwiseObjective(lambda k, v, trajectory: (v**2).mean() * (k + 1))


def _fake_model(mode: FakeTensorMode) -> torch.nn.Module:
    """tiny_mlp with every parameter converted to a fake tensor of ``mode``."""
    model = tiny_mlp(DIM, hidden=16, seed=0)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                fake = torch.nn.Parameter(
                    mode.from_tensor(param.detach()), requires_grad=param.requires_grad
                )
                module._parameters[name] = fake
    return model


def _setup(where: str):
    """(model, context manager, make_noise) for ``where`` in fake / meta / real."""
    if where == "fake":
        # The sampler (its grid) and the generator are real host objects built outside.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        return _fake_model(mode), mode, lambda: torch.randn(BATCH, DIM, dtype=torch.float64)
    if where == "meta":
        model = tiny_mlp(DIM, hidden=16, seed=0).to("meta")
        return (
            model,
            contextlib.nullcontext(),
            lambda: torch.randn(BATCH, DIM, dtype=torch.float64, device="meta"),
        )
    return (
        tiny_mlp(DIM, hidden=16, seed=0),
        contextlib.nullcontext(),
        lambda: torch.randn(
            BATCH, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
        ),
    )


def _run(spec: str, kind: str, where: str, verb: str, *, count: FlopCounterMode | None = None):
    """One ``estimate`` or ``surrogate`` + backward; returns (model, result)."""
    model, mode, make_noise = _setup(where)
    flow = gradest.RectifiedFlow(steps=STEPS)
    est = gradest.estimator(spec)
    with mode:
        noise = make_noise()
        inputs = (
            {"noise": noise}
            if kind == "terminal"
            else {"trajectory": gradest.rollout(model, flow, noise)}
        )
        generator = torch.Generator().manual_seed(0)
        with count if count is not None else contextlib.nullcontext():
            if verb == "surrogate":
                result = est.surrogate(model, flow, _objective(kind), generator=generator, **inputs)
                result.loss.backward()
            else:
                result = est.estimate(model, flow, _objective(kind), generator=generator, **inputs)
    return model, result


def _check_shapes(model: torch.nn.Module, grads, where: str) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(params)
    for name, param in params.items():
        grad = grads[name]
        assert grad.shape == param.shape and grad.dtype == param.dtype, name
        assert is_symbolic(grad), name
        if where == "meta":
            assert grad.device.type == "meta"


@pytest.mark.parametrize("where", ["fake", "meta"])
@pytest.mark.parametrize(("spec", "kind"), CASES)
def test_estimate_and_surrogate_run_without_data(spec: str, kind: str, where: str) -> None:
    model, result = _run(spec, kind, where, "estimate")
    _check_shapes(model, result.grads, where)
    assert math.isnan(result.value)

    model, sur = _run(spec, kind, where, "surrogate")
    assert math.isnan(sur.value)
    for key, value in sur.info.items():
        if isinstance(value, float) and key in ("loss", "evaluated_value", "sample_loss"):
            assert math.isnan(value), key
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    _check_shapes(model, grads, where)


@pytest.mark.parametrize("where", ["fake", "meta"])
@pytest.mark.parametrize("verb", ["estimate", "surrogate"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
# (exact:checkpoint=true is left out: FlopCounterMode's module tracker fails inside the
# checkpoint's autograd.grad, on real tensors too.)
@pytest.mark.parametrize("spec", ["exact", "sdo:full_sum=true"])
def test_flops_match_a_real_run(spec: str, kind: str, verb: str, where: str) -> None:
    if kind not in type(gradest.estimator(spec)).objectives:
        pytest.skip(f"{spec} has no {kind} objectives")
    counts = {}
    for run in ("real", where):
        counter = FlopCounterMode(display=False)
        _run(spec, kind, run, verb, count=counter)
        counts[run] = counter.get_total_flops()
    assert counts["real"] > 0
    assert counts[where] == counts["real"]


@pytest.mark.parametrize("where", ["fake", "meta"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_jagg_gate_refuses_in_one_line(kind: str, where: str) -> None:
    for verb in ("estimate", "surrogate"):
        with pytest.raises(InvalidValue, match="gate=off") as err:
            _run("jagg", kind, where, verb)
        message = str(err.value)
        assert "\n" not in message and "jagg's gate needs the velocities' values" in message


@pytest.mark.parametrize("where", ["fake", "meta"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_auto_refuses_in_one_line(kind: str, where: str) -> None:
    for verb in ("estimate", "surrogate"):
        with pytest.raises(InvalidValue, match="fake/meta") as err:
            _run("auto", kind, where, verb)
        assert "\n" not in str(err.value) and "auto" in str(err.value)


def test_is_symbolic() -> None:
    assert not is_symbolic(torch.zeros(2))
    assert not is_symbolic(1.0)
    assert is_symbolic(torch.zeros(2, device="meta"))
    with FakeTensorMode():
        assert is_symbolic(torch.zeros(2))
