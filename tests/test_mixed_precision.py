"""Mixed precision: bfloat16 autocast and bfloat16 parameters on the CPU.

gradest calls the model as itself and takes VJPs with ``torch.autograd.grad`` (or, with
``engine="func"``, through ``torch.func``); both work under
``torch.autocast("cpu", dtype=torch.bfloat16)`` wrapped around ``estimate``/``backward``:
linear layers, convolutions and attention run in bfloat16, the states, cotangents and
the returned gradients stay float32 (the parameters' dtype). A model converted with
``model.to(torch.bfloat16)`` (with bfloat16 noise) runs end to end too, and its
gradients are bfloat16.

Tolerances, from measurements: tiny DiT perturbed off its adaLN-Zero init and a tiny MLP,
8 steps, terminal and stepwise objectives, the seven ``SPECS`` below, 8 seeds of model and
noise each (and 4 more at 10 steps):

===============================  ================================  =========  ==========
setting                          compared with                     worst cos  worst rel.
===============================  ================================  =========  ==========
float32 model, bf16 autocast     the same estimate in float32      0.999983   0.0060
bf16 parameters and noise        float32 model, same rounded       0.99725    0.080
                                 weights
===============================  ================================  =========  ==========

The bounds leave a margin of 4x to 6x on ``1 - cos`` and on the relative error:
``AUTOCAST_MIN_COSINE = 1 - 1e-4``, ``AUTOCAST_MAX_RELATIVE_ERROR = 0.025``,
``BF16_MIN_COSINE = 0.99``, ``BF16_MAX_RELATIVE_ERROR = 0.3``. The smallest autocast error
measured was 0.0019, so the check that autocast changed anything (error > 1e-5) is safe.
With bfloat16 parameters the whole chain, states included, is rounded to 8 significand
bits, hence the larger error; under autocast only the matmul-like operators are.

``jagg``'s gate is excluded from the gradient tolerances (``gate="off"``): a gate cosine
near ``tau`` may fall on either side under bf16 rounding, and then a different group falls
back, which is a different (equally valid) estimate, not an error.
Its cosines are computed in float32 or better with autocast switched off inside the gate
(autocast would otherwise lower the interpolation ``einsum`` to bfloat16, which moved the
cosine by up to 2.9e-3 on identical float32 velocities, more than half the margin of the
default ``tau=0.995``); ``test_jagg_gate_ignores_autocast`` pins that.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

import gradest
from gradest.models.dit import DiT
from gradest.strategies.jagg_gate import gate_cosines
from gradest.strategies.jagg_layout import lagrange_weights, layout_groups
from gradest.testing.problems import tiny_mlp

AUTOCAST_MIN_COSINE = 1 - 1e-4
AUTOCAST_MAX_RELATIVE_ERROR = 0.025
BF16_MIN_COSINE = 0.99
BF16_MAX_RELATIVE_ERROR = 0.3
STEPS, BATCH = 8, 4
SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=4,gate=off",
    "jagg:window=3,order=2,shared_knots=true,gate=off",
    "sdo:full_sum=true",
    "sdo:samples=3",
    "truncated:k=3",
]


def _dit() -> torch.nn.Module:
    """A tiny DiT moved off its adaLN-Zero init (which outputs zeros), float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DiT.from_config("tiny")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def _problem(model_name: str):
    if model_name == "dit":
        model, shape, classes = _dit(), (BATCH, 1, 8, 8), 10
    else:
        model = tiny_mlp(4, hidden=32, num_classes=3, dtype=torch.float32)
        shape, classes = (BATCH, 4), 3
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    cond = {"y": torch.arange(BATCH) % (classes + 1)}
    objectives = {
        "terminal": gradest.TerminalObjective(
            lambda z: torch.sin(weights.to(z.dtype) * z).pow(2).sum() + 0.1 * z.pow(2).sum()
        ),
        "stepwise": gradest.StepwiseObjective(
            lambda k, v, traj: (v - weights.to(v.dtype)).pow(2).mean()
        ),
    }
    return model, noise, cond, objectives


def _cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()))


