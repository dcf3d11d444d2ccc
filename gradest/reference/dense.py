"""Dense per-step Jacobians and the exact gradient by explicit matrix products.

Ground truth for small models, deliberately independent of :mod:`gradest.vjp`: the
model's output-by-parameter Jacobian ``J_k`` and output-by-state Jacobian ``A_k`` are
materialised with ``torch.func.jacrev`` at every recorded state, and the adjoint and the
gradient ``sum_k J_k^T c_k`` are formed as matrix-vector products in float64.

Memory is ``N * D * (P + D)`` floats (``D`` = batch x state size, ``P`` = trainable
parameter count): meant for models with up to a few thousand parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.func import functional_call, jacrev

from gradest.conditioning import model_kwargs
from gradest.model_lock import compiled_code_eager, tensors_restored
from gradest.objectives import Objective, StepwiseObjective, TerminalObjective
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory


@attrs.frozen(eq=False)
class DenseChain:
    """Dense Jacobians of every step of a recorded trajectory (float64, flattened).

    Attributes:
        trajectory: the recorded path (states as data).
        names: trainable parameter names in ``named_parameters`` order.
        shapes: their shapes.
        velocities: ``[N, D]`` model velocities at the recorded states.
        param_jacobians: ``[N, D, P]``, ``J_k = dv_k / dtheta``.
        state_jacobians: ``[N, D, D]``, ``A_k = dv_k / dz_k``.
        alpha, beta: ``[N]`` step coefficients of the sampler.
        evaluate: ``evaluate(z, t) -> (v, J, A)`` flattened like the rows above, for any
            state ``z`` shaped like one recorded state (estimators that leave the recorded
            chain, ``draft_lv``, are defined at states of their own).
        sampler: the sampler the chain was built for (its interpolant, ``noised`` /
            ``jump_to_end``, defines ``draft_lv`` and ``refl``); None if not given.
    """

    trajectory: Trajectory
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    velocities: Tensor
    param_jacobians: Tensor
    state_jacobians: Tensor
    alpha: Tensor
    beta: Tensor
    evaluate: Callable[[Tensor, float], tuple[Tensor, Tensor, Tensor]]
    sampler: Any = None

    @property
    def num_steps(self) -> int:
        return self.velocities.shape[0]

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """A flat ``[P]`` gradient as a ``named_parameters``-keyed dict."""
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            size = shape.numel()
            out[name] = flat[offset : offset + size].reshape(shape)
            offset += size
        return out

    def gradient(self, cotangents: Tensor, steps: Any = None) -> Tensor:
        """``sum_k J_k^T c_k`` over ``steps`` (all by default) as a flat ``[P]`` vector."""
        steps = range(self.num_steps) if steps is None else steps
        total = torch.zeros(self.param_jacobians.shape[-1], dtype=torch.float64)
        for k in steps:
            total = total + self.param_jacobians[k].T @ cotangents[k]
        return total


def dense_chain(
    model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
) -> DenseChain:
    """Materialise ``J_k`` and ``A_k`` at every recorded state with ``jacrev`` (float64).

    ``trajectory`` was recorded on ``sampler`` (the chain keeps it as ``chain.sampler``).
    """
    cond = dict(cond or {})
    named = dict(model.named_parameters())
    trainable = {n: p.detach().to(torch.float64) for n, p in named.items() if p.requires_grad}
    others = {n: p.detach().to(torch.float64) for n, p in named.items() if not p.requires_grad}
    others.update(
        {n: b.to(torch.float64) if b.is_floating_point() else b for n, b in model.named_buffers()}
    )
    names = tuple(trainable)
    shapes = tuple(trainable[n].shape for n in names)
    flat_params = torch.cat([trainable[n].reshape(-1) for n in names])
    states = trajectory.states.to(torch.float64)
    state_shape = states.shape[1:]

    def unflatten(flat: Tensor) -> dict[str, Tensor]:
        out, offset = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            out[name] = flat[offset : offset + shape.numel()].reshape(shape)
            offset += shape.numel()
        return out

    kwargs = model_kwargs(cond or {}, state_shape[0])

    def velocity(flat: Tensor, z_flat: Tensor, t: Tensor) -> Tensor:
        z = z_flat.reshape(state_shape)
        times = torch.full((state_shape[0],), float(t), dtype=torch.float64)
        # Under jacrev: a torch.compile'd model runs eagerly here (gradest.model_lock).
        with tensors_restored(model), compiled_code_eager():
            v = functional_call(model, (unflatten(flat), others), (z, times), kwargs)
        return v.reshape(-1)

    def evaluate(z: Tensor, t: float) -> tuple[Tensor, Tensor, Tensor]:
        z_flat = z.to(torch.float64).reshape(-1)
        t64 = torch.as_tensor(float(t), dtype=torch.float64)
        return (
            velocity(flat_params, z_flat, t64).detach(),
            jacrev(velocity, argnums=0)(flat_params, z_flat, t64).detach(),
            jacrev(velocity, argnums=1)(flat_params, z_flat, t64).detach(),
        )

    rows = [evaluate(states[k], float(sampler.times[k])) for k in range(sampler.num_steps)]
    alpha, beta, _ = sampler.coefficients()
    return DenseChain(
        trajectory=trajectory,
        names=names,
        shapes=shapes,
        velocities=torch.stack([row[0] for row in rows]),
        param_jacobians=torch.stack([row[1] for row in rows]),
        state_jacobians=torch.stack([row[2] for row in rows]),
        alpha=alpha,
        beta=beta,
        evaluate=evaluate,
        sampler=sampler,
    )


def loss_gradient(state: Tensor, objective: TerminalObjective) -> Tensor:
    """``grad l(state)`` of the terminal loss, flat ``[D]`` (float64 in, float64 out)."""
    leaf = state.detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(objective.loss_fn(leaf).sum(), leaf)
    return grad.reshape(-1)


def terminal_adjoints(chain: DenseChain, objective: TerminalObjective) -> Tensor:
    """``a_0 .. a_N`` by ``a_k = alpha_k a_{k+1} + beta_k A_k^T a_{k+1}``: ``[N+1, D]``."""
    adjoints = [loss_gradient(chain.trajectory.states[-1], objective)]
    for k in reversed(range(chain.num_steps)):
        a_next = adjoints[0]
        adjoints.insert(
            0, chain.alpha[k] * a_next + chain.beta[k] * chain.state_jacobians[k].T @ a_next
        )
    return torch.stack(adjoints)


def exact_cotangents(chain: DenseChain, objective: Objective) -> Tensor:
    """Exact ``c_k`` (``[N, D]``): ``beta_k a_{k+1}`` (terminal) or ``d l_k/d v_k`` (stepwise)."""
    if isinstance(objective, TerminalObjective):
        adjoints = terminal_adjoints(chain, objective)
        return chain.beta[:, None] * adjoints[1:]
    cotangents = []
    shape = chain.trajectory.states.shape[1:]
    for k in range(chain.num_steps):
        v = chain.velocities[k].reshape(shape).detach().requires_grad_(True)
        with torch.enable_grad():
            assert isinstance(objective, StepwiseObjective)
            loss = objective.loss_fn(k, v, chain.trajectory)
            (grad,) = torch.autograd.grad(loss, v, allow_unused=True)
        cotangents.append(torch.zeros_like(v).reshape(-1) if grad is None else grad.reshape(-1))
    return torch.stack(cotangents)


def exact_gradient(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
    *,
    chain: DenseChain | None = None,
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The exact gradient ``sum_k J_k^T c_k`` and, for terminal objectives, ``a_0``.

    Returns:
        ``(grads keyed like named_parameters, noise gradient or None)``.
    """
    chain = chain or dense_chain(model, sampler, trajectory, cond)
    cotangents = exact_cotangents(chain, objective)
    grads = chain.unflatten(chain.gradient(cotangents))
    return grads, exact_noise_grad(chain, objective)


def exact_noise_grad(chain: DenseChain, objective: Objective) -> Tensor | None:
    """``a_0`` shaped like the noise for a terminal objective; None for a stepwise one."""
    if not isinstance(objective, TerminalObjective):
        return None
    return terminal_adjoints(chain, objective)[0].reshape(chain.trajectory.states.shape[1:])


def relative_error(
    estimate: Mapping[str, Tensor] | Tensor, truth: Mapping[str, Tensor] | Tensor
) -> float:
    """``||estimate - truth|| / ||truth||`` over all parameters (flattened)."""

    def flat(x: Mapping[str, Tensor] | Tensor) -> Tensor:
        if isinstance(x, Tensor):
            return x.reshape(-1).to(torch.float64)
        return torch.cat([g.reshape(-1).to(torch.float64) for g in x.values()])

    a, b = flat(estimate), flat(truth)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
