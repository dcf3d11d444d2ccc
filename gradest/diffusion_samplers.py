"""DDIM and DDPM ancestral sampling (epsilon-, v- or x0-prediction) as affine samplers.

A DDPM-family model is trained on ``z = sqrt(a) x + sqrt(1 - a) eps`` (``a`` =
``alphas_cumprod`` at the noise level) and predicts ``eps`` (``"epsilon"``), the
velocity ``v = sqrt(a) eps - sqrt(1 - a) x`` (``"v_prediction"``) or ``x`` itself
(``"sample"``). Each prediction is linear in ``(z, output)``::

    epsilon:       x0 = (z - sqrt(1-a) e) / sqrt(a)          e = e
    v_prediction:  x0 = sqrt(a) z - sqrt(1-a) v              e = sqrt(1-a) z + sqrt(a) v
    sample:        x0 = x                                     e = (z - sqrt(a) x) / sqrt(1-a)

and the DDIM step (Song et al. 2021, eq. 12; diffusers' ``DDIMScheduler.step``) from
``a`` to the next level ``a'`` is linear in ``(x0, e)`` plus fresh noise::

    z' = sqrt(a') x0 + sqrt(1 - a' - s^2) e + s xi,
    s  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')

so it is gradest's affine step ``z' = alpha z + beta v + sigma xi`` with ``v`` the
model's raw output (:func:`ddim_coefficients`). ``eta = 0`` is deterministic DDIM;
``eta = 1`` is DDPM ancestral sampling with the posterior variance ``"fixed_small"``
(diffusers' ``DDPMScheduler.step``; ``tests/test_ddim.py`` checks the identity against it).

The grid: :class:`DDIM` keeps gradest's time grid (``[N+1]`` in ``[0, 1]``,
strictly decreasing; the model is called at ``t_k``) and stores ``alphas_cumprod`` per
grid point explicitly, because the last point's ``a`` is a scheduler setting
(``final_alpha_cumprod``: 1 with ``set_alpha_to_one=True``, else ``alphas_cumprod[0]``)
rather than a function of its time. How a discrete-time model is called at ``t`` is
recorded with the sampler (``timestep = t * num_train_timesteps + timestep_shift``) for
adapters such as :meth:`gradest.integrations.diffusers.DiffusersVelocity.for_sampler`;
it does not enter the step's math. Build one from a diffusers scheduler with
:func:`gradest.integrations.diffusers.sampler_from_scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import require
from gradest.errors import InvalidType, InvalidValue
from gradest.samplers import TimeGrid, as_float64_cpu

PREDICTIONS = ("epsilon", "v_prediction", "sample")
# Round-off allowed in 1 - a' - s^2 before it counts as negative (eta too large).
DIRECTION_ROUNDOFF = 1e-12


def ddim_coefficients(
    a: Tensor, a_next: Tensor, direction: Tensor, prediction: str
) -> tuple[Tensor, Tensor]:
    """``(alpha, beta)`` of ``z' = sqrt(a') x0 + direction * e`` written as ``alpha z + beta v``.

    ``v`` is the model's output (``prediction``); ``direction`` is ``sqrt(1 - a' - s^2)``
    (the noise term ``s xi`` is added separately). Elementwise in float64.
    """
    root_a, root_1a, root_next = torch.sqrt(a), torch.sqrt(1.0 - a), torch.sqrt(a_next)
    if prediction == "epsilon":
        return root_next / root_a, direction - root_next * root_1a / root_a
    if prediction == "v_prediction":
        return root_next * root_a + direction * root_1a, direction * root_a - root_next * root_1a
    return direction / root_1a, root_next - direction * root_a / root_1a


def as_alphas_cumprod(alphas_cumprod: Any, points: int, prediction: str = "epsilon") -> Tensor:
    """``alphas_cumprod`` as a validated ``[N+1]`` float64 CPU tensor for an ``N``-step grid.

    Non-decreasing along the grid (an equal pair is an identity step), below 1 where the
    model is called, and above 0 there for an epsilon model (which cannot predict ``x0``
    from pure noise; v- and x0-prediction can, as zero-terminal-SNR schedules need).
    """
    alphas = as_float64_cpu(alphas_cumprod, "alphas_cumprod")
    require(
        alphas.ndim == 1 and alphas.numel() == points,
        f"alphas_cumprod must have one entry per grid point (len(times) = N+1 = {points}), "
        f"got shape {tuple(alphas.shape)}; the last entry is the final level "
        f"(scheduler.final_alpha_cumprod: 1.0 with set_alpha_to_one=True)",
    )
    require(
        bool(torch.isfinite(alphas).all()),
        f"alphas_cumprod must be finite, got {alphas.tolist()}",
    )
    inner = alphas[:-1]
    low_ok = inner > 0 if prediction == "epsilon" else inner >= 0
    if not bool((low_ok & (inner < 1)).all()):
        bad = int(torch.nonzero(~(low_ok & (inner < 1)))[0])
        interval = "(0, 1)" if prediction == "epsilon" else "[0, 1)"
        raise InvalidValue(
            f"alphas_cumprod[{bad}]={alphas[bad].item():g} must lie in {interval} at every "
            f"grid point the model is called at (prediction={prediction!r}; an epsilon model "
            f"cannot predict x0 from pure noise, alpha 0, as zero-terminal-SNR schedules "
            f"(rescale_betas_zero_snr) reach: use v_prediction there)"
        )
    require(
        0 < alphas[-1].item() <= 1,
        f"alphas_cumprod[-1]={alphas[-1].item():g} (the final level) must lie in (0, 1]",
    )
    diffs = alphas[1:] - alphas[:-1]
    if not bool((diffs >= 0).all()):
        bad = int(torch.nonzero(diffs < 0)[0])
        raise InvalidValue(
            f"alphas_cumprod must increase along the grid (noise -> data), but "
            f"alphas_cumprod[{bad}]={alphas[bad].item():g} > alphas_cumprod[{bad + 1}]="
            f"{alphas[bad + 1].item():g}; pass scheduler.alphas_cumprod[timesteps] followed "
            f"by the final alpha"
        )
    return alphas


@attrs.frozen(eq=False, repr=False, init=False)
class DDIM(TimeGrid):  # type: ignore[override]  # attrs' generated init gains fields
    """DDIM with ``eta`` (``eta = 1``: DDPM ancestral) as gradest's affine step.

    Step ``k`` goes from ``a = alphas_cumprod[k]`` to ``a' = alphas_cumprod[k+1]``::

        alpha_k, beta_k = ddim_coefficients(a, a', sqrt(1 - a' - s_k^2), prediction)
        sigma_k         = s_k = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')

    The interpolant is the diffusion's, ``z = sqrt(a) x + sqrt(1 - a) eps``
    (:meth:`noised`), and the one-step prediction of the final state (:meth:`jump_to_end`)
    is the deterministic DDIM step from ``a_k`` straight to ``a_N`` (the x0 prediction when
    ``a_N = 1``). With ``eta > 0`` each step is a Gaussian policy, so
    :meth:`~gradest.samplers.TimeGrid.step_log_prob` gives GRPO / DDPO log-probabilities;
    a step with ``s_k = 0`` has none: the last step when ``a_N = 1`` (use
    ``set_alpha_to_one=False``, as DDPO does with Stable Diffusion, for a stochastic last
    step).

    Constructed like every gradest sampler: ``DDIM(steps=N, alphas_cumprod=...)`` (a
    uniform grid) or ``DDIM(times=..., alphas_cumprod=...)``, plus the keyword options
    below; :func:`gradest.integrations.diffusers.sampler_from_scheduler` builds it from a
    diffusers ``DDIMScheduler`` / ``DDPMScheduler``.

    Args:
        steps: ``N``, a uniform grid from 1 to 0 (exclusive with ``times``).
        times: ``[N+1]`` grid, strictly decreasing in ``[0, 1]``; the model is called at
            ``t_0 .. t_{N-1}``.
        alphas_cumprod: ``[N+1]`` the level at every grid point, non-decreasing (an equal
            pair is an identity step, as diffusers' DDIM takes with
            ``set_alpha_to_one=False`` from timestep 0), in ``(0, 1)`` where the model is
            called (``[0, 1)`` for v- and x0-prediction) and ``(0, 1]`` at the end.
        prediction: the model's output: ``"epsilon"``, ``"v_prediction"`` or ``"sample"``.
        eta: DDIM's noise ratio ``>= 0`` (0 deterministic, 1 DDPM's posterior variance).
        num_train_timesteps: with ``timestep_shift``, how a discrete-time model is called
            at grid time ``t``: ``timestep = t * num_train_timesteps + timestep_shift``
            (metadata for model adapters; the step does not use them).
        timestep_shift: see ``num_train_timesteps``.
    """

    alphas_cumprod: Tensor
    prediction: str
    eta: float
    num_train_timesteps: int
    timestep_shift: float

    def __init__(
        self,
        steps: int | None = None,
        *,
        times: Sequence[float] | Tensor | None = None,
        alphas_cumprod: Sequence[float] | Tensor,
        prediction: str = "epsilon",
        eta: float = 0.0,
        num_train_timesteps: int = 1000,
        timestep_shift: float = 0.0,
    ):
        grid = self.make_grid("DDIM", steps, times)
        if prediction not in PREDICTIONS:
            raise InvalidValue(
                f"prediction must be one of {', '.join(map(repr, PREDICTIONS))} (what the "
                f"model outputs; diffusers' scheduler.config.prediction_type), got "
                f"{prediction!r}"
            )
        alphas = as_alphas_cumprod(alphas_cumprod, grid.numel(), prediction)
        if isinstance(eta, bool) or not isinstance(eta, int | float):
            raise InvalidType(f"eta must be a float >= 0 (0: DDIM, 1: DDPM), got {eta!r}")
        if not (math.isfinite(eta) and eta >= 0):
            raise InvalidValue(
                f"eta must be a finite float >= 0, got {eta!r}; use 0 for deterministic DDIM, "
                f"1 for DDPM ancestral sampling"
            )
        if isinstance(num_train_timesteps, bool) or not isinstance(num_train_timesteps, int):
            raise InvalidType(
                f"num_train_timesteps must be an int >= 1, got {num_train_timesteps!r}"
            )
        require(
            num_train_timesteps >= 1,
            f"num_train_timesteps must be >= 1, got {num_train_timesteps}",
        )
        if isinstance(timestep_shift, bool) or not isinstance(timestep_shift, int | float):
            raise InvalidType(f"timestep_shift must be a float, got {timestep_shift!r}")
        require(
            math.isfinite(timestep_shift),
            f"timestep_shift must be finite, got {timestep_shift!r}",
        )
        self.__attrs_init__(  # type: ignore[attr-defined]
            times=grid,
            alphas_cumprod=alphas,
            prediction=prediction,
            eta=float(eta),
            num_train_timesteps=num_train_timesteps,
            timestep_shift=float(timestep_shift),
        )
        direction = self._direction_squared()
        if not bool((direction >= -DIRECTION_ROUNDOFF).all()):
            bad = int(torch.nonzero(direction < -DIRECTION_ROUNDOFF)[0])
            raise InvalidValue(
                f"eta={eta!r} is too large for step {bad} (alphas_cumprod "
                f"{alphas[bad].item():g} -> {alphas[bad + 1].item():g}): its noise variance "
                f"s^2 exceeds 1 - a'; use eta <= 1"
            )

    def _noise_scale(self) -> Tensor:
        a, a_next = self.alphas_cumprod[:-1], self.alphas_cumprod[1:]
        variance = (1.0 - a_next) / (1.0 - a) * (1.0 - a / a_next)
        return self.eta * torch.sqrt(variance.clamp_min(0.0))

    def _direction_squared(self) -> Tensor:
        return 1.0 - self.alphas_cumprod[1:] - self._noise_scale() ** 2

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(alpha, beta, sigma)``, each ``[N]`` float64 (see the class docstring)."""
        a, a_next = self.alphas_cumprod[:-1], self.alphas_cumprod[1:]
        direction = torch.sqrt(self._direction_squared().clamp_min(0.0))
        alpha, beta = ddim_coefficients(a, a_next, direction, self.prediction)
        return alpha, beta, self._noise_scale()

    def model_timesteps(self) -> Tensor:
        """``[N]`` float64: the timestep a discrete-time model is called at at ``t_0..t_{N-1}``."""
        return self.times[:-1] * self.num_train_timesteps + self.timestep_shift

    # -- the diffusion interpolant ``z = sqrt(a) x + sqrt(1 - a) eps`` ----------------------

    def noised(self, data: Tensor, k: int, noise: Tensor) -> Tensor:
        """``sqrt(a_k) data + sqrt(1 - a_k) noise`` (diffusers' ``add_noise`` at ``t_k``)."""
        a = float(self.alphas_cumprod[k])
        return math.sqrt(a) * data + math.sqrt(1.0 - a) * noise

    def jump_to_end(self, k: int) -> tuple[float, float]:
        """``(a, b)`` in ``z^_N = a z_k + b v_k``: the deterministic DDIM step from ``t_k``
        straight to ``t_N`` (with ``alphas_cumprod[N] = 1``, the x0 prediction)."""
        a, a_end = self.alphas_cumprod[k], self.alphas_cumprod[-1]
        alpha, beta = ddim_coefficients(a, a_end, torch.sqrt(1.0 - a_end), self.prediction)
        return float(alpha), float(beta)

    def _options(self) -> str:
        return f", prediction={self.prediction!r}, eta={self.eta:g}"
