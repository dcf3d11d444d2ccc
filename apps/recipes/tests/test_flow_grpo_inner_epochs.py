"""The grpo recipe runs Flow-GRPO's algorithm (yifan123/flow_grpo, scripts/train_sd3.py at
ac4c86e): several optimizer steps per rollout with the clip active, ``timestep_fraction``,
per-prompt advantage statistics over the whole epoch's (and every process's) samples.

The reference is :func:`hand_grpo_step`, a loop written here from Flow-GRPO's code, not
from gradest: its own Euler-Maruyama SDE step and log-density (``sde_step_with_logprob``),
its numpy ``PerPromptStatTracker``, its clipped-ratio loss with its KL, per-timestep
backward with the accumulation's scaling, clipping and ``torch.optim.AdamW``. Only the
random draws (prompts, noise, permutations) and the velocity model are shared. On the tiny
SD3 model in float64 it equals the recipe's grpo functions to 1e-10; the whole recipe
(``train``, float32) equals it to float32 accuracy.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from recipe_support import RECIPE_WARNINGS, SCRIPTS, launch, records

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = RECIPE_WARNINGS

Batch = tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Generator]]


@attrs.frozen
class Processes:
    """This process of a ``torch.distributed`` group, for the hand loop: ``rank`` of
    ``world``, written with the collectives themselves (not accelerate's)."""

    rank: int
    world: int

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated in rank order (``accelerator.gather``)."""
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def average(self, params: list[torch.Tensor]) -> None:
        """Each gradient averaged over the processes (DDP's all-reduce)."""
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= self.world


# -- the hand-written loop -------------------------------------------------------------------


def sde_step(grid: torch.Tensor, a: float, k: int, v, z, prev=None, xi=None):
    """Flow-GRPO's ``sde_step_with_logprob`` at grid step ``k``: ``(next, log_prob, mean,
    std_dev_t)``, the log-density averaged over the elements."""
    sigma, sigma_prev, sigma_max = float(grid[k]), float(grid[k + 1]), float(grid[1])
    dt = sigma_prev - sigma
    std = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
    mean = z * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std * math.sqrt(-dt)
    if prev is None:
        prev = mean + scale * xi
    log_prob = -((prev.detach() - mean) ** 2) / (2 * scale**2) - math.log(scale)
    log_prob = log_prob - math.log(math.sqrt(2 * math.pi))
    return prev, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std


def tracker(prompts: np.ndarray, rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """Flow-GRPO's ``PerPromptStatTracker.update`` (type 'grpo') on the gathered epoch."""
    out = np.zeros_like(rewards, dtype=np.float64)
    for prompt in np.unique(prompts):
        mine = rewards[prompts == prompt]
        std = np.std(rewards) if global_std else np.std(mine)
        out[prompts == prompt] = (mine - np.mean(mine)) / (std + 1e-4)
    return out


def hand_grpo_step(
    velocity, reference, optimizer, config, grid: torch.Tensor, batches: list[Batch],
    cond_of: Callable[[torch.Tensor], dict], reward_of: Callable[[torch.Tensor, torch.Tensor], Any],
    shuffle: Callable[[int], torch.Generator],
    inspect: Callable[[int, dict], None] = lambda update, state: None,
    processes: Processes | None = None,
) -> None:  # fmt: skip
    """One epoch of Flow-GRPO's train_sd3.py: sample, per-prompt advantages, inner epochs.
    ``velocity(z, t, **cond)``: the guided velocity (:func:`flow_grpo_guidance`). Under
    ``processes`` (one of several), the rewards and prompts are gathered for the tracker
    and this process keeps its slice of the advantages (its ``accelerator.gather`` and
    ``reshape(num_processes, -1)[process_index]``), and the gradients are averaged over
    the processes before clipping (what DDP does in the synchronising backward)."""
    a, steps = config.noise_level, grid.numel() - 1
    trained = int(steps * config.timestep_fraction)
    states, old, rewards, rows_all = [], [], [], []
    with torch.no_grad():
        for noise, rows, generator in batches:
            cond = cond_of(rows)
            xi = torch.randn((steps, *noise.shape), generator=generator(), dtype=noise.dtype)
            z, path, log_probs = noise, [noise], []
            for k in range(steps):
                t = torch.full((noise.shape[0],), float(grid[k]), dtype=noise.dtype)
                z, log_prob, _, _ = sde_step(grid, a, k, velocity(z, t, **cond), z, xi=xi[k])
                path.append(z)
                log_probs.append(log_prob)
            states.append(torch.stack(path))
            old.append(torch.stack(log_probs))
            rewards.append(reward_of(z, rows))
            rows_all.append(rows)
    states, old = torch.cat(states, dim=1), torch.cat(old, dim=1)
    rows, rewards = torch.cat(rows_all), torch.cat(rewards)
    if processes is None:
        all_rows, all_rewards = rows, rewards
    else:
        all_rows, all_rewards = processes.gather(rows), processes.gather(rewards)
    advantages = torch.as_tensor(
        tracker(all_rows.numpy(), all_rewards.double().numpy(), config.global_std)
    ).clamp(-config.adv_clip_max, config.adv_clip_max)
    if processes is not None:
        advantages = advantages.reshape(processes.world, -1)[processes.rank]
    total, batch = rows.numel(), rows.numel() // config.rollout_batches
    eps, beta = config.clip_range, config.kl_weight
    accumulate, update = config.gradient_accumulation, 0
    for inner in range(config.num_inner_epochs):
        perm = torch.randperm(total, generator=shuffle(inner))
        for b in range(config.rollout_batches):
            index = perm[b * batch : (b + 1) * batch]
            cond = cond_of(rows[index])
            adv = advantages[index].to(states.dtype)
            for j in range(trained):
                z, z_next = states[j][index], states[j + 1][index]
                t = torch.full((batch,), float(grid[j]), dtype=z.dtype)
                _, log_prob, mean, std = sde_step(grid, a, j, velocity(z, t, **cond), z, z_next)
                ratio = torch.exp(log_prob - old[j][index])
                unclipped = -adv * ratio
                clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
                loss = torch.mean(torch.maximum(unclipped, clipped))
                if beta > 0:
                    with torch.no_grad():
                        v_ref = reference(z, t, **cond)
                        _, _, mean_ref, _ = sde_step(grid, a, j, v_ref, z, z_next)
                    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, z.ndim))) / (2 * std**2)
                    loss = loss + beta * kl.mean()
                # accelerate divides by its accumulation steps: batches * trained steps
                (loss / (accumulate * trained)).backward()
            if (inner * config.rollout_batches + b + 1) % accumulate == 0:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                if processes is not None:
                    processes.average(params)
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                update += 1
                inspect(update, {"states": states, "old": old, "advantages": advantages,
                                 "rows": rows, "trained": trained})  # fmt: skip