def _relative_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _estimate(est, model, objective, noise, cond):
    return est.estimate(
        model,
        gradest.RectifiedFlow(steps=STEPS),
        objective,
        noise=noise,
        cond=cond,
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("model_name", ["dit", "mlp"])
def test_bf16_autocast_matches_float32(model_name, kind):
    model, noise, cond, objectives = _problem(model_name)
    for spec in SPECS:
        est = gradest.estimator(spec)
        reference = _estimate(est, model, objectives[kind], noise, cond)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = _estimate(est, model, objectives[kind], noise, cond)
        assert all(g.dtype == torch.float32 for g in result.grads.values()), spec
        cosine = _cosine(result.flat(), reference.flat())
        error = _relative_error(result.flat(), reference.flat())
        assert cosine >= AUTOCAST_MIN_COSINE, (spec, cosine)
        assert error <= AUTOCAST_MAX_RELATIVE_ERROR, (spec, error)
        # bf16 rounding is really in play (the autocast region was not a no-op).
        assert error > 1e-5, (spec, error)


def test_surrogate_backward_under_autocast_accumulates_float32_grads():
    model, noise, cond, objectives = _problem("dit")
    est = gradest.estimator("exact")
    reference = _estimate(est, model, objectives["terminal"], noise, cond)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        est.surrogate(
            model,
            gradest.RectifiedFlow(steps=STEPS),
            objectives["terminal"],
            noise=noise,
            cond=cond,
        ).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    flat = torch.cat([grads[name].reshape(-1) for name in reference.grads])
    assert _cosine(flat, reference.flat()) >= AUTOCAST_MIN_COSINE


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("model_name", ["dit", "mlp"])
def test_bf16_parameters_match_float32_with_the_same_weights(model_name, kind):
    model, noise, cond, objectives = _problem(model_name)
    low = copy.deepcopy(model).to(torch.bfloat16)
    rounded = copy.deepcopy(low).float()  # the same rounded weights, in float32
    for spec in [*SPECS, "jagg:window=4"]:
        est = gradest.estimator(spec)
        reference = _estimate(est, rounded, objectives[kind], noise, cond)
        result = _estimate(est, low, objectives[kind], noise.bfloat16(), cond)
        assert all(g.dtype == torch.bfloat16 for g in result.grads.values()), spec
        if "gate=off" in spec or not spec.startswith("jagg"):
            assert _cosine(result.flat(), reference.flat()) >= BF16_MIN_COSINE, spec
            assert _relative_error(result.flat(), reference.flat()) <= BF16_MAX_RELATIVE_ERROR
        else:  # the gated estimate is only required to run and report float cosines
            assert all(c is None or -1.0 <= c <= 1.0 + 1e-6 for c in result.info["gate_cosines"])


def _gate_case(dtype: torch.dtype):
    """Velocities along a smooth path for one group of the default layout, and weights."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(BATCH, 64, generator=gen)
    drift = torch.randn(BATCH, 64, generator=gen)
    velocities = [(base + 0.1 * k * drift + 0.02 * k * k).to(dtype) for k in range(STEPS)]
    times = gradest.RectifiedFlow(steps=STEPS).times
    group = layout_groups(STEPS, 4, 1, False)[0]
    weights = lagrange_weights(times[list(group.nodes)], times[list(group.steps)])
    return group, weights, velocities


def _cosine_float64(group, weights, velocities) -> float:
    """The gate's min cosine computed in float64 from the same (rounded) velocities."""
    rows = [row for row, k in enumerate(group.steps) if k not in group.nodes]
    nodes = torch.stack([velocities[j] for j in group.nodes]).double()
    values = []
    for row in rows:
        predicted = torch.einsum("m,mbd->bd", weights[row], nodes)
        actual = velocities[group.steps[row]].double()
        values.append(
            (actual * predicted).sum(-1) / (actual.norm(dim=-1) * predicted.norm(dim=-1) + 1e-8)
        )
    return float(torch.cat(values).min())


def _gate_cosine(group, weights, velocities) -> float:
    """The gate's min cosine of the one group, as jagg computes it (all groups at once)."""
    (cosine,) = gate_cosines([group], [weights.tolist()], velocities, "min")
    return cosine


def test_jagg_gate_upcasts_bf16_velocities_to_float32():
    group, weights, velocities = _gate_case(torch.bfloat16)
    cosine = _gate_cosine(group, weights, velocities)
    # float32 arithmetic on bf16 inputs: agrees with float64 to ~1e-7, where bf16
    # arithmetic would be off by ~1e-3.
    assert cosine == pytest.approx(_cosine_float64(group, weights, velocities), abs=1e-6)


def test_jagg_gate_ignores_autocast():
    group, weights, velocities = _gate_case(torch.float32)
    plain = _gate_cosine(group, weights, velocities)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _gate_cosine(group, weights, velocities)
    assert autocast == pytest.approx(plain, abs=1e-6)
