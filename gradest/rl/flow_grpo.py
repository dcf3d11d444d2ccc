"""Flow-GRPO as a gradest stepwise objective: group advantages, the clipped surrogate, KL.

Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL")
treats every step of the :class:`~gradest.FlowSDE` sampler as a Gaussian policy
``pi_theta(z_{k+1} | z_k) = N(alpha_k z_k + beta_k v_theta(z_k, t_k), s_k^2 I)``. With
group-normalised advantages ``A_b`` and the log-probabilities ``log pi_old`` recorded
when the batch was sampled, the loss of step ``k`` is PPO's pessimistic clipped
surrogate, averaged over the batch and divided by ``N`` (Flow-GRPO accumulates the
per-step losses over the ``N`` training steps), plus an optional KL penalty to a frozen
reference policy ``pi_ref`` (the pretrained model)::

    r_{k,b}  = exp(log pi_theta(k, b) - log pi_old(k, b))
    KL_{k,b} = KL(pi_theta(. | z_k) || pi_ref(. | z_k)) = beta_k^2 ||v_k - v_ref,k||^2 / (2 s_k^2)
    l_k      = (1 / N) mean_b [ -min(r A_b, clip(r, 1 - eps, 1 + eps) A_b) + w_k KL_{k,b} ]

Both policies of a step share the variance ``s_k^2``, so their KL is the squared
distance of the step means ``beta_k v`` over ``2 s_k^2``; ``v_ref,k`` is the reference
model's velocity at the recorded state ``z_k`` (:func:`reference_velocities`, computed
once, without a graph). With ``reduction="mean"`` the KL, like
:meth:`~gradest.samplers.TimeGrid.step_log_prob`, is divided by the element count ``D``.

Conventions against Flow-GRPO's code (``scripts/train_sd3.py``): it computes
``((mean - mean_ref) ** 2).mean(dims) / (2 * std_dev_t ** 2)`` with ``std_dev_t`` the
diffusion ``sigma_t`` of the SDE, not the step's standard deviation
``s_k = sigma_t sqrt(|dt|)``; its KL term is therefore ``|h_k|`` times the Gaussian KL of
the paper (and of this module) with ``reduction="mean"``. To reproduce a run of that code
with its ``beta`` (0.04 for SD3), pass ``reduction="mean"`` and the per-step weights
``kl_weight = beta * sampler.step_sizes.abs()``; a float ``kl_weight`` weights the exact KL
equally at every step.

The recorded states are data and ``l_k`` depends on ``theta`` only through ``v_k``, so
this is exactly the shape of :class:`gradest.StepwiseObjective`: every estimator
evaluates ``sum_k J_k^T (d l_k / d v_k)`` its own way. At ``theta = theta_old`` the
surrogate's cotangent is the policy gradient ``-A_b (d log pi / d v_k) / (N B)``; a sample
whose ratio has left the band on the side its advantage favours contributes nothing. The
KL's cotangent is ``w_k beta_k^2 (v_k - v_ref,k) / (s_k^2 N B)`` (``/ D`` for ``"mean"``),
zero when the policy is the reference.

What Flow-GRPO logs of each trained timestep (``approx_kl``, the ``clipfrac`` family,
``policy_loss``, its ``kl_loss``) is :func:`grpo_step_statistics`, from the same velocity
the loss of that step evaluates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradest.errors import InvalidType, InvalidValue
from gradest.objectives import StepwiseObjective
from gradest.rl._common import check_recorded, model_velocities
from gradest.samplers import AffineSampler, FlowSDE, check_reduction, reduce_per_sample
from gradest.trajectory import Trajectory, check_trajectory_matches

ADVANTAGE_EPS = 1e-4
"""Added to a group's reward standard deviation in :func:`group_advantages`."""


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``(r - mean_group) / (std_group + 1e-4)`` for consecutive groups of ``group_size``.

    The standard deviation is the population one (``ddof=0``), as in Flow-GRPO.

    Args:
        rewards: ``[G * group_size]``, consecutive entries form a group (samples that
            share a prompt / class label).
        group_size: samples per group, at least 2 (one sample has no spread to
            normalise by).

    Returns:
        ``[G * group_size]`` advantages in ``rewards``' dtype.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise InvalidValue(
            f"group_size must be an int >= 2 (advantages compare samples within a group), "
            f"got {group_size!r}"
        )
    if not isinstance(rewards, Tensor) or rewards.ndim != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise InvalidValue(f"rewards must be a 1-D tensor [G * group_size], got {shape}")
    if rewards.numel() % group_size:
        raise InvalidValue(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            f"sample group_size images per group"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise InvalidValue("rewards contain NaN or Inf; check the reward function")
    groups = rewards.reshape(-1, group_size)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + ADVANTAGE_EPS)).reshape(-1)


