"""`exact` against the dense reference, finite differences, and hand-written autograd."""

from __future__ import annotations

import attrs
import pytest
import torch

import gradest
from gradest.reference import exact_gradient, relative_error
from gradest.testing import problems
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS, CLASSES = 3, 4, 5, 3


def NoisyAffineSampler() -> problems.NoisyAffineSampler:  # noqa: N802 - stands for the class
    """alpha != 1 and recorded noise (DDIM / flow-SDE shape): estimators see only the step form."""
    return problems.NoisyAffineSampler(STEPS, drift=0.1)


def _setup(conditioned: bool, frozen: bool):
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES if conditioned else None)
    if frozen:
        model.input.weight.requires_grad_(False)
        model.time_embed.mlp[0].requires_grad_(False)
    noise = seeded_normal((BATCH, DIM), seed=11)
    cond = {"y": torch.tensor([0, 2, 1, 3])} if conditioned else None  # 3 is the null class
    return model, noise, cond


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize(("conditioned", "frozen"), [(False, False), (True, False), (True, True)])
def test_exact_terminal_matches_reference(checkpoint, source, conditioned, frozen):
    model, noise, cond = _setup(conditioned, frozen)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = smooth_terminal_objective(DIM)
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    truth, truth_noise = exact_gradient(model, flow, objective, trajectory, cond)
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    result = gradest.estimator("exact", checkpoint=checkpoint).estimate(
        model, flow, objective, cond=cond, noise_grad=True, **inputs
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(result.grads) == trainable
    assert relative_error(result.grads, truth) <= 1e-10
    assert relative_error(result.noise_grad, truth_noise) <= 1e-10


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize(("conditioned", "frozen"), [(False, False), (True, True)])
def test_exact_stepwise_matches_reference(checkpoint, source, conditioned, frozen):
    model, noise, cond = _setup(conditioned, frozen)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = random_stepwise_objective(STEPS, (BATCH, DIM))
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    truth, _ = exact_gradient(model, flow, objective, trajectory, cond)
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    result = gradest.estimator("exact", checkpoint=checkpoint).estimate(
        model, flow, objective, cond=cond, **inputs
    )
    assert relative_error(result.grads, truth) <= 1e-10
    assert result.noise_grad is None


def test_exact_flow_matching_objective_matches_reference():
    model, _, _ = _setup(False, False)
    flow = gradest.RectifiedFlow(times=[1.0, 0.7, 0.45, 0.2, 0.0])
    data, noise = seeded_normal((BATCH, DIM), 5), seeded_normal((BATCH, DIM), 6)
    objective = gradest.flow_matching_objective(data, noise)
    trajectory = gradest.flow_matching_trajectory(flow, data, noise)
    truth, _ = exact_gradient(model, flow, objective, trajectory)
    result = gradest.estimator("exact").estimate(model, flow, objective, trajectory=trajectory)
    assert relative_error(result.grads, truth) <= 1e-10
    # the loss it reports is the flow-matching loss summed over the grid
    with torch.no_grad():
        expected = sum(
            (
                model(
                    trajectory.states[k],
                    torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64),
                )
                - (noise - data)
            )
            .pow(2)
            .mean()
            / 4
            for k in range(4)
        )
    assert result.info["loss"] == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_exact_on_a_generic_affine_sampler_matches_reference(checkpoint):
    model, noise, cond = _setup(True, False)
    flow = NoisyAffineSampler()
    objective = smooth_terminal_objective(DIM)
    result = gradest.estimator("exact", checkpoint=checkpoint).estimate(
        model,
        flow,
        objective,
        noise=noise,
        cond=cond,
        noise_grad=True,
        generator=torch.Generator().manual_seed(3),
    )
    # the same generator state reproduces the recorded step noise
    trajectory = gradest.rollout(
        model, flow, noise, cond=cond, generator=torch.Generator().manual_seed(3)
    )
    assert trajectory.step_noise is not None
    truth, truth_noise = exact_gradient(model, flow, objective, trajectory, cond)
    assert relative_error(result.grads, truth) <= 1e-10
    assert relative_error(result.noise_grad, truth_noise) <= 1e-10


def test_exact_matches_hand_written_autograd():
    model, noise, cond = _setup(True, False)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = smooth_terminal_objective(DIM)
    z = noise.clone().requires_grad_(True)
    state = z
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        state = state + float(flow.step_sizes[k]) * model(state, t, **cond)
    objective.loss_fn(state).backward()
    result = gradest.estimator("exact").estimate(
        model, flow, objective, noise=noise, cond=cond, noise_grad=True
    )
    hand = {n: p.grad for n, p in model.named_parameters()}
    assert relative_error(result.grads, hand) <= 1e-12
    assert relative_error(result.noise_grad, z.grad) <= 1e-12


