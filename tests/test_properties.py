"""Property-based tests: on random small problems every estimator equals its definition.

Hypothesis draws the problem (vector or ``[C, H, W]`` states, steps ``N``, batch, uniform
or non-uniform time grid, class/keyword conditioning, a frozen parameter subset, terminal
or stepwise objective, sampling from noise or on a recorded trajectory, noise gradient)
and the estimator with its options. For each draw:

* the estimate equals the estimator's dense definition
  (``gradest.reference.definition_gradient``) evaluated for the random choices the
  estimate reports (sampled steps, truncation depth, gate decisions), and ``jagg``'s
  reported gate cosines equal the dense ones;
* the noise gradient equals its dense definition;
* the known truths of docs/design.md#known-truths hold: ``exact`` equals ``exact_gradient``;
  ``truncated(k=N)``, ``jagg(window=2, order=1, shared_knots=False)`` and, for stepwise
  objectives, ``sdo(full_sum=True)`` equal ``exact``.

Tolerances: in float64 the estimate and its definition differ only by round-off of a few
hundred products of O(1) numbers, ~1e-15 relative; ``FLOAT64_TOLERANCE = 1e-9`` leaves
six orders of margin and still catches any wrong term (a single missing step changes the
gradient by O(1/N)); the measured worst over 300 random examples was 2e-15. In float32
the estimator runs in single precision against a float64 definition of the same (float32)
weights: the measured worst relative error over 400 random examples was 1.8e-5 (``sdo``,
whose ``N/m`` scaling magnifies round-off; ``exact``, ``jagg`` and ``truncated`` stayed
below 6e-6), unit round-off 6e-8 amplified through N <= 10 steps and the adjoint;
``FLOAT32_TOLERANCE = 2e-4`` leaves a 10x margin. Errors are relative to the larger of
the exact gradient's and the definition's norm, so an estimate that is legitimately near
zero (``truncated`` with a frozen last layer, say) is not held to its own tiny norm.

Profiles (``tests/_hypothesis_profiles.py``): ``ci`` (default, derandomized, a few
examples per property) and ``long`` (``GRADEST_HYPOTHESIS_PROFILE=long``).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from _hypothesis_profiles import examples
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import gradest
from gradest.reference import (
    definition_gradient,
    definition_noise_grad,
    dense_chain,
    exact_gradient,
    jagg_gate_cosines,
)
from gradest.testing.problems import seeded_normal, tiny_mlp

FLOAT64_TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 2e-4
CLASSES = 3


# -- models ------------------------------------------------------------------------------------


class TinyConvVelocity(nn.Module):
    """``v(z, t, y=None, gain=1.0)`` for ``[B, C, H, W]`` states: conv, SiLU, conv.

    The time (and class) embedding is added per channel after the first convolution;
    ``gain`` is a non-tensor keyword argument, to exercise conditioning values that are
    not batched tensors.
    """

    def __init__(self, channels: int, hidden: int, num_classes: int | None):
        super().__init__()
        self.conv_in = nn.Conv2d(channels, hidden, kernel_size=3, padding=1)
        self.time_embed = nn.Linear(1, hidden)
        self.class_embed = nn.Embedding(num_classes + 1, hidden) if num_classes else None
        self.conv_out = nn.Conv2d(hidden, channels, kernel_size=3, padding=1)

    def forward(self, z: Tensor, t: Tensor, y: Tensor | None = None, gain: float = 1.0) -> Tensor:
        h = self.conv_in(z) + self.time_embed(t[:, None])[:, :, None, None]
        if self.class_embed is not None and y is not None:
            h = h + self.class_embed(y)[:, :, None, None]
        return gain * self.conv_out(nn.functional.silu(h))


# -- what hypothesis draws ---------------------------------------------------------------------


@attrs.frozen
class Case:
    """One random problem; ``build`` turns it into tensors (printed on failure)."""

    state_shape: tuple[int, ...]  # per sample: (dim,) or (C, H, W)
    steps: int
    batch: int
    times: tuple[float, ...] | None  # None: uniform RectifiedFlow(steps=N)
    conditioned: bool
    frozen: frozenset[int]  # indices into named_parameters() to freeze (mod count)
    objective: str  # "terminal" | "stepwise"
    source: str  # "noise" | "trajectory"
    noise_grad: bool
    seed: int


@st.composite
def time_grids(draw, steps: int) -> tuple[float, ...] | None:
    """None (uniform 1 -> 0) or a strictly decreasing grid with uneven steps in [0, 1]."""
    if draw(st.booleans()):
        return None
    start = draw(st.sampled_from([1.0, 0.9, 0.75]))
    end = draw(st.sampled_from([0.0, 0.05, 0.2]))
    # Gaps within a factor 10 of each other: uneven, but no step so small that the
    # grid degenerates.
    gaps = draw(st.lists(st.integers(1, 10), min_size=steps, max_size=steps))
    total = sum(gaps)
    grid, t = [start], start
    for gap in gaps:
        t -= (start - end) * gap / total
        grid.append(t)
    grid[-1] = end
    return tuple(grid)


@st.composite
def cases(draw, objectives=("terminal", "stepwise")) -> Case:
    image = draw(st.booleans())
    if image:
        state_shape = (
            draw(st.integers(1, 2)),
            draw(st.integers(2, 3)),
            draw(st.integers(2, 3)),
        )
    else:
        state_shape = (draw(st.integers(1, 4)),)
    steps = draw(st.integers(2, 10))
    objective = draw(st.sampled_from(objectives))
    return Case(
        state_shape=state_shape,
        steps=steps,
        batch=draw(st.integers(1, 3)),
        times=draw(time_grids(steps)),
        conditioned=draw(st.booleans()),
        frozen=draw(st.frozensets(st.integers(0, 11), max_size=4)),
        objective=objective,
        source=draw(st.sampled_from(["noise", "trajectory"])),
        noise_grad=objective == "terminal" and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def estimator_specs(draw, steps: int) -> str:
    """A spec string with options valid for a chain of ``steps`` steps."""
    name = draw(st.sampled_from(["exact", "jagg", "sdo", "truncated"]))
    if name == "exact":
        return f"exact:checkpoint={draw(st.booleans())}"
    if name == "jagg":
        window = draw(st.integers(2, steps + 1))  # longer than the chain: one group
        order = draw(st.integers(1, min(window - 1, 3)))
        # tau near 1 makes some groups fall back, -1 none: both paths get exercised.
        tau = draw(st.sampled_from([-1.0, 0.0, 0.9, 0.999, 0.99999]))
        gate = draw(st.sampled_from(["min", "mean", "off"]))
        shared = draw(st.booleans())
        return f"jagg:window={window},order={order},tau={tau},gate={gate},shared_knots={shared}"
    if name == "sdo":
        if draw(st.booleans()):
            return "sdo:full_sum=true"
        samples = draw(st.integers(1, steps))
        return f"sdo:samples={samples},scale={draw(st.sampled_from(['unbiased', 'none']))}"
    kind = draw(st.sampled_from(["fixed", "uniform", "probabilities"]))
    if kind == "fixed":
        return f"truncated:k={draw(st.integers(1, steps))}"
    if kind == "uniform":
        largest = draw(st.one_of(st.none(), st.integers(1, steps)))
        return f"truncated:k={largest},random=uniform"
    weights = draw(st.lists(st.integers(0, 4), min_size=1, max_size=steps))
    if not any(weights):
        weights[-1] = 1
    # Exact binary fractions (sum of weights a power of two is not needed: the validator
    # allows 1e-6 slack for decimal round-off).
    total = sum(weights)
    return "truncated:random=" + "/".join(repr(w / total) for w in weights)


# -- building a case -------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Problem:
    model: nn.Module
    flow: gradest.RectifiedFlow
    objective: gradest.TerminalObjective | gradest.StepwiseObjective
    noise: Tensor
    cond: dict | None
    trajectory: gradest.Trajectory

    def inputs(self, source: str) -> dict:
        return {"noise": self.noise} if source == "noise" else {"trajectory": self.trajectory}


def _terminal_objective(shape: tuple[int, ...], seed: int) -> gradest.TerminalObjective:
    weights = seeded_normal(shape, seed)

    def loss_fn(z: Tensor) -> Tensor:
        return torch.sin(weights.to(z.dtype) * z).pow(2).sum() + 0.1 * z.pow(2).sum()

    return gradest.TerminalObjective(loss_fn)


def _stepwise_objective(steps: int, shape: tuple[int, ...], seed: int) -> gradest.StepwiseObjective:
    linear = seeded_normal((steps, *shape), seed)
    centres = seeded_normal((steps, *shape), seed + 1)

    def loss_fn(k: int, v: Tensor, trajectory) -> Tensor:
        del trajectory
        w, m = linear[k].to(v.dtype), centres[k].to(v.dtype)
        return (w * v).sum() + 0.5 * (v - m).pow(2).sum() / steps

    return gradest.StepwiseObjective(loss_fn)


def build(case: Case, dtype: torch.dtype = torch.float64) -> Problem:
    classes = CLASSES if case.conditioned else None
    if len(case.state_shape) == 1:
        model = tiny_mlp(case.state_shape[0], hidden=6, num_classes=classes, seed=case.seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            model = TinyConvVelocity(case.state_shape[0], hidden=3, num_classes=classes)
    model = model.to(dtype)
    names = [name for name, _ in model.named_parameters()]
    frozen = {names[index % len(names)] for index in case.frozen}
    if frozen >= set(names):
        frozen.discard(names[-1])  # at least one trainable parameter
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)

    flow = (
        gradest.RectifiedFlow(steps=case.steps)
        if case.times is None
        else gradest.RectifiedFlow(times=case.times)
    )
    full_shape = (case.batch, *case.state_shape)
    noise = seeded_normal(full_shape, case.seed + 1, dtype)
    cond = None
    if case.conditioned:
        # Labels cycle through the classes and the null class (label CLASSES).
        labels = (torch.arange(case.batch) + case.seed) % (CLASSES + 1)
        cond = {"y": labels} if len(case.state_shape) == 1 else {"y": labels, "gain": 0.7}
    objective = (
        _terminal_objective(full_shape, case.seed + 2)
        if case.objective == "terminal"
        else _stepwise_objective(case.steps, full_shape, case.seed + 2)
    )
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    return Problem(model, flow, objective, noise, cond, trajectory)


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1).to(torch.float64) for g in grads.values()])


def assert_close(estimate: Tensor, definition: Tensor, scale: Tensor, tolerance: float) -> None:
    """``|estimate - definition| <= tolerance * max(|scale|, |definition|)``.

    ``scale`` is the exact gradient: an estimate that is legitimately near zero is held to
    the size of the gradient it approximates, not to its own tiny norm.
    """
    error = float((estimate.to(torch.float64) - definition).norm())
    bound = tolerance * max(float(scale.norm()), float(definition.norm()), 1e-12)
    assert error <= bound, f"error {error:.3e} > {bound:.3e} (|definition|={definition.norm():.3e})"


def check_against_definition(
    case: Case,
    spec: str,
    generator_seed: int,
    dtype: torch.dtype,
    tolerance: float,
    engine: str = "autograd",
) -> float:
    """Estimate, rebuild the estimator's definition densely, compare; returns the error."""
    problem = build(case, dtype)
    est = gradest.estimator(spec)
    result = est.estimate(
        problem.model,
        problem.flow,
        problem.objective,
        cond=problem.cond,
        generator=torch.Generator().manual_seed(generator_seed),
        noise_grad=case.noise_grad,
        engine=engine,
        **problem.inputs(case.source),
    )
    chain = dense_chain(problem.model, problem.flow, problem.trajectory, problem.cond)
    truth, true_noise_grad = exact_gradient(
        problem.model, problem.flow, problem.objective, problem.trajectory, chain=chain
    )
    scale = _flat(truth)
    definition = definition_gradient(est, chain, problem.objective, result)
    assert definition is not None
    assert list(result.grads) == [n for n, p in problem.model.named_parameters() if p.requires_grad]
    estimate = result.flat()
    assert_close(estimate, definition, scale, tolerance)

    if est.name == "jagg" and est.gate != "off":
        dense = jagg_gate_cosines(
            chain, result.info["groups"], result.info["nodes"], problem.flow.times, est.gate
        )
        for got, want in zip(result.info["gate_cosines"], dense, strict=True):
            assert (got is None) == (want is None)
            if want is not None:
                assert got == pytest.approx(want, abs=10 * tolerance)

    if case.noise_grad:
        # Each estimator's own definition of the noise gradient (jagg's and exact's are
        # the exact a_0: cross-checked against exact_gradient's).
        want = definition_noise_grad(est, chain, problem.objective, result)
        if est.name in ("exact", "jagg"):
            assert_close(want.reshape(-1), true_noise_grad.reshape(-1), want.reshape(-1), tolerance)
        assert result.noise_grad is not None
        assert_close(result.noise_grad.reshape(-1), want.reshape(-1), want.reshape(-1), tolerance)
    else:
        assert result.noise_grad is None
    size = max(float(scale.norm()), float(definition.norm()), 1e-12)
    return float((estimate.to(torch.float64) - definition).norm()) / size


