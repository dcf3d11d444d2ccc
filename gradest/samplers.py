"""Samplers: a validated time grid and the coefficients of an affine step; nothing else.

Every sampler gradest supports takes affine steps (docs/design.md#notation)::

    z_{k+1} = alpha_k z_k + beta_k v_k + sigma_k xi_k

with per-step scalars and recorded noise ``xi_k``. Estimators are written against this
step form only (the :class:`AffineSampler` protocol), so a new sampler is a grid and a
``coefficients()`` method. :class:`TimeGrid` holds what every sampler here shares: the
grid's validation (given as ``steps=N`` or ``times=...``), ``num_steps``, ``step_sizes``,
the ``repr`` and, for stochastic samplers, the Gaussian log-density of a recorded step
(what GRPO's likelihood ratios need). The samplers themselves only define coefficients:

* :class:`RectifiedFlow`: rectified-flow Euler, ``alpha = 1, beta = h_k, sigma = 0``;
* :class:`FlowSDE`: Flow-GRPO's SDE (Euler-Maruyama of the reverse SDE with the ODE's
  marginals);
* :class:`StochasticFlowMatch`: diffusers' ``FlowMatchEulerDiscreteScheduler`` with
  ``stochastic_sampling=True``.

One naming and construction style for every sampler (here and
:class:`gradest.diffusion_samplers.DDIM`): the name says the process, without a
``Sampler`` suffix; ``Cls(steps=N)`` or ``Cls(times=...)`` plus the sampler's own keyword
options. A sampler that takes a diffusers scheduler's steps is built by the diffusers
adapter, :func:`gradest.integrations.diffusers.sampler_from_scheduler` (the core reads no
diffusers object).

All three share the rectified-flow interpolant ``z_t = t eps + (1 - t) x`` (``t = 1``
noise, ``t = 0`` data), which :meth:`TimeGrid.noised` and :meth:`TimeGrid.jump_to_end`
expose for the estimators that leave the recorded chain (``draft_lv``, ``refl``). DDIM /
DDPM samplers (another interpolant) are in :mod:`gradest.diffusion_samplers`.

The one sampling loop that runs any of them is :func:`gradest.trajectory.integrate`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from gradest._checks import check_allocation, is_symbolic, outside_fake_mode, require
from gradest.errors import InvalidType, InvalidValue

LOG_PROB_REDUCTIONS = ("sum", "mean")


@runtime_checkable
class AffineSampler(Protocol):
    """What estimators need to know about a sampler: its grid and its affine step.

    Attributes:
        times: ``[N+1]`` float64, strictly decreasing.
    """

    @property
    def times(self) -> Tensor: ...

    @property
    def num_steps(self) -> int: ...

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(alpha, beta, sigma)``, each ``[N]`` float64."""
        ...


def as_float64_cpu(value: Any, name: str) -> Tensor:
    """``value`` (a tensor or a sequence of floats) as a detached float64 CPU tensor.

    The conversion every per-grid-point input of a sampler (``times``, ``alphas_cumprod``)
    goes through before its own checks; anything torch cannot read as floats raises
    :class:`~gradest.errors.InvalidType` naming ``name``. The shape is not checked here.
    """
    if isinstance(value, Tensor):
        return value.detach().to(device="cpu", dtype=torch.float64)
    try:
        return torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise InvalidType(
            f"{name} must be a 1-D sequence or tensor of floats, got {type(value).__name__}"
        ) from err


def check_reduction(reduction: str) -> None:
    """Raise unless ``reduction`` is one of :data:`LOG_PROB_REDUCTIONS`."""
    if reduction not in LOG_PROB_REDUCTIONS:
        raise InvalidValue(
            f"reduction must be one of {', '.join(LOG_PROB_REDUCTIONS)}, got {reduction!r}"
        )


def reduce_per_sample(values: Tensor, reduction: str) -> Tensor:
    """``[B]``: ``values`` ``[B, ...]`` summed (``"sum"``) or averaged (``"mean"``) over all
    but the batch dimension, the one reduction of per-element log-densities and KLs."""
    flat = values.reshape(values.shape[0], -1)
    return flat.sum(1) if reduction == "sum" else flat.mean(1)


