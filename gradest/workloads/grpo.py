"""Flow-GRPO's objective: moved to :mod:`gradest.rl.flow_grpo` (public as ``gradest.rl``).

Kept so that ``from gradest.workloads.grpo import grpo_objective`` goes on working.
"""

from gradest.rl.flow_grpo import (
    ADVANTAGE_EPS,
    group_advantages,
    grpo_objective,
    reference_velocities,
    step_kl,
)

__all__ = [
    "ADVANTAGE_EPS",
    "group_advantages",
    "grpo_objective",
    "reference_velocities",
    "step_kl",
]
