"""NaN / Inf is detected where it appears; never a silently poisoned ``.grad``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest.reference.problems import (
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
    result = gradest.estimator(spec).backward(
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
