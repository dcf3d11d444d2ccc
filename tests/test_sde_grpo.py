"""FlowSDE (Flow-GRPO's sampler) and the GRPO surrogate against hand-written formulas and
the dense reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import gradest
from gradest.reference import exact_gradient, relative_error
from gradest.rl.flow_grpo import ADVANTAGE_EPS, group_advantages, grpo_objective
from gradest.samplers import FlowSDE
from gradest.testing import (
    assert_matches_definition,
    perturb_parameters,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS, GROUP = 3, 4, 5, 2
SEED = 7
# Estimator specs that must all run on FlowSDE; the dense definitions pin each of them.
SPECS = (
    "exact",
    "jagg:window=2",
    "jagg:window=3,shared_knots=true",
    "sdo:samples=2",
    "truncated:k=2",
    "truncated:random=uniform",
)


def flow_grpo_step(
    z: Tensor, v: Tensor, t: float, t_next: float, t_second: float, noise_level: float
):
    """Flow-GRPO's ``sde_step_with_logprob`` mean and noise scale, transcribed (sigma = t)."""
    dt = t_next - t
    denominator = 1 - (t_second if t == 1 else t)
    std = math.sqrt(t / denominator) * noise_level
    mean = z * (1 + std**2 / (2 * t) * dt) + v * (1 + std**2 * (1 - t) / (2 * t)) * dt
    return mean, std * math.sqrt(-dt)


def _model():
    return tiny_mlp(DIM, hidden=8, seed=0)


def _rollout(model, flow, seed=SEED, batch=BATCH):
    noise = seeded_normal((batch, DIM), seed=11)
    generator = torch.Generator().manual_seed(seed)
    return noise, gradest.rollout(model, flow, noise, generator=generator)


# -- FlowSDE -----------------------------------------------------------------------------


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("times", [None, [1.0, 0.8, 0.5, 0.45, 0.1, 0.0], [0.95, 0.6, 0.2, 0.05]])
def test_coefficients_match_flow_grpo_step(noise_level, times):
    flow = (
        FlowSDE(STEPS, noise_level=noise_level)
        if times is None
        else FlowSDE(times=times, noise_level=noise_level)
    )
    alpha, beta, sigma = flow.coefficients()
    grid = flow.times.tolist()
    z, v = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    for k in range(flow.num_steps):
        # The step is affine, so its z- and v-coefficients are the mean at unit inputs.
        a, scale = flow_grpo_step(z, v, grid[k], grid[k + 1], grid[1], noise_level)
        b, _ = flow_grpo_step(v, z, grid[k], grid[k + 1], grid[1], noise_level)
        assert alpha[k].item() == pytest.approx(float(a), rel=1e-14)
        assert beta[k].item() == pytest.approx(float(b), rel=1e-14)
        assert sigma[k].item() == pytest.approx(scale, rel=1e-14)
    assert bool(torch.isfinite(torch.stack([alpha, beta, sigma])).all())
    assert bool((sigma > 0).all())
    for c in (alpha, beta, sigma):
        assert c.dtype == torch.float64 and c.shape == (flow.num_steps,)


def test_zero_noise_level_is_the_euler_ode():
    sde, ode = FlowSDE(STEPS, noise_level=0.0), gradest.RectifiedFlow(steps=STEPS)
    for ours, theirs in zip(sde.coefficients(), ode.coefficients(), strict=True):
        assert torch.equal(ours, theirs)
    assert isinstance(sde, gradest.AffineSampler)
    assert repr(FlowSDE(4)) == "FlowSDE(steps=4, noise_level=0.7)"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of steps"),
        ({"steps": 3, "times": [1.0, 0.0]}, ValueError, "exactly one of steps"),
        ({"steps": 0}, ValueError, "steps must be >= 1"),
        ({"times": [1.0, 1.0, 0.0]}, ValueError, "strictly decreasing"),
        ({"steps": 3, "noise_level": -0.1}, ValueError, "noise_level must be a finite float"),
        ({"steps": 3, "noise_level": math.nan}, ValueError, "noise_level must be a finite"),
        ({"steps": 3, "noise_level": "0.7"}, TypeError, "noise_level must be a float"),
        ({"steps": 3, "noise_level": True}, TypeError, "noise_level must be a float"),
    ],
)
def test_flowsde_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        FlowSDE(**kwargs)


