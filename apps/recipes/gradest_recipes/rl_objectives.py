"""The RL recipes' objectives: Flow-GRPO with a KL to the base model, and adjoint matching.

Both sample the *current* LoRA model with a stochastic sampler on the scheduler's own
sigma grid (``sampler_from_scheduler(..., sde_noise_level=...)`` with the family's ``set_timesteps``
keywords), record the path, and train with a :mod:`gradest.rl` stepwise objective on it
(``est.surrogate(model, sampler, objective, trajectory=path, cond=...)``), so any
estimator that supports stepwise objectives computes the gradient. The frozen base /
reference model is the same denoiser with its LoRA adapters switched off
(:func:`gradest.integrations.adapters_disabled`), never a copy of the weights.

* ``grpo`` (Flow-GRPO, Liu et al. 2025): ``FlowSDE(noise_level)`` rollouts
  (:meth:`RLObjective.grpo_rollout`), groups of ``group_size`` samples of one prompt
  (:meth:`RLObjective.prompt_index`, spread over the processes as Flow-GRPO spreads
  them); the loss is :func:`gradest.rl.grpo_objective` with ``clip = clip_range``,
  advantages clipped to ``[-adv_clip_max, adv_clip_max]`` and Flow-GRPO's code
  conventions: per-element mean log-probabilities (``reduction="mean"``) and its KL
  scaling, per-step weights ``kl_weight * |h_k|`` (see :mod:`gradest.rl.flow_grpo`),
  against the adapters-off model's velocities at the recorded states
  (:func:`gradest.rl.reference_velocities`). The recipe's step around it (several
  batches, per-prompt statistics gathered across processes, inner epochs,
  ``timestep_fraction``) is :mod:`gradest_recipes.grpo_epoch`.
* ``adjoint_matching`` (Domingo-Enrich et al., ICLR 2025): the memoryless sampler
  :func:`gradest.rl.memoryless_flow` (``sigma_t = sqrt(2 t / (1 - t))``, its steps solved
  in closed form where Euler-Maruyama is stiff) on the same grid: ``memoryless_flow(times=
  sampler_from_scheduler(scheduler, N, sde_noise_level=...).times)``, as the memoryless
  sampler is read from no scheduler; the terminal loss per sample
  ``-reward_multiplier * reward(decode(z_N))``;
  the lean adjoint with the adapters-off model (:func:`gradest.rl.lean_adjoint`) and the
  regression loss (:func:`gradest.rl.regression_objective`).

What is logged besides the reward and ``sur.value`` (the full objective value):
``kl`` (grpo) / ``path_kl`` (adjoint matching), ``sum_k mean_b KL_k`` of the sampling
policy's Gaussian steps to the adapters-off model's (``reduction="sum"``: nats per sample
over the whole path), at the rollout's own velocities; and ``objective_model_units``, the
velocity-model work outside the estimator (the rollout's ``N`` forwards, plus ``N`` for
GRPO's reference or ``2N`` for the lean adjoint). grpo also logs Flow-GRPO's training
statistics (:data:`GRPO_STATISTICS`, recorded by :class:`StepStatistics` from the
velocities the estimator evaluates) and its ``zero_std_ratio``
(:mod:`gradest_recipes.grpo_epoch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest import InvalidValue, StepwiseObjective
from gradest_recipes.config import RecipeConfig
from gradest_recipes.errors import RecipeConfigError
from gradest_recipes.families import Family
from gradest_recipes.rewards import Reward, decoded_reward

__all__ = [
    "GRPO_STATISTICS",
    "GrpoRollout",
    "Prepared",
    "RLObjective",
    "StepStatistics",
    "per_sample_reward",
    "supports_stepwise",
]

PerSample = Callable[[Tensor], Tensor]

#: Flow-GRPO's training statistics the grpo recipe logs of each trained batch (names as in
#: its ``scripts/train_sd3.py``): :func:`gradest.rl.grpo_step_statistics`, with its ``kl``
#: scaled to Flow-GRPO's ``kl_loss`` (``|h_k|`` times the Gaussian KL, per element).
GRPO_STATISTICS = (
    "approx_kl",
    "clipfrac",
    "clipfrac_gt_one",
    "clipfrac_lt_one",
    "policy_loss",
    "kl_loss",
)


def supports_stepwise(estimator: Any) -> bool:
    """Whether ``estimator`` is defined for stepwise objectives (the RL objectives are)."""
    return "stepwise" in getattr(estimator, "objectives", ("terminal", "stepwise"))


def per_sample_reward(
    reward: Reward,
    vae: nn.Module,
    to_vae_latents: Callable[[Tensor], Tensor],
    prompts: Sequence[str],
    *,
    autocast: Callable[[], Any] | None = None,
) -> PerSample:
    """``z [B, ...] -> reward(decode(z)) [B]`` in float32, differentiable in ``z``."""
    scored = decoded_reward(reward, vae, to_vae_latents, prompts, autocast=autocast)

    def rewards(z: Tensor) -> Tensor:
        values = scored(z)
        if not isinstance(values, Tensor) or tuple(values.shape) != (z.shape[0],):
            raise InvalidValue(
                f"the reward returned {type(values).__name__} of shape "
                f"{tuple(getattr(values, 'shape', ()))}; the RL objectives need one reward per "
                f"image, a tensor [B] = [{z.shape[0]}]"
            )
        return values.float()

    return rewards


@attrs.frozen(eq=False)
class Prepared:
    """One micro-step's rollout and the objective on it.

    Attributes:
        objective: the stepwise objective (on ``trajectory``).
        trajectory: the recorded path (pass as ``trajectory=``).
        reward: the mean reward of the rollout's final samples.
        metrics: ``kl`` or ``path_kl``, ``objective_model_units``.
    """

    objective: Any
    trajectory: Any
    reward: float
    metrics: dict[str, float]


@attrs.frozen(eq=False)
class GrpoRollout:
    """A grpo rollout (no graph anywhere): what Flow-GRPO's sampling phase records.

    Attributes:
        trajectory: the recorded path ``[N+1, B, ...]``.
        rewards: ``[B]`` float32 rewards of the final samples.
        old_log_probs: ``[N, B]`` per-element mean step log-probabilities under the
            sampling policy (``reduction="mean"``, Flow-GRPO's).
        reference: ``[N, B, ...]`` the adapters-off model's velocities at the recorded states.
        kl: ``sum_k mean_b KL_k`` of the recorded steps to the reference's (logged).
    """

    trajectory: Any
    rewards: Tensor
    old_log_probs: Tensor
    reference: Tensor
    kl: float


class StepStatistics:
    """Flow-GRPO's training statistics (:data:`GRPO_STATISTICS`) of one trained batch.

    :meth:`RLObjective.grpo_objective` with ``statistics=`` records, for every step whose
    loss the estimator differentiates, :func:`gradest.rl.grpo_step_statistics` at the
    velocity that loss was given (detached, no graph, no model call), the first time that
    step is evaluated. ``exact`` and ``jagg`` evaluate every trained step; ``sdo``,
    ``truncated`` and ``telescope`` only the steps they draw or keep, so the batch's
    statistics are over those steps. The calls gradest makes without grad at the
    *recorded* velocities (to complete ``sur.value`` over the steps not evaluated) are not
    recorded: their ratio is 1 by construction. (A draw that evaluated no step at all would
    leave gradest's check that the loss depends on some step to differentiate step 0 at
    its recorded velocity, and that would be recorded; every built-in estimator evaluates
    at least one step.)
    """

    def __init__(self) -> None:
        self._steps: dict[int, dict[str, Tensor]] = {}

    def record(self, k: int, values: dict[str, Tensor]) -> None:
        """Keep step ``k``'s statistics (the first evaluation of a step, as
        ``sur.value`` keeps its first loss)."""
        self._steps.setdefault(k, values)

    @property
    def steps(self) -> list[int]:
        """The steps recorded, in order."""
        return sorted(self._steps)

    def means(self) -> dict[str, float]:
        """Each statistic's mean over the recorded steps (Flow-GRPO averages its
        per-timestep values alike); empty when no step was evaluated. One transfer."""
        if not self._steps:
            return {}
        stacked = torch.stack(
            [
                torch.stack([values[name] for name in GRPO_STATISTICS])
                for values in self._steps.values()
            ]
        )
        means = stacked.double().mean(0).tolist()
        return dict(zip(GRPO_STATISTICS, means, strict=True))


class RLObjective:
    """The sampler and the per-micro-step objective of the ``grpo`` / ``adjoint_matching``
    recipes (see the module docstring)."""

    def __init__(self, family: Family, config: RecipeConfig):
        from gradest.rl import memoryless_flow

        if config.objective not in ("grpo", "adjoint_matching"):
            raise RecipeConfigError(f"setting objective={config.objective!r} is not an RL one")
        if family.scheduler is None:
            raise RecipeConfigError(
                f"the {family.name} family has no flow-matching scheduler; the RL objectives "
                f"run on sd3 and flux"
            )
        self.config = config
        self.name = config.objective
        steps = config.num_inference_steps
        from gradest.integrations.diffusers import sampler_from_scheduler

        self.sampler = sampler_from_scheduler(
            family.scheduler, steps, sde_noise_level=config.noise_level, **family.schedule_options
        )
        if self.name == "adjoint_matching":  # the memoryless SDE on the scheduler's grid
            self.sampler = memoryless_flow(times=self.sampler.times)
        # The SDE runs on the grid of the reward recipe's (ODE) sampler and sample grids.
        if not torch.equal(self.sampler.times, family.sampler.times):
            raise RecipeConfigError(
                "the SDE sampler's grid differs from the recipe's sampler grid (a scheduler "
                "gradest cannot rebuild); this is a bug of the recipe"
            )
        # Flow-GRPO's code convention of the KL (gradest.rl.flow_grpo's docstring).
        self.kl_weights = config.kl_weight * self.sampler.step_sizes.abs()

    def prompt_index(
        self, generator: torch.Generator, count: int, batch: int, *, rank: int = 0, world: int = 1
    ) -> Tensor:
        """``[batch]`` prompt rows of process ``rank`` of ``world``.

        grpo: Flow-GRPO's ``DistributedKRepeatSampler``: ``world * batch / group_size``
        distinct prompts (drawn with replacement when there are fewer), each repeated
        ``group_size`` times, shuffled, and split over the processes, so a prompt's group
        may span processes (its advantages use every process's samples:
        :func:`gradest.rl.prompt_advantages`). ``generator`` must then be the same on every
        process. Otherwise ``batch`` independent draws."""
        if self.name != "grpo":
            return torch.randint(count, (batch,), generator=generator)
        group, total = self.config.group_size, world * batch
        distinct = total // group
        if distinct <= count:
            prompts = torch.randperm(count, generator=generator)[:distinct]
        else:
            prompts = torch.randint(count, (distinct,), generator=generator)
        repeated = prompts.repeat_interleave(group)
        shuffled = repeated[torch.randperm(total, generator=generator)]
        return shuffled[rank * batch : (rank + 1) * batch]

    def path_kl(self, velocities: Tensor, reference: Tensor) -> float:
        """``sum_k mean_b KL_k`` of the recorded steps to the reference's (in nats)."""
        from gradest.rl import step_kl

        total = 0.0
        for k in range(velocities.shape[0]):
            total += float(step_kl(self.sampler, k, velocities[k], reference[k]).mean())
        return total

    def grpo_rollout(
        self,
        policy: nn.Module,
        noise: Tensor,
        cond: dict[str, Any],
        rewards: PerSample,
        generator: torch.Generator,
    ) -> GrpoRollout:
        """Roll out ``policy`` (the current LoRA model, unwrapped) with the SDE's noise from
        ``generator``; its rewards, old log-probabilities and the reference velocities."""
        import gradest
        from gradest.integrations import adapters_disabled
        from gradest.rl import reference_velocities

        with torch.no_grad():
            path = gradest.rollout(policy, self.sampler, noise, cond=cond, generator=generator)
            values = rewards(path.states[-1])
            old_log_probs = self.sampler.trajectory_log_probs(path, reduction="mean")
            with adapters_disabled(policy):
                reference = reference_velocities(policy, self.sampler, path, cond)
        return GrpoRollout(
            trajectory=path, rewards=values, old_log_probs=old_log_probs, reference=reference,
            kl=self.path_kl(path.velocities, reference),
        )  # fmt: skip

    def grpo_objective(
        self,
        sampler: Any,
        rollout: GrpoRollout,
        advantages: Tensor,
        *,
        statistics: StepStatistics | None = None,
    ) -> Any:
        """:func:`gradest.rl.grpo_objective` on ``rollout`` (its trajectory on ``sampler``,
        the whole grid or its first steps: :func:`gradest.rl.leading_steps`), advantages
        clipped to ``[-adv_clip_max, adv_clip_max]``, Flow-GRPO's conventions (module
        docstring). With ``statistics``, its ``loss_fn`` also records Flow-GRPO's training
        statistics of every step the estimator evaluates there (:class:`StepStatistics`);
        the loss and its gradient are unchanged."""
        from gradest.rl import grpo_objective, grpo_step_statistics

        path = rollout.trajectory
        steps = path.num_steps
        limit = self.config.adv_clip_max
        old_log_probs, reference = rollout.old_log_probs[:steps], rollout.reference[:steps]
        clipped = advantages.clamp(-limit, limit).to(path.states.dtype)
        clip = self.config.clip_range
        objective = grpo_objective(
            sampler, path, old_log_probs, clipped, clip=clip, reduction="mean",
            kl_weight=self.kl_weights[:steps] if self.config.kl_weight > 0 else 0.0,
            reference=reference,
        )  # fmt: skip
        if statistics is None:
            return objective
        evaluate = objective.loss_fn
        # Flow-GRPO's kl_loss divides by sigma_t^2, not the step's variance sigma_t^2 |h_k|.
        scales = sampler.step_sizes.abs().tolist()

        def recorded(k: int, velocity: Tensor, given: Any) -> Tensor:
            loss = evaluate(k, velocity, given)  # checks ``given`` is the objective's path
            # An estimator differentiates the steps it evaluates (grad on, a velocity that
            # requires grad); gradest completes sur.value over the other steps without grad
            # at the recorded velocities, which are the old policy's: not statistics.
            if torch.is_grad_enabled() and velocity.requires_grad:
                values = grpo_step_statistics(
                    sampler, path, k, velocity, old_log_probs, clip, reduction="mean",
                    advantages=clipped, reference=reference,
                )  # fmt: skip
                values["kl_loss"] = scales[k] * values.pop("kl")
                statistics.record(k, values)
            return loss

        return StepwiseObjective(recorded)

    def prepare(
        self,
        policy: nn.Module,
        noise: Tensor,
        cond: dict[str, Any],
        rewards: PerSample,
        generator: torch.Generator,
    ) -> Prepared:
        """Roll out ``policy`` (the current LoRA model, unwrapped) from ``noise`` with the
        SDE's noise from ``generator``; build the objective on the path."""
        import gradest
        from gradest.integrations import adapters_disabled

        steps = self.config.num_inference_steps
        if self.name == "grpo":
            from gradest.rl import group_advantages

            sampled = self.grpo_rollout(policy, noise, cond, rewards, generator)
            path, values = sampled.trajectory, sampled.rewards
            # One batch whose groups are consecutive (the epoch loop of
            # gradest_recipes.grpo_epoch gathers per-prompt statistics instead).
            objective = self.grpo_objective(
                self.sampler, sampled, group_advantages(values, self.config.group_size)
            )
            metrics = {"kl": sampled.kl}
            units = 2 * steps
        else:
            with torch.no_grad():
                path = gradest.rollout(policy, self.sampler, noise, cond=cond, generator=generator)
            from gradest.rl import lean_adjoint, regression_objective

            multiplier = self.config.reward_multiplier
            with adapters_disabled(policy):
                targets = lean_adjoint(
                    policy, self.sampler, path, lambda z: -multiplier * rewards(z), cond
                )
            objective = regression_objective(self.sampler, path, targets)
            assert targets.losses is not None
            values = -targets.losses / multiplier
            metrics = {"path_kl": self.path_kl(path.velocities, targets.base_velocities)}
            units = 3 * steps
        metrics["objective_model_units"] = float(units)
        return Prepared(
            objective=objective, trajectory=path, reward=float(values.mean()), metrics=metrics
        )
