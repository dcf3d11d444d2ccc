"""The ``refl`` estimator's definition, densely: one step's Jacobian at the jump's cotangent.

    z^     = a_s z_s + b_s v_s          (the sampler's one-step prediction of z_N,
                                         (a_s, b_s) = sampler.jump_to_end(s); rectified
                                         flow: (1, t_N - t_s))
    g_refl = J_s^T (b_s grad l(z^)),     noise gradient 0 (the chain is cut at s)

with ``v_s`` and ``J_s`` from the dense chain at the recorded state ``z_s``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, loss_gradient
from gradest.samplers import require_interpolant


def refl_definition(chain: DenseChain, objective: Objective, step: int) -> tuple[Tensor, Tensor]:
    """``(flat [P] gradient, zero noise gradient)`` of ReFL stopped at ``step``."""
    if not isinstance(objective, TerminalObjective):
        raise InvalidValue("refl is defined for terminal objectives only")
    if not 0 <= step < chain.num_steps:
        raise InvalidValue(f"step must be in 0..{chain.num_steps - 1}, got {step}")
    scale, jump = require_interpolant(chain.sampler, "refl").jump_to_end(step)
    shape = chain.trajectory.states.shape[1:]
    state = chain.trajectory.states[step].to(torch.float64)
    predicted = scale * state + jump * chain.velocities[step].reshape(shape)
    grad = chain.param_jacobians[step].T @ (jump * loss_gradient(predicted, objective))
    return grad, torch.zeros(shape, dtype=torch.float64)
