"""gradest.rl.prompt_advantages (Flow-GRPO's per-prompt statistics, gathered across
processes), gradest.rl.leading_steps (its timestep_fraction) and gradest.rl.step_range (its
per-timestep backward): against a numpy transcription of Flow-GRPO's PerPromptStatTracker,
two gloo processes against one on the union of their samples, and the cut path's steps
against the whole path's, in float64 against gradest.reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradest
from gradest.errors import InvalidType, InvalidValue
from gradest.reference import exact_gradient
from gradest.rl import (
    group_advantages,
    grpo_objective,
    leading_steps,
    prompt_advantages,
    single_step,
    step_range,
)


def tracker_advantages(prompts: np.ndarray, rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """Flow-GRPO's ``PerPromptStatTracker.update(prompts, rewards)`` (type 'grpo'), as its
    code computes it: float64, per-prompt mean, population std of all rewards or of the
    prompt's, plus 1e-4."""
    advantages = np.zeros_like(rewards, dtype=np.float64)
    for prompt in np.unique(prompts):
        mine = rewards[prompts == prompt]
        std = np.std(rewards) if global_std else np.std(mine)
        advantages[prompts == prompt] = (mine - np.mean(mine)) / (std + 1e-4)
    return advantages


def samples(count: int = 12, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(count, generator=g, dtype=torch.float64)
    prompts = torch.randint(4, (count,), generator=g)
    return rewards, prompts


@pytest.mark.parametrize("global_std", [True, False])
def test_prompt_advantages_are_flow_grpos_tracker(global_std):
    rewards, prompts = samples()
    got = prompt_advantages(rewards, prompts, global_std=global_std)
    want = tracker_advantages(prompts.numpy(), rewards.numpy(), global_std)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-13)
    assert got.dtype == torch.float64
    # float32 rewards: the statistics in float64, the result in the rewards' dtype
    assert prompt_advantages(rewards.float(), prompts).dtype == torch.float32


def test_prompt_advantages_of_consecutive_groups_are_group_advantages():
    rewards, _ = samples()
    prompts = torch.arange(3).repeat_interleave(4)
    got = prompt_advantages(rewards, prompts, global_std=False)
    torch.testing.assert_close(got, group_advantages(rewards, 4), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("rewards", "prompts", "match"),
    [
        (torch.ones(2, 2), torch.zeros(2, dtype=torch.long), "rewards must be a 1-D"),
        (torch.ones(3), torch.zeros(2, dtype=torch.long), r"integer tensor \[B\] = \[3\]"),
        (torch.ones(3), torch.zeros(3), "prompts must be an integer tensor"),
        (torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long), "NaN or Inf"),
    ],
)  # fmt: skip
def test_prompt_advantages_refuse_bad_input_in_one_line(rewards, prompts, match):
    with pytest.raises(InvalidValue, match=match):
        prompt_advantages(rewards, prompts)


def _rank(rank: int, init: str, results: str) -> None:
    """One gloo process: its half of the samples (ranks interleaved, so every prompt spans
    both), then a call with a batch size of its own (refused on both ranks)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rewards, prompts = samples()
        half = rewards.shape[0] // 2
        order = torch.arange(rewards.shape[0]).reshape(half, 2).t().reshape(-1)
        mine = order[rank * half : (rank + 1) * half]
        out = {}
        for global_std in (True, False):
            out[global_std] = prompt_advantages(rewards[mine], prompts[mine], global_std=global_std)
        try:
            prompt_advantages(rewards[: 2 + rank], prompts[: 2 + rank])
            out["error"] = ""
        except InvalidValue as err:
            out["error"] = str(err)
        torch.save(out, f"{results}_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="no gloo backend"
)
def test_two_gloo_processes_get_the_statistics_of_the_union(tmp_path):
    """Each of two processes holds half of every prompt's samples; the advantages of both
    together are, bit for bit, the single-process computation on all samples in rank
    order; different batch sizes are one line on both ranks."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    results = str(tmp_path / "rank")
    mp.spawn(_rank, args=(init, results), nprocs=2, join=True)
    parts = [torch.load(f"{results}_{rank}.pt") for rank in range(2)]
    rewards, prompts = samples()
    order = torch.arange(rewards.shape[0]).reshape(-1, 2).t().reshape(-1)
    for global_std in (True, False):
        union = prompt_advantages(rewards[order], prompts[order], global_std=global_std)
        gathered = torch.cat([part[global_std] for part in parts])
        assert torch.equal(gathered, union), global_std
        # and not what each process would compute on its own samples alone
        alone = prompt_advantages(rewards[order[:6]], prompts[order[:6]], global_std=global_std)
        assert not torch.allclose(parts[0][global_std], alone)
    for part in parts:
        assert "different numbers of samples ([2, 3] by rank" in part["error"]


