"""``adjoint``: the continuous adjoint (AdjointDPM): no trajectory kept, states rebuilt backwards.

Cotangents: the exact adjoint's recursion, evaluated along *reconstructed* states. VJP
evaluation: one joint state-and-parameter VJP per step. Memory: one state, its adjoint and
one step's graph at a time, whatever ``N`` (no state of the path is stored). (The record:
``Adjoint.axes``, :class:`gradest.axes.EstimatorAxes`.)

Only ``z_N`` is kept from sampling (or taken from a recorded trajectory's last state).
For ``k = N-1 .. 0`` the state ``z_k`` is rebuilt by inverting the deterministic affine step
``z_{k+1} = alpha_k z_k + beta_k v(z_k, t_k)``, whose exact inverse
``z_k = (z_{k+1} - beta_k v(z_k, t_k)) / alpha_k`` is implicit in ``z_k``. It is solved by
``order`` fixed-point iterations started at the later state::

    w_0 = z^_{k+1}
    w_i = (z^_{k+1} - beta_k v(w_{i-1}, t_k)) / alpha_k,     i = 1 .. order
    z^_k = w_order

``order=1`` is the reverse Euler step with the step's own time at the later state. Each
iteration shrinks the error of the step's inversion by a factor ``|beta_k| L / alpha_k =
O(h)`` (``L`` the Lipschitz constant of ``v`` in ``z``), so one reverse step errs by
``O(h^(order+1))`` and the rebuilt path, and with it the gradient, by ``O(h^order)`` over
the whole chain. Along the rebuilt states the recursion of ``exact`` runs::

    a_N = grad l(z_N)
    g  += J(z^_k, t_k)^T (beta_k a_{k+1})
    a_k = alpha_k a_{k+1} + beta_k (dv/dz at z^_k, t_k)^T a_{k+1}

and the noise gradient is ``a_0``. Where ``v`` does not depend on ``z`` the inversion is
exact and so is the gradient. ``info["reconstruction_error"]`` is
``||z^_0 - z_0|| / ||z_0||`` (the noise, or the recorded first state).

``solver="backsolve"`` is torchdiffeq's ``odeint_adjoint`` with ``method="euler"`` (and
diffrax's ``BacksolveAdjoint`` with ``Euler``) on the sampler's grid, for Euler samplers
(``alpha_k = 1``): the augmented ODE is integrated backwards by explicit Euler steps, each
evaluated at the later state and the later time::

    g   += J(z^_{k+1}, t_{k+1})^T (beta_k a_{k+1})
    a_k  = a_{k+1} + beta_k (dv/dz at z^_{k+1}, t_{k+1})^T a_{k+1}
    z^_k = z^_{k+1} - beta_k v(z^_{k+1}, t_{k+1})

One joint VJP per step gives all three (``4NF`` with sampling, ``exact:checkpoint=true``'s
cost), but the reverse step does not invert the forward one even where ``v`` ignores ``z``
(it reads ``v`` at the later time): its error against ``exact`` is ``O(h)`` whatever the
model, and ``order`` does not apply.

Deterministic samplers only (``sigma_k = 0`` at every step: rectified-flow Euler, DDIM
with ``eta = 0``): a stochastic step's noise would have to be stored, which is what this
estimator exists not to do; ``exact:checkpoint=true`` is the choice there. Terminal
objectives only.

``surrogate()`` computes the estimate in the call and returns
:func:`gradest.plugin.estimated_surrogate`'s loss ``sum_p <p, g_p>``: a surrogate whose
backward re-ran the sweep would have to keep the states the sweep rebuilds, or rebuild them
in the caller's backward, where DDP and hooks expect the model's own graph. The backward
then only writes ``.grad`` (DDP averages it; sharded FSDP parameters are not supported).

Cost (docs/design.md#cost-formulas, row ``adjoint``): from noise ``N`` forwards without a
graph to reach ``z_N``, then per step ``order`` forwards without a graph for the
reconstruction and one forward with graph and a joint VJP: ``N(F + order F + 3F)``, one
forward per step more than ``exact:checkpoint=true`` at ``order=1``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase, estimated_surrogate
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.options import choice_option, int_option
from gradest.protocol import Definition
from gradest.reference.adjoint import SOLVERS, adjoint_definition
from gradest.reference.dense import DenseChain
from gradest.symbolic import host_value
from gradest.trajectory import affine_step
from gradest.vjp import ParamGradient, add_grads


def check_invertible_steps(coefficients: tuple[Any, Any, Any], estimator: str = "adjoint") -> None:
    """Refuse a sampler whose steps cannot be inverted without stored data: a step with
    noise (``sigma_k != 0``) or one that forgets its input (``alpha_k == 0``)."""
    alpha, _, sigma = coefficients
    for k, (scale, noise_scale) in enumerate(zip(alpha, sigma, strict=True)):
        if float(noise_scale) != 0.0:
            raise InvalidValue(
                f"{estimator} rebuilds the states by inverting deterministic steps, but the "
                f"sampler's step {k} adds noise (sigma_{k} = {float(noise_scale):g}); use "
                f"exact:checkpoint=true on stochastic samplers (it stores the N states)"
            )
        if float(scale) == 0.0:
            raise InvalidValue(
                f"{estimator} cannot invert the sampler's step {k}: alpha_{k} = 0 (the step "
                f"discards its input state); use exact:checkpoint=true on this sampler"
            )


def check_euler_steps(coefficients: tuple[Any, Any, Any], estimator: str = "adjoint") -> None:
    """Refuse a backsolve on a sampler whose steps are not Euler steps of an ODE
    (``alpha_k != 1``: DDIM and other affine steps)."""
    for k, scale in enumerate(coefficients[0]):
        if float(scale) != 1.0:
            raise InvalidValue(
                f"{estimator}: solver='backsolve' integrates dz/dt = v backwards by Euler "
                f"steps, but the sampler's step {k} is not one (alpha_{k} = {float(scale):g}, "
                f"not 1: DDIM or another affine step); use solver=inverse, which inverts any "
                f"deterministic affine step"
            )


@attrs.frozen
class Adjoint(EstimatorBase):
    """Continuous adjoint: the exact recursion along states rebuilt by reverse steps.

    Preferred when memory is what limits the chain: very long chains or large latents
    (video), where even the ``N`` states that ``exact:checkpoint=true`` keeps do not fit;
    it keeps one state at a time. Not recommended for trained models with curved paths,
    where the rebuilt states drift from the sampled ones (its error against
    ``exact`` is ``O(h^order)``; ``info["reconstruction_error"]`` shows it), and
    ``exact:checkpoint=true`` is exact at about the same cost.

    Source: AdjointDPM (Pan, Liew, Tan, Feng, Yan, "AdjointDPM: Adjoint Sensitivity Method
    for Gradient Backpropagation of Diffusion Probabilistic Models", ICLR 2024,
    arXiv 2307.10711); the adjoint sensitivity method of neural ODEs (Chen, Rubanova,
    Bettencourt, Duvenaud, NeurIPS 2018, arXiv 1806.07366), torchdiffeq's
    ``odeint_adjoint`` and diffrax's ``BacksolveAdjoint``.

    Attributes:
        order: velocity evaluations per reverse step (fixed-point iterations of the step's
            inversion); the rebuilt states, and the gradient, err by ``O(h^order)``.
        solver: ``"inverse"`` (default): invert the sampler's own step; ``"backsolve"``:
            torchdiffeq's ``odeint_adjoint(method="euler")`` on the sampler's grid, one joint
            VJP per step at the later state and time (Euler samplers; ``O(h)``).
    """

    name: ClassVar[str] = "adjoint"
    objectives: ClassVar[tuple[str, ...]] = ("terminal",)
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("adjoint:order=2", "adjoint:solver=backsolve")
    compare_specs: ClassVar[tuple[str, ...]] = ("adjoint", "adjoint:order=2")
    cost_specs: ClassVar[tuple[str, ...]] = ("adjoint",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="exact adjoint recursion along states rebuilt by reverse steps",
        evaluation="one joint VJP per step at the rebuilt state",
        memory="one state and one step's graph at a time: no state of the path is kept",
    )

    order: int = int_option(
        1,
        minimum=1,
        doc="velocity evaluations per reverse step (reconstruction error O(h^order))",
    )
    solver: str = choice_option(
        "inverse",
        SOLVERS,
        doc="'inverse': invert the sampler's step by fixed-point iterations; 'backsolve': "
        "torchdiffeq's Euler backsolve (Euler samplers, one joint VJP per step, O(h))",
    )

    def __attrs_post_init__(self) -> None:
        if self.solver == "backsolve" and self.order != 1:
            raise InvalidValue(
                f"adjoint: order={self.order} needs solver='inverse' (order counts the "
                f"fixed-point iterations of the inversion; the backsolve is one Euler step "
                f"per sampler step); drop order or use solver=inverse"
            )

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        check_invertible_steps(ctx.host_coefficients, repr(self))
        if self.solver == "backsolve":
            check_euler_steps(ctx.host_coefficients, repr(self))
        alpha, beta, _ = ctx.host_coefficients
        times = ctx.host_times
        first, final = self._ends(ctx)
        assert isinstance(ctx.objective, TerminalObjective)
        loss, adjoint = ctx.objective.terminal_adjoint(final)
        ctx.info["loss"] = host_value(loss)
        state = final
        grads: ParamGradient | None = None
        for k in reversed(range(ctx.num_steps)):
            cotangent = beta[k] * adjoint
            if self.solver == "backsolve":
                # One joint VJP at the later state and time serves the adjoint, the
                # parameter term and the reverse Euler step of the state.
                velocity, state_grad, step_grads = ctx.field.joint_vjp(
                    state, times[k + 1], cotangent
                )
                state = state - beta[k] * velocity
            else:
                state = self._reverse_step(ctx, k, state)
                _, state_grad, step_grads = ctx.field.joint_vjp(state, times[k], cotangent)
            grads = add_grads(grads, step_grads)
            # alpha = 1 (Euler) skips a multiply; adjoint * 1.0 == adjoint exactly.
            adjoint = (adjoint if alpha[k] == 1.0 else alpha[k] * adjoint) + state_grad
        assert grads is not None
        ctx.info["reconstruction_error"] = host_value(
            (state - first).norm() / first.norm().clamp_min(torch.finfo(first.dtype).tiny)
        )
        return grads, adjoint if ctx.want_noise_grad else None

    def _ends(self, ctx: EstimationContext) -> tuple[Tensor, Tensor]:
        """``(z_0, z_N)``: the noise and the sampled end (only the current state is kept
        while sampling), or the recorded trajectory's first and last states."""
        if ctx.noise is None:
            states = ctx.trajectory().states
            return states[0], states[-1]
        first = ctx.noise.detach()
        state = first
        for k in range(ctx.num_steps):
            velocity = ctx.field.velocity(state, ctx.host_times[k])
            state = affine_step(ctx.host_coefficients, k, state, velocity, None)
        return first, state

    def _reverse_step(self, ctx: EstimationContext, k: int, later: Tensor) -> Tensor:
        """``z^_k`` from ``z^_{k+1}``: ``order`` fixed-point iterations of the inversion."""
        alpha, beta = ctx.host_coefficients[0][k], ctx.host_coefficients[1][k]
        guess = later
        for _ in range(self.order):
            velocity = ctx.field.velocity(guess, ctx.host_times[k])
            guess = later - beta * velocity
            if alpha != 1.0:
                guess = guess / alpha
        return guess

    def _whole_call(
        self,
        model: torch.nn.Module,
        sampler: Any,
        objective: Objective,
        inputs: dict[str, Any],
        *,
        engine: str,
        surrogate: bool,
    ) -> Any:
        if not surrogate:
            return None
        # The gradient is computed now and handed to autograd as sum_p <p, g_p> (module
        # doc): a loss whose backward reran the sweep would keep or rebuild the states.
        with torch.enable_grad():
            return estimated_surrogate(self, model, sampler, objective, engine=engine, **inputs)

    # -- the contract -----------------------------------------------------------------------

    # No expected_decisions: it makes no choices, and gradest check expects the empty
    # record of an estimator whose hooks record none (EstimatorBase's default).

    def definition(self, chain: DenseChain, objective: Objective, decisions: Any) -> Definition:
        """The recursion along the densely rebuilt states (``order``, ``solver``)."""
        del decisions
        return Definition(*adjoint_definition(chain, objective, self.order, self.solver))
