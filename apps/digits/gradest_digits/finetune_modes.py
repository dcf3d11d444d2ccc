"""The fine-tuning objectives as small objects: which sampler, which objectives per batch.

* :class:`RewardMode`: the terminal objective ``L = -mean_b reward(z_N)``, differentiated
  through the deterministic Euler sampler (DRaFT / AlignProp / SDO-style direct reward
  backpropagation); one optimizer step per batch.
* :class:`GrpoMode`: Flow-GRPO. Rollouts of the stochastic :class:`~gradest.FlowSDE`,
  rewards normalised within groups into advantages, and ``inner_epochs`` optimizer steps
  on the clipped surrogate of the recorded trajectories (plus, with ``kl_weight > 0``, the
  KL to the frozen initial model).
* :class:`AdjointMatchingMode`: adjoint matching. Rollouts of the memoryless FlowSDE
  (``noise_level=sqrt(2)``), the lean adjoint of ``-reward`` through the frozen initial
  model, one optimizer step on the regression loss per batch.

A mode is asked for its sampler once, for the objectives of each :class:`Batch` and for what
building them cost in base-model calls (:meth:`objective_cost`, logged beside the
estimator's cost); the loop in
:mod:`gradest_digits.finetune` does the rest the same way for all of them. ``base`` is
a frozen copy of the model as it was when the run started (before a checkpoint is
loaded), given to the modes that need one (:func:`needs_base`), and ``cond`` the rank's
model keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest import AffineSampler, FlowSDE, RectifiedFlow, TerminalObjective, Trajectory
from gradest.plugin import Cost, Objective
from gradest.rl import (
    adjoint_matching_objective,
    group_advantages,
    grpo_objective,
    memoryless_flow,
    reference_velocities,
)
from gradest_digits.finetune_config import FinetuneConfig

Reward = Callable[[Tensor], Tensor]


@attrs.frozen
class Batch:
    """What a mode builds one batch's objectives from.

    Attributes:
        config: the run's settings.
        sampler: the mode's sampler (:meth:`sampler`), which ``trajectory`` was drawn on.
        trajectory: this rank's rollout of the current model.
        rewards: ``[B]`` rewards of the trajectory's final samples (no graph).
        reward: the reward function, differentiable (terminal objectives call it).
        base: the frozen initial model, for the modes that need one (:func:`needs_base`).
        cond: the rank's model keyword arguments (class labels), or None.
    """

    config: FinetuneConfig
    sampler: AffineSampler
    trajectory: Trajectory
    rewards: Tensor
    reward: Reward
    base: torch.nn.Module | None = None
    cond: dict[str, Tensor] | None = None


@attrs.frozen
class RewardMode:
    """Backpropagate ``-mean reward(z_N)`` through the ODE sampler."""

    name = "reward"

    def sampler(self, config: FinetuneConfig) -> AffineSampler:
        return RectifiedFlow(steps=config.sampler_steps)

    def objectives(self, batch: Batch) -> list[Objective]:
        reward = batch.reward
        return [TerminalObjective(lambda images: -reward(images).mean())]

    def objective_cost(self, config: FinetuneConfig) -> Cost:
        del config
        return Cost()

    def record_extras(self, losses: list[float | None], norms: list[float]) -> dict[str, Any]:
        del losses, norms
        return {}


@attrs.frozen
class GrpoMode:
    """Flow-GRPO: clipped surrogate on FlowSDE rollouts, ``inner_epochs`` steps per batch."""

    name = "grpo"

    def sampler(self, config: FinetuneConfig) -> AffineSampler:
        return FlowSDE(config.sampler_steps, noise_level=config.noise_level)

    def objectives(self, batch: Batch) -> list[Objective]:
        config, sampler, trajectory = batch.config, batch.sampler, batch.trajectory
        assert isinstance(sampler, FlowSDE)
        # Groups lie within one rank's share (checked), so these are exactly the
        # advantages of the global batch.
        advantages = group_advantages(batch.rewards.to(torch.float64), config.group_size)
        old_log_probs = sampler.trajectory_log_probs(
            trajectory, reduction=config.log_prob_reduction
        )
        reference = None
        if config.kl_weight:
            assert batch.base is not None, "kl_weight > 0 needs the frozen initial model"
            reference = reference_velocities(batch.base, sampler, trajectory, batch.cond)
        surrogate = grpo_objective(
            sampler,
            trajectory,
            old_log_probs,
            advantages.to(trajectory.states.dtype),
            config.clip,
            reduction=config.log_prob_reduction,
            kl_weight=config.kl_weight,
            reference=reference,
        )
        return [surrogate] * config.inner_epochs

    def objective_cost(self, config: FinetuneConfig) -> Cost:
        # The frozen reference's velocities at the N recorded states (no graph).
        return Cost(forwards_without_graph=config.sampler_steps if config.kl_weight else 0)

    def record_extras(self, losses: list[float | None], norms: list[float]) -> dict[str, Any]:
        return {"losses": losses, "grad_norms": norms}


@attrs.frozen
class AdjointMatchingMode:
    """Adjoint matching on memoryless FlowSDE rollouts; one optimizer step per batch.

    The terminal loss is ``-reward`` per sample, so the target distribution is
    ``p_base(x) exp(reward(x))`` (for the classifier reward ``log p(target | x)``:
    ``p_base(x) p(target | x)``).
    """

    name = "adjoint_matching"

    def sampler(self, config: FinetuneConfig) -> AffineSampler:
        return memoryless_flow(config.sampler_steps)

    def objectives(self, batch: Batch) -> list[Objective]:
        assert batch.base is not None, "adjoint matching needs the frozen initial model"
        reward = batch.reward
        return [
            adjoint_matching_objective(
                batch.base,
                batch.sampler,
                batch.trajectory,
                lambda images: -reward(images),
                cond=batch.cond,
            )
        ]

    def objective_cost(self, config: FinetuneConfig) -> Cost:
        # The lean adjoint: N base forwards with a graph in the state, N state-only VJPs.
        steps = config.sampler_steps
        return Cost(forwards_with_graph=steps, state_vjps=steps)

    def record_extras(self, losses: list[float | None], norms: list[float]) -> dict[str, Any]:
        del losses, norms
        return {}


Mode = RewardMode | GrpoMode | AdjointMatchingMode


def mode_of(config: FinetuneConfig) -> Mode:
    if config.mode == "grpo":
        return GrpoMode()
    if config.mode == "adjoint_matching":
        return AdjointMatchingMode()
    return RewardMode()


def needs_base(config: FinetuneConfig) -> bool:
    """Whether the run needs a frozen copy of the initial model (reference / base model)."""
    return config.mode == "adjoint_matching" or (config.mode == "grpo" and bool(config.kl_weight))
