"""The ``adjoint`` estimator's definition, densely: the exact recursion along rebuilt states.

From the recorded end ``z_N`` alone, for ``k = N-1 .. 0``::

    w_0 = z^_{k+1},   w_i = (z^_{k+1} - beta_k v(w_{i-1}, t_k)) / alpha_k  (i = 1..order)
    z^_k = w_order
    g   += J(z^_k, t_k)^T (beta_k a_{k+1})
    a_k  = alpha_k a_{k+1} + beta_k A(z^_k, t_k)^T a_{k+1}

with ``a_N = grad l(z_N)``; the noise gradient is ``a_0``. ``solver="backsolve"`` (Euler
samplers, ``alpha_k = 1``) is the explicit Euler step of the augmented ODE backwards, every
term at the later state and time, as torchdiffeq's ``odeint_adjoint(method="euler")``::

    g   += J(z^_{k+1}, t_{k+1})^T (beta_k a_{k+1})
    a_k  = a_{k+1} + beta_k A(z^_{k+1}, t_{k+1})^T a_{k+1}
    z^_k = z^_{k+1} - beta_k v(z^_{k+1}, t_{k+1})

Every ``v``, ``J`` and ``A`` comes from the dense chain's ``evaluate`` (``jacrev``, float64)
at the rebuilt states, not from the VJP engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.reference.dense import DenseChain, loss_gradient

#: How the states are rebuilt: the sampler's step inverted, or the Euler backsolve.
SOLVERS = ("inverse", "backsolve")


def _deterministic_times(chain: DenseChain) -> Tensor:
    """The chain's time grid, after refusing a sampler whose steps add noise."""
    if chain.sampler is None:
        return chain.trajectory.times
    if bool((chain.sampler.coefficients()[2] != 0).any()):
        raise InvalidValue("adjoint is defined for deterministic samplers (sigma_k = 0) only")
    return chain.sampler.times


def adjoint_reconstruction(chain: DenseChain, order: int) -> Tensor:
    """The states ``z^_0 .. z^_N`` rebuilt from the recorded ``z_N`` by ``order``
    fixed-point iterations of each step's inversion (``[N+1, ...]``, float64)."""
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise InvalidValue(f"order must be an int >= 1, got {order!r}")
    times = _deterministic_times(chain)
    shape = chain.trajectory.states.shape[1:]
    states = [chain.trajectory.states[-1].to(torch.float64)]
    for k in reversed(range(chain.num_steps)):
        later, alpha, beta = states[0], float(chain.alpha[k]), float(chain.beta[k])
        guess = later
        for _ in range(order):
            velocity = chain.evaluate(guess, float(times[k]))[0].reshape(shape)
            guess = (later - beta * velocity) / alpha
        states.insert(0, guess)
    return torch.stack(states)


def adjoint_definition(
    chain: DenseChain, objective: Objective, order: int, solver: str = "inverse"
) -> tuple[Tensor, Tensor]:
    """``(flat [P] gradient, noise gradient)`` of the continuous adjoint at ``order``
    (``solver="inverse"``) or of the Euler backsolve (``solver="backsolve"``)."""
    if not isinstance(objective, TerminalObjective):
        raise InvalidValue("adjoint is defined for terminal objectives only")
    if solver not in SOLVERS:
        raise InvalidValue(f"solver must be one of {SOLVERS}, got {solver!r}")
    if solver == "backsolve":
        return _backsolve_definition(chain, objective)
    states = adjoint_reconstruction(chain, order)
    shape = states.shape[1:]
    times = _deterministic_times(chain)
    adjoint = loss_gradient(states[-1], objective)
    grad = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    for k in reversed(range(chain.num_steps)):
        _, param_jacobian, state_jacobian = chain.evaluate(states[k], float(times[k]))
        grad = grad + param_jacobian.T @ (chain.beta[k] * adjoint)
        adjoint = chain.alpha[k] * adjoint + chain.beta[k] * state_jacobian.T @ adjoint
    return grad, adjoint.reshape(shape)


def _backsolve_definition(chain: DenseChain, objective: TerminalObjective) -> tuple[Tensor, Tensor]:
    """The Euler backsolve: every term at the later state and time (module doc)."""
    if bool((chain.alpha != 1).any()):
        raise InvalidValue("the adjoint's backsolve is defined for Euler samplers (alpha_k = 1)")
    times = _deterministic_times(chain)
    shape = chain.trajectory.states.shape[1:]
    state = chain.trajectory.states[-1].to(torch.float64)
    adjoint = loss_gradient(state, objective)
    grad = torch.zeros(chain.param_jacobians.shape[-1], dtype=torch.float64)
    for k in reversed(range(chain.num_steps)):
        velocity, param_jacobian, state_jacobian = chain.evaluate(state, float(times[k + 1]))
        grad = grad + param_jacobian.T @ (chain.beta[k] * adjoint)
        adjoint = adjoint + chain.beta[k] * state_jacobian.T @ adjoint
        state = state - chain.beta[k] * velocity.reshape(shape)
    return grad, adjoint.reshape(shape)
