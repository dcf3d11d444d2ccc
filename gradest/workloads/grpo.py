"""GRPO's clipped surrogate on a recorded FlowSDE trajectory, as a gradest stepwise objective.

Flow-GRPO (Liu et al. 2025) treats every SDE step as a Gaussian policy
``pi_theta(z_{k+1} | z_k) = N(alpha_k z_k + beta_k v_theta(z_k, t_k), s_k^2 I)``. With
group-normalised advantages ``A_b`` and the log-probabilities ``log pi_old`` recorded
when the batch was sampled, the loss of step ``k`` is PPO's pessimistic clipped
surrogate, averaged over the batch and divided by ``N`` (Flow-GRPO accumulates the
per-step losses over the ``N`` training steps)::

    r_{k,b} = exp(log pi_theta(k, b) - log pi_old(k, b))
    l_k     = -(1 / N) mean_b min(r A_b, clip(r, 1 - eps, 1 + eps) A_b)

The recorded states are data and ``l_k`` depends on ``theta`` only through ``v_k``, so
this is exactly the shape of :class:`gradest.StepwiseObjective`: every estimator
evaluates ``sum_k J_k^T (d l_k / d v_k)`` its own way. At ``theta = theta_old`` the
cotangent is the policy gradient ``-A_b (d log pi / d v_k) / (N B)``; a sample whose
ratio has left the band on the side its advantage favours contributes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradest.errors import InvalidType, InvalidValue
from gradest.flow import Trajectory, check_trajectory_matches
from gradest.objectives import StepwiseObjective
from gradest.samplers import FlowSDE

ADVANTAGE_EPS = 1e-4


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


def grpo_objective(
    flow: FlowSDE,
    trajectory: Trajectory,
    old_log_probs: Tensor,
    advantages: Tensor,
    clip: float = 0.2,
    *,
    reduction: str = "sum",
) -> StepwiseObjective:
    """The Flow-GRPO clipped surrogate on ``trajectory`` as a stepwise objective.

    Args:
        flow: the :class:`FlowSDE` the trajectory was sampled with.
        trajectory: the recorded rollout (states are data).
        old_log_probs: ``[N, B]`` step log-probabilities under the sampling policy,
            e.g. ``flow.trajectory_log_probs(trajectory)`` right after the rollout.
        advantages: ``[B]``, e.g. :func:`group_advantages` of the rewards.
        clip: PPO's ``eps``; the ratio is clipped to ``[1 - eps, 1 + eps]``.
        reduction: how :meth:`FlowSDE.step_log_prob` reduces over the state's elements
            (``"sum"``: the Gaussian log-density; ``"mean"``: Flow-GRPO's per-element
            average). Must match how ``old_log_probs`` were computed.

    Use it with ``trajectory=`` (the same one) in ``estimate`` / ``backward``.
    """
    if not isinstance(flow, FlowSDE):
        raise InvalidType(
            f"flow must be the gradest.workloads.FlowSDE the trajectory was sampled with, "
            f"got {type(flow).__name__}"
        )
    check_trajectory_matches(flow, trajectory)
    steps, batch = trajectory.num_steps, trajectory.batch_size
    if not isinstance(old_log_probs, Tensor) or tuple(old_log_probs.shape) != (steps, batch):
        shape = (
            tuple(old_log_probs.shape)
            if isinstance(old_log_probs, Tensor)
            else type(old_log_probs).__name__
        )
        raise InvalidValue(
            f"old_log_probs must be [N, B] = [{steps}, {batch}], got {shape}; use "
            f"flow.trajectory_log_probs(trajectory)"
        )
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != (batch,):
        shape = (
            tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        )
        raise InvalidValue(f"advantages must be [B] = [{batch}], got {shape}")
    if isinstance(clip, bool) or not isinstance(clip, int | float):
        raise InvalidType(f"clip must be a float in (0, 1), got {clip!r}; Flow-GRPO uses 0.2")
    if not (math.isfinite(clip) and 0 < clip < 1):
        raise InvalidValue(f"clip must be in (0, 1), got {clip!r}; Flow-GRPO uses 0.2")
    for name, tensor in (("old_log_probs", old_log_probs), ("advantages", advantages)):
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidValue(f"{name} contain NaN or Inf")
    old_log_probs = old_log_probs.detach()
    advantages = advantages.detach()
    low, high = 1.0 - float(clip), 1.0 + float(clip)

    def loss_fn(k: int, velocity: Tensor, given: Trajectory) -> Tensor:
        # The ratios are against log-probabilities of *this* trajectory's steps; an
        # estimator that sampled a fresh path (noise= instead of trajectory=) would
        # silently optimise nonsense.
        if given is not trajectory and not (
            given.states.shape == trajectory.states.shape
            and torch.equal(given.states, trajectory.states)
        ):
            raise InvalidValue(
                "this GRPO objective was built for a recorded trajectory; pass that "
                "trajectory to estimate/backward (trajectory=...), not noise="
            )
        log_prob = flow.step_log_prob(trajectory, k, velocity, reduction=reduction)
        ratio = torch.exp(log_prob - old_log_probs[k].to(log_prob))
        advantage = advantages.to(log_prob)
        surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, low, high) * advantage)
        return -surrogate.mean() / steps

    return StepwiseObjective(loss_fn)
