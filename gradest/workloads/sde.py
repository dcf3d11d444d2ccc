"""Flow-GRPO's stochastic sampler for rectified flow, as a gradest affine sampler.

Rectified flow interpolates ``z_t = (1 - t) x + t eps`` (t=1 noise, t=0 data). Its
velocity ``v = E[eps - x | z_t]`` also gives the score,
``grad log p_t(z) = -E[eps | z_t] / t = -(z + (1 - t) v) / t``, so the reverse-time SDE
with diffusion ``sigma_t`` and the same marginals as the ODE is (``dt < 0``)::

    dz = [v + sigma_t^2 / (2 t) * (z + (1 - t) v)] dt + sigma_t dW

Flow-GRPO (Liu et al. 2025) takes Euler-Maruyama steps of it with
``sigma_t = a sqrt(t / (1 - t))`` (``a`` = ``noise_level``)::

    z_{k+1} = z_k + [v + sigma^2 / (2 t) (z_k + (1 - t) v)] dt + sigma sqrt(|dt|) xi_k

which is affine in ``(z_k, v)`` (DESIGN.md section 1)::

    alpha_k = 1 + sigma^2 dt / (2 t)
    beta_k  = dt (1 + sigma^2 (1 - t) / (2 t))
    noise   = sigma sqrt(|dt|)          (the ``sigma`` of :meth:`FlowSDE.coefficients`)

so every gradest estimator differentiates it without changes, and each step is a
Gaussian policy ``N(alpha_k z_k + beta_k v, noise_k^2 I)`` whose log-density
(:meth:`FlowSDE.step_log_prob`) is what GRPO's likelihood ratio needs.

Endpoints. ``sigma_t`` is infinite at ``t = 1``; as in Flow-GRPO's
``sde_step_with_logprob``, a step that starts at exactly ``t = 1`` uses ``1 - t_1`` (the
next grid time) in place of ``1 - t``, i.e. the diffusion of the first interior time.
(The alternative, a grid that starts slightly below 1, is ``FlowSDE(times=...)``; no
substitution happens then.) At ``t = 0`` nothing is needed: steps start at
``t_0 .. t_{N-1}``, all positive on a strictly decreasing grid ending at ``t_N >= 0``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from gradest.flow import RectifiedFlow, Trajectory, _as_time_grid, check_trajectory_matches

LOG_PROB_REDUCTIONS = ("sum", "mean")


@attrs.frozen(eq=False, repr=False, init=False)
class FlowSDE:
    """Flow-GRPO's SDE sampler: an affine sampler with recorded Gaussian step noise.

    Give either ``steps`` (a uniform grid from 1 to 0) or ``times`` (any strictly
    decreasing grid in [0, 1]). ``noise_level=0`` is the deterministic Euler ODE
    (:class:`gradest.RectifiedFlow`); it has no step log-density.

    Attributes:
        times: the ``[N+1]`` float64 grid on the CPU.
        noise_level: ``a`` in ``sigma_t = a sqrt(t / (1 - t))`` (Flow-GRPO uses 0.7).
    """

    times: Tensor
    noise_level: float

    def __init__(
        self,
        steps: int | None = None,
        *,
        times: Sequence[float] | Tensor | None = None,
        noise_level: float = 0.7,
    ):
        if (steps is None) == (times is None):
            raise ValueError(
                "FlowSDE needs exactly one of steps=N (uniform grid 1 -> 0) or times=..."
                f" (got steps={steps!r}, times={'given' if times is not None else None})"
            )
        # RectifiedFlow validates steps and grids with the same messages.
        grid = RectifiedFlow(steps).times if steps is not None else _as_time_grid(times)
        if isinstance(noise_level, bool) or not isinstance(noise_level, int | float):
            raise TypeError(
                f"noise_level must be a float >= 0, got {noise_level!r}; Flow-GRPO uses 0.7"
            )
        if not (math.isfinite(noise_level) and noise_level >= 0):
            raise ValueError(
                f"noise_level must be a finite float >= 0, got {noise_level!r}; Flow-GRPO "
                f"uses 0.7 (0 gives the deterministic ODE sampler)"
            )
        self.__attrs_init__(times=grid, noise_level=float(noise_level))  # type: ignore[attr-defined]

    @property
    def num_steps(self) -> int:
        return self.times.numel() - 1

    @property
    def step_sizes(self) -> Tensor:
        """``dt_k = t_{k+1} - t_k`` (negative), ``[N]`` float64."""
        return self.times[1:] - self.times[:-1]

    def diffusion(self) -> Tensor:
        """``sigma_t`` at the start of every step, ``[N]`` float64 (finite; see module doc)."""
        start = self.times[:-1]
        # At t=1 use the next grid time's 1 - t (Flow-GRPO's sigma_max substitution).
        one_minus = torch.where(start == 1.0, 1.0 - self.times[1], 1.0 - start)
        return self.noise_level * torch.sqrt(start / one_minus)

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(alpha, beta, sigma)``: ``z_{k+1} = alpha_k z_k + beta_k v_k + sigma_k xi_k``."""
        t, dt = self.times[:-1], self.step_sizes
        variance = self.diffusion() ** 2
        alpha = 1.0 + variance * dt / (2.0 * t)
        beta = dt * (1.0 + variance * (1.0 - t) / (2.0 * t))
        return alpha, beta, torch.sqrt(variance * dt.abs())

    def step_log_prob(
        self, trajectory: Trajectory, k: int, velocity: Tensor, *, reduction: str = "sum"
    ) -> Tensor:
        """Log-density of the recorded ``z_{k+1}`` given ``z_k`` and ``velocity``, per sample.

        The step is ``N(alpha_k z_k + beta_k v, s_k^2 I)`` with ``s_k`` the step's noise
        scale. Differentiable in ``velocity`` (the recorded states are data).

        Args:
            trajectory: a path recorded on this sampler (``gradest.rollout``).
            k: the step, ``0 <= k < N``.
            velocity: ``[B, ...]``, the policy's velocity at ``z_k``.
            reduction: ``"sum"`` over the state's elements gives the Gaussian
                log-density; ``"mean"`` divides it by the element count ``D``, as
                Flow-GRPO does (it shrinks log-ratios by ``1/D`` so that clipping acts
                per element rather than per image).

        Returns:
            ``[B]`` log-probabilities in ``velocity``'s dtype.
        """
        if reduction not in LOG_PROB_REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {', '.join(LOG_PROB_REDUCTIONS)}, got {reduction!r}"
            )
        check_trajectory_matches(self, trajectory)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.num_steps:
            raise ValueError(f"k must be a step index in 0..{self.num_steps - 1}, got {k!r}")
        if velocity.shape != trajectory.states.shape[1:]:
            raise ValueError(
                f"velocity has shape {tuple(velocity.shape)} but the trajectory's states are "
                f"{tuple(trajectory.states.shape[1:])}; pass the model's velocity at step {k}"
            )
        alpha, beta, scale = (float(c[k]) for c in self.coefficients())
        if scale == 0.0:
            raise ValueError(
                f"step {k} of {self!r} is deterministic (noise scale 0), so it has no "
                f"log-density; use noise_level > 0 for likelihood-ratio objectives"
            )
        z = trajectory.states[k].to(velocity)
        z_next = trajectory.states[k + 1].to(velocity)
        residual = z_next - (alpha * z + beta * velocity)
        elementwise = -0.5 * (residual / scale) ** 2 - math.log(scale) - 0.5 * math.log(2 * math.pi)
        flat = elementwise.reshape(elementwise.shape[0], -1)
        return flat.sum(1) if reduction == "sum" else flat.mean(1)

    def trajectory_log_probs(self, trajectory: Trajectory, *, reduction: str = "sum") -> Tensor:
        """``[N, B]`` log-probabilities of every recorded step under the recorded velocities.

        On a rollout of the current model these are GRPO's ``log p_old``.
        """
        return torch.stack(
            [
                self.step_log_prob(trajectory, k, trajectory.velocities[k], reduction=reduction)
                for k in range(self.num_steps)
            ]
        )

    def __repr__(self) -> str:
        uniform = torch.allclose(
            self.times, torch.linspace(1.0, 0.0, self.num_steps + 1, dtype=torch.float64)
        )
        grid = f"steps={self.num_steps}" if uniform else f"times=<{self.num_steps + 1} points>"
        return f"FlowSDE({grid}, noise_level={self.noise_level:g})"
