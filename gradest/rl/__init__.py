"""Reinforcement-learning objectives on recorded sampling paths, as stepwise objectives.

* :mod:`gradest.rl.flow_grpo`: Flow-GRPO's group advantages, clipped surrogate and the KL
  penalty to a frozen reference model.
* :mod:`gradest.rl.adjoint_matching`: adjoint matching (memoryless sampler, lean adjoint,
  regression loss).

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
    reference_velocities,
    step_kl,
)

__all__ = [
    "ADVANTAGE_EPS",
    "MEMORYLESS_NOISE_LEVEL",
    "LeanAdjoint",
    "MemorylessFlow",
    "adjoint_matching_objective",
    "group_advantages",
    "grpo_objective",
    "lean_adjoint",
    "memoryless_flow",
    "reference_velocities",
    "regression_objective",
    "step_kl",
]
