"""The ``telescope`` estimator's definition, densely, with its own survival probabilities.

    q_j            = 1 (j <= min_depth),  rho^(j - min_depth) after,  sum_j q_j = mean_depth
    telescope_K    = sum_{j=1}^{K} J_{N-j}^T c_{N-j} / q_j       (exact c, dense adjoint)
    noise gradient = a_0 / q_N if K = N, else 0
    expectation    = sum_K P(K) telescope_K = the exact gradient

``rho`` is the real root in ``[0, 1]`` of ``sum_{i=1}^{M} rho^i = mean_depth - min_depth``
found from the polynomial's companion matrix (``numpy.roots``) and polished by Newton
steps, not by the estimator's bisection, so a wrong survival law is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, exact_cotangents, terminal_adjoints


def reference_survival(num_steps: int, mean_depth: float, min_depth: int) -> list[float]:
    """``q_1..q_N`` of ``telescope`` (see the module docstring)."""
    tail = num_steps - min_depth
    target = mean_depth - min_depth
    if tail <= 0 or target <= 0:
        return [1.0] * min_depth + [0.0] * max(tail, 0)
    if target >= tail:
        return [1.0] * num_steps
    # rho^M + ... + rho - target = 0, highest power first for numpy.roots.
    coefficients = [1.0] * tail + [-target]
    roots = np.roots(coefficients)
    real = [float(r.real) for r in roots if abs(r.imag) < 1e-7 and -1e-9 <= r.real <= 1 + 1e-9]
    if len(real) != 1:
        raise InvalidValue(f"no unique survival rate in [0, 1] for {mean_depth=}, {min_depth=}")
    rho = min(max(real[0], 0.0), 1.0)
    for _ in range(3):  # Newton on f(rho) = sum rho^i - target
        value = sum(rho**i for i in range(1, tail + 1)) - target
        slope = sum(i * rho ** (i - 1) for i in range(1, tail + 1))
        rho -= value / slope
    return [1.0] * min_depth + [rho**i for i in range(1, tail + 1)]


def telescope_definition(
    chain: DenseChain, objective: Objective, depth: int, survival: Sequence[float]
) -> Tensor:
    """``sum_{j=1}^{depth} J_{N-j}^T c_{N-j} / q_j`` as a flat ``[P]`` vector."""
    if not 1 <= depth <= chain.num_steps:
        raise InvalidValue(f"depth must be in 1..{chain.num_steps}, got {depth}")
    cotangents = exact_cotangents(chain, objective)
    total = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    for j in range(1, depth + 1):
        k = chain.num_steps - j
        total = total + chain.param_jacobians[k].T @ cotangents[k] / survival[j - 1]
    return total


def telescope_noise_grad_definition(
    chain: DenseChain, objective: Objective, depth: int, survival: Sequence[float]
) -> Tensor | None:
    """``a_0 / q_N`` when ``depth = N``, else zero (None for a stepwise objective)."""
    if not isinstance(objective, TerminalObjective):
        return None
    shape = chain.trajectory.states.shape[1:]
    if depth < chain.num_steps:
        return torch.zeros(shape, dtype=torch.float64)
    return terminal_adjoints(chain, objective)[0].reshape(shape) / survival[-1]


def telescope_expectation(
    chain: DenseChain, objective: Objective, survival: Sequence[float]
) -> Tensor:
    """``sum_K P(K) telescope_K`` with ``P(K) = q_K - q_{K+1}``: the exact gradient when
    every ``q_j > 0`` (flat ``[P]``); a check on the survival law itself."""
    total = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    padded = list(survival) + [0.0]
    for depth in range(1, chain.num_steps + 1):
        mass = padded[depth - 1] - padded[depth]
        if mass > 0:
            total = total + mass * telescope_definition(chain, objective, depth, survival)
    return total
