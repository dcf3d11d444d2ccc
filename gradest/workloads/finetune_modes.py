"""The two fine-tuning objectives as small objects: which sampler, which objectives per batch.

* :class:`RewardMode`: the terminal objective ``L = -mean_b reward(z_N)``, differentiated
  through the deterministic Euler sampler (DRaFT / AlignProp / SDO-style direct reward
  backpropagation); one optimizer step per batch.
* :class:`GrpoMode`: Flow-GRPO. Rollouts of the stochastic :class:`~gradest.FlowSDE`,
  rewards normalised within groups into advantages, and ``inner_epochs`` optimizer steps
  on the clipped surrogate of the recorded trajectories.

A mode is asked for its sampler once and for the objectives of each batch; the loop in
:mod:`gradest.workloads.finetune` does the rest the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest.flow import Trajectory
from gradest.objectives import Objective, TerminalObjective
from gradest.samplers import AffineSampler, FlowSDE, RectifiedFlow
from gradest.workloads.finetune_config import FinetuneConfig
from gradest.workloads.grpo import group_advantages, grpo_objective

Reward = Callable[[Tensor], Tensor]


@attrs.frozen
class RewardMode:
    """Backpropagate ``-mean reward(z_N)`` through the ODE sampler."""

    name = "reward"

    def sampler(self, config: FinetuneConfig) -> AffineSampler:
        return RectifiedFlow(steps=config.sampler_steps)

    def objectives(
        self,
        config: FinetuneConfig,
        sampler: AffineSampler,
        trajectory: Trajectory,
        rewards: Tensor,
        reward: Callable[[Tensor], Tensor],
    ) -> list[Objective]:
        del sampler, trajectory, rewards
        return [TerminalObjective(lambda images: -reward(images).mean())]

    def record_extras(self, losses: list[float | None], norms: list[float]) -> dict[str, Any]:
        del losses, norms
        return {}


@attrs.frozen
class GrpoMode:
    """Flow-GRPO: clipped surrogate on FlowSDE rollouts, ``inner_epochs`` steps per batch."""

    name = "grpo"

    def sampler(self, config: FinetuneConfig) -> AffineSampler:
        return FlowSDE(config.sampler_steps, noise_level=config.noise_level)

    def objectives(
        self,
        config: FinetuneConfig,
        sampler: AffineSampler,
        trajectory: Trajectory,
        rewards: Tensor,
        reward: Callable[[Tensor], Tensor],
    ) -> list[Objective]:
        del reward
        assert isinstance(sampler, FlowSDE)
        # Groups lie within one rank's share (checked), so these are exactly the
        # advantages of the global batch.
        advantages = group_advantages(rewards.to(torch.float64), config.group_size)
        old_log_probs = sampler.trajectory_log_probs(
            trajectory, reduction=config.log_prob_reduction
        )
        surrogate = grpo_objective(
            sampler,
            trajectory,
            old_log_probs,
            advantages.to(trajectory.states.dtype),
            config.clip,
            reduction=config.log_prob_reduction,
        )
        return [surrogate] * config.inner_epochs

    def record_extras(self, losses: list[float | None], norms: list[float]) -> dict[str, Any]:
        return {"losses": losses, "grad_norms": norms}


def mode_of(config: FinetuneConfig) -> RewardMode | GrpoMode:
    return GrpoMode() if config.mode == "grpo" else RewardMode()
