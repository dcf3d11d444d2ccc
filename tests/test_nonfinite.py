"""NaN / Inf is detected where it appears; never a silently poisoned ``.grad``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 2, 6
SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=3",
    "sdo:full_sum=true",
    f"truncated:k={STEPS}",
]


class NaNBelow(nn.Module):
    """A velocity model that returns NaN once t drops below ``threshold``."""

    def __init__(self, threshold: float):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.threshold = threshold

    def forward(self, z, t):
        poison = torch.where(t[:, None] < self.threshold, float("nan"), 0.0).to(z.dtype)
        return self.inner(z, t) + poison


class NaNGradient(nn.Module):
    """Finite forward, non-finite gradient: ``0 * sqrt(x)`` at ``x = 0``."""

    def __init__(self, in_state: bool):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.zero = nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.in_state = in_state

    def forward(self, z, t):
        x = (z - z.detach()) if self.in_state else self.zero
        return self.inner(z, t) + 0.0 * torch.sqrt(x)


def _objective(kind):
    if kind == "terminal":
        return smooth_terminal_objective(DIM)
    return random_stepwise_objective(STEPS, (BATCH, DIM))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_a_nan_velocity_is_reported_at_its_step(spec, kind):
    flow = gradest.RectifiedFlow(steps=STEPS)  # times 1, 5/6, 4/6, 3/6, ...
    model = NaNBelow(threshold=0.6)  # first NaN at step 3 (t = 0.5)
    noise = seeded_normal((BATCH, DIM), 0)
    with pytest.raises(gradest.NonFiniteError, match=r"velocity at step 3 in estimator") as info:
        gradest.estimator(spec).estimate(model, flow, _objective(kind), noise=noise)
    assert info.value.steps == (3,) and info.value.tensor == "velocity"
    assert info.value.estimator.startswith(type(gradest.estimator(spec)).__name__)


def test_a_nan_parameter_gradient_is_detected():
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    with pytest.raises(gradest.NonFiniteError, match=r"parameter gradient \(zero\)"):
        gradest.estimator("exact:checkpoint=true").estimate(
            NaNGradient(in_state=False), flow, _objective("terminal"), noise=noise
        )


def test_a_nan_state_gradient_is_detected_in_the_adjoint_sweep():
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    # the reverse sweep meets the last step first
    with pytest.raises(gradest.NonFiniteError, match=rf"state gradient at step {STEPS - 1}"):
        gradest.estimator("jagg").estimate(
            NaNGradient(in_state=True), flow, _objective("terminal"), noise=noise
        )


@pytest.mark.parametrize("spec", SPECS)
def test_skip_returns_an_unusable_estimate_and_leaves_grad_untouched(spec):
    flow = gradest.RectifiedFlow(steps=STEPS)
    model = NaNBelow(threshold=0.6)
    noise = seeded_normal((BATCH, DIM), 0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    result = gradest.estimator(spec).estimate(
        model, flow, _objective("terminal"), noise=noise, on_nonfinite="skip"
    )
    assert not result.usable and result.grads == {}
    assert "velocity at step 3" in result.info["nonfinite"]
    assert all(bool((p.grad == 7.0).all()) for p in model.parameters())


def test_finite_estimates_are_usable_and_bad_mode_is_rejected():
    flow = gradest.RectifiedFlow(steps=STEPS)
    model = tiny_mlp(DIM)
    noise = seeded_normal((BATCH, DIM), 0)
    est = gradest.estimator("exact")
    assert est.estimate(
        model, flow, _objective("terminal"), noise=noise, on_nonfinite="skip"
    ).usable
    with pytest.raises(ValueError, match=r"on_nonfinite must be one of \('raise', 'skip'\)"):
        est.estimate(model, flow, _objective("terminal"), noise=noise, on_nonfinite="ignore")


def test_a_non_finite_loss_gradient_names_the_step():
    flow = gradest.RectifiedFlow(steps=STEPS)
    model = tiny_mlp(DIM)
    trajectory = gradest.rollout(model, flow, seeded_normal((BATCH, DIM), 0))

    def loss(k, v, traj):
        return (v.abs() * 0 + torch.sqrt(v - v.detach())).sum() if k == 4 else v.sum()

    with pytest.raises(gradest.NonFiniteError, match=r"gradient of the loss at step 4"):
        gradest.estimator("exact").estimate(
            model, flow, gradest.StepwiseObjective(loss), trajectory=trajectory
        )


class NaNGradientBelow(nn.Module):
    """Finite forward everywhere; a NaN state gradient only at steps with ``t < threshold``
    (``0 * sqrt(z - z)`` differentiates to ``0 * inf``)."""

    def __init__(self, threshold: float):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.threshold = threshold

    def forward(self, z, t):
        if float(t[0]) < self.threshold:
            return self.inner(z, t) + 0.0 * torch.sqrt(z - z.detach())
        return self.inner(z, t)


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_a_nan_only_in_the_fused_backward_is_located_at_its_step(engine):
    """The fused chain's one backward sees the NaN somewhere in N steps; gradest then sweeps
    step by step and names the step where it first appears (the reverse sweep meets the
    latest poisoned step first: steps 3, 4, 5 have t < 0.6, so step 5)."""
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    with pytest.raises(gradest.NonFiniteError) as info:
        gradest.estimator("exact").estimate(
            NaNGradientBelow(0.6), flow, _objective("terminal"), noise=noise, engine=engine
        )
    assert info.value.steps == (STEPS - 1,), str(info.value)
    assert info.value.tensor.startswith(("state gradient", "parameter gradient"))


def test_a_nan_in_the_terminal_loss_gradient_is_not_blamed_on_the_model():
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    objective = gradest.TerminalObjective(
        lambda z: z.sum() + 0.0 * torch.sqrt(z - z.detach()).sum()
    )
    for spec in ("exact", "exact:checkpoint=true", "jagg:window=3", "sdo", "truncated"):
        with pytest.raises(gradest.NonFiniteError) as info:
            gradest.estimator(spec).estimate(tiny_mlp(DIM), flow, objective, noise=noise)
        assert info.value.tensor == "gradient of the loss on the final sample", spec
        assert "parameter" not in str(info.value)


@pytest.mark.parametrize("spec", ["exact", "jagg:window=3", "sdo", "truncated"])
def test_an_empty_batch_is_a_clear_error(spec):
    flow = gradest.RectifiedFlow(steps=STEPS)
    empty = torch.zeros(0, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"noise is empty \(shape \(0, 3\)\)"):
        gradest.estimator(spec).estimate(tiny_mlp(DIM), flow, _objective("terminal"), noise=empty)
    with pytest.raises(ValueError, match=r"noise is empty"):
        gradest.rollout(tiny_mlp(DIM), flow, empty)


@pytest.mark.parametrize(
    "spec",
    ["exact", "exact:checkpoint=true", "jagg:window=4", "jagg:window=2", "sdo", "truncated"],
)
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_one_sample_one_step_and_a_window_longer_than_the_chain(spec, kind):
    """Degenerate but valid shapes give the right answer (exact's) where it is defined."""
    from gradest.reference import exact_gradient, relative_error

    for steps, batch in ((1, 1), (1, 3), (3, 1)):
        flow = gradest.RectifiedFlow(steps=steps)
        model = tiny_mlp(DIM)
        noise = seeded_normal((batch, DIM), 0)
        objective = (
            smooth_terminal_objective(DIM)
            if kind == "terminal"
            else random_stepwise_objective(steps, (batch, DIM))
        )
        trajectory = gradest.rollout(model, flow, noise)
        truth, _ = exact_gradient(model, flow, objective, trajectory)
        result = gradest.estimator(spec).estimate(model, flow, objective, trajectory=trajectory)
        flat = torch.cat([g.reshape(-1) for g in truth.values()])
        if steps == 1 or spec in ("exact", "exact:checkpoint=true", "jagg:window=2"):
            # one step: every estimator keeps the only step's exact term
            assert relative_error(result.flat(), flat) < 1e-10, (spec, steps, batch)
        else:
            assert torch.isfinite(result.flat()).all()
