"""Flow-GRPO as public API (gradest.rl): the KL penalty to a frozen reference model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor

import gradest
from gradest import rl
from gradest.protocol import supports
from gradest.reference import dense_chain, exact_gradient, relative_error
from gradest.registry import builtin_estimators
from gradest.testing import assert_matches_definition, perturb_parameters, seeded_normal, tiny_mlp

DIM, BATCH, STEPS, GROUP = 3, 4, 5, 2


def _setup(reduction="sum", tuned=True):
    """``(reference model, policy, flow, trajectory, old log-probs, advantages, v_ref)``."""
    reference_model = tiny_mlp(DIM, hidden=8, seed=0).requires_grad_(False)
    model = copy.deepcopy(reference_model).requires_grad_(True)
    if tuned:
        perturb_parameters(model)
    flow = gradest.FlowSDE(STEPS)
    noise = seeded_normal((BATCH, DIM), seed=11)
    trajectory = gradest.rollout(model, flow, noise, generator=torch.Generator().manual_seed(7))
    old = flow.trajectory_log_probs(trajectory, reduction=reduction)
    advantages = rl.group_advantages(seeded_normal((BATCH,), seed=9), GROUP)
    reference = rl.reference_velocities(reference_model, flow, trajectory)
    return reference_model, model, flow, trajectory, old, advantages, reference


def _old_grpo_loss(flow, trajectory, old, advantages, clip, reduction, k, velocity):
    """The surrogate before the KL existed, transcribed from gradest 0.1's grpo.py."""
    log_prob = flow.step_log_prob(trajectory, k, velocity, reduction=reduction)
    ratio = torch.exp(log_prob - old[k].to(log_prob))
    advantage = advantages.to(log_prob)
    surrogate = torch.minimum(
        ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage
    )
    return -surrogate.mean() / trajectory.num_steps


def test_public_names_are_the_module_objects():
    from gradest.rl import flow_grpo

    assert rl.grpo_objective is flow_grpo.grpo_objective
    assert rl.group_advantages is flow_grpo.group_advantages
    assert rl.ADVANTAGE_EPS == flow_grpo.ADVANTAGE_EPS == 1e-4


def test_reference_velocities_are_the_model_at_the_recorded_states():
    reference_model, _, flow, trajectory, _, _, reference = _setup()
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        with torch.no_grad():
            assert torch.equal(reference[k], reference_model(trajectory.states[k], t))
    assert not reference.requires_grad


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kl_given", [False, True])
def test_kl_weight_zero_is_the_old_objective_bit_for_bit(reduction, kl_given):
    _, model, flow, trajectory, old, advantages, reference = _setup(reduction)
    objective = rl.grpo_objective(
        flow,
        trajectory,
        old,
        advantages,
        0.05,
        reduction=reduction,
        kl_weight=0.0,
        reference=reference if kl_given else None,
    )
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        with torch.no_grad():
            v = model(trajectory.states[k], t)
        ours = objective.step_cotangent(k, v, trajectory)
        leaf = v.clone().requires_grad_(True)
        theirs = _old_grpo_loss(flow, trajectory, old, advantages, 0.05, reduction, k, leaf)
        (grad,) = torch.autograd.grad(theirs, leaf)
        assert torch.equal(ours[0], theirs.detach()) and torch.equal(ours[1], grad)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_kl_value_and_cotangent_are_the_gaussian_kl(reduction):
    """``KL_k = beta_k^2 ||v - v_ref||^2 / (2 s_k^2)`` (``/ D`` for ``"mean"``); the step
    loss gains ``w mean_b KL / N`` and the cotangent ``w beta^2 (v - v_ref) / (s^2 N B)``."""
    _, model, flow, trajectory, old, advantages, reference = _setup(reduction)
    weight = 0.3
    plain = rl.grpo_objective(flow, trajectory, old, advantages, reduction=reduction)
    with_kl = rl.grpo_objective(
        flow,
        trajectory,
        old,
        advantages,
        reduction=reduction,
        kl_weight=weight,
        reference=reference,
    )
    alpha, beta, scale = flow.coefficients()
    per_element = 1.0 if reduction == "sum" else 1.0 / DIM
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        with torch.no_grad():
            v = model(trajectory.states[k], t)
        # The KL of the two step Gaussians, from their means, independent of the formula.
        mean = alpha[k] * trajectory.states[k] + beta[k] * v
        mean_ref = alpha[k] * trajectory.states[k] + beta[k] * reference[k]
        kl = per_element * (mean - mean_ref).pow(2).sum(1) / (2 * scale[k] ** 2)
        torch.testing.assert_close(rl.step_kl(flow, k, v, reference[k], reduction=reduction), kl)
        loss, cotangent = with_kl.step_cotangent(k, v, trajectory)
        base_loss, base_cotangent = plain.step_cotangent(k, v, trajectory)
        assert float(loss - base_loss) == pytest.approx(
            weight * kl.mean().item() / STEPS, rel=1e-12
        )
        expected = weight * per_element * beta[k] ** 2 * (v - reference[k]) / scale[k] ** 2
        torch.testing.assert_close(
            cotangent - base_cotangent, expected / (STEPS * BATCH), rtol=1e-10, atol=1e-15
        )


