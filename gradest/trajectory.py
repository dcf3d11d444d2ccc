"""Recorded trajectories, the one sampling loop, and the no-graph rollout.

Samplers (:mod:`gradest.samplers`) give a grid and the coefficients of the affine step
``z_{k+1} = alpha_k z_k + beta_k v_k + sigma_k xi_k``; this module runs them:
:func:`draw_step_noise` draws every ``xi_k`` up front from the generator (never hidden
randomness inside a transform), :func:`integrate` is the loop every rollout, sweep and
fused chain in gradest runs, and :func:`rollout` records a :class:`Trajectory`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import (
    all_finite,
    check_model_output,
    is_symbolic,
    outside_fake_mode,
)
from gradest.conditioning import check_cond, model_kwargs
from gradest.errors import InvalidType, InvalidValue
from gradest.mixed_dtypes import first_call
from gradest.samplers import AffineSampler, TimeGrid, same_grid


@attrs.frozen(eq=False)
class Trajectory:
    """A recorded sampling path; plain data without a graph.

    Attributes:
        times: ``[N+1]`` float64 grid the path was sampled on.
        states: ``[N+1, B, ...]``, ``states[0]`` is the initial noise, ``states[N]`` the sample.
        velocities: ``[N, B, ...]``, the model's output at each step when it was recorded.
        step_noise: ``[N, B, ...]`` recorded ``xi_k`` of a stochastic sampler, or None.
    """

    times: Tensor
    states: Tensor
    velocities: Tensor
    step_noise: Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.velocities.shape[0]

    @property
    def batch_size(self) -> int:
        return self.states.shape[1]


def check_model_fits_sampler(model: Any, sampler: Any) -> None:
    """A model that knows how it must be sampled says so: one with a
    ``check_sampler(sampler)`` method (under a DDP wrapper too), such as
    :class:`~gradest.integrations.DiffusersVelocity`, which knows the timesteps it calls
    its network at, refuses a sampler that would call it at others."""
    for candidate in (model, getattr(model, "module", None)):
        check = getattr(candidate, "check_sampler", None)
        if callable(check):
            check(sampler)
            return


def check_sampler(sampler: Any) -> None:
    if isinstance(sampler, type) and callable(getattr(sampler, "coefficients", None)):
        raise InvalidType(
            f"sampler must be a sampler instance such as gradest.RectifiedFlow(steps=50), got "
            f"the class {sampler.__name__}; construct it first, e.g. {sampler.__name__}(steps=50)"
        )
    # gradest's own samplers first: a runtime protocol check looks up every member (~40us).
    if isinstance(sampler, TimeGrid) or isinstance(sampler, AffineSampler):
        return
    if _is_diffusers_scheduler(sampler):
        name = type(sampler).__name__
        fix = "gradest.integrations.sampler_from_scheduler(scheduler, num_inference_steps)"
        raise InvalidType(
            f"sampler must be a gradest sampler, got the diffusers scheduler {name}; "
            f"use {fix}, which takes exactly the steps its step() takes"
        )
    raise InvalidType(
        f"sampler must be a sampler such as gradest.RectifiedFlow(steps=50), "
        f"got {type(sampler).__name__} {sampler!r}"
    )


def _is_diffusers_scheduler(value: Any) -> bool:
    """A diffusers ``SchedulerMixin`` (duck-typed: a ``config`` and ``set_timesteps``)."""
    return hasattr(value, "config") and callable(getattr(value, "set_timesteps", None))


def check_trajectory_matches(sampler: AffineSampler, trajectory: Trajectory) -> None:
    """A trajectory is differentiated on the grid it was recorded on, and must be whole.

    Checks the type, that ``times`` is the sampler's grid, that ``states`` is ``[N+1, B, ...]``
    and ``velocities`` (and ``step_noise`` if given) ``[N, B, ...]`` with the same sample
    shape, floating point of one dtype, and that every state is finite.
    """
    if not isinstance(trajectory, Trajectory):
        raise InvalidType(
            f"trajectory must be a gradest.Trajectory (from gradest.rollout), "
            f"got {type(trajectory).__name__}"
        )
    fields = {"states": trajectory.states, "velocities": trajectory.velocities}
    if trajectory.step_noise is not None:
        fields["step_noise"] = trajectory.step_noise
    for name, value in fields.items():
        if not isinstance(value, Tensor) or not value.is_floating_point():
            what = f"dtype {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
            raise InvalidType(
                f"trajectory.{name} must be a floating-point tensor, got {what}; record "
                f"trajectories with gradest.rollout(model, sampler, noise)"
            )
    times = trajectory.times
    if not same_grid(times, sampler.times):
        recorded = f"{times.numel() - 1} steps" if isinstance(times, Tensor) else "no grid"
        raise InvalidValue(
            f"trajectory was recorded on a different time grid ({recorded}) "
            f"than sampler={sampler!r} ({sampler.num_steps} steps); record it with "
            f"gradest.rollout(model, sampler, noise) using the same sampler"
        )
    steps = sampler.num_steps
    states = trajectory.states
    # The messages are formatted only when raised (repr(sampler) alone costs ~50 us, and
    # this check runs at every call on a recorded path).
    if not (states.ndim >= 3 and states.shape[0] == steps + 1):
        raise InvalidValue(
            f"trajectory.states must be [N+1, B, ...] = [{steps + 1}, B, ...] for "
            f"sampler={sampler!r}, got shape {tuple(states.shape)}"
        )
    for name, value in fields.items():
        if name == "states":
            continue
        if tuple(value.shape) != (steps, *states.shape[1:]):
            raise InvalidValue(
                f"trajectory.{name} must be [N, B, ...] = {[steps, *states.shape[1:]]} to "
                f"match trajectory.states {tuple(states.shape)}, got shape {tuple(value.shape)}"
            )
        if value.dtype != states.dtype:
            raise InvalidType(
                f"trajectory.{name} has dtype {value.dtype} but trajectory.states {states.dtype}"
            )
    if not is_symbolic(states) and not all_finite(states):
        bad = sorted({int(k) for k in torch.nonzero(~torch.isfinite(states))[:, 0].tolist()})
        raise InvalidValue(
            f"trajectory.states contains NaN or Inf at steps {bad[:8]}; the rollout that "
            f"recorded it diverged"
        )


def model_time(t: Tensor | float, batch: int, like: Tensor) -> Tensor:
    """The model's time argument: shape ``[B]`` in the state's dtype and device."""
    return torch.full((batch,), float(t), dtype=like.dtype, device=like.device)


def draw_step_noise(
    sigma: Tensor | Sequence[float], like: Tensor, generator: torch.Generator | None
) -> Tensor | None:
    """Pre-sample ``xi_k`` for a stochastic sampler (never hidden randomness inside vmap).

    ``sigma`` as host floats (:func:`host_coefficients`) decides without a tensor op."""
    if isinstance(sigma, Tensor):
        with outside_fake_mode():  # the schedule: real values under FakeTensorMode
            stochastic = bool((sigma != 0).any())
    else:
        stochastic = any(s != 0.0 for s in sigma)
    if not stochastic:
        return None
    shape = (len(sigma), *like.shape)
    if generator is None:
        return torch.randn(shape, dtype=like.dtype, device=like.device)
    return torch.randn(shape, dtype=like.dtype, generator=generator, device=generator.device).to(
        like.device
    )


def host_coefficients(
    coefficients: tuple[Tensor, Tensor, Tensor] | tuple[Sequence[float], ...],
) -> tuple[list[float], list[float], list[float]]:
    """The sampler's ``(alpha, beta, sigma)`` as host floats: one transfer per call, so
    that a loop over the steps never synchronises per step (``float(alpha[k])``). Lists
    (already host floats) are passed through as they are."""
    if all(isinstance(c, list) for c in coefficients):
        return coefficients  # type: ignore[return-value]
    with outside_fake_mode():
        alpha, beta, sigma = (
            c.tolist() if isinstance(c, Tensor) else [float(x) for x in c] for c in coefficients
        )
    return alpha, beta, sigma


def affine_step(
    coefficients: tuple[Tensor, Tensor, Tensor] | tuple[Sequence[float], ...],
    k: int,
    z: Tensor,
    v: Tensor,
    step_noise: Tensor | None,
) -> Tensor:
    """``z_{k+1} = alpha_k z_k + beta_k v_k + sigma_k xi_k`` (differentiable in z and v).

    ``coefficients`` as host floats (:func:`host_coefficients`) cost no host sync; as
    tensors, three per step.
    """
    alpha, beta, sigma = coefficients
    scale = float(alpha[k])
    # alpha = 1 (Euler) skips a multiply and its backward node; z * 1.0 == z exactly.
    out = (z if scale == 1.0 else z * scale) + v * float(beta[k])
    if step_noise is not None and float(sigma[k]) != 0.0:
        out = out + float(sigma[k]) * step_noise[k]
    return out


@attrs.frozen(eq=False)
class SamplerSteps:
    """What a chain needs of its sampler: the affine step coefficients ``(alpha, beta,
    sigma)``, the time grid and the recorded step noise (None for a deterministic one);
    ``host_coefficients`` are the coefficients as host floats (computed from them when not
    given), which the step loops read."""

    coefficients: tuple[Tensor, Tensor, Tensor]
    times: Tensor
    step_noise: Tensor | None
    host_coefficients: tuple[list[float], list[float], list[float]] = attrs.field(
        default=attrs.Factory(lambda self: host_coefficients(self.coefficients), takes_self=True)
    )


def integrate(
    velocity: Callable[[int, Tensor], Tensor],
    coefficients: tuple[Tensor, Tensor, Tensor] | tuple[Sequence[float], ...],
    z: Tensor,
    step_noise: Tensor | None,
    steps: range,
    *,
    pin: Callable[[int, Tensor], Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """The sampling loop: ``z_{k+1} = alpha_k z_k + beta_k velocity(k, z_k) + sigma_k xi_k``.

    The one loop every rollout, sweep and fused chain in gradest runs; graph or no graph
    is the caller's choice (``velocity`` and the grad mode around the call).

    Args:
        velocity: ``velocity(k, z_k) -> v_k``.
        coefficients: the sampler's ``(alpha, beta, sigma)``.
        z: the state at ``steps.start``.
        step_noise: recorded ``xi`` for every step of the sampler, or None.
        steps: consecutive step indices.
        pin: ``pin(k, z_k) -> z_k`` applied to every state after the first (and to the
            last), e.g. to hold a chain's values to a recorded path.

    Returns:
        ``(states, velocities)``: ``len(steps) + 1`` states and ``len(steps)`` velocities.
    """
    states, velocities = [z], []
    host = host_coefficients(coefficients)  # one transfer, not three syncs per step
    for k in steps:
        if pin is not None and k != steps.start:
            z = states[-1] = pin(k, z)
        v = velocity(k, z)
        if not isinstance(v, Tensor) or v.shape != z.shape or not v.is_floating_point():
            # Host metadata only (no sync): a model whose output changes at a late step
            # fails naming that step, not deep inside the affine step.
            check_model_output(v, z, step=k)
        velocities.append(v)
        z = affine_step(host, k, z, v, step_noise)
        states.append(z)
    if pin is not None and len(steps):
        states[-1] = pin(steps.stop, states[-1])
    return states, velocities


def rollout(
    model: torch.nn.Module,
    sampler: AffineSampler,
    noise: Tensor,
    cond: Mapping[str, Any] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Sample ``model`` along ``sampler`` from ``noise`` without a graph.

    Args:
        model: called as ``model(z, t, **cond)`` with ``t`` of shape ``[B]``.
        sampler: the sampler (e.g. :class:`RectifiedFlow`).
        noise: ``[B, ...]`` initial state at ``sampler.times[0]``.
        cond: keyword arguments passed to every model call (class labels, text embeddings).
        generator: source of the step noise for stochastic samplers.

    Returns:
        A detached :class:`Trajectory`.
    """
    from gradest._checks import check_allocation, check_generator, check_noise

    check_sampler(sampler)
    check_model_fits_sampler(model, sampler)
    check_noise(model, noise)
    # The recording holds N+1 states and N velocities of the noise's size.
    check_allocation(
        f"sampler={sampler!r} on noise of shape {tuple(noise.shape)}",
        2 * sampler.num_steps + 1,
        noise.numel() * noise.element_size(),
        name="2 * steps + 1",
        device=noise.device,
        detail="the recorded states and velocities",
    )
    cond = check_cond(cond, noise.shape[0])
    check_generator(generator)
    with outside_fake_mode():  # the schedule is a host object, real under FakeTensorMode
        coefficients = sampler.coefficients()
        times = sampler.times.tolist()  # host floats: no sync per step
    step_noise = draw_step_noise(coefficients[2], noise, generator)

    kwargs = model_kwargs(cond, noise.shape[0])

    def velocity(k: int, z: Tensor) -> Tensor:
        t = model_time(times[k], z.shape[0], z)
        if k == 0:
            return first_call(model, z, t, kwargs, cond_given=cond, batch_size=noise.shape[0])
        return model(z, t, **kwargs)

    with torch.no_grad():
        states, velocities = integrate(
            velocity, coefficients, noise.detach(), step_noise, range(sampler.num_steps)
        )
    return Trajectory(
        times=sampler.times.clone(),
        states=torch.stack(states),
        velocities=torch.stack(velocities),
        step_noise=step_noise,
    )