def flow_grpo_guidance(guided: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """Flow-GRPO's ``compute_log_prob`` velocity, written from its code: the unguided model
    (``guided.model``, the recipe's ``DiffusersVelocity``) called once on ``[uncond; cond]``,
    ``noise_pred_uncond.detach()``, then ``uncond + w (text - uncond)``. Only the network
    is shared with the recipe; its guidance module (and its ``detach_unconditional``) is not
    used, so the comparison checks the recipe's CFG too."""
    model, scale = guided.model, guided.scale

    def velocity(z: torch.Tensor, t: torch.Tensor, **cond: torch.Tensor) -> torch.Tensor:
        doubled = {
            key: torch.cat([cond["negative_" + key], cond[key]])
            for key in ("encoder_hidden_states", "pooled_projections")
        }
        noise_pred = model(torch.cat([z, z]), torch.cat([t, t]), **doubled)
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()
        return noise_pred_uncond + scale * (noise_pred_text - noise_pred_uncond)

    return velocity


# -- shared set-up ---------------------------------------------------------------------------


def tiny(dtype: torch.dtype, **overrides):
    """The tiny SD3 grpo family (LoRA seeded as the recipe seeds it), in ``dtype``."""
    from accelerate.utils import set_seed
    from gradest_recipes.config import load_config
    from gradest_recipes.embeddings import tiny_embeddings
    from gradest_recipes.families import build_family

    settings = {"tiny": True, "objective": "grpo", "estimator": "exact", **overrides}
    config = load_config("sd3", overrides=settings)
    set_seed(config.seed)
    embeddings = tiny_embeddings("sd3")
    family = build_family("sd3", config, embeddings)
    family.velocity.to(dtype)
    return config, embeddings, family


def trainable(module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def adamw(module, config) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        trainable(module), lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon, weight_decay=config.weight_decay,
    )  # fmt: skip


def draws(
    config, embeddings, family, dtype, step: int = 0, rank: int = 0, world: int = 1
) -> tuple[list[Batch], Callable]:
    """The recipe's own draws for ``step`` of process ``rank`` of ``world``: prompts,
    noise, SDE noise, permutations (gradest_recipes.train.generator_for on its streams)."""
    from gradest_recipes.grpo_epoch import PROMPTS, SHUFFLE
    from gradest_recipes.rl_objectives import RLObjective
    from gradest_recipes.train import NOISE, ROLLOUT, generator_for

    rl = RLObjective(family, config)
    seed, batches = config.seed, []
    for i in range(config.rollout_batches):
        rows = rl.prompt_index(generator_for(seed, PROMPTS, step, i), embeddings.count,
                               config.batch_size, rank=rank, world=world)  # fmt: skip
        shape = (config.batch_size, *family.latent_shape)
        noise = torch.randn(shape, generator=generator_for(seed, NOISE, step, i, rank)).to(dtype)
        batches.append((noise, rows, lambda i=i: generator_for(seed, ROLLOUT, step, i, rank)))
    return batches, lambda inner: generator_for(seed, SHUFFLE, step, inner, rank)


def latent_reward(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A reward on the latents that differs between prompts (float64 tests: no VAE)."""
    return z.flatten(1).mean(1) * (1.0 + rows.to(z.dtype)) - 0.1 * z.flatten(1).pow(2).mean(1)


SETTINGS = {"num_inner_epochs": 2, "rollout_batches": 2, "timestep_fraction": 0.67,
            "batch_size": 4, "lr": 1e-2}  # fmt: skip


def recipe_functions(config, embeddings, family, batches, shuffle, after_update=lambda: None):
    """The recipe's grpo step (gradest_recipes.grpo_epoch's functions) on one process."""
    from accelerate import Accelerator
    from gradest_recipes.grpo_epoch import sample_rollout, train_on_rollout
    from gradest_recipes.rl_objectives import RLObjective

    import gradest
    from gradest.rl import prompt_advantages

    dtype = batches[0][0].dtype
    rl = RLObjective(family, config)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=config.gradient_accumulation)
    optimizer = adamw(family.velocity, config)

    def cond_of(rows):
        return {k: v.to(dtype) for k, v in family.make_cond(embeddings, rows, "cpu").items()}

    def rewards_of(rows):
        return lambda z: latent_reward(z, rows)

    runs = [(noise, rows, make()) for noise, rows, make in batches]
    rollout, _ = sample_rollout(rl, family.velocity, runs, cond_of, rewards_of)
    rows = torch.cat([b[1] for b in batches])
    advantages = prompt_advantages(rollout.rewards, rows, global_std=config.global_std)
    estimator = gradest.estimator(config.estimator)
    train_on_rollout(
        rl, rollout, rows, advantages, model=family.velocity, estimator=estimator,
        optimizer=optimizer, accelerator=accelerator, make_cond=cond_of, shuffle=shuffle,
        estimator_generator=lambda micro: torch.Generator().manual_seed(micro),
        after_update=after_update,
    )  # fmt: skip
    return rl, cond_of, rollout, rows, advantages


def hand_on_fresh_family(
    config_overrides, dtype, reward_of=latent_reward, inspect=None, processes=None
):
    """The hand loop on a freshly built family (the same LoRA init), the recipe's draws
    (those of ``processes``' rank, if given)."""
    config, embeddings, family = tiny(dtype, **config_overrides)
    reference = copy.deepcopy(family.velocity).requires_grad_(False)  # every lora_B is 0
    rank, world = (0, 1) if processes is None else (processes.rank, processes.world)
    batches, shuffle = draws(config, embeddings, family, dtype, rank=rank, world=world)
    from gradest_recipes.rl_objectives import RLObjective

    grid = RLObjective(family, config).sampler.times

    def cond_of(rows):
        return {k: v.to(dtype) for k, v in family.make_cond(embeddings, rows, "cpu").items()}

    from gradest.integrations import ClassifierFreeGuidance

    assert isinstance(family.velocity, ClassifierFreeGuidance)  # the tiny SD3 runs CFG
    hand_grpo_step(
        flow_grpo_guidance(family.velocity), reference, adamw(family.velocity, config), config,
        grid, batches, cond_of, reward_of, shuffle, **({"inspect": inspect} if inspect else {}),
        processes=processes,
    )  # fmt: skip
    return family


# -- 1. the recipe's functions equal the hand loop (float64) -----------------------------------


@pytest.mark.parametrize("accumulation", [1, 2])
def test_inner_epochs_equal_the_hand_written_loop_in_float64(accumulation):
    """2 inner epochs of 2 batches, 2 of the 3 steps trained, KL on, prompts repeated over
    the batches (their statistics pooled over the epoch): the LoRA weights after the
    recipe's grpo step equal the hand loop's to 1e-10 (4 AdamW steps, or 2 with
    accumulation over 2 batches)."""
    overrides = {**SETTINGS, "gradient_accumulation": accumulation}
    config, embeddings, family = tiny(torch.float64, **overrides)
    batches, shuffle = draws(config, embeddings, family, torch.float64)
    rows = torch.cat([b[1] for b in batches])
    assert len(set(rows.tolist())) < rows.numel() // config.group_size  # a prompt repeats
    before = [p.detach().clone() for p in trainable(family.velocity)]
    recipe_functions(config, embeddings, family, batches, shuffle)
    hand = hand_on_fresh_family(overrides, torch.float64)
    mine, theirs = trainable(family.velocity), trainable(hand.velocity)
    assert len(mine) == len(theirs) > 0
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(mine, before, strict=True))
    assert moved > 1e-3  # the steps did train
    for p, q in zip(mine, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_the_hand_loop_tells_a_recipe_that_trains_through_the_unconditional_half():
    """Guards the test above: the recipe with ``detach_unconditional = false`` (CFG trained
    through both halves, as before Flow-GRPO's setting was the default) no longer equals
    Flow-GRPO's loop, whose ``noise_pred_uncond`` is detached."""
    overrides = {**SETTINGS, "detach_unconditional": False}
    config, embeddings, family = tiny(torch.float64, **overrides)
    batches, shuffle = draws(config, embeddings, family, torch.float64)
    before = [p.detach().clone() for p in trainable(family.velocity)]
    recipe_functions(config, embeddings, family, batches, shuffle)
    hand = hand_on_fresh_family(SETTINGS, torch.float64)
    mine, theirs = trainable(family.velocity), trainable(hand.velocity)
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(mine, before, strict=True))
    gap = max(float((p - q).abs().max()) for p, q in zip(mine, theirs, strict=True))
    assert gap > 1e-3 * moved  # far beyond the 1e-10 the detached recipe agrees to


# -- 2. the clip acts from the second optimizer step on ----------------------------------------


def _measured_grpo_step(monkeypatch, per_timestep: bool, **overrides):
    """The recipe's grpo step on a fresh tiny family, with ``exact`` trained one timestep
    at a time or in one surrogate (``backward_per_timestep`` forced), measured by the lab's
    ``measure_step`` (FLOPs, peak saved-tensor bytes): the trained weights and the cost."""
    from gradest_lab.cost.training_cost import measure_step
    from gradest_recipes import grpo_epoch

    monkeypatch.setattr(grpo_epoch, "backward_per_timestep", lambda estimator: per_timestep)
    config, embeddings, family = tiny(torch.float64, **{**SETTINGS, **overrides})
    batches, shuffle = draws(config, embeddings, family, torch.float64)
    weights = trainable(family.velocity)
    cost = measure_step(
        lambda: recipe_functions(config, embeddings, family, batches, shuffle),
        excluded=[*family.velocity.parameters(), *family.velocity.buffers()],
    )
    return [p.detach().clone() for p in weights], cost


def test_one_backward_per_timestep_is_one_surrogate_over_the_steps_with_one_steps_graph(
    monkeypatch,
):
    """Flow-GRPO's per-timestep backward (the recipe's default with ``exact``): the same
    update as one surrogate over the 5 trained steps (float64, 1e-10), the same FLOPs, and
    the graph of one step held at a time: the peak of saved-tensor bytes is the
    together-run's divided by the trained steps (up to what a step saves whatever its
    batch: 1.032x of the fifth here, for 3, 5 or 9 trained steps alike; deterministic)."""
    overrides = {"num_inference_steps": 6, "timestep_fraction": 0.99}  # 5 trained steps
    per_step, apart = _measured_grpo_step(monkeypatch, True, **overrides)
    together, joint = _measured_grpo_step(monkeypatch, False, **overrides)
    for p, q in zip(per_step, together, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert apart.flops == joint.flops
    trained = 5
    assert apart.retained_bytes * trained < 1.05 * joint.retained_bytes
    assert apart.retained_bytes * 2 < joint.retained_bytes  # far from the together-run


def test_the_clip_is_active_after_the_first_update():
    """After the first AdamW step of a rollout the ratio to its old log-probabilities
    differs from 1; the recipe's objective gives exactly zero gradient to the terms whose
    ratio left the band on the side its advantage favours, and non-zero to the others."""
    from gradest.rl import leading_steps

    config, embeddings, family = tiny(torch.float64, **SETTINGS, kl_weight=0.0)
    batches, shuffle = draws(config, embeddings, family, torch.float64)
    params = trainable(family.velocity)
    first: list[list[torch.Tensor]] = []

    def after_update():
        if not first:
            first.append([p.detach().clone() for p in params])

    rl, cond_of, rollout, rows, advantages = recipe_functions(
        config, embeddings, family, batches, shuffle, after_update
    )
    with torch.no_grad():  # the policy of the second optimizer step
        for p, value in zip(params, first[0], strict=True):
            p.copy_(value)
    steps = int(config.num_inference_steps * config.timestep_fraction)
    sampler, path = leading_steps(rl.sampler, rollout.trajectory, steps)
    objective = rl.grpo_objective(sampler, attrs.evolve(rollout, trajectory=path), advantages)
    cond, eps = cond_of(rows), config.clip_range
    clipped_any = False
    for k in range(steps):
        with torch.no_grad():
            t = torch.full((rows.numel(),), float(sampler.times[k]), dtype=torch.float64)
            velocity = family.velocity(path.states[k], t, **cond)
        log_prob = sampler.step_log_prob(path, k, velocity, reduction="mean")
        ratio = torch.exp(log_prob - rollout.old_log_probs[k])
        assert float((ratio - 1).abs().min()) > 0  # no ratio is 1 any more
        favoured = ((advantages > 0) & (ratio > 1 + eps)) | ((advantages < 0) & (ratio < 1 - eps))
        leaf = velocity.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(objective.loss_fn(k, leaf, path), leaf)
        per_sample = grad.flatten(1).abs().amax(1)
        assert bool((per_sample[favoured] == 0).all())
        assert bool((per_sample[~favoured] > 0).all())
        clipped_any |= bool(favoured.any())
    assert clipped_any  # the clip acted on some term


# -- 3. the whole recipe (float32) -----------------------------------------------------------


def test_recipe_step_equals_the_hand_written_loop(tmp_path):
    """``train`` with grpo, 2 inner epochs of 2 batches, timestep_fraction 0.67: after its
    one step (4 AdamW steps) the LoRA weights equal the hand loop's, run on the recipe's
    own draws and its VAE-decoded brightness reward, to float32 accuracy; the log counts
    the rollout's work (2 batches of 2N forwards)."""
    from gradest_recipes.config import load_config
    from gradest_recipes.rewards import resolve_reward
    from gradest_recipes.rl_objectives import per_sample_reward
    from gradest_recipes.train import train

    overrides = {**SETTINGS, "lr": 3e-4}
    settings = {"tiny": True, "objective": "grpo", "estimator": "exact", "steps": 1,
                "out": str(tmp_path / "run"), "report_to": "none", **overrides}  # fmt: skip
    run = train("sd3", load_config("sd3", overrides=settings))
    config, embeddings, family = tiny(torch.float32, **overrides)
    reward = resolve_reward(config.reward)

    def reward_of(z, rows):
        prompts = [embeddings.prompts[int(i)] for i in rows]
        return per_sample_reward(reward, family.vae, family.to_vae_latents, prompts)(z)

    hand = hand_on_fresh_family(overrides, torch.float32, reward_of=reward_of)
    start = [p.detach() for p in trainable(family.velocity)]  # the LoRA init of both
    mine = [p.detach() - p0 for p, p0 in zip(trainable(run.family.velocity), start, strict=True)]
    theirs = [p.detach() - p0 for p, p0 in zip(trainable(hand.velocity), start, strict=True)]
    moved = max(float(d.abs().max()) for d in theirs)
    assert moved > 1e-4
    # float32: the updates agree to 1e-3 of their size; one inner epoch fewer, or every
    # step trained, changes them by about half their size. (AdamW divides by sqrt(v): the
    # float32 rounding of a small gradient element, summed in another order by the recipe
    # and the hand loop, becomes a relative error of its update, up to ~1e-4 of the
    # largest with Flow-GRPO's LoRA on 8 projections at alpha = 2 rank.)
    assert max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)) < 1e-3 * moved
    (row,) = records(tmp_path / "run")
    assert row["objective_model_units"] == 2 * 2 * config.num_inference_steps