def test_kl_is_zero_when_the_policy_is_the_reference():
    _, model, flow, trajectory, old, advantages, reference = _setup(tuned=False)
    plain = rl.grpo_objective(flow, trajectory, old, advantages)
    with_kl = rl.grpo_objective(
        flow, trajectory, old, advantages, kl_weight=0.04, reference=reference
    )
    for k in range(STEPS):
        v = trajectory.velocities[k]
        assert torch.equal(reference[k], v)
        assert float(rl.step_kl(flow, k, v, reference[k]).abs().max()) == 0.0
        ours, theirs = (
            with_kl.step_cotangent(k, v, trajectory),
            plain.step_cotangent(k, v, trajectory),
        )
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    grads = gradest.estimator("exact").estimate(model, flow, with_kl, trajectory=trajectory)
    plain_grads = gradest.estimator("exact").estimate(model, flow, plain, trajectory=trajectory)
    assert relative_error(grads.grads, plain_grads.grads) <= 1e-14


def test_kl_gradient_is_the_analytic_one():
    """``grad_theta sum_k w mean_b KL_k / N``
    ``= sum_k J_k^T w beta_k^2 (v_k - v_ref,k) / (s_k^2 N B)``, ``J_k`` from dense Jacobians."""
    _, model, flow, trajectory, old, advantages, reference = _setup()
    weight = 0.5
    plain = rl.grpo_objective(flow, trajectory, old, advantages)
    with_kl = rl.grpo_objective(
        flow, trajectory, old, advantages, kl_weight=weight, reference=reference
    )
    chain = dense_chain(model, flow, trajectory)
    _, beta, scale = flow.coefficients()
    velocities = chain.velocities.reshape(reference.shape)
    cotangents = torch.stack(
        [
            (weight * beta[k] ** 2 / scale[k] ** 2 * (velocities[k] - reference[k])).reshape(-1)
            / (STEPS * BATCH)
            for k in range(STEPS)
        ]
    )
    analytic = chain.gradient(cotangents)
    exact = gradest.estimator("exact")
    difference = (
        exact.estimate(model, flow, with_kl, trajectory=trajectory).flat()
        - exact.estimate(model, flow, plain, trajectory=trajectory).flat()
    )
    assert relative_error(difference, analytic) <= 1e-10
    truth, _ = exact_gradient(model, flow, with_kl, trajectory)
    result = exact.estimate(model, flow, with_kl, trajectory=trajectory)
    assert relative_error(result.grads, truth) <= 1e-10


def test_per_step_weights_reproduce_flow_grpo_code():
    """Flow-GRPO's code: ``((mean - mean_ref)^2).mean(dims) / (2 std_dev_t^2)`` with the
    diffusion ``sigma_t``; that is ``kl_weight = beta * |h_k|`` with ``reduction="mean"``."""
    _, model, flow, trajectory, old, advantages, reference = _setup("mean")
    beta_code = 0.04
    objective = rl.grpo_objective(
        flow,
        trajectory,
        old,
        advantages,
        reduction="mean",
        kl_weight=beta_code * flow.step_sizes.abs(),
        reference=reference,
    )
    plain = rl.grpo_objective(flow, trajectory, old, advantages, reduction="mean")
    alpha, beta, _ = flow.coefficients()
    sigma = flow.diffusion()
    for k in range(STEPS):
        v = trajectory.velocities[k] + 0.1
        mean = alpha[k] * trajectory.states[k] + beta[k] * v
        mean_ref = alpha[k] * trajectory.states[k] + beta[k] * reference[k]
        code_kl = ((mean - mean_ref) ** 2).mean(1) / (2 * sigma[k] ** 2)
        gained = (
            objective.step_cotangent(k, v, trajectory)[0]
            - plain.step_cotangent(k, v, trajectory)[0]
        )
        assert float(gained) == pytest.approx(beta_code * code_kl.mean().item() / STEPS, rel=1e-12)


