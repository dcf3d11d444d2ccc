"""The one VJP engine: the model evaluated through ``torch.func.functional_call``.

Every estimator evaluates the model and its vector-Jacobian products through a
:class:`VelocityField`; none calls the model or autograd itself. That keeps three
things in one place: which parameters are differentiated (``requires_grad=True`` only),
how conditioning is repeated when several states are stacked into one batched call, and
the :class:`~gradest.protocol.Cost` bookkeeping, which is therefore exact by construction.

Batched calls stack ``M`` states of batch ``B`` along the batch dimension (one model
call on ``M*B`` rows), which assumes the model treats rows independently, as diffusion
transformers and MLPs do (no batch norm in training mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.func import functional_call
from torch.func import vjp as _torch_vjp

from gradest._checks import check_model_output, first_model_call, trainable_parameters
from gradest.flow import affine_step
from gradest.nonfinite import check_finite

Grads = dict[str, Tensor]

# torch.func.vjp's annotations do not distinguish has_aux=True (three results) from the
# default (two); typed loosely here rather than silenced at every call.
vjp: Callable[..., Any] = _torch_vjp

# Every pullback here is called once and its result is detached: do not build a
# second-order graph (torch.func follows grad mode by default, which costs ~20% of a
# backward) and free the saved activations as soon as the backward has run.
_ONE_SHOT = {"retain_graph": False, "create_graph": False}


@attrs.define
class CostMeter:
    """Mutable counters behind :class:`gradest.protocol.Cost`; one per estimate call."""

    forwards_with_graph: int = 0
    forwards_without_graph: int = 0
    param_vjps: int = 0
    state_vjps: int = 0

    def freeze(self) -> Any:
        from gradest.protocol import Cost

        return Cost(**attrs.asdict(self))


def add_grads(total: Grads | None, extra: Grads) -> Grads:
    """Accumulate ``extra`` into ``total`` (None for "nothing yet") and return it.

    The first term is copied once into a buffer the caller owns; later terms are added
    in place, so summing ``N`` per-step gradients allocates one buffer, not ``N``.
    """
    if total is None:
        return {name: g.clone() for name, g in extra.items()}
    for name, g in extra.items():
        total[name].add_(g)
    return total


def scale_grads(grads: Grads, factor: float) -> Grads:
    return {name: g * factor for name, g in grads.items()}


class VelocityField:
    """``v_theta(z, t, **cond)`` as a function of the trainable parameters.

    Args:
        model: the velocity model, called as ``model(z, t, **cond)``.
        cond: keyword arguments for every call; tensors whose first dimension is the
            batch size are repeated when ``M`` states are stacked into one call.
        batch_size: ``B``, the number of samples in one state.
        meter: where calls are counted.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cond: Mapping[str, Any],
        batch_size: int,
        meter: CostMeter,
    ):
        self.model = model
        self.params: Grads = {n: p.detach() for n, p in trainable_parameters(model).items()}
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        frozen.update(dict(model.named_buffers()))
        self.frozen = frozen
        self.cond = dict(cond)
        self.batch_size = batch_size
        self.meter = meter
        self._checked_output = False

    # -- plumbing -------------------------------------------------------------------------

    def _stacked_cond(self, copies: int) -> dict[str, Any]:
        if copies == 1:
            return self.cond
        return {
            key: torch.cat([value] * copies)
            if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == self.batch_size
            else value
            for key, value in self.cond.items()
        }

    def _times(self, times: Sequence[float] | Tensor, like: Tensor) -> Tensor:
        """Per-row model times for ``len(times)`` stacked states of batch ``B``."""
        t = torch.as_tensor(times, dtype=like.dtype).reshape(-1).to(like.device)
        return t.repeat_interleave(self.batch_size)

    def call(self, params: Grads, z: Tensor, t: Tensor) -> Tensor:
        """Functional model call on ``z`` of ``M*B`` rows with per-row times ``t``."""
        copies = z.shape[0] // self.batch_size
        if not self._checked_output:
            # First call of an estimate: turn shape mismatches into a readable error.
            self._checked_output = True
            return first_model_call(
                lambda z_, t_, **c: functional_call(self.model, (params, self.frozen), (z_, t_), c),
                z,
                t,
                self._stacked_cond(copies),
            )
        return functional_call(
            self.model, (params, self.frozen), (z, t), self._stacked_cond(copies)
        )

    @staticmethod
    def _stack(states: Tensor) -> Tensor:
        """``[M, B, ...] -> [M*B, ...]``."""
        return states.reshape(-1, *states.shape[2:])

    # -- evaluations ----------------------------------------------------------------------

    def velocity(self, z: Tensor, t: float | Tensor) -> Tensor:
        """``v(z, t)`` without a graph (one forward)."""
        self.meter.forwards_without_graph += 1
        with torch.no_grad():
            v = self.call(self.params, z, self._times([float(t)], z))
        check_finite(v, "velocity", [float(t)])
        return v

    def state_vjp(self, z: Tensor, t: float | Tensor, cotangent: Tensor) -> tuple[Tensor, Tensor]:
        """``(v, (dv/dz)^T cotangent)``: a forward with graph in ``z`` only, no parameter part."""
        times = self._times([float(t)], z)
        v, pullback = vjp(lambda z_: self.call(self.params, z_, times), z)
        check_finite(v, "velocity", [float(t)])
        (z_grad,) = pullback(cotangent, **_ONE_SHOT)
        check_finite(z_grad, "state gradient", [float(t)])
        self.meter.forwards_with_graph += 1
        self.meter.state_vjps += 1
        return v, z_grad

    def joint_vjp(
        self, z: Tensor, t: float | Tensor, cotangent: Tensor
    ) -> tuple[Tensor, Tensor, Grads]:
        """``(v, (dv/dz)^T c, J^T c)``: one forward with graph and one full VJP."""
        times = self._times([float(t)], z)
        v, pullback = vjp(lambda p, z_: self.call(p, z_, times), self.params, z)
        check_finite(v, "velocity", [float(t)])
        grads, z_grad = pullback(cotangent, **_ONE_SHOT)
        check_finite(z_grad, "state gradient", [float(t)])
        check_finite(grads, "parameter gradient", [float(t)])
        self.meter.forwards_with_graph += 1
        self.meter.param_vjps += 1
        return v, z_grad, grads

    def param_pullback(
        self, states: Tensor, times: Sequence[float] | Tensor
    ) -> tuple[Tensor, Callable[[Tensor], Grads]]:
        """Forward ``M`` stacked states with a graph now; pull parameter cotangents later.

        Args:
            states: ``[M, B, ...]``.
            times: ``M`` times.

        Returns:
            ``(velocities [M, B, ...], pullback)`` where ``pullback(cotangents [M, B, ...])``
            returns ``sum_j J_j^T cotangents_j`` as one batched VJP. Holding the pullback
            holds the ``M`` graphs until it is called; it can be called once.
        """
        count = states.shape[0]
        z = self._stack(states)
        row_times = self._times(times, z)
        v, pullback = vjp(lambda p: self.call(p, z, row_times), self.params)
        self.meter.forwards_with_graph += count
        step_times = [float(t) for t in torch.as_tensor(times).reshape(-1)]
        check_finite(v.reshape(states.shape), "velocity", step_times)

        def pull(cotangents: Tensor) -> Grads:
            if cotangents.shape != states.shape:
                raise ValueError(
                    f"cotangents shape {tuple(cotangents.shape)} != states {tuple(states.shape)}"
                )
            self.meter.param_vjps += count
            (grads,) = pullback(self._stack(cotangents), **_ONE_SHOT)
            check_finite(grads, "parameter gradient", step_times)
            return grads

        return v.reshape(states.shape), pull

    def param_vjp(
        self, states: Tensor, times: Sequence[float] | Tensor, cotangents: Tensor
    ) -> Grads:
        """``sum_j J(z_j, t_j)^T c_j`` over ``M`` stacked states in one batched VJP."""
        _, pull = self.param_pullback(states, times)
        return pull(cotangents)

    def chain_vjp(
        self,
        coefficients: tuple[Tensor, Tensor, Tensor],
        times: Tensor,
        start: int,
        z_start: Tensor,
        step_noise: Tensor | None,
        terminal_loss: Callable[[Tensor], Tensor],
        *,
        state_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Grads, Tensor | None]:
        """Fused VJP of ``terminal_loss(z_N)`` through steps ``start..N-1`` (graph kept).

        Returns:
            ``(loss, states [N-start+1, B, ...], velocities [N-start, B, ...],
            parameter grads, grad w.r.t. z_start or None)``.
        """
        num_steps = times.numel() - 1

        def run(params: Grads, z: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
            states, velocities = [z], []
            for k in range(start, num_steps):
                v = self.call(params, z, self._times([float(times[k])], z))
                if k == start:
                    check_model_output(v, z)
                check_finite(v, "velocity", [float(times[k])])
                velocities.append(v)
                z = affine_step(coefficients, k, z, v, step_noise)
                states.append(z)
            return terminal_loss(z), (torch.stack(states), torch.stack(velocities))

        if state_grad:
            loss, pullback, (states, velocities) = vjp(run, self.params, z_start, has_aux=True)
            grads, z_grad = pullback(torch.ones_like(loss), **_ONE_SHOT)
        else:
            loss, pullback, (states, velocities) = vjp(
                lambda p: run(p, z_start), self.params, has_aux=True
            )
            (grads,) = pullback(torch.ones_like(loss), **_ONE_SHOT)
            z_grad = None
        chain_times = [float(t) for t in times[start:num_steps]]
        check_finite(grads, "parameter gradient", chain_times)
        if z_grad is not None:
            check_finite(z_grad, "state gradient", chain_times)
        steps = num_steps - start
        self.meter.forwards_with_graph += steps
        self.meter.param_vjps += steps
        return loss.detach(), states.detach(), velocities.detach(), grads, z_grad