def test_exact_agrees_with_central_finite_differences():
    model = tiny_mlp(2, hidden=4, depth=1)
    flow = gradest.RectifiedFlow(steps=3)
    noise = seeded_normal((2, 2), seed=4)
    objective = smooth_terminal_objective(2)
    result = gradest.estimator("exact").estimate(model, flow, objective, noise=noise)

    def loss_value() -> float:
        return float(objective.loss_fn(gradest.rollout(model, flow, noise).states[-1]))

    eps = 1e-6
    for name, param in model.named_parameters():
        for index in [0, param.numel() - 1]:
            flat = param.data.view(-1)
            original = flat[index].item()
            flat[index] = original + eps
            up = loss_value()
            flat[index] = original - eps
            down = loss_value()
            flat[index] = original
            numeric = (up - down) / (2 * eps)
            analytic = result.grads[name].reshape(-1)[index].item()
            # central differences: O(eps^2) truncation plus O(1e-16/eps) rounding
            assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (name, index)


def test_cost_counts_of_exact():
    model, noise, _ = _setup(False, False)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = smooth_terminal_objective(DIM)
    fused = gradest.estimator("exact").estimate(model, flow, objective, noise=noise).cost
    assert fused == gradest.Cost(forwards_with_graph=STEPS, param_vjps=STEPS)
    ckpt = (
        gradest.estimator("exact", checkpoint=True)
        .estimate(model, flow, objective, noise=noise)
        .cost
    )
    assert ckpt == gradest.Cost(
        forwards_with_graph=STEPS, forwards_without_graph=STEPS, param_vjps=STEPS
    )
    stepwise = random_stepwise_objective(STEPS, (BATCH, DIM))
    trajectory = gradest.rollout(model, flow, noise)
    cost = gradest.estimator("exact").estimate(model, flow, stepwise, trajectory=trajectory).cost
    assert cost == gradest.Cost(forwards_with_graph=STEPS, param_vjps=STEPS)
    assert cost.model_units() == 3 * STEPS


def test_same_generator_state_gives_bitwise_identical_results():
    model, noise, cond = _setup(True, False)
    flow = NoisyAffineSampler()
    objective = smooth_terminal_objective(DIM)
    est = gradest.estimator("exact:checkpoint=true")
    runs = [
        est.estimate(
            model,
            flow,
            objective,
            noise=noise,
            cond=cond,
            noise_grad=True,
            generator=torch.Generator().manual_seed(7),
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].flat(), runs[1].flat())
    assert torch.equal(runs[0].noise_grad, runs[1].noise_grad)
    other = est.estimate(
        model, flow, objective, noise=noise, cond=cond, generator=torch.Generator().manual_seed(8)
    )
    assert not torch.equal(runs[0].flat(), other.flat())


def test_results_do_not_depend_on_global_rng():
    model, noise, cond = _setup(True, False)
    flow = NoisyAffineSampler()
    objective = smooth_terminal_objective(DIM)
    est = gradest.estimator("exact")
    torch.manual_seed(0)
    a = est.estimate(
        model, flow, objective, noise=noise, cond=cond, generator=torch.Generator().manual_seed(1)
    )
    torch.manual_seed(123)
    b = est.estimate(
        model, flow, objective, noise=noise, cond=cond, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(a.flat(), b.flat())


def test_estimator_is_frozen_hashable_and_evolvable():
    est = gradest.estimator("exact")
    assert hash(est) == hash(gradest.estimator("exact:checkpoint=false"))
    assert attrs.evolve(est, checkpoint=True) == gradest.estimator("exact", checkpoint=True)
    assert "checkpoint=True" in repr(attrs.evolve(est, checkpoint=True))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        est.checkpoint = True  # type: ignore[misc]
    assert isinstance(est, gradest.TrajectoryGradientEstimator)


def test_stepwise_checkpoint_trades_memory_for_batching():
    """checkpoint=False batches the steps (N steps' activations at once), True holds one."""
    from gradest.harness.cost import retained_activation_bytes

    model, noise, _ = _setup(False, False)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = random_stepwise_objective(STEPS, (BATCH, DIM))
    trajectory = gradest.rollout(model, flow, noise)
    sizes = {}
    for checkpoint in (False, True):
        est = gradest.estimator("exact", checkpoint=checkpoint)
        sizes[checkpoint] = retained_activation_bytes(
            lambda est=est: est.estimate(model, flow, objective, trajectory=trajectory)
        )
        cost = est.estimate(model, flow, objective, trajectory=trajectory).cost
        assert cost == gradest.Cost(forwards_with_graph=STEPS, param_vjps=STEPS)
    # activations scale with the rows in one call: N steps vs one step (+10% for small
    # per-call tensors such as the time embedding's)
    assert sizes[False] >= 0.9 * STEPS * sizes[True]
    assert sizes[False] <= 1.1 * STEPS * sizes[True]
