"""The dense definition of ``sdo_mean``, registered with ``gradest.reference``.

``gradest check`` (and ``gradest.reference.definition_gradient``) look estimators up by
name; registering a definition here makes ``gradest check`` compare the plugin's result
with its formula evaluated from dense Jacobians, independently of the plugin's VJP code:

    g = (1/K) sum_i sdo(S_i, N/m)

with the subsets ``S_i`` read from ``result.info["draws"]`` (the estimator's random
choices) and each ``sdo(S, s) = s sum_{k in S} J_k^T c~_k`` computed by gradest's own
dense SDO definition.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gradest.objectives import Objective
from gradest.protocol import GradientEstimate
from gradest.reference import DenseChain, register_definition, sdo_definition


def sdo_mean_definition(
    estimator: Any, chain: DenseChain, objective: Objective, result: GradientEstimate
) -> Tensor:
    """The mean of the dense SDO definitions of each recorded draw (flat ``[P]``)."""
    del estimator
    subsets = result.info["draws"]
    scale = result.info["scale"]
    total = sum(sdo_definition(chain, objective, subset, scale) for subset in subsets)
    return total / len(subsets)


register_definition("sdo_mean", sdo_mean_definition)
