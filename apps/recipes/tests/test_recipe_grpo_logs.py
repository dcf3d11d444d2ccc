"""The grpo recipe logs what Flow-GRPO's ``scripts/train_sd3.py`` logs (yifan123/flow_grpo):
per trained batch ``approx_kl``, ``clipfrac``, ``clipfrac_gt_one``, ``clipfrac_lt_one``,
``policy_loss`` and ``kl_loss``, per step ``zero_std_ratio``.

1. :func:`gradest.rl.grpo_step_statistics` against a direct computation on a tiny
   :class:`gradest.FlowSDE` problem in float64 (old log-probabilities written by hand
   with the sampler's ``step_log_prob``): zero at the sampling policy, the clip band
   left after the model is perturbed.
2. :func:`gradest.rl.zero_std_ratio` on groups of equal rewards, alone and on two gloo
   processes (the rewards gathered).
3. The recipe: the statistics come from the velocities the estimator evaluates (``sdo``:
   its sampled steps only), are 0 at a step's first trained batch (the policy has not
   moved), and the log records hold them as finite numbers in range.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from recipe_support import RECIPE_WARNINGS, records

import gradest
from gradest.errors import InvalidType, InvalidValue
from gradest.rl import (
    group_advantages,
    grpo_objective,
    grpo_step_statistics,
    prompt_advantages,
    reference_velocities,
    step_kl,
    zero_std_ratio,
)
from gradest.testing import perturb_parameters, seeded_normal, tiny_mlp

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = RECIPE_WARNINGS

DIM, BATCH, STEPS, GROUP = 3, 8, 4, 2
FLOW_GRPO_KEYS = ("approx_kl", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one")


# -- 1. the statistics of one step -------------------------------------------------------------


def _problem(reduction: str) -> dict[str, Any]:
    """A FlowSDE rollout of a tiny MLP (float64), its old log-probabilities written step by
    step with ``step_log_prob`` at the recorded velocities, advantages and the velocities
    of a frozen reference (the unperturbed model)."""
    model = tiny_mlp(DIM, hidden=8, seed=0)
    reference_model = copy.deepcopy(model).requires_grad_(False)
    flow = gradest.FlowSDE(STEPS, noise_level=0.7)
    noise = seeded_normal((BATCH, DIM), seed=11)
    with torch.no_grad():
        path = gradest.rollout(model, flow, noise, generator=torch.Generator().manual_seed(7))
    old = torch.stack(
        [flow.step_log_prob(path, k, path.velocities[k], reduction=reduction) for k in range(STEPS)]
    )
    return {
        "model": model,
        "flow": flow,
        "path": path,
        "old": old,
        "advantages": group_advantages(seeded_normal((BATCH,), seed=9), GROUP),
        "reference": reference_velocities(reference_model, flow, path),
    }


def _velocity(model: torch.nn.Module, flow: gradest.FlowSDE, path: Any, k: int) -> torch.Tensor:
    t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
    with torch.no_grad():
        return model(path.states[k], t)


def _direct(problem: dict[str, Any], k: int, velocity: torch.Tensor, clip: float, reduction: str):
    """Flow-GRPO's formulas, sample by sample in Python floats."""
    flow, path = problem["flow"], problem["path"]
    log_prob = flow.step_log_prob(path, k, velocity, reduction=reduction).tolist()
    old, advantages = problem["old"][k].tolist(), problem["advantages"].tolist()
    differences = [a - b for a, b in zip(log_prob, old, strict=True)]
    ratios = [math.exp(d) for d in differences]
    _, beta, scale = (float(c[k]) for c in flow.coefficients())
    squares = (velocity - problem["reference"][k]).pow(2).flatten(1)
    per_sample = squares.sum(1) if reduction == "sum" else squares.mean(1)
    return {
        "approx_kl": 0.5 * sum(d * d for d in differences) / BATCH,
        "clipfrac": sum(abs(r - 1.0) > clip for r in ratios) / BATCH,
        "clipfrac_gt_one": sum(r - 1.0 > clip for r in ratios) / BATCH,
        "clipfrac_lt_one": sum(1.0 - r > clip for r in ratios) / BATCH,
        "policy_loss": sum(
            max(-a * r, -a * min(max(r, 1.0 - clip), 1.0 + clip))
            for a, r in zip(advantages, ratios, strict=True)
        )
        / BATCH,
        "kl": float((beta * beta / (2 * scale * scale) * per_sample).mean()),
    }


