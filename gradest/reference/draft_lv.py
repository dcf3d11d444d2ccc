"""The ``draft_lv`` estimator's definition, densely, at the copies' own states.

    z^(i)   = noised(z_N, N-1, eps_i)                          (the sampler's interpolant;
                                                               rectified flow:
                                                               t_{N-1} eps_i + (1 - t_{N-1}) z_N)
    z_N^(i) = alpha_{N-1} z^(i) + beta_{N-1} v(z^(i)) + r       (r: the recorded last step's
                                                               noise term, zero for an ODE)
    g_lv    = (1/n) sum_i J(z^(i))^T (beta_{N-1} grad l(z_N^(i))),   noise gradient 0

``v`` and ``J`` at the new states come from ``DenseChain.evaluate`` (``jacrev``); ``r`` is
recovered from the recorded step, ``z_N - alpha z_{N-1} - beta v_{N-1}``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, loss_gradient
from gradest.samplers import require_interpolant


def draft_lv_definition(
    chain: DenseChain, objective: Objective, renoise: Tensor
) -> tuple[Tensor, Tensor]:
    """``(flat [P] gradient, zero noise gradient)`` of DRaFT-LV with copies' noise ``renoise``."""
    if not isinstance(objective, TerminalObjective):
        raise InvalidValue("draft_lv is defined for terminal objectives only")
    sampler = require_interpolant(chain.sampler, "draft_lv")
    states = chain.trajectory.states.to(torch.float64)
    shape = states.shape[1:]
    last = chain.num_steps - 1
    t = float(chain.trajectory.times[last])
    alpha, beta = float(chain.alpha[last]), float(chain.beta[last])
    recorded_noise_term = (
        states[-1] - alpha * states[last] - beta * chain.velocities[last].reshape(shape)
    )
    total = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    copies = renoise.shape[0]
    for eps in renoise.to(torch.float64):
        state = sampler.noised(states[-1], last, eps)
        velocity, jacobian, _ = chain.evaluate(state, t)
        final = alpha * state + beta * velocity.reshape(shape) + recorded_noise_term
        total = total + jacobian.T @ (beta * loss_gradient(final, objective)) / copies
    return total, torch.zeros(shape, dtype=torch.float64)
