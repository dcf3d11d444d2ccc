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

Definition = Callable[[Any, DenseChain, Objective, GradientEstimate], Tensor]


def _exact(estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate) -> Tensor:
    del estimator, result
    return chain.gradient(exact_cotangents(chain, objective))


_DEFINITIONS: dict[str, Definition] = {"exact": _exact}


def register_definition(name: str, definition: Definition) -> None:
    """Teach the reference an estimator's definition (built-ins register at import)."""
    _DEFINITIONS[name] = definition


def definition_gradient(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor | None:
    """The estimator's defining formula, densely, for the random choices in ``result``."""
    definition = _DEFINITIONS.get(getattr(estimator, "name", ""))
    return None if definition is None else definition(estimator, chain, objective, result)