def _statistics(problem, k, velocity, clip, reduction):
    return grpo_step_statistics(
        problem["flow"], problem["path"], k, velocity, problem["old"], clip,
        reduction=reduction, advantages=problem["advantages"], reference=problem["reference"],
    )  # fmt: skip


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_statistics_at_the_sampling_policy_are_zero(reduction):
    """At the recorded velocities (the policy that sampled) the log-ratio is exactly 0:
    approx_kl and every clipfrac are 0, the policy loss is -mean(A)."""
    problem = _problem(reduction)
    for k in range(STEPS):
        velocity = problem["path"].velocities[k]
        stats = _statistics(problem, k, velocity, 1e-4, reduction)
        assert set(stats) == {*FLOW_GRPO_KEYS, "policy_loss", "kl"}
        for name in FLOW_GRPO_KEYS:
            assert stats[name].shape == () and float(stats[name]) == 0.0, name
        assert float(stats["policy_loss"]) == pytest.approx(
            -float(problem["advantages"].mean()), abs=1e-15
        )
        assert float(stats["kl"]) == 0.0  # the reference is the sampling model
        assert not any(value.requires_grad for value in stats.values())


@pytest.mark.parametrize(("reduction", "clip"), [("sum", 0.2), ("mean", 0.02)])
def test_statistics_equal_a_direct_computation_off_the_old_policy(reduction, clip):
    """The model perturbed after the old log-probabilities were recorded: every statistic
    equals Flow-GRPO's formula written sample by sample, ratios leave the clip band on
    both sides, and the policy loss is N times the objective's step loss without KL."""
    problem = _problem(reduction)
    flow, path = problem["flow"], problem["path"]
    model = perturb_parameters(problem["model"], scale=0.1, seed=3)
    surrogate = grpo_objective(
        flow, path, problem["old"], problem["advantages"], clip, reduction=reduction
    )
    above = below = 0.0
    for k in range(STEPS):
        velocity = _velocity(model, flow, path, k).requires_grad_(True)
        stats = _statistics(problem, k, velocity, clip, reduction)
        want = _direct(problem, k, velocity.detach(), clip, reduction)
        for name, value in want.items():
            assert float(stats[name]) == pytest.approx(value, rel=1e-12, abs=1e-15), (k, name)
        assert float(stats["approx_kl"]) > 0
        clipfrac = float(stats["clipfrac"])
        assert clipfrac == float(stats["clipfrac_gt_one"]) + float(stats["clipfrac_lt_one"])
        above += float(stats["clipfrac_gt_one"])
        below += float(stats["clipfrac_lt_one"])
        step_loss = float(surrogate.loss_fn(k, velocity, path).detach())
        assert float(stats["policy_loss"]) == pytest.approx(STEPS * step_loss, rel=1e-12)
        kl = step_kl(flow, k, velocity.detach(), problem["reference"][k], reduction=reduction)
        assert float(stats["kl"]) == pytest.approx(float(kl.mean()), rel=1e-12)
        assert not any(value.requires_grad for value in stats.values())
    assert above > 0 and below > 0  # the band was left on both sides


def test_statistics_without_advantages_or_reference_leave_those_out():
    problem = _problem("sum")
    stats = grpo_step_statistics(
        problem["flow"], problem["path"], 0, problem["path"].velocities[0], problem["old"]
    )
    assert set(stats) == set(FLOW_GRPO_KEYS)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"sampler": gradest.RectifiedFlow(STEPS)}, InvalidType, "must be the gradest.FlowSDE"),
        ({"trajectory": "path"}, InvalidType, "trajectory must be a gradest.Trajectory"),
        ({"old_log_probs": torch.zeros(STEPS)}, InvalidValue, r"old_log_probs must be \[N, B\]"),
        ({"clip": 1.5}, InvalidValue, r"clip must be a float in \(0, 1\)"),
        ({"k": STEPS}, InvalidValue, "k must be a step index"),
        ({"velocity": torch.zeros(BATCH, DIM + 1)}, InvalidValue, "velocity has shape"),
        ({"advantages": torch.zeros(3)}, InvalidValue, r"advantages must be \[B\]"),
        ({"reference": torch.zeros(2, BATCH, DIM)}, InvalidValue, r"reference must be \[N, B"),
    ],
)  # fmt: skip
def test_statistics_refuse_bad_input_in_one_line(change, error, match):
    problem = _problem("sum")
    arguments = {
        "sampler": problem["flow"], "trajectory": problem["path"], "k": 0,
        "velocity": problem["path"].velocities[0], "old_log_probs": problem["old"], "clip": 0.2,
    }  # fmt: skip
    keywords = {key: change.pop(key) for key in ("advantages", "reference") if key in change}
    arguments.update(change)
    with pytest.raises(error, match=match):
        grpo_step_statistics(**arguments, **keywords)


