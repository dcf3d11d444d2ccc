"""The ``truncated`` estimator's definition, computed densely from the exact cotangents.

    truncated_k           = sum_{j=N-k}^{N-1} J_j^T c_j     (exact c_j, dense adjoint)
    truncated_expectation = sum_k p_k truncated_k          (randomized truncation)
    noise gradient        = a_0 if k = N, else 0           (the chain is cut before step 0)

Computed with :func:`~gradest.reference.dense.exact_cotangents`, so it shares no code
with :mod:`gradest.strategies.truncated` (which runs a fused VJP or a partial sweep).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, exact_cotangents, terminal_adjoints


def _check_k(chain: DenseChain, k: int) -> None:
    if not 1 <= k <= chain.num_steps:
        raise InvalidValue(f"k must be in 1..{chain.num_steps} (the chain's steps), got {k}")


def truncated_definition(chain: DenseChain, objective: Objective, k: int) -> Tensor:
    """``sum_{j >= N-k} J_j^T c_j`` with exact cotangents, as a flat ``[P]`` vector."""
    _check_k(chain, k)
    cotangents = exact_cotangents(chain, objective)
    return chain.gradient(cotangents, steps=range(chain.num_steps - k, chain.num_steps))


def truncated_noise_grad_definition(
    chain: DenseChain, objective: Objective, k: int
) -> Tensor | None:
    """The initial-noise gradient of truncation at ``k``: ``a_0`` if ``k = N``, else zero
    (None for a stepwise objective)."""
    _check_k(chain, k)
    if not isinstance(objective, TerminalObjective):
        return None
    shape = chain.trajectory.states.shape[1:]
    if k < chain.num_steps:
        return torch.zeros(shape, dtype=torch.float64)
    return terminal_adjoints(chain, objective)[0].reshape(shape)


def uniform_probabilities(largest: int) -> tuple[float, ...]:
    """``P(k) = 1/K`` on ``k = 1..K``: what ``random="uniform"`` draws from."""
    return tuple(1.0 / largest for _ in range(largest))


def truncated_expectation(
    chain: DenseChain, objective: Objective, probabilities: Sequence[float]
) -> Tensor:
    """``sum_k p_k truncated_k`` (flat ``[P]``), with ``p_k = probabilities[k-1]``."""
    if len(probabilities) > chain.num_steps:
        raise InvalidValue(
            f"{len(probabilities)} probabilities for a chain of {chain.num_steps} steps"
        )
    cotangents = exact_cotangents(chain, objective)
    total = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    for k, p in enumerate(probabilities, start=1):
        steps = range(chain.num_steps - k, chain.num_steps)
        total = total + p * chain.gradient(cotangents, steps=steps)
    return total