# -- 4. two processes: groups span the processes -----------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)
def test_two_processes_train_groups_that_span_them(tmp_path):
    """``torchrun --nproc_per_node 2`` with batch_size 1 and group_size 2: every group has
    one sample on each process (valid only with 2 processes: the per-prompt statistics are
    gathered); the run trains and logs."""
    out = tmp_path / "ddp"
    launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "sd3_grpo.py"), "--tiny", "--out", str(out), "--report_to", "none",
         "--batch_size", "1", "--group_size", "2", "--num_inner_epochs", "2",
         "--rollout_batches", "2", "--estimator", "exact"],
        tmp_path,
    )  # fmt: skip
    rows = records(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)
@pytest.mark.parametrize("detached", [True, False])
def test_two_processes_equal_flow_grpos_update_written_by_hand(tmp_path, detached):
    """Two gloo processes (``flow_grpo_two_processes.py``): the recipe's grpo step (DDP,
    tiny SD3 with CFG, 2 inner epochs of 2 batches, 4 AdamW steps) and Flow-GRPO's update
    written by hand (rewards and prompts gathered for the advantages, gradients
    all-reduced, ``noise_pred_uncond.detach()``) end with the same LoRA weights to float32
    accuracy (1e-3 of the update, as the one-process test), on both processes. The recipe
    with ``detach_unconditional = false`` does not."""
    out = tmp_path / "two"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(Path(__file__).with_name("flow_grpo_two_processes.py")),
               str(out)]  # fmt: skip
    if not detached:
        command.append("detach_unconditional=False")
    launch(command, tmp_path)
    results = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["parameters"] > 0 and result["moved"] > 1e-4
        if detached:
            assert result["gap"] < 1e-3 * result["moved"], result
        else:
            assert result["gap"] > 1e-2 * result["moved"], result
    assert results[0] == results[1]  # DDP: the processes hold one model