# -- 2. zero_std_ratio -------------------------------------------------------------------------


def flow_grpo_zero_std_ratio(prompts: np.ndarray, rewards: np.ndarray) -> float:
    """Flow-GRPO's ``calculate_zero_std_ratio``, with "zero spread" read as "all equal"."""
    groups = [rewards[prompts == p] for p in np.unique(prompts)]
    return sum(bool((g == g[0]).all()) for g in groups) / len(groups)


def _groups() -> tuple[torch.Tensor, torch.Tensor]:
    """12 samples of 4 prompts, the first 6 on rank 0 and the last 6 on rank 1 of two
    processes: prompts 5 and 2 have equal rewards (0.1 three times: numpy's std of that
    is a 1e-17 residue, not 0), 9 and 0 do not; prompt 0's rewards are equal within each
    process's half (1.0 on rank 0, 1.5 twice on rank 1) but not over both."""
    prompts = torch.tensor([5, 9, 2, 0, 5, 9, 2, 0, 5, 9, 2, 0])
    rewards = torch.tensor(
        [0.1, 0.3, 0.7, 1.0, 0.1, 0.4, 0.7, 1.5, 0.1, 0.3, 0.7, 1.5], dtype=torch.float64
    )
    return rewards, prompts


def test_zero_std_ratio_counts_the_prompts_whose_rewards_are_all_equal():
    rewards, prompts = _groups()
    assert np.std(rewards[prompts == 5].numpy()) != 0  # the residue Flow-GRPO's == 0 misses
    assert zero_std_ratio(rewards, prompts) == 0.5
    assert zero_std_ratio(rewards, prompts) == flow_grpo_zero_std_ratio(
        prompts.numpy(), rewards.numpy()
    )
    assert zero_std_ratio(rewards.float(), prompts) == 0.5
    assert zero_std_ratio(torch.ones(4), torch.tensor([0, 0, 1, 1])) == 1.0
    assert zero_std_ratio(torch.arange(4.0), torch.tensor([0, 0, 1, 1])) == 0.0
    with pytest.raises(InvalidValue, match="NaN or Inf"):
        zero_std_ratio(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(InvalidValue, match="prompts must be an integer tensor"):
        zero_std_ratio(torch.ones(2), torch.zeros(2))


def _zero_std_rank(rank: int, init: str, results: str) -> None:
    """One gloo process with its half of :func:`_groups`' samples."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rewards, prompts = _groups()
        half = rewards.numel() // 2
        mine = slice(rank * half, (rank + 1) * half)
        local = zero_std_ratio(rewards[mine], prompts[mine])
        torch.save({"ratio": local}, f"{results}_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="no gloo backend"
)
def test_zero_std_ratio_of_two_gloo_processes_is_over_the_gathered_rewards(tmp_path):
    """Each process holds half of the samples, every prompt on both; both get the ratio of
    the union (prompt 0 is not counted: its rewards differ across the processes), which
    neither process's half alone gives."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    results = str(tmp_path / "rank")
    mp.spawn(_zero_std_rank, args=(init, results), nprocs=2, join=True)
    ratios = [torch.load(f"{results}_{rank}.pt")["ratio"] for rank in range(2)]
    rewards, prompts = _groups()
    assert ratios == [0.5, 0.5] == [zero_std_ratio(rewards, prompts)] * 2
    assert zero_std_ratio(rewards[:6], prompts[:6]) == 0.75  # rank 0's half alone
    assert zero_std_ratio(rewards[6:], prompts[6:]) == 1.0  # rank 1's


# -- 3. the recipe -----------------------------------------------------------------------------

SETTINGS = {"rollout_batches": 2, "batch_size": 4, "kl_weight": 0.04, "lr": 1e-2}


def _tiny(dtype: torch.dtype, **overrides: Any):
    """The tiny SD3 grpo family in ``dtype`` (the LoRA seeded as the recipe seeds it):
    test_flow_grpo_inner_epochs' ``tiny``, imported here so that this file's library
    tests run without diffusers (that module skips itself without it)."""
    from test_flow_grpo_inner_epochs import tiny

    return tiny(dtype, **overrides)


def _rollout(config, embeddings, family, dtype):
    """Step 0's rollout of the recipe's draws on one process, its rows and advantages."""
    from gradest_recipes.grpo_epoch import PROMPTS, SHUFFLE, sample_rollout
    from gradest_recipes.rl_objectives import RLObjective
    from gradest_recipes.train import NOISE, ROLLOUT, generator_for

    rl, seed, batches = RLObjective(family, config), config.seed, []
    for i in range(config.rollout_batches):
        rows = rl.prompt_index(
            generator_for(seed, PROMPTS, 0, i), embeddings.count, config.batch_size
        )
        shape = (config.batch_size, *family.latent_shape)
        noise = torch.randn(shape, generator=generator_for(seed, NOISE, 0, i, 0)).to(dtype)
        batches.append((noise, rows, generator_for(seed, ROLLOUT, 0, i, 0)))

    def cond_of(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) for k, v in family.make_cond(embeddings, rows, "cpu").items()}

    def rewards_of(rows: torch.Tensor):
        return lambda z: z.flatten(1).mean(1) * (1.0 + rows.to(z.dtype))

    rollout, _ = sample_rollout(rl, family.velocity, batches, cond_of, rewards_of)
    rows = torch.cat([b[1] for b in batches])
    advantages = prompt_advantages(rollout.rewards, rows)
    shuffle = lambda inner: generator_for(seed, SHUFFLE, 0, inner, 0)  # noqa: E731
    return rl, rollout, rows, advantages, cond_of, shuffle