SPECS = (
    *builtin_estimators(),
    "jagg:window=2",
    "jagg:window=3,shared_knots=true",
    "sdo:samples=2",
    "truncated:k=2",
    "truncated:random=uniform",
    "telescope:mean_depth=2",
)


@pytest.mark.parametrize("spec", SPECS)
def test_every_builtin_matches_its_definition_with_the_kl(spec):
    if not supports(gradest.estimator(spec), "stepwise"):
        pytest.skip(f"{spec} is for terminal objectives only")
    _, model, flow, trajectory, old, advantages, reference = _setup()
    objective = rl.grpo_objective(
        flow, trajectory, old, advantages, 0.05, kl_weight=0.5, reference=reference
    )
    generator = torch.Generator().manual_seed(2)
    assert_matches_definition(
        spec,
        model,
        flow,
        objective,
        trajectory=trajectory,
        generator=generator,
        rtol=1e-10,
        # auto's first call probes (exact), its next the chosen candidate
        surrogate=not spec.startswith("auto"),
    )


def test_exact_with_the_kl_is_autograd_of_the_total_loss():
    _, model, flow, trajectory, old, advantages, reference = _setup()
    objective = rl.grpo_objective(
        flow, trajectory, old, advantages, 0.05, kl_weight=0.5, reference=reference
    )
    total: Tensor | float = 0.0
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        total = total + objective.loss_fn(k, model(trajectory.states[k], t), trajectory)
    names = [n for n, _ in model.named_parameters()]
    by_hand = dict(zip(names, torch.autograd.grad(total, list(model.parameters())), strict=True))
    result = gradest.estimator("exact").estimate(model, flow, objective, trajectory=trajectory)
    assert relative_error(result.grads, by_hand) <= 1e-12


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"kl_weight": 0.04}, ValueError, r"kl_weight > 0 needs reference=.*reference_velocities"),
        ({"kl_weight": -0.1, "reference": "ok"}, ValueError, "kl_weight must be finite and >= 0"),
        ({"kl_weight": math.nan, "reference": "ok"}, ValueError, "kl_weight must be finite"),
        ({"kl_weight": "0.04"}, TypeError, "kl_weight must be a float >= 0"),
        ({"kl_weight": True}, TypeError, "kl_weight must be a float >= 0"),
        ({"kl_weight": torch.ones(STEPS + 1)}, ValueError, r"\[N\] = \[5\] float tensor"),
        (
            {"kl_weight": 0.04, "reference": torch.zeros(STEPS, BATCH)},
            ValueError,
            r"reference must be \[N, B, \.\.\.\] = \[5, 4, 3\]",
        ),
        ({"reduction": "max"}, ValueError, "reduction must be one of sum, mean"),
    ],
)
def test_kl_validation(change, error, match):
    _, _, flow, trajectory, old, advantages, reference = _setup()
    arguments = {"kl_weight": 0.0, "reference": None, "reduction": "sum"}
    arguments.update(change)
    if isinstance(arguments["reference"], str):
        arguments["reference"] = reference
    with pytest.raises(error, match=match):
        rl.grpo_objective(flow, trajectory, old, advantages, **arguments)


def test_reference_velocities_validation():
    _, _, flow, trajectory, _, _, _ = _setup()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        rl.reference_velocities(lambda z, t: z, flow, trajectory)
    with pytest.raises(ValueError, match="different time grid"):
        rl.reference_velocities(tiny_mlp(DIM), gradest.FlowSDE(STEPS + 1), trajectory)
    with pytest.raises(ValueError, match="deterministic"):
        rl.step_kl(
            gradest.FlowSDE(STEPS, noise_level=0.0),
            0,
            trajectory.velocities[0],
            trajectory.velocities[0],
        )
