"""How much of a perturbation of ``z_k`` survives to ``z_N``: the chain's contraction.

The sampler's step ``z_{j+1} = alpha_j z_j + beta_j v(z_j, t_j) + sigma_j xi_j`` has the
state Jacobian ``A_j = alpha_j I + beta_j dv_j/dz_j`` (the recorded noise ``xi_j`` is
data, so a stochastic sampler's Jacobian is the same formula), and a perturbation of
``z_k`` reaches the sample through ``dz_N/dz_k = A_{N-1} ... A_k``. Its operator norm
(largest singular value) is the condition SDO's error bound rests on (arXiv 2505.07477,
Theorem 4.1: the one-step shortcut drops exactly these products, and its bound assumes
the chain contracts); :func:`chain_contraction` measures it on a recorded trajectory,
per step and per sample, without forming a Jacobian.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import check_generator, check_model_modes, check_model_output
from gradest.conditioning import check_cond, model_kwargs
from gradest.errors import InvalidType, InvalidValue
from gradest.model_lock import compiled_code_eager
from gradest.samplers import AffineSampler
from gradest.trajectory import (
    Trajectory,
    check_model_fits_sampler,
    check_sampler,
    check_trajectory_matches,
    host_coefficients,
    model_time,
)
from gradest.vjp.model_call import unwrap_data_parallel

__all__ = ["ChainContraction", "chain_contraction"]


@attrs.frozen(eq=False)
class ChainContraction:
    """The largest singular value of ``dz_N/dz_k`` on a recorded trajectory, per sample.

    Attributes:
        steps: the measured steps ``k``, increasing.
        num_steps: ``N``, the sampler's number of steps.
        norms: ``[len(steps), B]`` float64 (CPU): the estimate of ``||dz_N/dz_k||_2`` of
            each sample's chain (the samples of a batch are independent chains). The
            estimate is a lower bound that power iteration raises towards the norm.
        change: ``[len(steps), B]`` float64: the estimate's relative change in the last
            iteration, ``|s_T - s_{T-1}| / s_T``; near 0 where it has converged.
        iters: the power iterations run.
    """

    steps: tuple[int, ...]
    num_steps: int
    norms: Tensor
    change: Tensor
    iters: int

    @property
    def mean(self) -> Tensor:
        """``[len(steps)]``: the norm of each step, mean over the samples."""
        return self.norms.mean(dim=1)

    @property
    def max(self) -> Tensor:
        """``[len(steps)]``: the norm of each step, largest over the samples."""
        return self.norms.amax(dim=1)

    def summary(self) -> dict[str, Any]:
        """The measurement as JSON values (what ``gradest compare``'s report holds).

        ``mean`` / ``max`` per measured step (over the samples); ``at_start`` the mean at
        the first measured step (``start_step``, 0 unless ``steps`` left it out);
        ``at_middle`` the mean at ``middle_step = N // 2`` (None if not measured);
        ``largest`` the largest mean and its ``largest_step``; ``per_step`` the geometric
        mean of one step's factor, ``at_start ** (1 / (N - start_step))`` (the factor that,
        compounded over the remaining steps, gives ``at_start``: below 1 the chain
        contracts on average); ``last_change`` the largest last relative change of any
        step and sample (the convergence of the power iteration).
        """
        mean = self.mean.tolist()
        start, middle = self.steps[0], self.num_steps // 2
        largest = max(range(len(mean)), key=mean.__getitem__)
        at_start = mean[0]
        return {
            "iters": self.iters,
            "samples": int(self.norms.shape[1]),
            "steps": list(self.steps),
            "mean": mean,
            "max": self.max.tolist(),
            "start_step": start,
            "at_start": at_start,
            "middle_step": middle,
            "at_middle": mean[self.steps.index(middle)] if middle in self.steps else None,
            "largest_step": self.steps[largest],
            "largest": mean[largest],
            "per_step": at_start ** (1.0 / (self.num_steps - start)),
            "last_change": float(self.change.max()),
        }


def chain_contraction(
    model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
    *,
    iters: int = 8,
    steps: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    chunk: int | None = None,
) -> ChainContraction:
    """Estimate ``||dz_N/dz_k||_2`` at every step ``k`` of a recorded trajectory.

    ``dz_N/dz_k = A_{N-1} ... A_k`` with ``A_j = alpha_j I + beta_j dv_j/dz_j`` evaluated
    at the recorded states (docs/design.md#notation); each sample of the batch is its own
    chain, so each gets its own norm. The largest singular value ``s`` of ``M = dz_N/dz_k``
    is found by power iteration on ``M^T M`` from a random unit start vector per step and
    sample (drawn from ``generator``): each iteration applies ``M`` (a sweep of JVPs,
    forward from step ``k``) and ``M^T`` (a sweep of VJPs, the adjoint recursion back to
    ``k``), and estimates ``s ~ ||M^T x|| / ||x||`` at ``x = M w``, a lower bound whose
    relative error falls like ``(s_2 / s)^(4 T)`` after ``T`` iterations (``s_2`` the second
    singular value; the vector's angle falls like ``(s_2 / s)^(2 T)`` and the estimate's
    error is quadratic in it). The last iteration's relative change is returned with it.

    Cost: every measured step needs its own vectors, so the chains of all measured steps
    run together: chain ``k`` joins the forward sweep at step ``k`` and leaves the backward
    sweep there, and step ``j``'s JVP (or VJP) is one model call on the stacked states of
    every chain that passes step ``j`` (``m_j`` of them, ``B`` rows each; the model must
    treat rows independently, as gradest's batched calls assume). One iteration is ``N``
    JVP calls and ``N`` VJP calls on ``sum_j m_j B`` rows each way: ``N (N + 1) / 2 x B``
    rows when every step is measured, about ``(N + 1) / 2`` rollouts' worth of rows
    each way, against ``N`` separate sweeps per step, ``N^2`` calls, for the same rows.
    A JVP (``torch.func.jvp``) evaluates the forward with it and costs about 2-3
    forwards, a VJP a forward and a backward. ``steps`` measures fewer steps for less
    (chain ``k`` costs ``N - k`` rows of each), ``chunk`` bounds the rows of one call.

    The model is evaluated as it is (``model.eval()`` first if it has dropout), under
    ``torch.no_grad`` (nothing lands in ``.grad``), with scaled-dot-product attention on
    its math kernel (the fused kernels have no forward-mode derivative; the math kernel
    computes the same function).

    Args:
        model: the velocity model, ``model(z, t, **cond)``.
        sampler: the sampler ``trajectory`` was recorded on (its coefficients give
            ``alpha_j``, ``beta_j``).
        trajectory: a recorded path (:func:`gradest.rollout`).
        cond: the conditioning the trajectory was recorded with.
        iters: power iterations, ``>= 1``.
        steps: the steps ``k`` to measure, each in ``0 .. N-1`` and none twice (all by
            default); the result lists them in increasing order.
        generator: draws the start vectors (the global generator if None).
        chunk: at most this many chains stacked in one model call (all by default).

    Returns:
        A :class:`ChainContraction`.

    Raises:
        InvalidType / InvalidValue: a bad argument, in one line naming it.
    """
    check_model_modes(model)
    check_sampler(sampler)
    check_model_fits_sampler(model, sampler)
    check_trajectory_matches(sampler, trajectory)
    states = trajectory.states
    batch = states.shape[1]
    cond = check_cond(cond, batch)
    check_count("iters", iters)
    if chunk is not None:
        check_count("chunk", chunk)
    measured = _measured_steps(steps, sampler.num_steps)
    generator = check_generator(generator, like=states)

    alpha, beta, _ = host_coefficients(sampler.coefficients())
    jacobians = RecordedJacobians(
        unwrap_data_parallel(model), trajectory, sampler.times.tolist(), cond, chunk
    )
    shape = (len(measured), *states.shape[1:])
    device = states.device if generator is None else generator.device
    start = torch.randn(shape, generator=generator, dtype=states.dtype, device=device)
    w = _unit(start.to(states.device))

    def forward(vectors: Tensor) -> Tensor:
        # Chain i (step measured[i]) is in the stack from step measured[i] on: the
        # measured steps are increasing, so the chains under way are always a prefix.
        out = vectors.clone()
        for j in range(measured[0], sampler.num_steps):
            m = bisect.bisect_right(measured, j)
            out[:m] = alpha[j] * out[:m] + beta[j] * jacobians.apply(j, out[:m])
        return out

    def backward(vectors: Tensor) -> Tensor:
        out = vectors.clone()
        for j in reversed(range(measured[0], sampler.num_steps)):
            m = bisect.bisect_right(measured, j)
            out[:m] = alpha[j] * out[:m] + beta[j] * jacobians.apply(j, out[:m], transpose=True)
        return out

    tiny = torch.finfo(states.dtype).tiny
    previous: Tensor | None = None
    estimate = change = torch.zeros(shape[:2], dtype=states.dtype, device=states.device)
    with jacobian_calls():
        for _ in range(iters):
            x = forward(w)
            x_norm = sample_norms(x)
            y = backward(x)
            y_norm = sample_norms(y)
            estimate = y_norm / x_norm.clamp_min(tiny)
            # The first iteration's change is against ||M w_0||, the estimate before it.
            before = x_norm if previous is None else previous
            change = (estimate - before).abs() / estimate.clamp_min(tiny)
            previous = estimate
            w = y / _expanded(y_norm.clamp_min(tiny), y)
    return ChainContraction(
        steps=tuple(measured),
        num_steps=sampler.num_steps,
        norms=estimate.to(device="cpu", dtype=torch.float64),
        change=change.to(device="cpu", dtype=torch.float64),
        iters=iters,
    )


@attrs.frozen(eq=False)
class RecordedJacobians:
    """``dv_j/dz_j`` at the recorded states, applied to stacks of per-chain vectors."""

    model: torch.nn.Module
    trajectory: Trajectory
    times: list[float]  # the grid as host floats: no device sync per call
    cond: Mapping[str, Any]
    chunk: int | None

    def apply(self, j: int, vectors: Tensor, *, transpose: bool = False) -> Tensor:
        """``dv_j/dz_j`` (or its transpose) applied to ``vectors`` ``[m, B, ...]``."""
        size = vectors.shape[0] if self.chunk is None else self.chunk
        return torch.cat(
            [
                self._apply_stacked(j, vectors[first : first + size], transpose)
                for first in range(0, vectors.shape[0], size)
            ]
        )

    def _apply_stacked(self, j: int, vectors: Tensor, transpose: bool) -> Tensor:
        copies = vectors.shape[0]
        z = self.trajectory.states[j]
        batch = z.shape[0]
        # Every chain is evaluated at the same recorded state: copies stacked on the rows.
        primal = torch.cat([z] * copies)
        t = model_time(self.times[j], primal.shape[0], primal)
        kwargs = model_kwargs(self.cond, batch, copies)

        def velocity(rows: Tensor) -> Tensor:
            v = self.model(rows, t, **kwargs)
            check_model_output(v, rows, step=j)
            return v

        flat = vectors.reshape(primal.shape)
        if transpose:
            pullback = torch.func.vjp(velocity, primal)[1]
            (out,) = pullback(flat)
        else:
            out = torch.func.jvp(velocity, (primal,), (flat,))[1]
        return out.reshape(vectors.shape)


@contextlib.contextmanager
def jacobian_calls() -> Iterator[None]:
    """No autograd graph of the parameters; torch.compile'd code eager (Dynamo does not
    trace under torch.func); attention on the math kernel, which has forward-mode AD."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), compiled_code_eager(), sdpa_kernel(SDPBackend.MATH):
        yield


def sample_norms(vectors: Tensor) -> Tensor:
    """``[m, B]``: the norm of each chain's vector of each sample."""
    return vectors.flatten(2).norm(dim=2)


def _expanded(norms: Tensor, like: Tensor) -> Tensor:
    return norms.reshape(*norms.shape, *([1] * (like.ndim - 2)))


def _unit(vectors: Tensor) -> Tensor:
    tiny = torch.finfo(vectors.dtype).tiny
    return vectors / _expanded(sample_norms(vectors).clamp_min(tiny), vectors)


def check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise InvalidValue(f"{name} must be an int >= 1, got {name}={value}")


def _measured_steps(steps: Sequence[int] | None, num_steps: int) -> list[int]:
    """``steps`` checked and sorted (every step ``0 .. N-1`` if None)."""
    if steps is None:
        return list(range(num_steps))
    if isinstance(steps, str) or not isinstance(steps, Sequence):
        raise InvalidType(f"steps must be a sequence of ints or None, got {steps!r}")
    if not steps:
        raise InvalidValue("steps is empty; pass None to measure every step")
    for k in steps:
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidType(f"steps must hold ints, got {k!r} in steps={list(steps)!r}")
        if not 0 <= k < num_steps:
            raise InvalidValue(
                f"steps must lie in 0 .. N-1 = 0 .. {num_steps - 1} (the sampler's steps), "
                f"got {k} in steps={list(steps)!r}"
            )
    if len(set(steps)) != len(steps):
        raise InvalidValue(f"steps lists a step twice: steps={list(steps)!r}")
    return sorted(steps)