@pytest.mark.parametrize("estimator", ["exact", "sdo"])
def test_train_on_rollout_logs_zero_at_the_first_batch_then_the_moved_policy(estimator):
    """float64, 2 inner epochs of 2 batches, an optimizer step after each batch: the first
    batch's statistics are those of the sampling policy (approx_kl and clipfrac 0), the
    later ones of a moved policy (approx_kl > 0, the clip band left by some sample)."""
    from accelerate import Accelerator
    from gradest_recipes.grpo_epoch import train_on_rollout
    from gradest_recipes.rl_objectives import GRPO_STATISTICS

    config, embeddings, family = _tiny(
        torch.float64, **SETTINGS, num_inner_epochs=2, estimator=estimator
    )
    rl, rollout, rows, advantages, cond_of, shuffle = _rollout(
        config, embeddings, family, torch.float64
    )
    trainable = [p for p in family.velocity.parameters() if p.requires_grad]
    _, _, _, statistics = train_on_rollout(
        rl, rollout, rows, advantages, model=family.velocity,
        estimator=gradest.estimator(config.estimator),
        optimizer=torch.optim.AdamW(trainable, lr=config.lr),
        accelerator=Accelerator(cpu=True), make_cond=cond_of, shuffle=shuffle,
        estimator_generator=lambda micro: torch.Generator().manual_seed(micro),
    )  # fmt: skip
    assert set(statistics) == set(GRPO_STATISTICS)
    assert all(len(values) == 4 for values in statistics.values())  # one per trained batch
    assert statistics["approx_kl"][0] == 0.0
    assert statistics["clipfrac"][0] == 0.0
    assert min(statistics["approx_kl"][1:]) > 0
    assert max(statistics["clipfrac"][1:]) > 0


