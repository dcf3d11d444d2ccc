"""What one ``estimate`` call knows: validated inputs, the trajectory, cotangents, costs.

Strategies receive an :class:`EstimationContext` and only decide *which cotangents*
and *how the sum of VJPs* is evaluated; everything else (sampling, loss checks, the
adjoint sweep, cost counting) is shared here and in :mod:`gradest.vjp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import check_cond, check_generator, check_noise
from gradest.flow import (
    AffineSampler,
    Trajectory,
    affine_step,
    check_sampler,
    check_trajectory_matches,
    draw_step_noise,
)
from gradest.nonfinite import check_finite
from gradest.objectives import Objective, StepwiseObjective, TerminalObjective
from gradest.vjp import CostMeter, Grads, VelocityField, add_grads


@attrs.frozen(eq=False)
class AdjointSweep:
    """Result of the reverse adjoint sweep along a recorded path.

    Attributes:
        cotangents: ``c_k = beta_k a_{k+1}``, ``[N, B, ...]``.
        velocities: the model's velocity at each recorded state (from the sweep's forwards).
        state_grad: ``a_0``, the gradient w.r.t. the initial state (only meaningful when
            the noise gradient was requested or step 0 was a joint step).
        grads: parameter gradients of the steps swept with joint VJPs (None if none).
    """

    cotangents: Tensor
    velocities: Tensor
    state_grad: Tensor
    grads: Grads | None


class EstimationContext:
    """Validated inputs of one estimate, with the shared building blocks strategies use.

    Attributes:
        field: the model as a :class:`~gradest.vjp.VelocityField`.
        flow: the sampler; ``coefficients`` its ``(alpha, beta, sigma)``.
        objective: terminal or stepwise.
        generator: the only source of randomness.
        want_noise_grad: whether the caller asked for the initial-noise gradient.
        meter: cost counters of this call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        flow: AffineSampler,
        objective: Objective,
        *,
        noise: Tensor | None,
        trajectory: Trajectory | None,
        cond: Mapping[str, Any] | None,
        generator: torch.Generator | None,
        noise_grad: bool,
    ):
        check_sampler(flow)
        if not isinstance(objective, TerminalObjective | StepwiseObjective):
            raise TypeError(
                "objective must be gradest.TerminalObjective(loss_fn) or "
                f"gradest.StepwiseObjective(loss_fn), got {type(objective).__name__}"
            )
        if (noise is None) == (trajectory is None):
            raise ValueError(
                "pass exactly one of noise= (the estimator samples itself) or trajectory= "
                "(a path recorded with gradest.rollout); got "
                + ("both" if noise is not None else "neither")
            )
        if not isinstance(noise_grad, bool):
            raise TypeError(f"noise_grad must be True or False, got {noise_grad!r}")
        if noise_grad and isinstance(objective, StepwiseObjective):
            raise ValueError(
                "noise_grad=True needs a TerminalObjective: a StepwiseObjective treats the "
                "recorded states as data, so the loss does not depend on the initial noise"
            )
        self.generator = check_generator(generator)
        cond = check_cond(cond)
        if noise is not None:
            check_noise(model, noise)
            batch = noise.shape[0]
        else:
            assert trajectory is not None
            check_trajectory_matches(flow, trajectory)
            check_noise(model, trajectory.states[0], name="trajectory.states[0]")
            batch = trajectory.batch_size
        self.meter = CostMeter()
        self.field = VelocityField(model, cond, batch, self.meter)
        self.flow = flow
        self.coefficients = flow.coefficients()
        self.objective = objective
        self.noise = noise
        self.want_noise_grad = noise_grad
        self._trajectory = trajectory
        # Velocities recorded by a rollout made in this call are the current model's, so
        # strategies may reuse them instead of evaluating the model again.
        self._velocities_are_current = False
        self.info: dict[str, Any] = {}

    @property
    def num_steps(self) -> int:
        return self.flow.num_steps

    @property
    def times(self) -> Tensor:
        return self.flow.times

    @property
    def is_terminal(self) -> bool:
        return isinstance(self.objective, TerminalObjective)

    @property
    def sampled_here(self) -> bool:
        """True when the estimator samples from ``noise`` itself (it may fuse sampling)."""
        return self.noise is not None

    def step_noise(self) -> Tensor | None:
        """Recorded ``xi_k`` (drawn once from the generator when sampling here)."""
        if self._trajectory is not None:
            return self._trajectory.step_noise
        if not hasattr(self, "_step_noise"):
            assert self.noise is not None
            self._step_noise = draw_step_noise(self.coefficients[2], self.noise, self.generator)
        return self._step_noise

    def trajectory(self) -> Trajectory:
        """The given trajectory, or a no-graph rollout from ``noise`` (``N`` forwards)."""
        if self._trajectory is None:
            assert self.noise is not None
            step_noise = self.step_noise()
            z = self.noise.detach()
            states, velocities = [z], []
            for k in range(self.num_steps):
                v = self.field.velocity(z, self.times[k])
                velocities.append(v)
                z = affine_step(self.coefficients, k, z, v, step_noise)
                states.append(z)
            self._trajectory = Trajectory(
                times=self.times.clone(),
                states=torch.stack(states),
                velocities=torch.stack(velocities),
                step_noise=step_noise,
            )
            self._velocities_are_current = True
        return self._trajectory

    def record(self, trajectory: Trajectory) -> None:
        """Adopt a path sampled by a strategy itself with the current parameters."""
        self._trajectory = trajectory
        self._velocities_are_current = True

    def velocity(self, k: int) -> Tensor:
        """Current-model velocity at recorded state ``k`` (a no-graph forward if needed)."""
        trajectory = self.trajectory()
        if self._velocities_are_current:
            return trajectory.velocities[k]
        return self.field.velocity(trajectory.states[k], self.times[k])

    # -- objectives -----------------------------------------------------------------------

    def terminal_adjoint(self) -> Tensor:
        """``a_N = grad l(z_N)`` on the trajectory's final state; records the loss."""
        assert isinstance(self.objective, TerminalObjective)
        loss, adjoint = self.objective.terminal_adjoint(self.trajectory().states[-1])
        self.info["loss"] = float(loss)
        return adjoint

    def step_cotangent(self, k: int, velocity: Tensor) -> Tensor:
        """``c_k = d l_k / d v_k`` of a stepwise objective; accumulates the loss."""
        assert isinstance(self.objective, StepwiseObjective)
        loss, cotangent = self.objective.step_cotangent(k, velocity, self.trajectory())
        self.info["loss"] = self.info.get("loss", 0.0) + float(loss)
        return cotangent

    # -- the adjoint ----------------------------------------------------------------------

    def adjoint_sweep(
        self, terminal_adjoint: Tensor, *, joint_steps: frozenset[int] | range
    ) -> AdjointSweep:
        """Reverse sweep ``a_k = alpha_k a_{k+1} + beta_k (dv_k/dz_k)^T a_{k+1}`` on the path.

        Steps in ``joint_steps`` take one full VJP (state and parameters, exact
        ``J_k^T c_k`` accumulated into ``grads``); the others a state-only VJP, which
        skips the parameter part. Every step costs one forward with graph, except a
        state-only step 0 when the noise gradient is not wanted (``c_0`` needs only ``a_1``).
        """
        trajectory = self.trajectory()
        alpha, beta, _ = self.coefficients
        adjoint = terminal_adjoint
        cotangents: list[Tensor] = [terminal_adjoint] * self.num_steps
        velocities: list[Tensor] = [terminal_adjoint] * self.num_steps
        grads: Grads | None = None
        for k in reversed(range(self.num_steps)):
            cotangent = float(beta[k]) * adjoint
            z, t = trajectory.states[k], self.times[k]
            if k in joint_steps:
                v, z_grad, step_grads = self.field.joint_vjp(z, t, cotangent)
                grads = add_grads(grads, step_grads)
            elif k == 0 and not self.want_noise_grad:
                v, z_grad = self.velocity(0), None
            else:
                v, z_grad = self.field.state_vjp(z, t, cotangent)
            cotangents[k], velocities[k] = cotangent, v
            adjoint = float(alpha[k]) * adjoint + z_grad if z_grad is not None else adjoint
            check_finite(adjoint, "adjoint", [float(t)])
        return AdjointSweep(
            cotangents=torch.stack(cotangents),
            velocities=torch.stack(velocities),
            state_grad=adjoint,
            grads=grads,
        )