# -- leading_steps ----------------------------------------------------------------------------


def _path(steps: int = 6, batch: int = 4):
    torch.manual_seed(0)
    model = gradest.models.MLPVelocity(dim=3, hidden=16).double()
    sampler = gradest.FlowSDE(times=torch.linspace(1.0, 0.0, steps + 1) ** 1.5, noise_level=0.7)
    noise = torch.randn(batch, 3, dtype=torch.float64)
    with torch.no_grad():
        path = gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(1))
    return model, sampler, path


def test_leading_steps_keep_the_whole_paths_steps():
    """The cut sampler's coefficients and step log-probabilities are the first ``count``
    of the whole grid's (bitwise); the GRPO surrogate on the cut path is the mean over the
    trained steps of the whole path's per-step surrogate."""
    _, sampler, path = _path()
    count = 4
    cut, kept = leading_steps(sampler, path, count)
    assert kept.num_steps == count and torch.equal(kept.states, path.states[: count + 1])
    for mine, whole in zip(cut.coefficients(), sampler.coefficients(), strict=True):
        assert torch.equal(mine, whole[:count])
    old = sampler.trajectory_log_probs(path, reduction="mean")
    assert torch.equal(cut.trajectory_log_probs(kept, reduction="mean"), old[:count])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    shifted = path.velocities + 0.01  # a policy that has moved: ratios away from 1
    whole = grpo_objective(sampler, path, old, advantages, clip=0.2, reduction="mean")
    part = grpo_objective(cut, kept, old[:count], advantages, clip=0.2, reduction="mean")
    steps = path.num_steps
    want = sum(float(whole.loss_fn(k, shifted[k], path)) * steps / count for k in range(count))
    got = sum(float(part.loss_fn(k, shifted[k], kept)) for k in range(count))
    assert got == pytest.approx(want, rel=1e-12)


def test_leading_steps_refuse_bad_input_in_one_line():
    _, sampler, path = _path()
    with pytest.raises(InvalidValue, match=r"count must be an int in \[1, 6\]"):
        leading_steps(sampler, path, 0)
    with pytest.raises(InvalidValue, match=r"count must be an int in \[1, 6\]"):
        leading_steps(sampler, path, 7)
    with pytest.raises(InvalidType, match="gradest.FlowSDE"):
        leading_steps(gradest.RectifiedFlow(steps=6), path, 2)


# -- step_range: one step's graph at a time ---------------------------------------------------


@pytest.mark.parametrize(("start", "stop"), [(0, 1), (2, 3), (5, 6), (1, 4), (0, 6)])
def test_a_step_range_keeps_the_whole_paths_coefficients(start, stop):
    """Bit for bit: the range's coefficients and step log-probabilities are the whole
    grid's steps start..stop-1 (step 0 at t = 1 reads t_1, which a range from 0 keeps)."""
    _, sampler, path = _path()
    cut, kept = step_range(sampler, path, start, stop)
    assert kept.num_steps == stop - start
    assert torch.equal(kept.states, path.states[start : stop + 1])
    assert torch.equal(kept.step_noise, path.step_noise[start:stop])
    for mine, whole in zip(cut.coefficients(), sampler.coefficients(), strict=True):
        assert torch.equal(mine, whole[start:stop])
    old = sampler.trajectory_log_probs(path, reduction="mean")
    assert torch.equal(cut.trajectory_log_probs(kept, reduction="mean"), old[start:stop])


