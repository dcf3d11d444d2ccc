"""gradest: parameter gradients through diffusion / flow-model sampling chains.

Swap estimators by name; train with the surrogate loss::

    est = gradest.estimator("jagg", window=4)
    sur = est.surrogate(model, gradest.RectifiedFlow(steps=50), objective, noise=noise)
    sur.loss.backward()   # .grad now holds the estimate; or est.estimate(...) for a dict
"""

# RL objectives (Flow-GRPO, adjoint matching) as a namespace: ``gradest.rl.grpo_objective``.
from gradest import rl
from gradest.conditioning import Shared
from gradest.diffusion_samplers import DDIMSampler
from gradest.errors import GradestError
from gradest.trajectory import Trajectory, rollout
from gradest.harness.compare import compare
from gradest.harness.report import Report
from gradest.nonfinite import NonFiniteError
from gradest.objectives import (
    StepwiseObjective,
    TerminalObjective,
    flow_matching_objective,
    flow_matching_trajectory,
)
from gradest.protocol import Cost, GradientEstimate, Surrogate, TrajectoryGradientEstimator
from gradest.registry import UnknownEstimatorError, available_estimators, estimator
from gradest.samplers import AffineSampler, FlowSDE, RectifiedFlow

__version__ = "0.1.0"

__all__ = [
    "AffineSampler",
    "Cost",
    "DDIMSampler",
    "FlowSDE",
    "GradestError",
    "GradientEstimate",
    "NonFiniteError",
    "RectifiedFlow",
    "Report",
    "Shared",
    "StepwiseObjective",
    "Surrogate",
    "TerminalObjective",
    "Trajectory",
    "TrajectoryGradientEstimator",
    "UnknownEstimatorError",
    "available_estimators",
    "compare",
    "estimator",
    "flow_matching_objective",
    "flow_matching_trajectory",
    "rl",
    "rollout",
]
