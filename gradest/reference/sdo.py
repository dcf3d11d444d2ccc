"""The ``sdo`` estimator's definition, computed densely and independently of its code path.

With the dense Jacobians of :class:`~gradest.reference.dense.DenseChain`:

    one-step cotangents  c~_k = beta_k (prod_{j>k} alpha_j) a_N    (terminal)
                         c~_k = c_k = d l_k / d v_k                (stepwise)
    sdo(S, s)            = s * sum_{k in S} J_k^T c~_k
    full sum             = sum_{k=0}^{N-1} J_k^T c~_k             (= E[sdo] at s = N/|S|)
    noise gradient       = (prod_{j>0} alpha_j)(alpha_0 I + beta_0 A_0)^T a_N

``a_N`` comes from autograd on the loss at the recorded final state; the products of
``alpha`` are formed term by term here, sharing no code with
:mod:`gradest.strategies.sdo`. Take ``S`` and ``s`` from a result's
``info["sampled_steps"]`` and ``info["scale"]`` to check a run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, exact_cotangents, terminal_adjoints


def _final_adjoint(chain: DenseChain, objective: TerminalObjective) -> Tensor:
    return terminal_adjoints(chain, objective)[-1]


def one_step_cotangents(chain: DenseChain, objective: Objective) -> Tensor:
    """``c~_k`` for every step (``[N, D]``): the model-detached chain's cotangents."""
    if not isinstance(objective, TerminalObjective):
        return exact_cotangents(chain, objective)
    a_final = _final_adjoint(chain, objective)
    rows = []
    for k in range(chain.num_steps):
        weight = chain.beta[k]
        for j in range(k + 1, chain.num_steps):
            weight = weight * chain.alpha[j]
        rows.append(weight * a_final)
    return torch.stack(rows)


def sdo_definition(
    chain: DenseChain,
    objective: Objective,
    sampled_steps: Iterable[int],
    scale_factor: float,
) -> Tensor:
    """``scale_factor * sum_{k in sampled_steps} J_k^T c~_k`` as a flat ``[P]`` vector."""
    steps = list(sampled_steps)
    if len(set(steps)) != len(steps) or not all(0 <= k < chain.num_steps for k in steps):
        raise InvalidValue(
            f"sampled_steps must be distinct steps in 0..{chain.num_steps - 1}, got {steps}"
        )
    return scale_factor * chain.gradient(one_step_cotangents(chain, objective), steps=steps)


def sdo_full_sum_definition(chain: DenseChain, objective: Objective) -> Tensor:
    """The one-step sum over all steps (flat ``[P]``): the expectation of unbiased ``sdo``."""
    return sdo_definition(chain, objective, range(chain.num_steps), 1.0)


def sdo_noise_grad_definition(chain: DenseChain, objective: Objective) -> Tensor | None:
    """``(prod_{j>0} alpha_j)(alpha_0 a_N + beta_0 A_0^T a_N)``, shaped like the noise
    (None for a stepwise objective: its loss does not depend on the noise)."""
    if not isinstance(objective, TerminalObjective):
        return None
    a_final = _final_adjoint(chain, objective)
    through_first = chain.alpha[0] * a_final + chain.beta[0] * chain.state_jacobians[0].T @ a_final
    for j in range(1, chain.num_steps):
        through_first = chain.alpha[j] * through_first
    return through_first.reshape(chain.trajectory.states.shape[1:])
