"""Small analytic test problems shared by the tests, benchmarks, ``gradest check`` and
plugin authors' tests (re-exported by :mod:`gradest.testing`).

Everything here is deterministic given a seed and sized for dense Jacobians.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor, nn

from gradest.diffusion_samplers import DDIM
from gradest.models.mlp import MLPVelocity
from gradest.objectives import StepwiseObjective, TerminalObjective, flow_matching_trajectory
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory


class AffineVelocity(nn.Module):
    """``v(z, t) = W z + t u + b``: affine in ``(z, t)``, so ``J_t`` is affine along a
    straight path and linear JAGG interpolation is exact there."""

    def __init__(self, dim: int, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(
            0.5 * torch.randn(dim, dim, generator=gen, dtype=dtype) / dim**0.5
        )
        self.time_direction = nn.Parameter(torch.randn(dim, generator=gen, dtype=dtype))
        self.bias = nn.Parameter(torch.randn(dim, generator=gen, dtype=dtype))

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        return z @ self.weight.T + t[:, None] * self.time_direction + self.bias


@attrs.frozen(eq=False, init=False)
class NoisyAffineSampler:
    """A sampler of the general affine form, for tests: ``alpha_k = 1 + drift h_k`` (not 1),
    ``beta_k = h_k`` and recorded step noise of scale ``noise_scale``.

    DDIM and flow-SDE samplers have this shape. Estimators see only the step form, so one
    that passes on this sampler needs no sampler-specific code; the one-step weights
    ``beta_k prod_{j>k} alpha_j`` of sdo are not just ``h_k`` here.
    """

    times: Tensor
    drift: float
    noise_scale: float

    def __init__(self, steps: int, drift: float = 0.1, noise_scale: float = 0.05):
        self.__attrs_init__(  # type: ignore[attr-defined]
            times=torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64),
            drift=drift,
            noise_scale=noise_scale,
        )

    @property
    def num_steps(self) -> int:
        return self.times.numel() - 1

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        h = self.times[1:] - self.times[:-1]
        return 1.0 + self.drift * h, h, self.noise_scale * torch.ones_like(h)


def tiny_mlp(
    dim: int = 3,
    hidden: int = 8,
    depth: int = 2,
    num_classes: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> MLPVelocity:
    """A seeded :class:`~gradest.models.MLPVelocity` small enough for dense Jacobians."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLPVelocity(dim, hidden, depth, num_classes=num_classes)
    return model.to(dtype)


def perturbed_dit(config: str = "tiny", seed: int = 0, **overrides: object) -> nn.Module:
    """A seeded DiT whose adaLN-Zero (all-zero) linear layers are re-drawn from N(0, 0.02).

    A fresh adaLN-Zero DiT is the zero map and only its final layer gets a gradient; this
    makes a generic non-trivial DiT for benchmarks and comparisons (float32).
    """
    from gradest.models.dit import DiT

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiT.from_config(config, **overrides)
        for module in model.modules():
            if isinstance(module, nn.Linear) and bool((module.weight == 0).all()):
                nn.init.normal_(module.weight, std=0.02)
    return model


def seeded_normal(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """A standard normal tensor of ``shape`` drawn from its own generator seeded ``seed``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def smooth_terminal_objective(dim: int, seed: int = 1) -> TerminalObjective:
    """A smooth non-quadratic loss on the final sample: ``sum sin(z . w)^2 + 0.1 |z|^2``."""
    weights = seeded_normal((dim,), seed)

    def loss_fn(z: Tensor) -> Tensor:
        w = weights.to(z.dtype)
        return torch.sin(z * w).pow(2).sum() + 0.1 * z.pow(2).sum()

    return TerminalObjective(loss_fn)


def random_stepwise_objective(
    num_steps: int, state_shape: tuple[int, ...], seed: int = 2
) -> StepwiseObjective:
    """``l_k(v) = <w_k, v> + 0.5 |v - m_k|^2 / N``: different cotangents at every step."""
    linear = seeded_normal((num_steps, *state_shape), seed)
    centres = seeded_normal((num_steps, *state_shape), seed + 1)

    def loss_fn(k: int, v: Tensor, trajectory: Trajectory) -> Tensor:
        del trajectory
        w, m = linear[k].to(v.dtype), centres[k].to(v.dtype)
        return (w * v).sum() + 0.5 * (v - m).pow(2).sum() / num_steps

    return StepwiseObjective(loss_fn)


def straight_trajectory(
    sampler: AffineSampler, batch: int, dim: int, seed: int = 3, dtype: torch.dtype = torch.float64
) -> Trajectory:
    """Interpolants ``(1 - t) x + t eps`` on the sampler's grid: a straight recorded path."""
    data = seeded_normal((batch, dim), seed, dtype)
    noise = seeded_normal((batch, dim), seed + 1, dtype)
    return flow_matching_trajectory(sampler, data, noise)


def five_step_ddim(eta: float = 0.5) -> DDIM:
    """A 5-step DDIM on the DDPM linear schedule (``beta`` 1e-4 .. 0.02 over 1000 steps;
    timesteps 999 .. 199, final level 1): ``alpha_j != 1``, unlike rectified flow, so a
    test sees the sampler's linear part; ``eta > 0`` makes it stochastic (DDPM-like)."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas = torch.cumprod(1 - betas, 0)
    timesteps = torch.tensor([999, 799, 599, 399, 199])
    return DDIM(
        times=torch.cat([timesteps / 1000, torch.zeros(1, dtype=torch.float64)]),
        alphas_cumprod=torch.cat([alphas[timesteps], torch.ones(1, dtype=torch.float64)]),
        eta=eta,
    )


def perturb_parameters(model: nn.Module, scale: float = 0.05, seed: int = 3) -> nn.Module:
    """Add seeded ``N(0, scale^2)`` noise to every parameter of ``model`` in place (a model
    after an update: a policy that differs from its reference); returns ``model``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model
