"""Each estimator's *definition*, evaluated densely: asked of the estimator itself.

Given the dense chain of a recorded trajectory and an estimate (whose typed
``decisions`` say which random and gate choices it made), return the gradient the
estimator's formula in docs/design.md#estimator-table prescribes, computed from dense Jacobians only
(the functions in this package), not by the estimator's VJP code. Every estimator owns its
definition (``EstimatorBase.definition``); no table names them here, so a plugin that
defines one is checked like a built-in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradest.objectives import Objective
from gradest.protocol import Decisions, Definition, GradientEstimate
from gradest.reference.dense import DenseChain


def definition_gradient(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor | None:
    """The estimator's defining formula, densely, for the decisions in ``result`` (flat ``[P]``).

    Asks the estimator itself (``estimator.definition(chain, objective, result.decisions)``);
    None for an estimator that defines none (a plugin may not), so ``gradest check``
    reports "n/a" for it.
    """
    definition = _definition(estimator, chain, objective, result)
    return None if definition is None else definition.grad


def definition_noise_grad(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor | None:
    """The initial-noise gradient the estimator's definition prescribes (or None)."""
    definition = _definition(estimator, chain, objective, result)
    return None if definition is None else definition.noise_grad


def _definition(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Definition | None:
    return definition_at(estimator, chain, objective, result.decisions)


def definition_at(
    estimator: Any, chain: DenseChain, objective: Objective, decisions: Any
) -> Definition | None:
    """The estimator's definition at the given ``decisions`` (None where it defines none)."""
    return _ask(estimator, "definition", chain, objective, decisions)


def expected_decisions(
    estimator: Any, chain: DenseChain, objective: Objective, generator: torch.Generator
) -> Decisions | None:
    """The decisions the estimator must make, re-derived independently
    (``estimator.expected_decisions``), or None where it does not re-derive them."""
    return _ask(estimator, "expected_decisions", chain, objective, generator)


def _ask(estimator: Any, method: str, *args: Any) -> Any:
    """``estimator.method(*args)``, or None where the estimator lacks it (a plugin) or
    raises NotImplementedError (``EstimatorBase``'s default)."""
    bound = getattr(estimator, method, None)
    if bound is None:
        return None
    try:
        return bound(*args)
    except NotImplementedError:
        return None