def test_sdo_records_the_steps_it_evaluated_only():
    """``sdo`` with one sampled step of the 3: the recorded statistics are of that step
    (its decisions name it), at the velocity its loss was given; the value gradest
    completes over the other steps at the recorded velocities is not recorded."""
    from gradest_recipes.rl_objectives import GRPO_STATISTICS, StepStatistics

    config, embeddings, family = _tiny(torch.float64, **SETTINGS, num_inference_steps=3)
    rl, rollout, rows, advantages, cond_of, _ = _rollout(config, embeddings, family, torch.float64)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a policy that is not the sampling one
        for name, parameter in family.velocity.named_parameters():
            if "lora_B" in name:
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.copy_(0.05 * noise)
    estimator = gradest.estimator("sdo:samples=1")
    evaluated: set[int] = set()
    for seed in range(6):
        recorded = StepStatistics()
        objective = rl.grpo_objective(rl.sampler, rollout, advantages, statistics=recorded)
        sur = estimator.surrogate(
            family.velocity, rl.sampler, objective, trajectory=rollout.trajectory,
            cond=cond_of(rows), generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        decisions: Any = sur.decisions  # sdo's: the steps it sampled
        assert recorded.steps == list(decisions.sampled_steps)
        (k,) = recorded.steps
        evaluated.add(k)
        means = recorded.means()
        assert set(means) == set(GRPO_STATISTICS)
        assert means["approx_kl"] > 0  # the moved policy's, not the recorded velocities'
    assert len(evaluated) > 1  # different draws evaluated different steps
    # the wrapper leaves the loss as it was
    plain = rl.grpo_objective(rl.sampler, rollout, advantages)
    wrapped = rl.grpo_objective(rl.sampler, rollout, advantages, statistics=StepStatistics())
    velocity = rollout.trajectory.velocities[1] + 0.01
    assert torch.equal(
        plain.loss_fn(1, velocity, rollout.trajectory),
        wrapped.loss_fn(1, velocity, rollout.trajectory),
    )


def _run(tmp_path: Path, name: str, **overrides: Any) -> list[dict]:
    from gradest_recipes.config import load_config
    from gradest_recipes.train import train

    out = tmp_path / name
    settings = {"tiny": True, "objective": "grpo", "steps": 2, "out": str(out),
                "report_to": "none", **SETTINGS, **overrides}  # fmt: skip
    train("sd3", load_config("sd3", overrides=settings))
    return records(out)


def _assert_in_range(row: dict) -> None:
    for name in (*FLOW_GRPO_KEYS, "policy_loss", "kl_loss", "zero_std_ratio"):
        assert isinstance(row[name], float) and math.isfinite(row[name]), (name, row)
    for name in ("clipfrac", "clipfrac_gt_one", "clipfrac_lt_one", "zero_std_ratio"):
        assert 0.0 <= row[name] <= 1.0, (name, row)
    assert row["approx_kl"] >= 0 and row["kl_loss"] >= 0
    assert row["clipfrac"] == pytest.approx(row["clipfrac_gt_one"] + row["clipfrac_lt_one"])


@pytest.mark.parametrize("estimator", ["exact", "sdo"])
def test_recipe_log_records_hold_flow_grpos_statistics(estimator, tmp_path):
    """Two tiny runs of 2 steps, 2 rollout batches a step. With one optimizer step after
    both batches (gradient_accumulation 2, one inner epoch) every trained batch is at the
    sampling policy: approx_kl and clipfrac are 0 in every record. With one after each
    batch the second batch's policy has moved: approx_kl > 0, clipfrac > 0. With
    ``exact`` the logged loss is policy_loss + kl_weight * kl_loss (Flow-GRPO's loss)."""
    unmoved = _run(tmp_path, "unmoved", estimator=estimator, gradient_accumulation=2)
    moved = _run(tmp_path, "moved", estimator=estimator, gradient_accumulation=1)
    for row in unmoved + moved:
        _assert_in_range(row)
    for row in unmoved:
        assert row["approx_kl"] == 0.0 and row["clipfrac"] == 0.0, row
    assert all(row["approx_kl"] > 0 for row in moved)
    assert any(row["clipfrac"] > 0 for row in moved)
    if estimator == "exact":
        for row in unmoved + moved:
            want = row["policy_loss"] + SETTINGS["kl_weight"] * row["kl_loss"]
            assert row["loss"] == pytest.approx(want, abs=1e-6)
