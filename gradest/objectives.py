"""Objectives on sampling trajectories: a loss on the final sample, or a loss on every step.

Both kinds reduce, for an estimator, to cotangents on the model outputs
(docs/design.md#notation): the terminal objective supplies ``a_N = grad l(z_N)`` that the
adjoint carries back through the chain; the stepwise objective supplies ``c_k = d l_k / d v_k``
directly, with the recorded states treated as data.

Losses are differentiated with autograd on a detached leaf, so any ordinary torch code
works as a loss function; the model itself is only ever differentiated by the VJP
engine in :mod:`gradest.vjp`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import Tensor

from gradest._checks import check_scalar_loss
from gradest.errors import InvalidType, InvalidValue
from gradest.nonfinite import NonFiniteError, defer_finite
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory


def _loss_and_grad(
    fn: Callable[[Tensor], Tensor], x: Tensor, where: str
) -> tuple[Tensor, Tensor, bool]:
    """``(loss, d loss / d x, whether the loss depends on x at all)``."""
    leaf = x.detach()
    if leaf.untyped_storage().nbytes() > leaf.numel() * leaf.element_size():
        # x is a view of the trajectory's [N+1, B, ...] buffer: tensors the loss saves
        # would keep the whole buffer in its graph (and count as N+1 samples' bytes); the
        # loss gets the sample alone, as a hand-written loop gives it.
        leaf = leaf.clone()
    leaf.requires_grad_(True)
    with torch.enable_grad():
        try:
            value = fn(leaf)
        except RuntimeError as err:
            if "in-place" not in str(err):
                raise
            # An in-place op on the argument (z.mul_(2), v.clamp_(...)), which autograd
            # refuses on a leaf: the loss gets a copy, so it is differentiated like its
            # out-of-place form and never changes the recorded path. (Only then: a copy
            # for every loss would be retained activations for nothing.)
            leaf = x.detach().requires_grad_(True)
            value = fn(leaf.clone())
        loss = check_scalar_loss(value, where)
        if not loss.requires_grad:
            return loss.detach(), torch.zeros_like(x), False
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if grad is None:
        return loss.detach(), torch.zeros_like(x), False
    defer_finite(grad, lambda _: NonFiniteError(f"gradient of the loss {where}"))
    return loss.detach(), grad, True


def _check_callable(value: object, usage: str) -> None:
    if not callable(value):
        raise InvalidType(
            f"loss_fn must be a function called as {usage}, got {type(value).__name__} {value!r}"
        )


@attrs.frozen
class TerminalObjective:
    """``L = loss_fn(z_N)``: a loss on the final sample (use ``-reward`` to maximise a reward).

    Attributes:
        loss_fn: ``loss_fn(z_final) -> scalar tensor``; must be differentiable in ``z_final``.
    """

    loss_fn: Callable[[Tensor], Tensor] = attrs.field(
        validator=lambda _, __, value: _check_callable(value, "loss_fn(z_final) -> scalar loss")
    )

    def loss(self, final_state: Tensor) -> Tensor:
        """The loss inside a differentiable computation (checked to be a finite scalar)."""
        return check_scalar_loss(self.loss_fn(final_state), "on the final sample")

    def terminal_adjoint(self, final_state: Tensor) -> tuple[Tensor, Tensor]:
        """``(L, a_N)`` with ``a_N = grad loss_fn(z_N)``.

        Raises:
            ValueError: the loss does not depend on the final sample (detached, an
                integer/bool result, or computed from something else), where autograd
                would raise too; a silent all-zero gradient would train nothing.
        """
        loss, adjoint, depends = _loss_and_grad(self.loss_fn, final_state, "on the final sample")
        if not depends:
            raise InvalidValue(
                "the loss on the final sample does not depend on it (loss_fn returned a "
                "tensor detached from z_final, an integer/bool result, or one computed from "
                "something else), so every estimator's gradient would be zero; return a "
                "differentiable function of z_final, e.g. -reward(z_final).mean() (autograd "
                "refuses the same loss: 'element 0 of tensors does not require grad')"
            )
        return loss, adjoint


@attrs.frozen
class StepwiseObjective:
    """``L = sum_k loss_fn(k, v_k, trajectory)`` on recorded states treated as data.

    This is the shape of GRPO / policy-gradient surrogates and of flow matching.

    Attributes:
        loss_fn: ``loss_fn(k, v_k, trajectory) -> scalar tensor``, differentiable in ``v_k``.
    """

    loss_fn: Callable[[int, Tensor, Trajectory], Tensor] = attrs.field(
        validator=lambda _, __, value: _check_callable(
            value, "loss_fn(k, v_k, trajectory) -> scalar loss"
        )
    )

    def step_cotangent(
        self, k: int, velocity: Tensor, trajectory: Trajectory
    ) -> tuple[Tensor, Tensor]:
        """``(l_k, c_k)`` with ``c_k = d l_k / d v_k`` at the given velocity."""
        loss, cotangent, _ = self.evaluate_step(k, velocity, trajectory)
        return loss, cotangent

    def evaluate_step(
        self, k: int, velocity: Tensor, trajectory: Trajectory
    ) -> tuple[Tensor, Tensor, bool]:
        """``(l_k, c_k, depends)``; ``depends`` is False when ``l_k`` ignores ``v_k`` (``c_k = 0``).

        An estimate in which no evaluated step's loss depends on its velocity is refused
        by the estimator, as autograd refuses the summed loss.
        """
        return _loss_and_grad(lambda v: self.loss_fn(k, v, trajectory), velocity, f"at step {k}")

    def depends_at_some_step(self, trajectory: Trajectory) -> bool:
        """Whether some step's loss depends on its velocity, at the recorded velocities.

        A stochastic estimator whose draw missed every step the loss uses returns a zero
        estimate (the right one for that draw); only a loss that depends on no step's
        velocity at all is refused. Evaluates ``loss_fn`` (no model call) until a step
        depends.
        """
        for k in range(trajectory.num_steps):
            velocity = trajectory.velocities[k].detach()
            leaf = velocity.clone().requires_grad_(True)
            with torch.enable_grad():
                loss = self.loss_fn(k, leaf, trajectory)
                if isinstance(loss, Tensor) and loss.requires_grad:
                    (grad,) = torch.autograd.grad(loss.sum(), leaf, allow_unused=True)
                    if grad is not None:
                        return True
        return False


Objective = TerminalObjective | StepwiseObjective


def _check_pair(data: Tensor, noise: Tensor) -> None:
    for name, value in (("data", data), ("noise", noise)):
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise InvalidType(
                f"{name} must be a floating-point tensor [B, ...], got {type(value).__name__}"
            )
    if data.shape != noise.shape:
        raise InvalidValue(
            f"data and noise must have the same shape (one noise per data point), got "
            f"data {tuple(data.shape)} and noise {tuple(noise.shape)}"
        )


def flow_matching_trajectory(sampler: AffineSampler, data: Tensor, noise: Tensor) -> Trajectory:
    """States ``z_{t_k} = (1 - t_k) x + t_k eps`` on the sampler's grid, for flow matching.

    The velocities are the target ``eps - x`` (no model is evaluated); stepwise
    estimators evaluate the model themselves.
    """
    _check_pair(data, noise)
    t = sampler.times.to(dtype=data.dtype, device=data.device).reshape(-1, *([1] * data.ndim))
    states = (1 - t) * data.detach() + t * noise.detach()
    target = (noise - data).detach()
    return Trajectory(
        times=sampler.times.clone(),
        states=states,
        velocities=target.expand(sampler.num_steps, *target.shape).clone(),
    )


def flow_matching_objective(data: Tensor, noise: Tensor) -> StepwiseObjective:
    """The rectified-flow matching loss ``(1/N) sum_k mean ||v_k - (eps - x)||^2``.

    Pair it with :func:`flow_matching_trajectory` (the interpolants on the same grid)::

        traj = gradest.flow_matching_trajectory(sampler, data, noise)
        objective = gradest.flow_matching_objective(data, noise)
        est.surrogate(model, sampler, objective, trajectory=traj).loss.backward()
    """
    _check_pair(data, noise)
    target = (noise - data).detach()

    def loss_fn(k: int, velocity: Tensor, trajectory: Trajectory) -> Tensor:
        del k
        return (velocity - target).pow(2).mean() / trajectory.num_steps

    return StepwiseObjective(loss_fn)