def as_time_grid(times: Any) -> Tensor:
    """``times`` as a validated ``[N+1]`` float64 CPU grid: strictly decreasing, in [0, 1]."""
    grid = as_float64_cpu(times, "times")
    require(
        grid.ndim == 1 and grid.numel() >= 2,
        f"times must be 1-D with at least 2 entries (one step), got shape {tuple(grid.shape)}",
    )
    require(bool(torch.isfinite(grid).all()), f"times must be finite, got {grid.tolist()}")
    diffs = grid[1:] - grid[:-1]
    if not bool((diffs < 0).all()):
        bad = int(torch.nonzero(diffs >= 0)[0])
        raise InvalidValue(
            f"times must be strictly decreasing (t=1 is noise, t=0 is data), but "
            f"times[{bad}]={grid[bad].item():g} <= times[{bad + 1}]={grid[bad + 1].item():g}; "
            f"pass e.g. torch.linspace(1, 0, steps + 1)"
        )
    require(
        bool(((grid >= 0) & (grid <= 1)).all()),
        f"times must lie in [0, 1], got range [{grid.min().item():g}, {grid.max().item():g}]",
    )
    return grid


# float64 arrays a sampler keeps per step: the grid, its coefficients (alpha, beta, sigma)
# and the step sizes and diffusion some samplers derive from it.
_GRID_BYTES_PER_STEP = 8 * 8