# -- properties --------------------------------------------------------------------------------


@examples(ci=30)
@given(data=st.data(), case=cases())
def test_every_estimator_equals_its_definition_float64(data, case):
    spec = data.draw(estimator_specs(case.steps), label="spec")
    seed = data.draw(st.integers(0, 2**16), label="generator seed")
    check_against_definition(case, spec, seed, torch.float64, FLOAT64_TOLERANCE)


@examples(ci=12)
@given(data=st.data(), case=cases())
def test_every_estimator_equals_its_definition_float32(data, case):
    spec = data.draw(estimator_specs(case.steps), label="spec")
    seed = data.draw(st.integers(0, 2**16), label="generator seed")
    check_against_definition(case, spec, seed, torch.float32, FLOAT32_TOLERANCE)


@examples(ci=12)
@given(data=st.data(), case=cases())
def test_every_estimator_equals_its_definition_with_the_func_engine(data, case):
    """The torch.func path (functional_call + torch.func.vjp) against the same definitions."""
    spec = data.draw(estimator_specs(case.steps), label="spec")
    seed = data.draw(st.integers(0, 2**16), label="generator seed")
    check_against_definition(case, spec, seed, torch.float64, FLOAT64_TOLERANCE, engine="func")


# The surrogate's gradient and the estimate evaluate the same VJPs; only the order of a
# few sums may differ (measured worst over the ci examples: 4e-16).
SURROGATE_TOLERANCE = 1e-12


