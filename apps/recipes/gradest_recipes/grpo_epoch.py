"""The grpo recipe's step as Flow-GRPO runs it: one epoch of its training script.

One recipe step of ``objective = "grpo"`` is one epoch of Flow-GRPO's
``scripts/train_sd3.py`` (``yifan123/flow_grpo``, read at commit ac4c86e of 2025-07-18):

1. **Sampling**: each process rolls out ``rollout_batches`` batches of ``batch_size``
   samples with the current LoRA model (:meth:`RLObjective.grpo_rollout`: the path, its
   rewards, the old log-probabilities and the adapters-off model's velocities, no graph).
   The prompts of a batch are Flow-GRPO's ``DistributedKRepeatSampler``'s
   (:meth:`RLObjective.prompt_index`): ``processes * batch_size / group_size`` prompts,
   each ``group_size`` times, shuffled over the processes from a generator every process
   seeds alike.
2. **Advantages**: :func:`gradest.rl.prompt_advantages` over every process's samples of
   the step (per-prompt mean; the std of all rewards with ``global_std``, else the
   prompt's), this process's part kept, clipped to ``[-adv_clip_max, adv_clip_max]``.
3. **Training**: ``num_inner_epochs`` passes over the rollout. Each pass permutes this
   process's samples (Flow-GRPO's ``torch.randperm`` per inner epoch; here from a
   generator seeded by ``(seed, step, pass, process)``, so a resumed run repeats it) and
   splits them into ``rollout_batches`` batches of ``batch_size``. Each batch trains on
   the first ``int(N * timestep_fraction)`` steps of its paths
   (:func:`gradest.rl.leading_steps`; Flow-GRPO's ``num_train_timesteps``, in grid order:
   its per-sample timestep shuffle is the identity in every commit) with
   ``est.surrogate(model, sampler, objective, trajectory=...)``; with ``exact`` (the
   default), as Flow-GRPO, one surrogate and one backward per trained step
   (:func:`gradest.rl.single_step`: one step's graph held at a time, the same gradient and
   FLOPs as one surrogate over the steps; :func:`backward_per_timestep`); every
   ``gradient_accumulation`` batches the gradients are clipped and AdamW steps (the lr
   schedule and the EMA with it). The ratio is always to the rollout's old
   log-probabilities, so from the second optimizer step of a step on the policy has moved,
   the ratio differs from 1 and ``clip_range`` acts.

A step therefore takes :func:`updates_per_step` optimizer steps; ``steps`` counts epochs.
Flow-GRPO also drops samples whose advantage is zero at every step before training (and
pads the count back to a multiple of the batch count); here every sample is kept (an
exactly zero advantage needs a group of equal rewards; it adds nothing to the surrogate's
gradient, only to the KL term's).

Logged besides the reward, ``loss``, ``kl`` and the work: Flow-GRPO's training statistics
(:data:`~gradest_recipes.rl_objectives.GRPO_STATISTICS`: ``approx_kl``, ``clipfrac``,
``clipfrac_gt_one``, ``clipfrac_lt_one``, ``policy_loss``, ``kl_loss``), per trained batch
the mean over the steps the estimator evaluated of each step's mean over the samples,
from the velocities the surrogate's loss evaluates (no extra model call:
:class:`~gradest_recipes.rl_objectives.StepStatistics`); and the sampling's
``zero_std_ratio`` (:func:`gradest.rl.zero_std_ratio`: the fraction of the step's prompts
whose rewards over every process are all equal). The recipe's ``train_step`` averages each
over the step's batches and over the processes: Flow-GRPO logs them per optimizer step,
a record here holds their mean over the step's optimizer steps. Before the first optimizer
step of a step the policy is the sampling one, so ``approx_kl`` and the ``clipfrac``
family are 0 there (up to the rounding of the velocity model's batched forwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest.plugin import check_surrogate
from gradest_recipes.config import RecipeConfig
from gradest_recipes.rl_objectives import (
    GRPO_STATISTICS,
    GrpoRollout,
    RLObjective,
    StepStatistics,
    per_sample_reward,
)

__all__ = [
    "PROMPTS",
    "backward_per_timestep",
    "SHUFFLE",
    "grpo_step",
    "sample_rollout",
    "train_on_rollout",
    "trained_steps",
    "updates_per_step",
]

# Generator streams beside train.py's NOISE, ESTIMATOR, SAMPLES, ROLLOUT (0 to 3).
PROMPTS, SHUFFLE = 4, 5

Batch = tuple[Tensor, Tensor, torch.Generator]  # noise [B, ...], prompt rows [B], SDE noise


def trained_steps(config: RecipeConfig) -> int:
    """``int(N * timestep_fraction)``: the steps of each path the surrogate trains on."""
    return int(config.num_inference_steps * config.timestep_fraction)


def updates_per_step(config: RecipeConfig) -> int:
    """Optimizer steps per recipe step: ``num_inner_epochs * rollout_batches /
    gradient_accumulation`` for grpo, 1 for the other objectives."""
    if config.objective != "grpo":
        return 1
    return config.num_inner_epochs * config.rollout_batches // config.gradient_accumulation


def _rows(rollout: GrpoRollout, index: Tensor) -> GrpoRollout:
    """The samples ``index`` of ``rollout`` (every tensor's batch dimension)."""
    from gradest import Trajectory

    path = rollout.trajectory
    noise = path.step_noise
    picked = Trajectory(
        times=path.times,
        states=path.states[:, index],
        velocities=path.velocities[:, index],
        step_noise=None if noise is None else noise[:, index],
    )
    return GrpoRollout(
        trajectory=picked,
        rewards=rollout.rewards[index],
        old_log_probs=rollout.old_log_probs[:, index],
        reference=rollout.reference[:, index],
        kl=rollout.kl,
    )


def _joined(rollouts: Sequence[GrpoRollout]) -> GrpoRollout:
    """The batches of one step's sampling as one rollout (``kl``: their mean)."""
    from gradest import Trajectory

    paths = [r.trajectory for r in rollouts]
    noises = [p.step_noise for p in paths]
    path = Trajectory(
        times=paths[0].times,
        states=torch.cat([p.states for p in paths], dim=1),
        velocities=torch.cat([p.velocities for p in paths], dim=1),
        step_noise=None if noises[0] is None else torch.cat(noises, dim=1),  # type: ignore[arg-type]
    )
    return GrpoRollout(
        trajectory=path,
        rewards=torch.cat([r.rewards for r in rollouts]),
        old_log_probs=torch.cat([r.old_log_probs for r in rollouts], dim=1),
        reference=torch.cat([r.reference for r in rollouts], dim=1),
        kl=float(sum(r.kl for r in rollouts) / len(rollouts)),
    )


def sample_rollout(
    rl: RLObjective,
    policy: torch.nn.Module,
    batches: Sequence[Batch],
    make_cond: Callable[[Tensor], dict[str, Any]],
    rewards_of: Callable[[Tensor], Callable[[Tensor], Tensor]],
) -> tuple[GrpoRollout, list[float]]:
    """Flow-GRPO's sampling phase: each batch ``(noise, prompt rows, SDE generator)``
    rolled out by ``policy`` (unwrapped); ``rewards_of(rows)`` is the per-sample reward of
    those rows' prompts. Returns the batches joined, and each batch's path KL."""
    sampled = [
        rl.grpo_rollout(policy, noise, make_cond(rows), rewards_of(rows), generator)
        for noise, rows, generator in batches
    ]
    return _joined(sampled), [r.kl for r in sampled]


def train_on_rollout(
    rl: RLObjective,
    rollout: GrpoRollout,
    rows: Tensor,
    advantages: Tensor,
    *,
    model: torch.nn.Module,
    estimator: Any,
    optimizer: Any,
    accelerator: Any,
    make_cond: Callable[[Tensor], dict[str, Any]],
    shuffle: Callable[[int], torch.Generator],
    estimator_generator: Callable[[int], torch.Generator],
    after_update: Callable[[], None] = lambda: None,
) -> tuple[list[float], float, float, dict[str, list[float]]]:
    """Flow-GRPO's training phase on one rollout (this process's samples ``rows`` of the
    prompts, ``advantages`` unclipped): ``num_inner_epochs`` reshuffled passes of
    ``rollout_batches`` batches, each on its first :func:`trained_steps` steps (with
    ``exact`` a surrogate and a backward per step, :func:`backward_per_timestep`), an
    optimizer step (clipping, ``optimizer.step()``, then ``after_update()``) every
    ``gradient_accumulation`` batches through ``accelerator.accumulate``.

    ``shuffle(pass)`` gives the permutation's generator, ``estimator_generator(micro)``
    the estimator's (``micro`` counts the batches of the step). Returns each batch's
    ``sur.value``, the estimator's model units, the last gradient norm, and per statistic
    of :data:`~gradest_recipes.rl_objectives.GRPO_STATISTICS` its value for each batch
    that evaluated a step (:meth:`StepStatistics.means`, at the policy of that batch's
    surrogate: before its optimizer step).
    """
    config = rl.config
    total = rollout.rewards.shape[0]
    batch = total // config.rollout_batches
    losses: list[float] = []
    statistics: dict[str, list[float]] = {}
    units, grad_norm = 0.0, float("nan")
    per_timestep = backward_per_timestep(estimator)
    for inner in range(config.num_inner_epochs):
        order = torch.randperm(total, generator=shuffle(inner)).to(rows.device)
        for b in range(config.rollout_batches):
            index = order[b * batch : (b + 1) * batch]
            part = _rows(rollout, index)
            recorded = StepStatistics()
            trained = _TrainedBatch(
                rl, part, advantages[index], model=model, estimator=estimator,
                accelerator=accelerator, cond=make_cond(rows[index]), statistics=recorded,
                generator=estimator_generator(inner * config.rollout_batches + b),
            )  # fmt: skip
            with accelerator.accumulate(model):
                value, cost = trained.per_timestep() if per_timestep else trained.together()
                if accelerator.sync_gradients:
                    grad_norm = _clip(model, accelerator, config.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    after_update()
            losses.append(value)
            units += cost
            for name, value in recorded.means().items():
                statistics.setdefault(name, []).append(value)
    return losses, units, grad_norm, statistics


def backward_per_timestep(estimator: Any) -> bool:
    """Whether a batch trains one timestep at a time, as Flow-GRPO does: with ``exact``
    (:func:`gradest.rl.separable_over_steps`).

    Its gradient is a sum of one VJP per trained step, so a surrogate and a backward per
    step (:func:`gradest.rl.single_step`) accumulate the same gradient as one surrogate
    over the steps, with the same FLOPs, holding one step's graph instead of all of them
    (``gradest cost --objective stepwise --per-timestep``). Every other estimator chooses
    among the batch's steps (draws, windows, kept steps), which a one-step range would
    take from it: they train on one surrogate over the trained steps.
    """
    from gradest.rl import separable_over_steps

    return separable_over_steps(estimator)


@attrs.define
class _TrainedBatch:
    """The backward of one trained batch: its first :func:`trained_steps` steps."""

    rl: RLObjective
    part: GrpoRollout
    advantages: Tensor
    model: torch.nn.Module = attrs.field(kw_only=True)
    estimator: Any = attrs.field(kw_only=True)
    accelerator: Any = attrs.field(kw_only=True)
    cond: dict[str, Any] = attrs.field(kw_only=True)
    statistics: StepStatistics = attrs.field(kw_only=True)
    generator: torch.Generator = attrs.field(kw_only=True)

    def together(self) -> tuple[float, float]:
        """One surrogate over the trained steps, one backward: ``(sur.value, units)``."""
        sampler, path, objective = self._objective()
        sur = self._backward(sampler, path, objective)
        return float(sur.value), sur.cost.model_units()

    def per_timestep(self) -> tuple[float, float]:
        """Flow-GRPO's loop: per trained step a surrogate on that step's term alone
        (:func:`gradest.rl.single_step`) and its backward. Returns the objective's value
        (the sum of the terms' values) and the units summed."""
        from gradest.rl import single_step

        sampler, path, objective = self._objective()
        steps = path.num_steps
        value, units = 0.0, 0.0
        for j in range(steps):
            # Under DDP the gradients are reduced once per batch, in its last backward (the
            # others accumulate locally), as one backward over the steps would.
            last = j == steps - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                sur = self._backward(*single_step(sampler, path, objective, j))
            value += float(sur.value)
            units += sur.cost.model_units()
        return value, units

    def _objective(self) -> tuple[Any, Any, Any]:
        """The sampler, path and objective of the batch's trained steps."""
        from gradest.rl import leading_steps

        steps = trained_steps(self.rl.config)
        sampler, path = leading_steps(self.rl.sampler, self.part.trajectory, steps)
        objective = self.rl.grpo_objective(
            sampler, attrs.evolve(self.part, trajectory=path), self.advantages,
            statistics=self.statistics,
        )  # fmt: skip
        return sampler, path, objective

    def _backward(self, sampler: Any, path: Any, objective: Any) -> Any:
        sur = self.estimator.surrogate(
            self.model, sampler, objective, trajectory=path, cond=self.cond,
            generator=self.generator,
        )  # fmt: skip
        self.accelerator.backward(check_surrogate(self.estimator, sur).loss)
        return sur


def _clip(model: torch.nn.Module, accelerator: Any, max_norm: float) -> float:
    parameters = [p for p in model.parameters() if p.requires_grad]
    norm = accelerator.clip_grad_norm_(parameters, max_norm or float("inf"))
    if norm is not None and hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()  # FSDP: a DTensor
    return float(norm) if norm is not None else float("nan")


def grpo_step(
    run: Any, seeded: Callable[..., torch.Generator], streams: tuple[int, int, int]
) -> tuple[list[float], list[float], float, float, dict[str, list[float]]]:
    """One grpo step of the recipe's run (``gradest_recipes.train._Run``): sampling,
    gathered advantages, training (the module docstring). ``seeded(seed, *keys)`` is the
    recipe's generator, ``streams`` its ``(NOISE, ESTIMATOR, ROLLOUT)`` stream keys.
    Returns ``(rewards, losses, units, grad_norm, extras)`` as the
    recipe's ``train_step`` records them: each batch's mean reward, each trained batch's
    ``sur.value``, the estimator's model units, the last gradient norm, and the lists it
    averages: per rollout batch ``kl`` and ``objective_model_units``, per trained batch
    the :data:`~gradest_recipes.rl_objectives.GRPO_STATISTICS` (``[nan]`` for one that no
    batch of this process evaluated: every process must log the same names), and the
    step's ``zero_std_ratio``."""
    from gradest.rl import prompt_advantages, zero_std_ratio

    NOISE, ESTIMATOR, ROLLOUT = streams  # noqa: N806 (train.py's constants)
    config, accelerator, family, rl = run.config, run.accelerator, run.family, run.rl
    device, rank = accelerator.device, accelerator.process_index
    world, step, seed = accelerator.num_processes, run.step, config.seed
    embeddings = run.embeddings

    def make_cond(rows: Tensor) -> dict[str, Any]:
        return family.make_cond(embeddings, rows.cpu(), device)

    def rewards_of(rows: Tensor) -> Callable[[Tensor], Tensor]:
        prompts = [embeddings.prompts[int(i)] for i in rows]
        return per_sample_reward(
            run.reward, family.vae, family.to_vae_latents, prompts, autocast=accelerator.autocast
        )

    batches: list[Batch] = []
    for i in range(config.rollout_batches):
        shared = seeded(seed, PROMPTS, step, i)  # the same on every process
        rows = rl.prompt_index(shared, embeddings.count, config.batch_size, rank=rank, world=world)
        noise = torch.randn(
            (config.batch_size, *family.latent_shape), generator=seeded(seed, NOISE, step, i, rank)
        )
        batches.append((noise.to(device), rows, seeded(seed, ROLLOUT, step, i, rank)))
    policy = accelerator.unwrap_model(run.model)
    rollout, kls = sample_rollout(rl, policy, batches, make_cond, rewards_of)
    rows = torch.cat([b[1] for b in batches])
    advantages = prompt_advantages(
        rollout.rewards.to(device), rows.to(device), global_std=config.global_std
    )
    zero_std = zero_std_ratio(rollout.rewards.to(device), rows.to(device))

    def after_update() -> None:
        run.lr_scheduler.step()
        if run.ema is not None:
            run.ema.step(run.trainable)

    losses, units, grad_norm, statistics = train_on_rollout(
        rl, rollout, rows, advantages.cpu(), model=run.model, estimator=run.estimator,
        optimizer=run.optimizer, accelerator=accelerator, make_cond=make_cond,
        shuffle=lambda inner: seeded(seed, SHUFFLE, step, inner, rank),
        estimator_generator=lambda micro: seeded(seed, ESTIMATOR, step, micro, rank),
        after_update=after_update,
    )  # fmt: skip
    per_batch = rollout.rewards.reshape(config.rollout_batches, -1).mean(1)
    extras = {
        "kl": kls,
        "objective_model_units": [float(2 * config.num_inference_steps)] * len(kls),
        "zero_std_ratio": [zero_std],
        **{name: statistics.get(name) or [float("nan")] for name in GRPO_STATISTICS},
    }
    return [float(x) for x in per_batch], losses, units, grad_norm, extras