def test_grpo_settings_refused_with_their_names():
    from gradest_recipes.config import RecipeConfigError, config_from_argv

    def parse(*argv):
        return config_from_argv("sd3", ["--tiny", *argv], objective="grpo")

    with pytest.raises(RecipeConfigError, match=r"timestep_fraction=1\.5.*\(0, 1\]"):
        parse("--timestep_fraction", "1.5")
    with pytest.raises(RecipeConfigError, match=r"timestep_fraction=0\.2.*= 0 of the 3 steps"):
        parse("--timestep_fraction", "0.2")
    with pytest.raises(RecipeConfigError, match="num_inner_epochs=0"):
        parse("--num_inner_epochs", "0")
    with pytest.raises(RecipeConfigError, match="rollout_batches=3.*gradient_accumulation=2"):
        parse("--rollout_batches", "3", "--gradient_accumulation", "2")
    with pytest.raises(RecipeConfigError, match="batch_size=1.*1 process.*group_size=2"):
        parse("--batch_size", "1")
    # the official defaults (config/base.py, config/grpo.py's SD3 configs)
    from gradest_recipes.config import load_config

    full = load_config("sd3", overrides={"objective": "grpo", "pretrained": "x",
                                         "embeddings": "y.pt"})  # fmt: skip
    assert (full.num_inner_epochs, full.rollout_batches, full.timestep_fraction) == (1, 2, 0.99)
    assert (full.global_std, full.lr, full.weight_decay) == (True, 3e-4, 1e-4)
    assert (full.clip_range, full.adv_clip_max, full.noise_level) == (1e-4, 5.0, 0.7)
