"""Flow-GRPO's stochastic sampler: moved to :mod:`gradest.samplers` (``gradest.FlowSDE``).

Kept so that ``from gradest.workloads.sde import FlowSDE`` goes on working.
"""

from gradest.samplers import LOG_PROB_REDUCTIONS, FlowSDE

__all__ = ["LOG_PROB_REDUCTIONS", "FlowSDE"]