def test_step_log_prob_validation():
    model = _model()
    flow = FlowSDE(STEPS)
    _, trajectory = _rollout(model, flow)
    v = trajectory.velocities[0]
    with pytest.raises(ValueError, match="k must be a step index in 0..4"):
        flow.step_log_prob(trajectory, STEPS, v)
    with pytest.raises(ValueError, match="reduction must be one of sum, mean"):
        flow.step_log_prob(trajectory, 0, v, reduction="max")
    with pytest.raises(ValueError, match="velocity has shape"):
        flow.step_log_prob(trajectory, 0, v[:2])
    with pytest.raises(ValueError, match="different time grid"):
        FlowSDE(STEPS + 1).step_log_prob(trajectory, 0, v)
    deterministic = FlowSDE(STEPS, noise_level=0.0)
    _, ode_path = _rollout(model, deterministic)
    assert ode_path.step_noise is None
    with pytest.raises(ValueError, match="no log-density; use noise_level > 0"):
        deterministic.step_log_prob(ode_path, 0, ode_path.velocities[0])


class GaussianVelocity(nn.Module):
    """The exact velocity ``E[eps - x | z_t]`` for data ``x ~ N(mean, std^2)`` (1-D)."""

    def __init__(self, mean: float, std: float):
        super().__init__()
        self.mean, self.std = mean, std
        self.unused = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        t = t[:, None]
        variance = (1 - t) ** 2 * self.std**2 + t**2
        covariance = t - (1 - t) * self.std**2  # Cov(eps - x, z_t)
        return -self.mean + covariance / variance * (z - (1 - t) * self.mean)


def test_sde_keeps_the_marginals_of_the_flow():
    """With the exact velocity of Gaussian data the SDE must end at the data distribution.

    A wrong drift (the score term's sign or its factor 1/2) changes the final variance
    by O(1); Euler-Maruyama adds an O(1/N) bias, bounded here by the Euler ODE's own bias
    on the same grid and noise, plus 4 standard errors of the sample statistics.
    """
    mean, std, samples, steps = 0.5, 0.3, 20_000, 100
    model = GaussianVelocity(mean, std)
    noise = seeded_normal((samples, 1), seed=3)
    ode = gradest.rollout(model, gradest.RectifiedFlow(steps=steps), noise).states[-1]
    sde = gradest.rollout(
        model, FlowSDE(steps), noise, generator=torch.Generator().manual_seed(4)
    ).states[-1]
    se_mean, se_std = std / math.sqrt(samples), std / math.sqrt(2 * samples)
    ode_bias_mean, ode_bias_std = abs(ode.mean() - mean), abs(ode.std() - std)
    assert abs(sde.mean() - mean) <= 4 * se_mean + ode_bias_mean
    assert abs(sde.std() - std) <= 4 * se_std + ode_bias_std
    # The noise really is injected: the SDE's samples are not the ODE's.
    assert float((sde - ode).abs().mean()) > 10 * se_std


def test_rollout_records_the_flow_grpo_step():
    model = _model()
    flow = FlowSDE(STEPS, noise_level=0.8)
    noise, trajectory = _rollout(model, flow)
    # The step noise is the generator's first draw, one standard normal per step.
    expected_noise = torch.randn(
        (STEPS, BATCH, DIM), generator=torch.Generator().manual_seed(SEED), dtype=torch.float64
    )
    assert torch.equal(trajectory.step_noise, expected_noise)
    assert torch.equal(trajectory.states[0], noise)
    grid = flow.times.tolist()
    _, _, scales = flow.coefficients()
    for k in range(STEPS):
        z, v = trajectory.states[k], trajectory.velocities[k]
        with torch.no_grad():
            assert torch.equal(v, model(z, torch.full((BATCH,), grid[k], dtype=torch.float64)))
        mean, scale = flow_grpo_step(z, v, grid[k], grid[k + 1], grid[1], 0.8)
        step = mean + scale * trajectory.step_noise[k]
        torch.testing.assert_close(trajectory.states[k + 1], step, rtol=0, atol=1e-13)
        # log N(z_{k+1}; mean, s^2 I) at the recorded velocity is that of the noise draw.
        xi = trajectory.step_noise[k]
        density = -0.5 * xi.pow(2).sum(1) - DIM * (math.log(scale) + 0.5 * math.log(2 * math.pi))
        torch.testing.assert_close(flow.step_log_prob(trajectory, k, v), density)
        torch.testing.assert_close(
            flow.step_log_prob(trajectory, k, v, reduction="mean"), density / DIM
        )
    log_probs = flow.trajectory_log_probs(trajectory)
    assert log_probs.shape == (STEPS, BATCH)
    # Same seed, same path; another seed, another path.
    assert torch.equal(_rollout(model, flow)[1].states, trajectory.states)
    assert not torch.equal(_rollout(model, flow, seed=SEED + 1)[1].states, trajectory.states)