def as_int(value: Any) -> Any:
    """Integral numbers (numpy integers, 0-d integer arrays or tensors) as a Python int;
    anything else unchanged (bools stay bools, so that the caller's check refuses them)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, int) and not isinstance(item, bool):
            return item
    return value


def uniform_grid(steps: Any) -> Tensor:
    """``N + 1`` equally spaced times from 1 to 0."""
    steps = as_int(steps)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise InvalidType(f"steps must be an int >= 1, got {steps!r}")
    require(steps >= 1, f"steps must be >= 1, got {steps}; use steps=50 for example")
    # Bounded by what the grid itself allocates, before torch's allocator is asked.
    check_allocation(
        f"steps={steps}",
        steps + 1,
        _GRID_BYTES_PER_STEP,
        name="steps",
        detail="the time grid and its coefficients alone",
    )
    return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)


def same_grid(recorded: Any, times: Tensor) -> bool:
    """Whether ``recorded`` (a trajectory's times) is the grid ``times``."""
    if not isinstance(recorded, Tensor) or recorded.shape != times.shape:
        return False
    if is_symbolic(recorded):
        return True  # fake/meta times (a rollout under FakeTensorMode): no values to compare
    with outside_fake_mode():
        return torch.allclose(recorded.to(torch.float64).cpu(), times, rtol=0, atol=1e-12)


@attrs.frozen(eq=False, repr=False, init=False)
class TimeGrid:
    """A validated time grid ``1 >= t_0 > ... > t_N >= 0``; the base of gradest's samplers.

    Attributes:
        times: the ``[N+1]`` float64 grid on the CPU.
    """

    times: Tensor

    @staticmethod
    def make_grid(owner: str, steps: int | None, times: Sequence[float] | Tensor | None) -> Tensor:
        """The grid from exactly one of ``steps`` (uniform 1 -> 0) or ``times``."""
        if (steps is None) == (times is None):
            raise InvalidValue(
                f"{owner} needs exactly one of steps=N (uniform grid 1 -> 0) or times=..."
                f" (got steps={steps!r}, times={'given' if times is not None else None})"
            )
        return uniform_grid(steps) if steps is not None else as_time_grid(times)

    @property
    def num_steps(self) -> int:
        return self.times.numel() - 1

    @property
    def step_sizes(self) -> Tensor:
        """``h_k = t_{k+1} - t_k`` (negative), ``[N]`` float64."""
        return self.times[1:] - self.times[:-1]

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(alpha, beta, sigma)`` of ``z_{k+1} = alpha_k z_k + beta_k v_k + sigma_k xi_k``."""
        raise NotImplementedError

    # -- the rectified-flow interpolant ``z_t = t eps + (1 - t) x`` (every sampler here) ---
    # Estimators that leave the recorded chain (DRaFT-LV re-noises the final sample, ReFL
    # jumps to the end in one step) need the interpolant, which the affine step form does
    # not carry; a sampler with another interpolant overrides both.

    def noised(self, data: Tensor, k: int, noise: Tensor) -> Tensor:
        """``t_k noise + (1 - t_k) data``: ``data`` noised to the grid time ``t_k``."""
        with outside_fake_mode():
            t = float(self.times[k])
        return t * noise + (1.0 - t) * data

    def jump_to_end(self, k: int) -> tuple[float, float]:
        """``(a, b)`` in ``z^_N = a z_k + b v_k``, the one-step prediction of the state at
        ``t_N`` from step ``k``: here ``(1, t_N - t_k)`` (the data prediction ``z - t v``
        when ``t_N = 0``). Samplers with another interpolant (DDIM) have ``a != 1``."""
        with outside_fake_mode():
            return 1.0, float(self.times[-1] - self.times[k])

    def _options(self) -> str:
        """Further ``repr`` arguments after the grid (``", noise_level=0.7"``)."""
        return ""

    def __repr__(self) -> str:
        with outside_fake_mode():
            uniform = torch.allclose(
                self.times, torch.linspace(1.0, 0.0, self.num_steps + 1, dtype=torch.float64)
            )
        grid = f"steps={self.num_steps}" if uniform else f"times=<{self.num_steps + 1} points>"
        return f"{type(self).__name__}({grid}{self._options()})"

    # -- stochastic steps: the Gaussian policy of GRPO -------------------------------------

    def step_log_prob(
        self, trajectory: Any, k: int, velocity: Tensor, *, reduction: str = "sum"
    ) -> Tensor:
        """Log-density of the recorded ``z_{k+1}`` given ``z_k`` and ``velocity``, per sample.

        The step is ``N(alpha_k z_k + beta_k v, sigma_k^2 I)``. Differentiable in
        ``velocity`` (the recorded states are data).

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
        check_reduction(reduction)
        require(
            same_grid(getattr(trajectory, "times", None), self.times),
            f"trajectory was recorded on a different time grid than {self!r}; record it "
            f"with gradest.rollout(model, sampler, noise) using this sampler",
        )
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.num_steps:
            raise InvalidValue(f"k must be a step index in 0..{self.num_steps - 1}, got {k!r}")
        if velocity.shape != trajectory.states.shape[1:]:
            raise InvalidValue(
                f"velocity has shape {tuple(velocity.shape)} but the trajectory's states are "
                f"{tuple(trajectory.states.shape[1:])}; pass the model's velocity at step {k}"
            )
        alpha, beta, scale = (float(c[k]) for c in self.coefficients())
        if scale == 0.0:
            raise InvalidValue(
                f"step {k} of {self!r} is deterministic (noise scale 0), so it has no "
                f"log-density; use noise_level > 0 (a stochastic sampler) for "
                f"likelihood-ratio objectives"
            )
        z = trajectory.states[k].to(velocity)
        z_next = trajectory.states[k + 1].to(velocity)
        residual = z_next - (alpha * z + beta * velocity)
        elementwise = -0.5 * (residual / scale) ** 2 - math.log(scale) - 0.5 * math.log(2 * math.pi)
        return reduce_per_sample(elementwise, reduction)

    def trajectory_log_probs(self, trajectory: Any, *, reduction: str = "sum") -> Tensor:
        """``[N, B]`` log-probabilities of every recorded step under the recorded velocities.

        On a rollout of the current model these are GRPO's ``log p_old``.
        """
        return torch.stack(
            [
                self.step_log_prob(trajectory, k, trajectory.velocities[k], reduction=reduction)
                for k in range(self.num_steps)
            ]
        )


@attrs.frozen(eq=False, repr=False, init=False)
class RectifiedFlow(TimeGrid):
    """Rectified-flow Euler sampler: ``z_{k+1} = z_k + h_k v_k`` with ``h_k = t_{k+1} - t_k < 0``.

    Give either ``steps`` (a uniform grid from 1 to 0) or ``times`` (any strictly
    decreasing grid in [0, 1]; it need not start at 1 or end at 0).
    :func:`gradest.integrations.diffusers.sampler_from_scheduler` builds one from a diffusers
    ``FlowMatchEulerDiscreteScheduler``.
    """

    def __init__(self, steps: int | None = None, *, times: Sequence[float] | Tensor | None = None):
        self.__attrs_init__(times=self.make_grid("RectifiedFlow", steps, times))  # type: ignore[attr-defined]

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        h = self.step_sizes
        return torch.ones_like(h), h, torch.zeros_like(h)


@attrs.frozen(eq=False, repr=False, init=False)
class FlowSDE(TimeGrid):  # type: ignore[override]  # attrs' generated init gains noise_level
    """Flow-GRPO's SDE sampler for rectified flow: affine steps with Gaussian step noise.

    Rectified flow's velocity ``v = E[eps - x | z_t]`` also gives the score,
    ``-(z + (1 - t) v) / t``, so the reverse-time SDE with diffusion ``sigma_t`` and the
    ODE's marginals is ``dz = [v + sigma_t^2 / (2 t) (z + (1 - t) v)] dt + sigma_t dW``.
    Flow-GRPO (Liu et al. 2025) takes Euler-Maruyama steps of it with
    ``sigma_t = a sqrt(t / (1 - t))`` (``a`` = ``noise_level``)::

        alpha_k = 1 + sigma^2 dt / (2 t)
        beta_k  = dt (1 + sigma^2 (1 - t) / (2 t))
        sigma_k = sigma sqrt(|dt|)

    so each step is a Gaussian policy ``N(alpha_k z_k + beta_k v, sigma_k^2 I)``
    (:meth:`~TimeGrid.step_log_prob`). ``sigma_t`` is infinite at ``t = 1``: as in
    Flow-GRPO's ``sde_step_with_logprob``, a step that starts at exactly ``t = 1`` uses
    ``1 - t_1`` (the next grid time) in place of ``1 - t``. ``noise_level=0`` is the
    deterministic Euler ODE (:class:`RectifiedFlow`), without a step log-density.

    Attributes:
        times: the ``[N+1]`` float64 grid on the CPU.
        noise_level: ``a`` in ``sigma_t = a sqrt(t / (1 - t))`` (Flow-GRPO uses 0.7).
    """

    noise_level: float

    def __init__(
        self,
        steps: int | None = None,
        *,
        times: Sequence[float] | Tensor | None = None,
        noise_level: float = 0.7,
    ):
        grid = self.make_grid("FlowSDE", steps, times)
        if isinstance(noise_level, bool) or not isinstance(noise_level, int | float):
            raise InvalidType(
                f"noise_level must be a float >= 0, got {noise_level!r}; Flow-GRPO uses 0.7"
            )
        if not (math.isfinite(noise_level) and noise_level >= 0):
            raise InvalidValue(
                f"noise_level must be a finite float >= 0, got {noise_level!r}; Flow-GRPO "
                f"uses 0.7 (0 gives the deterministic ODE sampler)"
            )
        self.__attrs_init__(times=grid, noise_level=float(noise_level))  # type: ignore[attr-defined]

    def diffusion(self) -> Tensor:
        """``sigma_t`` at the start of every step, ``[N]`` float64 (finite; see above)."""
        start = self.times[:-1]
        # At t=1 use the next grid time's 1 - t (Flow-GRPO's sigma_max substitution).
        one_minus = torch.where(start == 1.0, 1.0 - self.times[1], 1.0 - start)
        return self.noise_level * torch.sqrt(start / one_minus)

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        t, dt = self.times[:-1], self.step_sizes
        variance = self.diffusion() ** 2
        alpha = 1.0 + variance * dt / (2.0 * t)
        beta = dt * (1.0 + variance * (1.0 - t) / (2.0 * t))
        return alpha, beta, torch.sqrt(variance * dt.abs())

    def _options(self) -> str:
        return f", noise_level={self.noise_level:g}"


@attrs.frozen(eq=False, repr=False, init=False)
class StochasticFlowMatch(TimeGrid):
    """``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)`` as an affine sampler.

    Its step predicts ``x0 = z - sigma v`` and re-noises to the next level with fresh
    noise ``xi``: ``z_next = (1 - sigma_next) x0 + sigma_next xi``, i.e.
    ``alpha = 1 - sigma_next``, ``beta = -(1 - sigma_next) sigma``, ``sigma_k = sigma_next``.
    Give ``steps`` or ``times`` (the sigma grid) as for :class:`RectifiedFlow`, or build it
    from the scheduler with :func:`gradest.integrations.diffusers.sampler_from_scheduler`.
    Not exported at the top
    level of ``gradest``: it exists to reproduce that one diffusers scheduler.
    """

    def __init__(self, steps: int | None = None, *, times: Sequence[float] | Tensor | None = None):
        self.__attrs_init__(times=self.make_grid("StochasticFlowMatch", steps, times))  # type: ignore[attr-defined]

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        sigma, sigma_next = self.times[:-1], self.times[1:]
        return 1.0 - sigma_next, -(1.0 - sigma_next) * sigma, sigma_next.clone()


def require_interpolant(sampler: Any, estimator: str) -> TimeGrid:
    """``sampler`` if it knows its interpolant (``noised``/``jump_to_end``), else a clear error."""
    if callable(getattr(sampler, "noised", None)) and callable(
        getattr(sampler, "jump_to_end", None)
    ):
        return sampler
    raise InvalidType(
        f"estimator {estimator!r} needs the sampler's interpolant (methods noised(data, k, "
        f"noise) and jump_to_end(k) -> (a, b)), which {type(sampler).__name__} does not "
        f"define; use gradest.RectifiedFlow / FlowSDE / StochasticFlowMatch "
        f"(rectified-flow interpolant z_t = t eps + (1 - t) x) or gradest.DDIM, or "
        f"add the two methods to your sampler"
    )