@examples(ci=25)
@given(data=st.data(), case=cases())
def test_the_surrogate_loss_gradient_equals_the_estimate(data, case):
    spec = data.draw(estimator_specs(case.steps), label="spec")
    seed = data.draw(st.integers(0, 2**16), label="generator seed")
    problem = build(case)
    est = gradest.estimator(spec)
    kwargs = dict(cond=problem.cond, **problem.inputs(case.source))
    result = est.estimate(
        problem.model,
        problem.flow,
        problem.objective,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )
    sur = est.surrogate(
        problem.model,
        problem.flow,
        problem.objective,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )
    params = [p for p in problem.model.parameters() if p.requires_grad]
    got = torch.cat([g.reshape(-1) for g in torch.autograd.grad(sur.loss, params)])
    assert_close(got, result.flat(), result.flat(), SURROGATE_TOLERANCE)


def _estimate(problem: Problem, spec: str, case: Case, **extra) -> gradest.GradientEstimate:
    return gradest.estimator(spec, **extra).estimate(
        problem.model,
        problem.flow,
        problem.objective,
        cond=problem.cond,
        noise_grad=case.noise_grad,
        generator=torch.Generator().manual_seed(0),
        **problem.inputs(case.source),
    )


@examples(ci=8)
@given(case=cases())
def test_exact_equals_the_dense_exact_gradient(case):
    problem = build(case)
    result = _estimate(problem, "exact", case)
    truth, noise_grad = exact_gradient(
        problem.model, problem.flow, problem.objective, problem.trajectory, problem.cond
    )
    assert_close(result.flat(), _flat(truth), _flat(truth), FLOAT64_TOLERANCE)
    if case.noise_grad:
        assert_close(result.noise_grad, noise_grad, noise_grad, FLOAT64_TOLERANCE)


@examples(ci=8)
@given(data=st.data(), case=cases())
def test_pinned_configurations_equal_exact(data, case):
    """truncated(k=N), jagg(window=2, order=1, no shared knots) with any gate, and (stepwise)
    sdo(full_sum=True) are exact, through the VJP code path (no dense reference)."""
    problem = build(case)
    exact = _estimate(problem, "exact", case)
    pinned = [
        f"truncated:k={case.steps}",
        "jagg:window=2,order=1,shared_knots=false,"
        + data.draw(st.sampled_from(["gate=off", "gate=min,tau=1.0", "gate=mean,tau=-1.0"])),
    ]
    if case.objective == "stepwise":
        pinned.append("sdo:full_sum=true")
    for spec in pinned:
        result = _estimate(problem, spec, case)
        assert_close(result.flat(), exact.flat(), exact.flat(), FLOAT64_TOLERANCE)
        if case.noise_grad:
            assert_close(result.noise_grad, exact.noise_grad, exact.noise_grad, FLOAT64_TOLERANCE)