def test_step_log_prob_is_differentiable_in_velocity():
    model = _model()
    flow = FlowSDE(STEPS)
    _, trajectory = _rollout(model, flow)
    k = 2
    v = trajectory.velocities[k].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(flow.step_log_prob(trajectory, k, v).sum(), v)
    alpha, beta, scale = (float(c[k]) for c in flow.coefficients())
    residual = trajectory.states[k + 1] - alpha * trajectory.states[k] - beta * v.detach()
    torch.testing.assert_close(grad, beta * residual / scale**2)


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_exact_on_flowsde_matches_reference(source):
    model = _model()
    flow = FlowSDE(STEPS)
    objective = smooth_terminal_objective(DIM)
    noise, trajectory = _rollout(model, flow)
    truth, truth_noise = exact_gradient(model, flow, objective, trajectory)
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    result = gradest.estimator("exact").estimate(
        model,
        flow,
        objective,
        generator=torch.Generator().manual_seed(SEED),
        noise_grad=True,
        **inputs,
    )
    assert relative_error(result.grads, truth) <= 1e-10
    assert relative_error(result.noise_grad, truth_noise) <= 1e-10
    # Sampling from noise with the same generator state follows the rollout's path:
    # without the step noise the gradient would differ by O(1).
    without_noise = exact_gradient(
        model, flow, objective, gradest.rollout(model, gradest.RectifiedFlow(steps=STEPS), noise)
    )[0]
    assert relative_error(without_noise, truth) > 1e-2


@pytest.mark.parametrize("spec", SPECS)
def test_estimators_on_flowsde_terminal_match_their_definitions(spec):
    model = _model()
    flow = FlowSDE(STEPS)
    objective = smooth_terminal_objective(DIM)
    _, trajectory = _rollout(model, flow)
    generator = torch.Generator().manual_seed(1)
    assert_matches_definition(
        spec, model, flow, objective, trajectory=trajectory, generator=generator, rtol=1e-10
    )


# -- GRPO --------------------------------------------------------------------------------


def test_group_advantages():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 2)
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0], dtype=torch.float64)
    # Population std of (1, 3) is 1, of (2, 2) is 0, of (-1, 5) is 3.
    expected[:2] /= 1 + ADVANTAGE_EPS
    expected[4:] *= 3 / (3 + ADVANTAGE_EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-15)
    groups = group_advantages(seeded_normal((12,), seed=5), 4).reshape(3, 4)
    torch.testing.assert_close(groups.mean(1), torch.zeros(3, dtype=torch.float64))
    assert bool((groups.std(1, unbiased=False) <= 1).all())


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(6), 1, "group_size must be an int >= 2"),
        (torch.zeros(6), 4, "not a multiple of group_size=4"),
        (torch.zeros(2, 3), 3, "rewards must be a 1-D tensor"),
        (torch.tensor([1.0, math.nan]), 2, "NaN or Inf"),
    ],
)
def test_group_advantages_validation(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)


def _grpo_setup(clip=0.2, reduction="sum"):
    model = _model()
    flow = FlowSDE(STEPS)
    _, trajectory = _rollout(model, flow)
    old = flow.trajectory_log_probs(trajectory, reduction=reduction)
    advantages = group_advantages(seeded_normal((BATCH,), seed=9), GROUP)
    objective = grpo_objective(flow, trajectory, old, advantages, clip, reduction=reduction)
    return model, flow, trajectory, old, advantages, objective


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_grpo_cotangent_at_old_policy_is_the_policy_gradient(reduction):
    _, flow, trajectory, _, advantages, objective = _grpo_setup(reduction=reduction)
    per_element = 1.0 if reduction == "sum" else 1.0 / DIM
    for k in range(STEPS):
        loss, cotangent = objective.step_cotangent(k, trajectory.velocities[k], trajectory)
        alpha, beta, scale = (float(c[k]) for c in flow.coefficients())
        residual = (
            trajectory.states[k + 1]
            - alpha * trajectory.states[k]
            - beta * (trajectory.velocities[k])
        )
        grad_log_prob = per_element * beta * residual / scale**2  # d log pi / d v_k, [B, D]
        expected = -advantages[:, None] * grad_log_prob / (BATCH * STEPS)
        torch.testing.assert_close(cotangent, expected, rtol=1e-12, atol=1e-15)
        # The ratio is 1, so the loss is -mean(A) / N.
        assert float(loss) == pytest.approx(-float(advantages.mean()) / STEPS, abs=1e-15)


