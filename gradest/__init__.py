"""gradest: parameter gradients through diffusion / flow-model sampling chains.

Swap estimators by name; train with the surrogate loss::

    est = gradest.estimator("jagg", window=4)
    sur = est.surrogate(model, gradest.RectifiedFlow(steps=50), objective, noise=noise)
    sur.loss.backward()   # .grad now holds the estimate; or est.estimate(...) for a dict
"""

# -- estimators: pick one by name ------------------------------------------------------------
# estimator("jagg:window=4") builds one from a spec; available_estimators() lists the
# registered classes; UnknownEstimatorError is raised for a name nobody registered.
# TrajectoryGradientEstimator is the protocol (two verbs: surrogate() to train, estimate()
# to measure); EstimatorBase, EstimationContext, Decisions, Definition and EstimatorAxes
# are here for a plugin's class line, and with everything else a plugin uses in
# gradest.plugin.
# -- results of the two verbs -----------------------------------------------------------------
# Surrogate (surrogate(): a loss to backpropagate) and GradientEstimate (estimate(): the
# gradients as a dict) share value, cost (a Cost of model calls), info, decisions, usable.
# -- samplers: a time grid and an affine step -------------------------------------------------
# RectifiedFlow (Euler), FlowSDE (Flow-GRPO's SDE) and DDIM (DDIM / DDPM) are built as
# Cls(steps=N) or Cls(times=...); AffineSampler is the protocol a sampler of your own meets.
# -- paths, objectives and conditioning -------------------------------------------------------
# rollout(model, sampler, noise) records a Trajectory; TerminalObjective / StepwiseObjective
# are what is differentiated; flow_matching_objective / flow_matching_trajectory build the
# flow-matching loss; SharedCondition marks a cond value that must not be repeated per row;
# model_rng_seed(generator) is the seed of the stream a model's dropout draws from when an
# estimate is given generator= (seed a hand-written loop with it to draw the same masks).
# -- measuring and errors ---------------------------------------------------------------------
# compare() measures estimators against exact into a Report (loaded on first use: the
# measuring tools live in gradest.harness); GradestError is the base of every error
# gradest raises on purpose: InvalidValue / InvalidType for bad input (also ValueError /
# TypeError), MissingDependency for a missing extra, NonFiniteError for NaN/Inf,
# SurrogateOutdated for a surrogate backpropagated after its model changed.
# -- namespaces -------------------------------------------------------------------------------
# gradest.rl (RL objectives: Flow-GRPO, adjoint matching), gradest.plugin (what a plugin
# author needs), gradest.harness (measuring), gradest.reference (dense ground truth),
# gradest.testing (checks for estimator authors), gradest.models (small velocity models),
# gradest.integrations (diffusers, peft, torch.distributed).
from typing import TYPE_CHECKING, Any

from gradest import rl
from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.conditioning import SharedCondition
from gradest.context import EstimationContext
from gradest.diffusion_samplers import DDIM
from gradest.errors import (
    GradestError,
    InvalidType,
    InvalidValue,
    MissingDependency,
    SurrogateOutdated,
)
from gradest.nonfinite import NonFiniteError
from gradest.objectives import (
    StepwiseObjective,
    TerminalObjective,
    flow_matching_objective,
    flow_matching_trajectory,
)
from gradest.protocol import (
    Cost,
    Decisions,
    Definition,
    GradientEstimate,
    Surrogate,
    TrajectoryGradientEstimator,
)
from gradest.registry import UnknownEstimatorError, available_estimators, estimator
from gradest.replay import model_rng_seed
from gradest.samplers import AffineSampler, FlowSDE, RectifiedFlow
from gradest.trajectory import Trajectory, rollout

if TYPE_CHECKING:
    from gradest.harness.comparison import compare
    from gradest.harness.report import Report

# Served from gradest.harness on first use: measuring imports torch's FLOP counter, which
# training code that only estimates gradients never needs.
_FROM_HARNESS = ("Report", "compare")


def __getattr__(name: str) -> Any:
    if name in _FROM_HARNESS:
        from gradest import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The one place the version is written: pyproject.toml reads it from here (setuptools
# dynamic metadata, read statically), tests/test_packaging.py checks the two agree.
__version__ = "0.1.0"

__all__ = [
    "AffineSampler",
    "Cost",
    "DDIM",
    "Decisions",
    "Definition",
    "EstimationContext",
    "EstimatorAxes",
    "EstimatorBase",
    "FlowSDE",
    "GradestError",
    "GradientEstimate",
    "InvalidType",
    "InvalidValue",
    "MissingDependency",
    "NonFiniteError",
    "RectifiedFlow",
    "Report",
    "SharedCondition",
    "StepwiseObjective",
    "Surrogate",
    "SurrogateOutdated",
    "TerminalObjective",
    "Trajectory",
    "TrajectoryGradientEstimator",
    "UnknownEstimatorError",
    "available_estimators",
    "compare",
    "estimator",
    "flow_matching_objective",
    "flow_matching_trajectory",
    "model_rng_seed",
    "rl",
    "rollout",
]
