"""The ``alignprop`` estimator's definition and its expectation, computed densely.

AlignProp (and TRL's ``truncated_rand_backprop_minmax``) draws, at every step ``i`` of
the sampling loop (``i = 0`` the noisiest; gradest's step ``k = i``), an independent
``r_i`` uniform on ``{a, ..., b}`` and keeps the graph of that step's model output iff
``i >= r_i``. The state path is never cut: a step whose output is detached passes the
adjoint through the sampler's own linear part, ``dz_{k+1}/dz_k = alpha_k I``. With the
kept set ``S`` fixed::

    c~_N = grad l(z_N)
    c~_k = alpha_k c~_{k+1} + [k in S] beta_k A_k^T c~_{k+1}        (A_k = dv_k/dz_k)
    g_S  = sum_{k in S} J_k^T (beta_k c~_{k+1})                      (terminal)
    g_S  = sum_{k in S} J_k^T (d l_k / d v_k)                        (stepwise: each kept
                                                                      step's own loss)
    noise gradient = c~_0

The draws are independent and ``c~_{k+1}`` depends on the draws after ``k`` only, so with
``p_k = P(k >= r) = clip(k - a + 1, 0, b - a + 1) / (b - a + 1)``::

    E[c~_k] = (alpha_k I + p_k beta_k A_k)^T E[c~_{k+1}]
    E[g]    = sum_k p_k J_k^T (beta_k E[c~_{k+1}])                   (terminal)
    E[g]    = sum_k p_k J_k^T (d l_k / d v_k)                        (stepwise)

Computed from the dense Jacobians of :class:`~gradest.reference.dense.DenseChain` by
explicit matrix products, so it shares no code with :mod:`gradest.strategies.alignprop`
(which runs a fused chain with per-step detached outputs, or a joint-VJP sweep).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, exact_cotangents, loss_gradient


def keep_probabilities(num_steps: int, low: int, high: int) -> tuple[float, ...]:
    """``p_k = P(k >= r)``, ``r`` uniform on ``{low, ..., high}``, for ``k = 0..N-1``."""
    if not 0 <= low <= high:
        raise InvalidValue(f"need 0 <= low <= high, got low={low}, high={high}")
    width = high - low + 1
    return tuple(min(max(k - low + 1, 0), width) / width for k in range(num_steps))


def kept_steps(draws: Sequence[int]) -> tuple[int, ...]:
    """The steps ``k`` whose output keeps its graph: ``k >= r_k``."""
    return tuple(k for k, r in enumerate(draws) if k >= r)


def _weighted_adjoints(
    chain: DenseChain, objective: TerminalObjective, weights: Sequence[float]
) -> Tensor:
    """``e_N = grad l(z_N)``, ``e_k = alpha_k e_{k+1} + w_k beta_k A_k^T e_{k+1}``: ``[N+1, D]``.

    ``w_k`` in {0, 1} is the adjoint of one kept set; ``w_k = p_k`` its expectation."""
    adjoints = [loss_gradient(chain.trajectory.states[-1], objective)]
    for k in reversed(range(chain.num_steps)):
        a_next = adjoints[0]
        step = chain.alpha[k] * a_next
        if weights[k] != 0.0:
            step = step + weights[k] * chain.beta[k] * (chain.state_jacobians[k].T @ a_next)
        adjoints.insert(0, step)
    return torch.stack(adjoints)


def _check_steps(chain: DenseChain, kept: Collection[int]) -> None:
    bad = [k for k in kept if not 0 <= k < chain.num_steps]
    if bad:
        raise InvalidValue(f"kept steps {bad} outside 0..{chain.num_steps - 1}")


def alignprop_cotangents(chain: DenseChain, objective: Objective, kept: Collection[int]) -> Tensor:
    """``[N, D]`` cotangents of a kept set: ``beta_k c~_{k+1}`` (terminal) or ``d l_k/d v_k``
    (stepwise) on kept steps, zero on the others."""
    _check_steps(chain, kept)
    mask = [1.0 if k in kept else 0.0 for k in range(chain.num_steps)]
    if isinstance(objective, TerminalObjective):
        adjoints = _weighted_adjoints(chain, objective, mask)
        cotangents = chain.beta[:, None] * adjoints[1:]
    else:
        cotangents = exact_cotangents(chain, objective)
    return cotangents * torch.tensor(mask, dtype=torch.float64)[:, None]


def alignprop_definition(chain: DenseChain, objective: Objective, kept: Collection[int]) -> Tensor:
    """``g_S = sum_{k in S} J_k^T c_k`` (module docstring), flat ``[P]``."""
    cotangents = alignprop_cotangents(chain, objective, kept)
    return chain.gradient(cotangents, steps=sorted(kept))


def alignprop_noise_grad_definition(
    chain: DenseChain, objective: Objective, kept: Collection[int]
) -> Tensor | None:
    """``c~_0`` of the kept set, shaped like the noise (None for a stepwise objective)."""
    _check_steps(chain, kept)
    if not isinstance(objective, TerminalObjective):
        return None
    mask = [1.0 if k in kept else 0.0 for k in range(chain.num_steps)]
    shape = chain.trajectory.states.shape[1:]
    return _weighted_adjoints(chain, objective, mask)[0].reshape(shape)


def alignprop_expectation(chain: DenseChain, objective: Objective, low: int, high: int) -> Tensor:
    """``E[g]`` over the per-step draws ``r ~ U{low..high}`` (module docstring), flat ``[P]``."""
    p = keep_probabilities(chain.num_steps, low, high)
    if isinstance(objective, TerminalObjective):
        adjoints = _weighted_adjoints(chain, objective, p)
        cotangents = chain.beta[:, None] * adjoints[1:]
    else:
        cotangents = exact_cotangents(chain, objective)
    weights = torch.tensor(p, dtype=torch.float64)[:, None]
    return chain.gradient(weights * cotangents)


def alignprop_noise_grad_expectation(
    chain: DenseChain, objective: TerminalObjective, low: int, high: int
) -> Tensor:
    """``E[c~_0]``, shaped like the noise."""
    p = keep_probabilities(chain.num_steps, low, high)
    shape = chain.trajectory.states.shape[1:]
    return _weighted_adjoints(chain, objective, p)[0].reshape(shape)