def test_grpo_clipping_kills_the_gradient_outside_the_band():
    model, flow, trajectory, old, _, _ = _grpo_setup()
    k = 1
    # Ratios 1.5, 1.5, 0.6, 0.6 (outside [0.8, 1.2]) with advantages +, -, +, -.
    ratios = torch.tensor([1.5, 1.5, 0.6, 0.6], dtype=torch.float64)
    shifted = old.clone()
    shifted[k] = old[k] - ratios.log()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    objective = grpo_objective(flow, trajectory, shifted, advantages, clip=0.2)
    loss, cotangent = objective.step_cotangent(k, trajectory.velocities[k], trajectory)
    norms = cotangent.norm(dim=1)
    # Clipped where the ratio left the band in the direction its advantage rewards
    # (r > 1 + eps with A > 0; r < 1 - eps with A < 0); PPO's pessimistic min keeps the
    # unclipped term, and its gradient, in the other two cases.
    assert norms[0] == 0 and norms[3] == 0
    assert norms[1] > 0 and norms[2] > 0
    expected_loss = -(1.2 * 1 + 1.5 * -1 + 0.6 * 1 + 0.8 * -1) / BATCH / STEPS
    assert float(loss) == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("updated", [False, True])
def test_exact_on_grpo_matches_reference(updated):
    model, flow, trajectory, old, _, objective = _grpo_setup(clip=0.05)
    if updated:
        perturb_parameters(model)  # ratios leave 1, some leave the clip band
        # Meaningful only if some ratios left the clip band and some did not; the
        # policy is evaluated at the recorded states (the data of the surrogate).
        times = flow.times
        with torch.no_grad():
            ratios = torch.stack(
                [
                    torch.exp(
                        flow.step_log_prob(
                            trajectory,
                            k,
                            model(
                                trajectory.states[k],
                                torch.full((BATCH,), float(times[k]), dtype=torch.float64),
                            ),
                        )
                        - old[k]
                    )
                    for k in range(STEPS)
                ]
            )
        outside = (ratios - 1).abs() > 0.05
        assert 0 < int(outside.sum()) < outside.numel()
    truth, _ = exact_gradient(model, flow, objective, trajectory)
    result = gradest.estimator("exact").estimate(model, flow, objective, trajectory=trajectory)
    assert relative_error(result.grads, truth) <= 1e-10


@pytest.mark.parametrize("spec", SPECS)
def test_estimators_run_on_grpo_and_match_their_definitions(spec):
    model, flow, trajectory, _, _, objective = _grpo_setup(clip=0.05)
    perturb_parameters(model)  # ratios leave 1, some leave the clip band
    generator = torch.Generator().manual_seed(2)
    assert_matches_definition(
        spec, model, flow, objective, trajectory=trajectory, generator=generator, rtol=1e-10
    )


def test_grpo_objective_refuses_a_fresh_path():
    model, flow, trajectory, _, _, objective = _grpo_setup()
    with pytest.raises(ValueError, match="pass that trajectory to surrogate/estimate"):
        gradest.estimator("exact").estimate(
            model,
            flow,
            objective,
            noise=trajectory.states[0],
            generator=torch.Generator().manual_seed(SEED + 1),
        )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"flow": gradest.RectifiedFlow(steps=STEPS)}, TypeError, "FlowSDE"),
        ({"old_log_probs": torch.zeros(STEPS, BATCH + 1)}, ValueError, r"\[N, B\] = \[5, 4\]"),
        ({"advantages": torch.zeros(BATCH, 1)}, ValueError, r"advantages must be \[B\]"),
        ({"clip": 0.0}, ValueError, "clip must be in"),
        ({"clip": "0.2"}, TypeError, "clip must be a float"),
        ({"old_log_probs": torch.full((STEPS, BATCH), math.inf)}, ValueError, "NaN or Inf"),
    ],
)
def test_grpo_objective_validation(change, error, match):
    _, flow, trajectory, old, advantages, _ = _grpo_setup()
    arguments = {"flow": flow, "old_log_probs": old, "advantages": advantages, "clip": 0.2}
    arguments.update(change)
    with pytest.raises(error, match=match):
        grpo_objective(
            arguments["flow"],
            trajectory,
            arguments["old_log_probs"],
            arguments["advantages"],
            arguments["clip"],
        )
