"""``gradest.harness.one_step_cotangent_error``: the one-step cotangents' error against the
exact ones, checked against the dense reference's two definitions
(``gradest.reference.exact_cotangents`` and ``gradest.reference.sdo.one_step_cotangents``)
and a chain with a known answer (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest import FlowSDE, RectifiedFlow, TerminalObjective
from gradest.harness import OneStepCotangentError, one_step_cotangent_error
from gradest.reference import dense_chain
from gradest.reference.dense import exact_cotangents
from gradest.reference.sdo import one_step_cotangents
from gradest.testing.problems import (
    five_step_ddim,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

BATCH, DIM, STEPS = 3, 3, 5


SAMPLERS = {
    "rectified": lambda: RectifiedFlow(steps=STEPS),
    "flow-sde": lambda: FlowSDE(steps=STEPS, noise_level=0.5),
    "ddim": five_step_ddim,
}


def mlp() -> nn.Module:
    model = tiny_mlp(DIM, hidden=16, seed=2)
    with torch.no_grad():
        model.output.weight.mul_(3.0)  # state Jacobians far enough from zero to matter
    return model


def recorded(model: nn.Module, sampler) -> gradest.Trajectory:
    noise = seeded_normal((BATCH, DIM), seed=11)
    return gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_it_is_the_dense_references_two_cotangents_compared(kind):
    model, sampler = mlp(), SAMPLERS[kind]()
    objective = smooth_terminal_objective(DIM)
    trajectory = recorded(model, sampler)
    chain = dense_chain(model, sampler, trajectory)
    exact = exact_cotangents(chain, objective).reshape(STEPS, BATCH, DIM)
    one_step = one_step_cotangents(chain, objective).reshape(STEPS, BATCH, DIM)
    want_error = (one_step - exact).norm(dim=2) / exact.norm(dim=2)
    want_cosine = torch.nn.functional.cosine_similarity(one_step, exact, dim=2)

    result = one_step_cotangent_error(model, sampler, trajectory, objective)
    assert isinstance(result, OneStepCotangentError) and result.num_steps == STEPS
    assert result.errors.shape == result.cosines.shape == (STEPS, BATCH)
    assert result.errors.dtype == torch.float64 and result.errors.device.type == "cpu"
    # The last step's cotangent is beta a_N either way; the earlier ones differ.
    assert torch.equal(result.errors[-1], torch.zeros(BATCH))
    assert want_error[:-1].min() > 1e-3
    torch.testing.assert_close(result.errors, want_error, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.cosines, want_cosine, rtol=1e-10, atol=1e-12)

    summary = result.summary()
    assert summary["error"] == pytest.approx(want_error.mean(dim=1).tolist(), rel=1e-10)
    assert summary["mean_error"] == pytest.approx(float(want_error.mean()), rel=1e-10)
    assert summary["mean_cosine"] == pytest.approx(float(want_cosine.mean()), rel=1e-10)
    assert summary["at_start"] == summary["error"][0]
    assert summary["samples"] == BATCH and summary["steps"] == list(range(STEPS))


def test_a_linear_velocity_has_a_known_error():
    """``v = c z`` gives the state Jacobian ``A_j = f_j I``, ``f_j = alpha_j + beta_j c``, so
    ``a_{k+1} = P a_N`` with ``P = prod_{j>k} f_j``, against the one-step ``Q a_N``,
    ``Q = prod_{j>k} alpha_j``: the error is ``|Q - P| / |P|`` and the cosine ``sign(P Q)``."""

    class Linear(nn.Module):
        def forward(self, z, t):
            return -1.7 * z

    for sampler in (RectifiedFlow(steps=STEPS), five_step_ddim()):
        trajectory = gradest.rollout(
            Linear(), sampler, seeded_normal((BATCH, DIM), seed=1), generator=torch.Generator()
        )
        alpha, beta, _ = sampler.coefficients()
        factors = alpha + beta * -1.7
        carried = torch.stack([factors[k + 1 :].prod() for k in range(STEPS)])
        one_step = torch.stack([alpha[k + 1 :].prod() for k in range(STEPS)])
        expected = ((one_step - carried).abs() / carried.abs())[:, None].expand(STEPS, BATCH)
        assert expected[0, 0] > 0.1  # not a trivial comparison
        result = one_step_cotangent_error(
            Linear(), sampler, trajectory, smooth_terminal_objective(DIM)
        )
        torch.testing.assert_close(result.errors, expected, rtol=1e-12, atol=1e-15)
        sign = torch.sign(one_step * carried)[:, None].expand(STEPS, BATCH)
        torch.testing.assert_close(result.cosines, sign, rtol=1e-12, atol=1e-15)


def test_a_state_independent_model_has_no_error():
    """The one-step cotangents drop ``dv/dz`` only: a velocity that ignores the state makes
    them exact under rectified flow (every ``alpha_j = 1``)."""

    class TimeOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

        def forward(self, z, t):
            return self.scale * t.reshape(-1, 1).expand_as(z)

    sampler = RectifiedFlow(steps=STEPS)
    trajectory = gradest.rollout(TimeOnly(), sampler, seeded_normal((BATCH, DIM), seed=1))
    result = one_step_cotangent_error(
        TimeOnly(), sampler, trajectory, smooth_terminal_objective(DIM)
    )
    assert torch.equal(result.errors, torch.zeros(STEPS, BATCH, dtype=torch.float64))
    assert torch.equal(result.cosines, torch.ones(STEPS, BATCH, dtype=torch.float64))


def test_a_loss_blind_to_a_sample_gives_it_zero_error_not_nan():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    trajectory = recorded(model, sampler)
    # Only sample 0 enters the loss: the others' cotangents are zero both ways.
    objective = TerminalObjective(lambda z: (z[:1] ** 2).sum())
    result = one_step_cotangent_error(model, sampler, trajectory, objective)
    assert torch.equal(result.errors[:, 1:], torch.zeros(STEPS, BATCH - 1, dtype=torch.float64))
    assert result.errors[:-1, 0].min() > 0
    assert torch.isfinite(result.cosines).all()


def test_parameters_get_no_gradient():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    one_step_cotangent_error(
        model, sampler, recorded(model, sampler), smooth_terminal_objective(DIM)
    )
    assert all(p.grad is None for p in model.parameters())


# (argument changed, error, message)
BAD_INPUTS = [
    ({"objective": "stepwise"}, TypeError, r"objective must be a gradest.TerminalObjective"),
    ({"objective": len}, TypeError, r"objective must be a gradest.TerminalObjective"),
    ({"sampler": RectifiedFlow(steps=STEPS + 1)}, ValueError, r"different time grid"),
    ({"trajectory": "states"}, TypeError, r"trajectory must be a gradest.Trajectory"),
    ({"model": nn.Module}, TypeError, r"model must be a torch.nn.Module instance"),
    ({"cond": [1]}, TypeError, r"cond must be a dict of keyword arguments"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_argument(change, error, message):
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    trajectory = recorded(model, sampler)
    if change.get("trajectory") == "states":
        change = {"trajectory": trajectory.states}
    if change.get("objective") == "stepwise":
        change = {"objective": random_stepwise_objective(STEPS, (BATCH, DIM))}
    arguments = {
        "model": model,
        "sampler": sampler,
        "trajectory": trajectory,
        "objective": smooth_terminal_objective(DIM),
        **change,
    }
    with pytest.raises(error, match=message) as raised:
        one_step_cotangent_error(**arguments)
    assert "\n" not in str(raised.value)
