r"""Adjoint matching (Domingo-Enrich, Drozdzal, Karrer, Chen, ICLR 2025) as a stepwise objective.

Adjoint matching fine-tunes a flow model towards the *tilted* distribution
``p*(x) ∝ p_base(x) exp(-l(x))`` (``l`` a loss, e.g. ``-reward``) by regressing the
fine-tuned model's control onto a "lean adjoint" that is computed along trajectories of
the current model with state-only VJPs of the frozen base model. Every term is data except
the fine-tuned velocity ``v_k``, so the loss is a :class:`gradest.StepwiseObjective` and
any estimator differentiates it.

Derivation in gradest's conventions
-----------------------------------
gradest's time runs ``t: 1 (noise) -> 0 (data)`` with ``z_t = (1 - t) x + t eps`` and
velocity ``v = E[eps - x | z_t]``; the paper's time is ``s = 1 - t`` with
``X_s = s x + (1 - s) eps`` (its ``alpha_s = s``, ``beta_s = 1 - s``) and velocity
``v_paper = -v``.

*Memoryless schedule.* The paper's family of generative SDEs with the flow's marginals is
``dX = [kappa_s X + (sigma(s)^2 / 2 + eta_s) score] ds + sigma(s) dB`` with
``kappa_s = alpha'_s / alpha_s = 1 / s`` and
``eta_s = beta_s (alpha'_s beta_s / alpha_s - beta'_s) = (1 - s) / s``; the memoryless
schedule is ``sigma(s)^2 = 2 eta_s = 2 (1 - s) / s``, i.e. ``sigma_t = sqrt(2 t / (1 - t))``
in gradest's time. :class:`~gradest.FlowSDE` uses ``sigma_t = a sqrt(t / (1 - t))``, so the
memoryless SDE is ``FlowSDE(noise_level=sqrt(2))``'s. Its drift (in ``dt < 0``) is
``B(z, t) = z / (1 - t) + 2 v(z, t)``, the paper's ``b = 2 v_paper - kappa X`` with the
sign of time flipped. Its Euler-Maruyama steps (``alpha_k = 1 + h_k / (1 - t_k)``,
``beta_k = 2 h_k``, ``s_k^2 = 2 t_k |h_k| / (1 - t_k)``) are far off near ``t = 1``, where
``z / (1 - t)`` is stiff (at ``t_0 = 1`` FlowSDE's substitution gives ``alpha_0 = 0``,
``s_0^2 = 2``, and the next marginals are ~50% too wide), so :func:`memoryless_flow`
(:class:`MemorylessFlow`) takes each step as the SDE's exact Gaussian transition given the
step's data prediction ``z_k - t_k v_k`` (DDPM's posterior; the same steps to ``O(h^2)``
away from ``t = 1``; its first step forgets ``z_0`` but through ``v_0``). With it the base
chain's final sample is (in continuous time exactly, on a grid nearly) independent of the
initial noise, which is what makes the optimum of the control problem the tilted
distribution rather than a tilt of each ``z_0``'s conditional.

*The control problem, discretely.* gradest's chain takes affine Gaussian steps
``z_{k+1} = alpha_k z_k + beta_k v_k + s_k xi_k``. Between the fine-tuned and the base
chain each step's KL is ``beta_k^2 ||v_theta - v_base||^2 / (2 s_k^2)`` (equal
variances), the discrete form of the paper's ``int 1/2 ||u||^2 ds`` with the control
``u = sigma^{-1} (b_fine - b_base) = 2 (v_paper,fine - v_paper,base) / sigma``. The
objective is ``E[sum_k beta_k^2 ||v_theta,k - v_base,k||^2 / (2 s_k^2) + l(z_N)]``.

*Lean adjoint.* ``a_N = grad l(z_N)`` per sample (a *loss* gradient: we minimise), and
backwards along the recorded states, with the base model only::

    a_k = (alpha_k I + beta_k d v_base(z_k, t_k) / d z_k)^T a_{k+1}

This is the exact adjoint of the discrete base chain (the Jacobian at the step's start
state). In the limit ``a_k - a_{k+1} = h_k (dB_base/dz)^T a_{k+1}``, i.e.
``da/dt = -(dB_base/dz)^T a``; with ``s = 1 - t`` and ``b = -B`` this is the paper's lean
adjoint ODE ``d a/ds = -(d b_base / dX)^T a``, ``a(1) = grad g(X_1)``. The paper's
Algorithm 1 takes the Jacobian at the later state of the step instead; both are
first-order in ``h``, and this one is what the dense test pins.

*Regression loss.* The paper's ``1/2 ||u + sigma a||^2``, in gradest's velocities
(``u = -2 (v_theta - v_base) / sigma``), is ``1/2 ||2 (v_theta - v_base) / sigma - sigma a||^2``
per unit time. Its discrete form on the affine steps, with ``beta_k / s_k ≈ -2 sqrt|h_k| / sigma``
and ``s_k ≈ sigma sqrt|h_k|``, is::

    l_k(v_k) = (1 / B) sum_b 1/2 || (beta_k / s_k) (v_k - v_base,k) + s_k a_{k+1} ||^2

``= |h_k| 1/2 ||2 (v - v_base) / sigma(t_k) - sigma(t_k) a_{k+1}||^2 + O(h^2)``, the
Riemann sum of the paper's loss (its Algorithm 1 drops the constant ``|h| / 2``). Its
cotangent is ``c_k = (beta_k^2 / s_k^2)(v_k - v_base,k) + beta_k a_{k+1}`` (over ``B``): the
control cost's gradient plus ``beta_k a_{k+1}``, the exact step cotangent of the terminal
loss. So at ``theta = base`` (``v = v_base``, where the lean adjoint is the full adjoint)
the adjoint-matching gradient is exactly gradest's ``exact`` gradient of the terminal
objective ``mean_b l(z_N)`` on the same recorded trajectory, the gradient of the control
objective: the first update moves along the reward gradient. Its minimiser in ``v_k`` is
``v_base,k - (s_k^2 / beta_k) E[a_{k+1} | z_k]`` (``≈ v_base + sigma^2 E[a] / 2``), which for
a linear loss is the optimal control of the discrete problem exactly.

The regression targets (``a_{k+1}``, ``v_base,k``) are computed once per batch of
rollouts (:func:`lean_adjoint`: ``N`` base forwards with a graph in the state and ``N``
state-only VJPs, no parameter gradient); sample the batch from the *current* model with
:func:`memoryless_flow` (any stochastic affine sampler is accepted: the discrete problem
above is well defined on any, but only the memoryless schedule tilts the final marginal).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import check_model
from gradest.conditioning import check_cond, model_kwargs
from gradest.errors import InvalidType, InvalidValue
from gradest.objectives import StepwiseObjective
from gradest.rl._common import check_recorded, checked_path
from gradest.samplers import AffineSampler, FlowSDE
from gradest.trajectory import Trajectory, model_time

MEMORYLESS_NOISE_LEVEL = math.sqrt(2.0)
"""``sqrt(2)``: the noise level of ``FlowSDE`` that makes its SDE memoryless."""
# MemorylessFlow takes Euler-Maruyama steps where |h_k| <= this * (1 - t_k), exact
# Gaussian steps given the data prediction before (tests/test_memoryless.py).
STIFFNESS_SWITCH = 0.2

Loss = Callable[[Tensor], Tensor]


@attrs.frozen(eq=False, repr=False, init=False)
class MemorylessFlow(FlowSDE):  # type: ignore[override]
    """The memoryless SDE of rectified flow (``sigma_t = sqrt(2 t / (1 - t))``), each step
    solved exactly given the step's data prediction ``x^ = z_k - t_k v_k``.

    Euler-Maruyama steps of this SDE (:class:`~gradest.FlowSDE` with ``noise_level=sqrt(2)``)
    are useless near ``t = 1``, where its drift ``z / (1 - t)`` is stiff: the step from
    ``t = 1`` has ``alpha_0 = 0`` (the sigma substitution) and noise ``sqrt(2)``, and on
    ``N(0, 1)`` data a 10-step grid puts the std at ``t = 0.9 / 0.8`` at ``1.42 / 1.36``
    instead of ``0.91 / 0.82`` (still ~46% off at the end of 50 steps). Here, with
    ``x^`` held fixed over the step, the SDE is the one conditioned on ``x = x^``, whose
    transition is Gaussian and known in closed form (DDPM's posterior for the interpolant
    ``z_t = (1 - t) x + t eps``; with ``r = (1 - t) / (1 - t')`` and ``t' = t_{k+1}``)::

        z_{k+1} ~ N((1 - t') x^ + (t'^2 r / t^2)(z_k - (1 - t) x^),  (t'^2 / t^2)(t^2 - r^2 t'^2))

    i.e. ``alpha_k = (1 - t') + c t``, ``beta_k = -(1 - t') t + c (1 - t) t`` with
    ``c = t'^2 r / t^2``, and ``sigma_k = (t' / t) sqrt(t^2 - r^2 t'^2)``. These agree with
    the Euler-Maruyama coefficients to ``O(h^2)`` away from ``t = 1``, and the first step
    forgets ``z_0`` as the continuous SDE does (``alpha_0 = 1 - t_1``, ``beta_0 = -(1 - t_1)``:
    only ``x^ = z_0 - v_0`` is kept). Holding ``x^`` fixed loses a little variance per step,
    while Euler-Maruyama, once the step is short against ``1 - t``, contracts its own
    errors away (its final marginal is the more accurate), so the steps with
    ``|h_k| <= 0.2 (1 - t_k)`` (:data:`STIFFNESS_SWITCH`), and the step into ``t = 0``
    (which would otherwise be deterministic; adjoint matching needs step noise), are
    Euler-Maruyama's. On ``N(0, 1)`` data with the exact velocity the sampled std is then
    within 2% of the marginal at ``t = 0.9 / 0.8`` on 10 steps, and within 4% at every grid
    time on 20, 50 or 100 steps (tests/test_memoryless.py).
    """

    def __init__(self, steps: int | None = None, *, times: Sequence[float] | Tensor | None = None):
        FlowSDE.__init__(self, steps, times=times, noise_level=MEMORYLESS_NOISE_LEVEL)

    def _options(self) -> str:
        return ""  # the noise level is the schedule's own

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        t, t_next = self.times[:-1], self.times[1:]
        ratio = (1.0 - t) / (1.0 - t_next)
        forward_variance = (t**2 - ratio**2 * t_next**2).clamp_min(0.0)
        gain = t_next**2 * ratio / t**2
        alpha = (1.0 - t_next) + gain * t
        beta = -(1.0 - t_next) * t + gain * (1.0 - t) * t
        scale = t_next * torch.sqrt(forward_variance) / t
        em_alpha, em_beta, em_scale = FlowSDE.coefficients(self)
        # Euler-Maruyama where it is accurate (a step short against 1 - t: it contracts
        # its own errors away and keeps the final marginal to O(h^2) on Gaussian data),
        # and for the step into t = 0, which needs step noise.
        final = (t_next == 0.0) | ((t - t_next) <= STIFFNESS_SWITCH * (1.0 - t))
        return (
            torch.where(final, em_alpha, alpha),
            torch.where(final, em_beta, beta),
            torch.where(final, em_scale, scale),
        )


def memoryless_flow(
    steps: int | None = None, *, times: Sequence[float] | Tensor | None = None
) -> MemorylessFlow:
    """The memoryless sampler of rectified flow (:class:`MemorylessFlow`).

    ``sigma_t = sqrt(2 t / (1 - t))``, the paper's ``sigma(s) = sqrt(2 eta_s)`` in gradest's
    time (see the module docstring), with each step taken as the exact Gaussian transition
    given its data prediction, so that its marginals are right from the first step. A
    :class:`~gradest.FlowSDE` with ``noise_level=sqrt(2)``. Give ``steps`` (uniform grid) or
    ``times``.
    """
    return MemorylessFlow(steps, times=times)


@attrs.frozen(eq=False)
class LeanAdjoint:
    """The regression targets of adjoint matching on one recorded trajectory (all data).

    Attributes:
        adjoints: ``[N+1, B, ...]``, ``a_0 .. a_N``; ``a_N = grad l(z_N)`` per sample.
        base_velocities: ``[N, B, ...]``, ``v_base(z_k, t_k)`` at the recorded states.
        losses: ``[B]`` terminal losses ``l(z_N)`` (None when ``a_N`` was given).
    """

    adjoints: Tensor
    base_velocities: Tensor
    losses: Tensor | None


def _terminal_adjoint(loss: Any, final: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(a_N, per-sample losses)`` from a per-sample loss function or a given gradient."""
    if isinstance(loss, Tensor):
        if loss.shape != final.shape or not loss.is_floating_point():
            raise InvalidValue(
                f"loss given as a tensor must be the per-sample loss gradient at the final "
                f"state, shape {tuple(final.shape)}, got shape {tuple(loss.shape)} and dtype "
                f"{loss.dtype}; or pass a function z_final -> [B] losses"
            )
        if not bool(torch.isfinite(loss).all()):
            raise InvalidValue("loss (the terminal loss gradient) contains NaN or Inf")
        return loss.detach().to(final), None
    if not callable(loss):
        raise InvalidType(
            f"loss must be a function z_final [B, ...] -> per-sample losses [B] (e.g. "
            f"lambda z: -reward(z)), or the loss gradient at z_final as a tensor; got "
            f"{type(loss).__name__}"
        )
    leaf = final.detach().requires_grad_(True)
    with torch.enable_grad():
        values = loss(leaf)
        batch = final.shape[0]
        if not isinstance(values, Tensor) or tuple(values.shape) != (batch,):
            raise InvalidValue(
                f"loss(z_final) must return one loss per sample, shape [{batch}], got "
                f"{_shape_of(values)}; do not reduce over the batch (a batch mean would weight "
                f"the loss 1/B against the KL to the base model): e.g. lambda z: -reward(z)"
            )
        if not values.requires_grad:
            raise InvalidValue(
                "loss(z_final) does not depend on z_final (it returned a tensor without a "
                "graph), so the lean adjoint would be zero; return a differentiable function "
                "of z_final"
            )
        (grad,) = torch.autograd.grad(values.sum(), leaf, allow_unused=True)
    if grad is None:
        raise InvalidValue("loss(z_final) does not depend on z_final; the adjoint would be zero")
    if not bool(torch.isfinite(grad).all()) or not bool(torch.isfinite(values).all()):
        raise InvalidValue("loss(z_final) or its gradient contains NaN or Inf")
    return grad.detach(), values.detach()


def _shape_of(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__


def lean_adjoint(
    base_model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    loss: Loss | Tensor,
    cond: Mapping[str, Any] | None = None,
) -> LeanAdjoint:
    """``a_k = (alpha_k I + beta_k dv_base/dz(z_k))^T a_{k+1}`` backwards from ``a_N``.

    Args:
        base_model: the frozen pretrained model, called as ``base_model(z, t, **cond)``;
            only state VJPs are taken (no parameter gradient).
        sampler: the sampler ``trajectory`` was recorded on (its ``alpha``, ``beta``).
        trajectory: a rollout of the *current* model (``gradest.rollout``).
        loss: ``loss(z_final) -> [B]`` per-sample losses (e.g. ``lambda z: -reward(z)``),
            ``a_N = d sum_b loss_b / d z_N``; or ``a_N`` itself as a ``[B, ...]`` tensor.
        cond: the model's keyword arguments (class labels, ...), as for the rollout.
    """
    check_model(base_model)
    checked_path(sampler, trajectory)
    batch = trajectory.batch_size
    kwargs = model_kwargs(check_cond(cond, batch), batch)
    states = trajectory.states
    a_next, losses = _terminal_adjoint(loss, states[-1])
    alpha, beta, _ = sampler.coefficients()
    adjoints, velocities = [a_next], []
    for k in reversed(range(trajectory.num_steps)):
        z = states[k]
        with torch.enable_grad():
            leaf = z.detach().requires_grad_(True)
            v = base_model(leaf, model_time(sampler.times[k], z.shape[0], z), **kwargs)
            if not isinstance(v, Tensor) or v.shape != z.shape:
                raise InvalidValue(
                    f"base_model returned {_shape_of(v)} at step {k} for states of shape "
                    f"{tuple(z.shape)}; it must return a velocity shaped like its input"
                )
            if v.requires_grad:
                (pulled,) = torch.autograd.grad(v, leaf, a_next, allow_unused=True)
            else:
                pulled = None
        if pulled is None:  # a model that ignores its state
            pulled = torch.zeros_like(z)
        if not (bool(torch.isfinite(v).all()) and bool(torch.isfinite(pulled).all())):
            raise InvalidValue(f"base_model's velocity or its state VJP is NaN or Inf at step {k}")
        a_next = float(alpha[k]) * a_next + float(beta[k]) * pulled.detach()
        adjoints.append(a_next)
        velocities.append(v.detach())
    return LeanAdjoint(
        adjoints=torch.stack(adjoints[::-1]),
        base_velocities=torch.stack(velocities[::-1]),
        losses=losses,
    )


def regression_objective(
    sampler: AffineSampler, trajectory: Trajectory, targets: LeanAdjoint
) -> StepwiseObjective:
    """The adjoint-matching regression ``sum_k l_k(v_k)`` on precomputed :class:`LeanAdjoint`
    targets: ``l_k = mean_b 1/2 ||(beta_k / s_k)(v_k - v_base,k) + s_k a_{k+1}||^2``, on a
    ``trajectory`` recorded on ``sampler``."""
    checked_path(sampler, trajectory)
    if not isinstance(targets, LeanAdjoint):
        raise InvalidType(
            f"targets must be a gradest.rl.LeanAdjoint (from lean_adjoint), got "
            f"{type(targets).__name__}"
        )
    steps = trajectory.num_steps
    want = (steps, *trajectory.states.shape[1:])
    if tuple(targets.base_velocities.shape) != want or tuple(targets.adjoints.shape) != (
        steps + 1,
        *want[1:],
    ):
        raise InvalidValue(
            f"targets do not belong to this trajectory: base_velocities "
            f"{tuple(targets.base_velocities.shape)}, adjoints {tuple(targets.adjoints.shape)}; "
            f"expected {list(want)} and {[steps + 1, *want[1:]]}"
        )
    _, beta, scale = sampler.coefficients()
    if bool((scale <= 0).any()) or bool((beta == 0).any()):
        bad = int(torch.nonzero((scale <= 0) | (beta == 0))[0])
        raise InvalidValue(
            f"adjoint matching needs a stochastic sampler (noise scale > 0 at every step), "
            f"but step {bad} of {sampler!r} has noise scale {float(scale[bad]):g}; sample with "
            f"gradest.rl.memoryless_flow(steps) (FlowSDE with noise_level=sqrt(2))"
        )
    ratio = (beta / scale).tolist()
    scales = scale.tolist()
    base = targets.base_velocities.detach()
    adjoints = targets.adjoints.detach()

    def loss_fn(k: int, velocity: Tensor, given: Trajectory) -> Tensor:
        check_recorded(given, trajectory, "adjoint-matching")
        residual = ratio[k] * (velocity - base[k].to(velocity)) + scales[k] * adjoints[k + 1].to(
            velocity
        )
        return 0.5 * residual.pow(2).reshape(velocity.shape[0], -1).sum(1).mean()

    return StepwiseObjective(loss_fn)


def adjoint_matching_objective(
    base_model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    loss: Loss | Tensor,
    *,
    cond: Mapping[str, Any] | None = None,
) -> StepwiseObjective:
    """Adjoint matching on a rollout of the current model, as a stepwise objective.

    Computes the lean adjoint with the frozen ``base_model`` (:func:`lean_adjoint`) and
    returns the regression loss of :func:`regression_objective`. Use it with
    ``trajectory=`` (the same one) in ``surrogate`` / ``estimate``::

        sampler = gradest.rl.memoryless_flow(steps=20)
        traj = gradest.rollout(model, sampler, noise, generator=generator)
        objective = gradest.rl.adjoint_matching_objective(
            base, sampler, traj, lambda z: -reward(z))
        est.surrogate(model, sampler, objective, trajectory=traj).loss.backward()

    Args:
        base_model: the frozen pretrained model (a copy of the model before fine-tuning).
        sampler: the stochastic sampler of the rollout (:func:`memoryless_flow`).
        trajectory: the rollout of the model being fine-tuned.
        loss: per-sample terminal losses ``loss(z_final) -> [B]`` (the tilt is
            ``exp(-loss)``; scale it to weight the reward against the KL), or the
            per-sample loss gradient at ``z_final`` as a tensor.
        cond: the models' keyword arguments.
    """
    targets = lean_adjoint(base_model, sampler, trajectory, loss, cond)
    return regression_objective(sampler, trajectory, targets)
