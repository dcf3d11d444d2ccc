"""Each estimator's *definition*, evaluated densely: dispatch by estimator name.

Given the dense chain of a recorded trajectory and an estimate (whose ``info`` says
which random choices it made: sampled steps, truncation depth, gate decisions), return
the flat gradient the estimator's formula in DESIGN.md section 2 prescribes, computed
from dense Jacobians only. Unknown estimators (plugins) return None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from gradest.objectives import Objective
from gradest.protocol import GradientEstimate
from gradest.reference.dense import DenseChain, exact_cotangents
from gradest.reference.jagg_definition import jagg_definition
from gradest.reference.sdo_definition import sdo_definition
from gradest.reference.truncated_definition import truncated_definition

Definition = Callable[[Any, DenseChain, Objective, GradientEstimate], Tensor]


def _exact(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor:
    del estimator, result
    return chain.gradient(exact_cotangents(chain, objective))


def _jagg(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor:
    # The layout and the gate decisions are read from the result (they are checked
    # separately against the dense gate cosines); the interpolation is recomputed here.
    info = result.info
    failed = set(info["fallback_groups"])
    passed = [index not in failed for index in range(len(info["groups"]))]
    return jagg_definition(chain, objective, info["groups"], info["nodes"], passed)


def _sdo(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor:
    # The sampled steps and the factor N/m (or 1) are the estimator's random choices.
    return sdo_definition(chain, objective, result.info["sampled_steps"], result.info["scale"])


def _truncated(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor:
    return truncated_definition(chain, objective, result.info["k"])


_DEFINITIONS: dict[str, Definition] = {
    "exact": _exact,
    "jagg": _jagg,
    "sdo": _sdo,
    "truncated": _truncated,
}


def register_definition(name: str, definition: Definition) -> None:
    """Teach the reference the definition of a plugin estimator, for ``gradest check``."""
    _DEFINITIONS[name] = definition


def definition_gradient(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor | None:
    """The estimator's defining formula, densely, for the random choices in ``result``."""
    definition = _DEFINITIONS.get(getattr(estimator, "name", ""))
    return None if definition is None else definition(estimator, chain, objective, result)
