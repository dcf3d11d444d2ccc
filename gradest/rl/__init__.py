"""Reinforcement-learning objectives on recorded sampling paths, as stepwise objectives.

* :mod:`gradest.rl.flow_grpo`: Flow-GRPO's group advantages, clipped surrogate and the KL
  penalty to a frozen reference model, and the training statistics it logs
  (:func:`grpo_step_statistics`: ``approx_kl``, ``clipfrac``, ...), and the recorded
  path's steps one trains on (:func:`leading_steps`, :func:`step_range`, :func:`single_step`,
  :func:`separable_over_steps`).
* :mod:`gradest.rl.prompt_stats`: Flow-GRPO's per-prompt advantages, the statistics
  gathered across processes, and its ``zero_std_ratio`` (:func:`zero_std_ratio`).
* :mod:`gradest.rl.adjoint_matching`: adjoint matching (memoryless sampler, lean adjoint,
  regression loss).
* :data:`LOG_PROB_REDUCTIONS` / :func:`check_reduction`: how a step's log-density under a
  stochastic sampler (:class:`gradest.FlowSDE`, :class:`gradest.DDIM` with ``eta > 0``) is
  reduced over a sample's elements, as the GRPO ratio reads it.

Each objective treats the recorded states as data and depends on the parameters only
through the velocities ``v_k``, so every gradest estimator differentiates it.
"""

from gradest.rl.adjoint_matching import (
    MEMORYLESS_NOISE_LEVEL,
    LeanAdjoint,
    MemorylessFlow,
    adjoint_matching_objective,
    lean_adjoint,
    memoryless_flow,
    regression_objective,
)
from gradest.rl.flow_grpo import (
    ADVANTAGE_EPS,
    group_advantages,
    grpo_objective,
    grpo_step_statistics,
    leading_steps,
    reference_velocities,
    separable_over_steps,
    single_step,
    step_kl,
    step_range,
)
from gradest.rl.prompt_stats import gather_samples, prompt_advantages, zero_std_ratio
from gradest.samplers import LOG_PROB_REDUCTIONS, check_reduction

__all__ = [
    "ADVANTAGE_EPS",
    "LOG_PROB_REDUCTIONS",
    "MEMORYLESS_NOISE_LEVEL",
    "LeanAdjoint",
    "MemorylessFlow",
    "adjoint_matching_objective",
    "check_reduction",
    "gather_samples",
    "group_advantages",
    "grpo_objective",
    "grpo_step_statistics",
    "leading_steps",
    "lean_adjoint",
    "memoryless_flow",
    "prompt_advantages",
    "reference_velocities",
    "regression_objective",
    "separable_over_steps",
    "single_step",
    "step_kl",
    "step_range",
    "zero_std_ratio",
]
