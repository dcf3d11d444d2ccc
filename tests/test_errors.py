"""Bad input gets a clear error naming the argument and the fix, before any work starts."""

from __future__ import annotations

import pytest
import torch

import gradest
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 2, 4


@pytest.fixture
def problem():
    model = tiny_mlp(DIM)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    return model, flow, noise, smooth_terminal_objective(DIM)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"steps": 0}, ValueError, r"steps must be >= 1, got 0"),
        ({"steps": 2.5}, TypeError, r"steps must be an int"),
        ({"times": [1.0, 0.5, 0.5, 0.0]}, ValueError, r"strictly decreasing.*times\[1\]=0.5"),
        ({"times": [0.0, 0.5, 1.0]}, ValueError, r"strictly decreasing"),
        ({"times": [1.5, 0.5, 0.0]}, ValueError, r"must lie in \[0, 1\]"),
        ({"times": [1.0]}, ValueError, r"at least 2 entries"),
        ({"times": [1.0, float("nan")]}, ValueError, r"finite"),
        ({}, ValueError, r"exactly one of steps"),
        ({"steps": 3, "times": [1.0, 0.0]}, ValueError, r"exactly one of steps"),
    ],
)
def test_bad_flow_grids(kwargs, error, message):
    with pytest.raises(error, match=message):
        gradest.RectifiedFlow(**kwargs)


def test_noise_of_the_wrong_rank_dtype_or_device(problem):
    model, flow, noise, objective = problem
    est = gradest.estimator("exact")
    with pytest.raises(ValueError, match=r"batch dimension.*noise\[None\]"):
        est.estimate(model, flow, objective, noise=noise[0])
    with pytest.raises(
        ValueError, match=r"model\(z, t, \*\*cond\) failed on a state of shape \(2, 5\)"
    ):
        est.estimate(model, flow, objective, noise=torch.zeros(BATCH, 5, dtype=torch.float64))
    with pytest.raises(
        TypeError,
        match=r"noise has dtype torch.float32 but the model's parameters are torch.float64",
    ):
        est.estimate(model, flow, objective, noise=noise.float())
    with pytest.raises(ValueError, match=r"noise is on meta but the model is on cpu"):
        est.estimate(model, flow, objective, noise=noise.to("meta"))
    with pytest.raises(TypeError, match=r"noise must be a torch.Tensor"):
        est.estimate(model, flow, objective, noise=[[0.0] * DIM])
    with pytest.raises(ValueError, match=r"NaN or Inf"):
        est.estimate(model, flow, objective, noise=noise * float("nan"))
    with pytest.raises(ValueError, match=r"failed on a state of shape"):
        gradest.rollout(model, flow, torch.zeros(BATCH, 7, dtype=torch.float64))


class _WrongShape(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM + 1).double()

    def forward(self, z, t):
        return self.linear(z)


def test_model_returning_a_different_shape(problem):
    _, flow, noise, objective = problem
    for spec in ["exact", "exact:checkpoint=true"]:
        with pytest.raises(
            ValueError, match=r"returned shape \(2, 4\) for a state of shape \(2, 3\)"
        ):
            gradest.estimator(spec).estimate(_WrongShape(), flow, objective, noise=noise)


def test_losses_that_are_not_finite_scalars_name_the_step(problem):
    model, flow, noise, _ = problem
    est = gradest.estimator("exact")
    with pytest.raises(
        ValueError, match=r"loss on the final sample must be a scalar, got shape \(2, 3\)"
    ):
        est.estimate(model, flow, gradest.TerminalObjective(lambda z: z), noise=noise)
    with pytest.raises(ValueError, match=r"non-finite \(NaN/Inf\) loss on the final sample"):
        est.estimate(model, flow, gradest.TerminalObjective(lambda z: z.sum() / 0.0), noise=noise)
    trajectory = gradest.rollout(model, flow, noise)

    def bad_at_step_2(k, v, traj):
        return v.sum() * (float("inf") if k == 2 else 1.0)

    with pytest.raises(ValueError, match=r"non-finite \(NaN/Inf\) loss at step 2"):
        est.estimate(model, flow, gradest.StepwiseObjective(bad_at_step_2), trajectory=trajectory)
    with pytest.raises(ValueError, match=r"loss at step 0 must be a scalar"):
        est.estimate(
            model, flow, gradest.StepwiseObjective(lambda k, v, t: v), trajectory=trajectory
        )
    with pytest.raises(TypeError, match=r"must return a scalar tensor, got float"):
        est.estimate(model, flow, gradest.TerminalObjective(lambda z: 1.0), noise=noise)


def test_no_trainable_parameters(problem):
    model, flow, noise, objective = problem
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no parameters with requires_grad=True"):
        gradest.estimator("exact").estimate(model, flow, objective, noise=noise)


def test_both_or_neither_of_noise_and_trajectory(problem):
    model, flow, noise, objective = problem
    trajectory = gradest.rollout(model, flow, noise)
    est = gradest.estimator("exact")
    with pytest.raises(ValueError, match=r"exactly one of noise= .* or trajectory=.*both"):
        est.estimate(model, flow, objective, noise=noise, trajectory=trajectory)
    with pytest.raises(ValueError, match=r"exactly one of noise=.*neither"):
        est.estimate(model, flow, objective)


def test_trajectory_from_a_different_grid(problem):
    model, flow, noise, objective = problem
    other = gradest.rollout(model, gradest.RectifiedFlow(steps=STEPS + 1), noise)
    with pytest.raises(ValueError, match=r"different time grid \(5 steps\).*same sampler"):
        gradest.estimator("exact").estimate(model, flow, objective, trajectory=other)
    with pytest.raises(TypeError, match=r"gradest.Trajectory"):
        gradest.estimator("exact").estimate(model, flow, objective, trajectory=noise)


def test_wrong_argument_kinds(problem):
    model, flow, noise, objective = problem
    est = gradest.estimator("exact")
    with pytest.raises(TypeError, match=r"objective must be gradest.TerminalObjective"):
        est.estimate(model, flow, lambda z: z.sum(), noise=noise)
    with pytest.raises(TypeError, match=r"sampler must be a sampler"):
        est.estimate(model, 50, objective, noise=noise)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        est.estimate(lambda z, t: z, flow, objective, noise=noise)
    with pytest.raises(TypeError, match=r"cond must be a dict"):
        est.estimate(model, flow, objective, noise=noise, cond=[1])
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator"):
        est.estimate(model, flow, objective, noise=noise, generator=0)
    with pytest.raises(ValueError, match=r"noise_grad=True needs a TerminalObjective"):
        est.estimate(
            model,
            flow,
            random_stepwise_objective(STEPS, (BATCH, DIM)),
            noise=noise,
            noise_grad=True,
        )
    with pytest.raises(TypeError, match=r"loss_fn"):
        gradest.TerminalObjective(3)


def test_the_cli_prints_gradest_errors_as_one_line_and_lets_bugs_show_their_traceback(
    monkeypatch, capsys
):
    from gradest import cli, errors

    def documented(args):
        raise errors.InvalidValue("--thing must be positive, got -1")

    def bug(args):
        raise ValueError("an internal bug, not a user error")

    monkeypatch.setattr(cli, "_cmd_list", documented)
    assert cli.main(["list"]) == 2
    message = capsys.readouterr().err.strip()
    assert message == "gradest list: error: --thing must be positive, got -1"
    monkeypatch.setattr(cli, "_cmd_list", bug)
    with pytest.raises(ValueError, match="an internal bug"):
        cli.main(["list"])