def _moved(model: torch.nn.Module) -> torch.nn.Module:
    """The policy after an update: ratios away from 1, so the clip and the KL act."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_backward_per_step_is_the_whole_paths_exact_gradient(checkpoint):
    """Flow-GRPO's per-timestep backward: exact's surrogate on each step's term alone
    (``single_step``), backwarded on its own (one step's graph held), accumulates the exact
    gradient of the objective on the trained steps (dense Jacobians, gradest.reference),
    and so does the one surrogate over them; the terms' values add up to the objective's."""
    model, sampler, path = _path()
    model = _moved(model)
    count = 4
    old = sampler.trajectory_log_probs(path, reduction="mean")
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    with torch.no_grad():
        reference = path.velocities - 0.02
    options = {"clip": 0.2, "reduction": "mean", "kl_weight": 0.3}
    cut, kept = leading_steps(sampler, path, count)
    options["reference"] = reference[:count]
    whole = grpo_objective(cut, kept, old[:count], advantages, **options)
    truth, _ = exact_gradient(model, cut, whole, kept)

    exact = gradest.estimator("exact", checkpoint=checkpoint)
    model.zero_grad(set_to_none=True)
    values = []
    for j in range(count):
        one, step, term = single_step(cut, kept, whole, j)
        assert one.num_steps == step.num_steps == 1
        sur = exact.surrogate(model, one, term, trajectory=step)
        sur.loss.backward()
        values.append(float(sur.value))
    per_step = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sur = exact.surrogate(model, cut, whole, trajectory=kept)
    sur.loss.backward()
    together = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert sum(values) == pytest.approx(float(sur.value), rel=1e-12)
    for name, want in truth.items():
        torch.testing.assert_close(per_step[name], want, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(together[name], want, rtol=1e-10, atol=1e-13)
    # a gradient to compare: the clip leaves some samples' terms differentiable
    assert float(truth["output.weight"].abs().max()) > 1e-3


def test_single_step_refuses_bad_input_in_one_line():
    _, sampler, path = _path()
    objective = grpo_objective(
        sampler, path, sampler.trajectory_log_probs(path), torch.ones(4, dtype=torch.float64)
    )
    for step in (-1, 6, 1.0, True):
        with pytest.raises(InvalidValue, match=r"step must be an int in \[0, 5\]"):
            single_step(sampler, path, objective, step)
    with pytest.raises(InvalidType, match="StepwiseObjective"):
        single_step(sampler, path, gradest.TerminalObjective(lambda z: z.sum()), 0)


@pytest.mark.parametrize(
    ("start", "stop", "match"),
    [
        (-1, 2, r"start must be an int in \[0, 6\]"),
        (0, 7, r"stop must be an int in \[1, 6\]"),
        (3, 3, "stop must be greater than start"),
        (4, 2, "stop must be greater than start"),
        (True, 2, r"start must be an int"),
        (0, 2.0, r"stop must be an int"),
    ],
)
def test_a_step_range_refuses_bad_input_in_one_line(start, stop, match):
    _, sampler, path = _path()
    with pytest.raises(InvalidValue, match=match):
        step_range(sampler, path, start, stop)
    with pytest.raises(InvalidType, match="gradest.FlowSDE"):
        step_range(gradest.RectifiedFlow(steps=6), path, 0, 1)


# auto is left out: stateful, its first (probe) call returns exact's gradient and later
# calls its choice's, so one call tells nothing about the next (it is not separable).
STEPWISE_BUILTINS = sorted(
    name
    for name, cls in gradest.available_estimators().items()
    if "stepwise" in getattr(cls, "objectives", ("terminal", "stepwise")) and name != "auto"
)


@pytest.mark.parametrize("name", STEPWISE_BUILTINS)
def test_separable_over_steps_says_which_estimators_a_backward_per_step_keeps(name):
    """The rule the grpo recipe and ``gradest cost --per-timestep`` train by: an estimator
    is separable exactly when one surrogate per step's term (``single_step``), summed, is
    its own gradient over the steps (same generator for both)."""
    from gradest.rl import separable_over_steps

    model, sampler, path = _path(steps=8)
    model = _moved(model)
    old = sampler.trajectory_log_probs(path, reduction="mean")
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    steps = path.num_steps
    est = gradest.estimator(name)

    objective = grpo_objective(sampler, path, old, advantages, clip=0.2)

    def gradient(parts) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for part_sampler, part_path, part_objective in parts:
            sur = est.surrogate(
                model, part_sampler, part_objective, trajectory=part_path,
                generator=torch.Generator().manual_seed(5),
            )  # fmt: skip
            sur.loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = gradient([(sampler, path, objective)])
    try:
        per_step = gradient(single_step(sampler, path, objective, j) for j in range(steps))
    except InvalidValue as refused:  # options that need more than one step (telescope's depth)
        assert not separable_over_steps(est), refused
        return
    agree = torch.allclose(per_step, whole, rtol=1e-9, atol=1e-12)
    assert agree == separable_over_steps(est), (name, float((per_step - whole).norm()))