def leading_steps(
    sampler: FlowSDE, trajectory: Trajectory, count: int
) -> tuple[FlowSDE, Trajectory]:
    """The first ``count`` steps of a recorded path, with the sampler of those steps.

    Flow-GRPO's ``train.timestep_fraction`` trains on the first ``int(N * fraction)``
    steps of each rollout only. Returns :func:`step_range` ``(sampler, trajectory, 0,
    count)``: :func:`grpo_objective` on the result is the surrogate of the trained steps,
    averaged over them as Flow-GRPO's accumulation over ``num_train_timesteps`` averages,
    and an estimator evaluates only those steps.
    """
    _check_path_sampler(sampler, trajectory)
    steps = trajectory.num_steps
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= steps:
        raise InvalidValue(
            f"count must be an int in [1, {steps}] (the steps to keep of the path's "
            f"{steps}), got {count!r}"
        )
    return step_range(sampler, trajectory, 0, count)


def step_range(
    sampler: FlowSDE, trajectory: Trajectory, start: int, stop: int
) -> tuple[FlowSDE, Trajectory]:
    """Steps ``start .. stop - 1`` of a recorded path, with the sampler of those steps.

    Returns ``(FlowSDE(times=sampler.times[start:stop + 1]), the path's states start..stop)``.
    Every kept step's coefficients are those of the whole grid, bit for bit: a step's
    ``alpha_k, beta_k, sigma_k`` depend on ``t_k`` and ``t_{k+1}`` only, and at ``t = 1``
    (step 0 of a grid that starts there) on ``t_1``, which a range from 0 keeps. So
    :func:`grpo_objective` on one step (``stop = start + 1``) is that step's term of the
    whole path's objective times the path's step count: Flow-GRPO's per-timestep
    ``loss.backward()`` (one step's graph held at a time) is ``surrogate(...)`` and
    ``backward`` per step on these, each loss divided by the number of steps trained.
    """
    _check_path_sampler(sampler, trajectory)
    steps = trajectory.num_steps
    for name, value, low in (("start", start, 0), ("stop", stop, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= steps:
            raise InvalidValue(
                f"{name} must be an int in [{low}, {steps}] (a step boundary of the path's "
                f"{steps} steps), got {value!r}"
            )
    if stop <= start:
        raise InvalidValue(
            f"stop must be greater than start (a range of at least one step), got "
            f"start={start}, stop={stop}"
        )
    cut = FlowSDE(times=sampler.times[start : stop + 1], noise_level=sampler.noise_level)
    noise = trajectory.step_noise
    path = Trajectory(
        times=trajectory.times[start : stop + 1],
        states=trajectory.states[start : stop + 1],
        velocities=trajectory.velocities[start:stop],
        step_noise=None if noise is None else noise[start:stop],
    )
    return cut, path


def single_step(
    sampler: FlowSDE, trajectory: Trajectory, objective: StepwiseObjective, step: int
) -> tuple[FlowSDE, Trajectory, StepwiseObjective]:
    """Step ``step`` of a stepwise objective on a recorded path, on its own.

    Returns the one-step sampler and path of :func:`step_range` and the objective whose
    only term is ``objective``'s term ``step`` (its ``loss_fn`` called with the whole
    path's index and path). A surrogate on them has that term's value and gradient, so
    Flow-GRPO's per-timestep loop is::

        for k in range(path.num_steps):
            step_sampler, step_path, term = gradest.rl.single_step(sampler, path, objective, k)
            sur = est.surrogate(model, step_sampler, term, trajectory=step_path, cond=cond)
            sur.loss.backward()

    and accumulates ``est``'s gradient of the whole objective when ``est`` is
    :func:`separable_over_steps` (``exact``), holding one step's graph at a time.
    """
    if not isinstance(objective, StepwiseObjective):
        raise InvalidType(
            f"objective must be a gradest.StepwiseObjective (a loss on every step's "
            f"velocity), got {type(objective).__name__}"
        )
    _check_path_sampler(sampler, trajectory)
    steps = trajectory.num_steps
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < steps:
        raise InvalidValue(
            f"step must be an int in [0, {steps - 1}] (a step of the path's {steps}), got {step!r}"
        )
    cut, path = step_range(sampler, trajectory, step, step + 1)
    whole = objective.loss_fn

    def term(k: int, velocity: Tensor, _one_step_path: Trajectory) -> Tensor:
        return whole(step + k, velocity, trajectory)

    return cut, path, StepwiseObjective(term)


def separable_over_steps(estimator: Any) -> bool:
    """Whether ``estimator``'s gradient of a stepwise objective is the sum of its gradients
    on each step alone (:func:`step_range`), so that a surrogate and a backward per step
    give its gradient with one step's graph held at a time.

    True for ``exact`` (one VJP per step with the step's own cotangent). False for every
    estimator that chooses among the steps it is given (``sdo``'s draws, ``jagg``'s
    windows, ``truncated``'s kept steps, ...): given one step at a time, each would
    evaluate that step exactly and so become ``exact``.
    """
    return getattr(estimator, "name", None) == "exact"


def _check_path_sampler(sampler: Any, trajectory: Trajectory) -> None:
    if not isinstance(sampler, FlowSDE):
        raise InvalidType(
            f"sampler must be the gradest.FlowSDE the trajectory was sampled with, "
            f"got {type(sampler).__name__}"
        )
    check_trajectory_matches(sampler, trajectory)


def reference_velocities(
    reference: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
) -> Tensor:
    """``[N, B, ...]``: the reference model's velocities at the recorded states (no graph).

    The reference is evaluated once per batch of rollouts, on the states the current
    policy visited (``reference(z_k, t_k, **cond)``); the KL of :func:`grpo_objective` treats
    the result as data. For a LoRA-adapted model the reference is the model with its
    adapters disabled, as in Flow-GRPO, without a copy:
    ``with gradest.integrations.adapters_disabled(model): reference_velocities(model, ...)``
    (a diffusers model, a peft ``PeftModel``, or either inside ``DiffusersVelocity``).
    ``sampler`` is the sampler the trajectory was recorded on.
    """
    return model_velocities(reference, sampler, trajectory, cond, what="reference model")


def step_kl(
    sampler: AffineSampler, k: int, velocity: Tensor, reference: Tensor, *, reduction: str = "sum"
) -> Tensor:
    """``[B]``: ``KL(N(m_theta, s_k^2 I) || N(m_ref, s_k^2 I))`` of step ``k`` of ``sampler``,
    per sample.

    ``m = alpha_k z_k + beta_k v``, so the KL is ``beta_k^2 ||velocity - reference||^2 /
    (2 s_k^2)`` (``reduction="sum"``) or that divided by the element count (``"mean"``, as
    :meth:`~gradest.samplers.TimeGrid.step_log_prob` averages log-densities).
    Differentiable in ``velocity``.
    """
    check_reduction(reduction)
    _, beta, scale = (float(c[k]) for c in sampler.coefficients())
    if scale == 0.0:
        raise InvalidValue(
            f"step {k} of {sampler!r} is deterministic (noise scale 0): the KL of two "
            f"deterministic steps is infinite; use noise_level > 0"
        )
    squared = (velocity - reference.to(velocity)).pow(2)
    return (beta * beta / (2.0 * scale * scale)) * reduce_per_sample(squared, reduction)


def _shape_of(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__


def _kl_weights(kl_weight: Any, steps: int) -> Tensor | None:
    """``kl_weight`` as ``[N]`` float64 weights, or None when it is off (all zero)."""
    if isinstance(kl_weight, Tensor):
        if kl_weight.shape != (steps,) or not kl_weight.is_floating_point():
            raise InvalidValue(
                f"kl_weight must be a float >= 0 or a [N] = [{steps}] float tensor of per-step "
                f"weights, got a tensor of shape {tuple(kl_weight.shape)} and dtype "
                f"{kl_weight.dtype}; e.g. kl_weight=0.04"
            )
        weights = kl_weight.detach().to(device="cpu", dtype=torch.float64)
    elif isinstance(kl_weight, bool) or not isinstance(kl_weight, int | float):
        raise InvalidType(
            f"kl_weight must be a float >= 0 (0: no KL term) or a [N] tensor, got "
            f"{kl_weight!r}; Flow-GRPO uses 0.04"
        )
    else:
        weights = torch.full((steps,), float(kl_weight), dtype=torch.float64)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise InvalidValue(
            f"kl_weight must be finite and >= 0, got {kl_weight!r}; 0 switches the KL off"
        )
    return weights if bool((weights > 0).any()) else None


def grpo_objective(
    sampler: FlowSDE,
    trajectory: Trajectory,
    old_log_probs: Tensor,
    advantages: Tensor,
    clip: float = 0.2,
    *,
    reduction: str = "sum",
    kl_weight: float | Tensor = 0.0,
    reference: Tensor | None = None,
) -> StepwiseObjective:
    """The Flow-GRPO clipped surrogate (plus its KL penalty) on ``trajectory``.

    Args:
        sampler: the :class:`FlowSDE` the trajectory was sampled with.
        trajectory: the recorded rollout (states are data).
        old_log_probs: ``[N, B]`` step log-probabilities under the sampling policy,
            e.g. ``sampler.trajectory_log_probs(trajectory)`` right after the rollout.
        advantages: ``[B]``, e.g. :func:`group_advantages` of the rewards.
        clip: PPO's ``eps``; the ratio is clipped to ``[1 - eps, 1 + eps]`` (default 0.2,
            PPO's; Flow-GRPO's configs use 1e-4 with several optimizer steps per rollout).
        reduction: how :meth:`FlowSDE.step_log_prob` (and the KL) reduce over the state's
            elements (``"sum"``: the Gaussian log-density; ``"mean"``: Flow-GRPO's
            per-element average). Must match how ``old_log_probs`` were computed.
        kl_weight: ``w`` of the KL to the reference policy: a float for every step, or
            ``[N]`` per-step weights (see the module docstring for Flow-GRPO's code
            convention); 0 (the default) leaves the objective exactly the surrogate.
        reference: ``[N, B, ...]`` reference velocities at the recorded states
            (:func:`reference_velocities`); needed when ``kl_weight > 0``.

    Use it with ``trajectory=`` (the same one) in ``surrogate`` / ``estimate``.
    """
    if not isinstance(sampler, FlowSDE):
        raise InvalidType(
            f"sampler must be the gradest.FlowSDE the trajectory was sampled with, "
            f"got {type(sampler).__name__}"
        )
    check_trajectory_matches(sampler, trajectory)
    steps, batch = trajectory.num_steps, trajectory.batch_size
    if not isinstance(old_log_probs, Tensor) or tuple(old_log_probs.shape) != (steps, batch):
        raise InvalidValue(
            f"old_log_probs must be [N, B] = [{steps}, {batch}], got {_shape_of(old_log_probs)}; "
            f"use sampler.trajectory_log_probs(trajectory)"
        )
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != (batch,):
        raise InvalidValue(f"advantages must be [B] = [{batch}], got {_shape_of(advantages)}")
    if isinstance(clip, bool) or not isinstance(clip, int | float):
        raise InvalidType(
            f"clip must be a float in (0, 1), got {clip!r} (PPO uses 0.2, Flow-GRPO's configs 1e-4)"
        )
    if not (math.isfinite(clip) and 0 < clip < 1):
        raise InvalidValue(
            f"clip must be in (0, 1), got {clip!r} (PPO uses 0.2, Flow-GRPO's configs 1e-4)"
        )
    check_reduction(reduction)
    for name, tensor in (("old_log_probs", old_log_probs), ("advantages", advantages)):
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidValue(f"{name} contain NaN or Inf")
    weights = _kl_weights(kl_weight, steps)
    reference = _checked_reference(reference, trajectory, weights is not None)
    old_log_probs = old_log_probs.detach()
    advantages = advantages.detach()
    low, high = 1.0 - float(clip), 1.0 + float(clip)

    def loss_fn(k: int, velocity: Tensor, given: Trajectory) -> Tensor:
        # The ratios are against log-probabilities of *this* trajectory's steps; an
        # estimator that sampled a fresh path (noise= instead of trajectory=) would
        # silently optimise nonsense.
        check_recorded(given, trajectory, "GRPO")
        log_prob = sampler.step_log_prob(trajectory, k, velocity, reduction=reduction)
        ratio = torch.exp(log_prob - old_log_probs[k].to(log_prob))
        advantage = advantages.to(log_prob)
        surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, low, high) * advantage)
        loss = -surrogate.mean() / steps
        if weights is None or float(weights[k]) == 0.0:
            return loss
        assert reference is not None
        kl = step_kl(sampler, k, velocity, reference[k], reduction=reduction)
        return loss + float(weights[k]) * kl.mean() / steps

    return StepwiseObjective(loss_fn)


def grpo_step_statistics(
    sampler: FlowSDE,
    trajectory: Trajectory,
    k: int,
    velocity: Tensor,
    old_log_probs: Tensor,
    clip: float = 0.2,
    *,
    reduction: str = "sum",
    advantages: Tensor | None = None,
    reference: Tensor | None = None,
) -> dict[str, Tensor]:
    """Flow-GRPO's training statistics of step ``k`` at ``velocity``, as 0-dim tensors.

    What Flow-GRPO's ``scripts/train_sd3.py`` logs of each trained timestep, from the
    velocity :func:`grpo_objective`'s loss evaluates at step ``k`` (no model call; no
    graph: ``velocity`` is detached), with ``r_b = exp(log pi_theta(k, b) - log pi_old(k, b))``
    and each a mean over the batch::

        approx_kl       = 0.5 mean_b (log pi_theta(k, b) - log pi_old(k, b))^2
        clipfrac        = mean_b [|r_b - 1| > eps]
        clipfrac_gt_one = mean_b [r_b - 1 > eps]
        clipfrac_lt_one = mean_b [1 - r_b > eps]
        policy_loss     = mean_b max(-A_b r_b, -A_b clip(r_b, 1 - eps, 1 + eps))  (advantages=)
        kl              = mean_b KL_{k,b}                                        (reference=)

    ``policy_loss`` is the step's clipped surrogate loss before :func:`grpo_objective`'s
    ``1 / N``; ``kl`` is :func:`step_kl` (the exact Gaussian KL, reduced as ``reduction``),
    so Flow-GRPO's logged ``kl_loss`` is ``|h_k|`` times it with ``reduction="mean"``
    (the module docstring). Flow-GRPO averages each statistic over the trained timesteps
    and the batches of an optimizer step: average these over the steps an estimator
    evaluated. At the sampling policy (``velocity`` the recorded one) ``approx_kl`` and
    every ``clipfrac`` are 0. No host synchronisation: the values stay on the device.

    Args:
        sampler: the :class:`FlowSDE` the trajectory was sampled with.
        trajectory: the recorded rollout (states are data).
        k: the step, ``0 <= k < N``.
        velocity: ``[B, ...]``, the policy's velocity at ``z_k``.
        old_log_probs: ``[N, B]`` step log-probabilities under the sampling policy.
        clip: PPO's ``eps`` (Flow-GRPO's ``clip_range``).
        reduction: as in :func:`grpo_objective`; must match ``old_log_probs``.
        advantages: ``[B]`` (already clipped, as the objective's); adds ``policy_loss``.
        reference: ``[N, B, ...]`` reference velocities (:func:`reference_velocities`);
            adds ``kl``.

    Returns:
        ``{"approx_kl", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one"}``, plus
        ``"policy_loss"`` and ``"kl"`` when given what they need, each a 0-dim tensor in
        the log-probabilities' dtype.
    """
    if not isinstance(sampler, FlowSDE):
        raise InvalidType(
            f"sampler must be the gradest.FlowSDE the trajectory was sampled with, "
            f"got {type(sampler).__name__}"
        )
    if not isinstance(trajectory, Trajectory):
        raise InvalidType(
            f"trajectory must be a gradest.Trajectory (from gradest.rollout), "
            f"got {type(trajectory).__name__}"
        )
    steps, batch = trajectory.num_steps, trajectory.batch_size
    if not isinstance(old_log_probs, Tensor) or tuple(old_log_probs.shape) != (steps, batch):
        raise InvalidValue(
            f"old_log_probs must be [N, B] = [{steps}, {batch}], got {_shape_of(old_log_probs)}; "
            f"use sampler.trajectory_log_probs(trajectory)"
        )
    if not isinstance(velocity, Tensor):
        raise InvalidType(f"velocity must be a tensor [B, ...], got {type(velocity).__name__}")
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 < clip < 1:
        raise InvalidValue(f"clip must be a float in (0, 1) (PPO's eps), got {clip!r}")
    if advantages is not None and (
        not isinstance(advantages, Tensor) or tuple(advantages.shape) != (batch,)
    ):
        raise InvalidValue(f"advantages must be [B] = [{batch}], got {_shape_of(advantages)}")
    expected = tuple(trajectory.velocities.shape)
    if reference is not None and (
        not isinstance(reference, Tensor) or tuple(reference.shape) != expected
    ):
        raise InvalidValue(
            f"reference must be [N, B, ...] = {list(expected)} (the reference model's "
            f"velocities at the recorded states), got {_shape_of(reference)}"
        )
    with torch.no_grad():
        velocity = velocity.detach()
        # step_log_prob checks k, the velocity's shape and the grid.
        log_prob = sampler.step_log_prob(trajectory, k, velocity, reduction=reduction)
        difference = log_prob - old_log_probs[k].detach().to(log_prob)
        ratio = torch.exp(difference)
        eps = float(clip)
        stats = {
            "approx_kl": 0.5 * difference.square().mean(),
            "clipfrac": ((ratio - 1.0).abs() > eps).to(log_prob.dtype).mean(),
            "clipfrac_gt_one": (ratio - 1.0 > eps).to(log_prob.dtype).mean(),
            "clipfrac_lt_one": (1.0 - ratio > eps).to(log_prob.dtype).mean(),
        }
        if advantages is not None:
            advantage = advantages.detach().to(log_prob)
            unclipped = -advantage * ratio
            clipped = -advantage * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
            stats["policy_loss"] = torch.maximum(unclipped, clipped).mean()
        if reference is not None:
            kl = step_kl(sampler, k, velocity, reference[k].detach(), reduction=reduction)
            stats["kl"] = kl.mean().to(log_prob.dtype)
    return stats


def _checked_reference(reference: Any, trajectory: Trajectory, needed: bool) -> Tensor | None:
    if reference is None:
        if needed:
            raise InvalidValue(
                "kl_weight > 0 needs reference= (the reference model's velocities at the "
                "recorded states, [N, B, ...]): pass reference=gradest.rl.reference_velocities("
                "reference_model, sampler, trajectory, cond), or set kl_weight=0"
            )
        return None
    expected = tuple(trajectory.velocities.shape)
    if not isinstance(reference, Tensor) or tuple(reference.shape) != expected:
        raise InvalidValue(
            f"reference must be [N, B, ...] = {list(expected)} (the reference model's "
            f"velocities at the recorded states), got {_shape_of(reference)}; use "
            f"gradest.rl.reference_velocities(reference_model, sampler, trajectory, cond)"
        )
    if not reference.is_floating_point() or not bool(torch.isfinite(reference).all()):
        raise InvalidValue("reference must be a finite floating-point tensor")
    return reference.detach()
