"""Chains of sampling steps with their graphs kept: the fused chain and the retained chain.

* :class:`ChainForward` is the forward of a chain, ``(params, z_start) -> (z_N, aux)``,
  that an engine differentiates (:meth:`gradest.vjp.VelocityField.chain`); the result
  waits for the terminal adjoint as a :class:`ChainPullback`.
* :class:`RetainedChain` keeps one graph per step, each from its own input leaf, for the
  state-only adjoint sweep and the parameter VJPs of chosen steps
  (:meth:`gradest.vjp.VelocityField.retained_chain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from gradest._checks import check_model_output, outside_fake_mode
from gradest.nonfinite import BackwardWatch, NonFiniteError, check_finite
from gradest.trajectory import SamplerSteps, integrate
from gradest.vjp.engines import Pullback
from gradest.vjp.gradients import Grads, ParamGradient, SurrogateTerms, inner
from gradest.vjp.meter import CostMeter


class ChainField(Protocol):
    """What a chain needs of the :class:`~gradest.vjp.VelocityField` that builds it: the
    field evaluates each step and counts it; the chain keeps the graphs and pulls the
    cotangents back (the field imports the chains, never the reverse)."""

    meter: CostMeter
    surrogate: bool
    params: Grads
    watch: BackwardWatch | None

    def _graph_forward(
        self,
        z: Tensor,
        times: Sequence[float],
        params: Grads | None,
        *,
        low_memory: bool,
        watched: bool = True,
    ) -> Tensor: ...

    def state_vjp(
        self, z: Tensor, t: float | Tensor, cotangent: Tensor
    ) -> tuple[Tensor, Tensor]: ...


def _retain_refused(err: RuntimeError) -> bool:
    """AOTAutograd's refusal of ``retain_graph=True`` on a backward with donated buffers."""
    return "donated buffer" in str(err).lower()


@contextmanager
def velocities_checked(velocities: list[Tensor], times: Sequence[float]) -> Iterator[list[Tensor]]:
    """Check the velocities a chain appends to ``velocities`` once, when the block ends
    (also when it raises): one finiteness sum over them all, stacked, instead of one
    per step; the error names the first non-finite step, as a check per step would
    have. The block's ``as`` target receives the stacked velocities (detached)."""
    stacked: list[Tensor] = []
    try:
        yield stacked
    finally:
        # The steps before a failing one (a model whose output changed shape at a late
        # step fails in the loop, naming that step; the earlier ones are still checked).
        count = 0
        for v in velocities:
            first = velocities[0]
            if not isinstance(v, Tensor) or v.shape != first.shape or v.dtype != first.dtype:
                break
            count += 1
        if count:
            with torch.no_grad():
                stacked.append(torch.stack(velocities[:count]).detach())
            check_finite(stacked[0], "velocity", times[:count], sequential=True)


def host_times(sampler: SamplerSteps) -> list[float]:
    """The sampler's grid as host floats (one transfer; real values under FakeTensorMode)."""
    with outside_fake_mode():
        return sampler.times.tolist()


class ChainForward:
    """Steps ``start..N-1`` with the graph kept, as a forward for an engine:
    ``(params, z_start) -> (z_N, (states [N - start + 1, B, ...], velocities))``, both
    detached.

    Args:
        field: evaluates each step (:meth:`VelocityField._graph_forward`).
        sampler: the affine steps.
        start: the first step.
        recorded: the recorded states ``[N - start + 1, B, ...]`` the chain passes
            through (surrogate mode): each state's value is pinned to the recording and
            its graph kept.
        low_memory: each step's forward recomputed in the caller's backward (surrogate).
    """

    def __init__(
        self,
        field: ChainField,
        sampler: SamplerSteps,
        start: int,
        *,
        recorded: Tensor | None,
        low_memory: bool,
    ):
        self._field = field
        self._sampler = sampler
        self._host_times = host_times(sampler)
        self.start = start
        self.steps = range(start, len(self._host_times) - 1)
        self.times = [self._host_times[k] for k in self.steps]
        self._recorded = recorded
        self._low_memory = low_memory
        # Of the call in progress (cleared when it ends: they hold the step graphs).
        self._params: Grads | None = None
        self._velocities: list[Tensor] = []

    def __call__(self, params: Grads | None, z_start: Tensor) -> tuple[Tensor, Any]:
        self._params, self._velocities = params, []
        try:
            with velocities_checked(self._velocities, self.times) as stacked:
                states, _ = integrate(
                    self._velocity,
                    self._sampler.host_coefficients,
                    z_start,
                    self._sampler.step_noise,
                    self.steps,
                    pin=self._pin,
                )
        finally:
            self._params, self._velocities = None, []
        return states[-1], (torch.stack(states).detach(), stacked[0])

    def _pin(self, k: int, z: Tensor) -> Tensor:
        if self._recorded is None or k == self.start:
            return z
        # Value of the recording, derivative of the chain (z - z.detach() is 0).
        return z - z.detach() + self._recorded[k - self.start]

    def _velocity(self, k: int, z: Tensor) -> Tensor:
        field, times = self._field, self._host_times
        v = field._graph_forward(
            z, [times[k]], self._params, low_memory=self._low_memory, watched=False
        )
        watch = field.watch
        if watch is not None:
            # Its output only: the gradient step k's model sends into z_k reaches step
            # k-1's output (z_k = alpha z_{k-1} + beta v_{k-1}), whose flag stands for it
            # (one hook a step instead of two, no alias of z_k).
            previous = None if k == self.start else [times[k - 1]]
            watch.observe_chain_step(z, v, [times[k]], previous)
        if k == self.start:
            check_model_output(v, z, step=k)
        self._velocities.append(v)
        return v


class ChainPullback:
    """A chain sampled with its graph, waiting for the terminal adjoint ``a_N``.

    Attributes:
        states: ``[N - start + 1, B, ...]`` detached.
        velocities: ``[N - start, B, ...]`` detached.
    """

    def __init__(
        self,
        field: ChainField,
        states: Tensor,
        velocities: Tensor,
        pullback: Pullback,
        times: Sequence[float],
    ):
        self.states = states
        self.velocities = velocities
        self._field = field
        self._pullback = pullback
        self._times = list(times)

    def pull(
        self,
        terminal_adjoint: Tensor,
        locate: Callable[[], NonFiniteError | None] | None = None,
    ) -> tuple[ParamGradient, Tensor | None]:
        """``(parameter gradient, gradient w.r.t. the chain's first state or None)``;
        callable once. ``locate()`` (failure path only) may name the step a non-finite
        gradient came from more precisely than the fused backward can."""
        self._field.meter.param_vjps += len(self._times)
        grads, z_grad = self._pullback(terminal_adjoint)
        if isinstance(grads, SurrogateTerms):
            return grads, None
        check_finite(grads, "parameter gradient", self._times, refine=locate)
        if z_grad is not None:
            check_finite(z_grad, "state gradient", self._times, refine=locate)
        return grads, z_grad


class RetainedChain:
    """Steps of a chain whose graphs are kept one per step, each from its own input leaf.

    Built by :meth:`VelocityField.retained_chain`. Each step ``k`` keeps the graph of
    ``v_k = v_theta(z_k)`` from a fresh leaf ``z_k`` (no graph across steps), so that the
    adjoint is swept with state-only backward passes through those graphs (about ``F``
    each, no parameter part, no recomputed forward), and the parameter VJPs of chosen
    steps are taken at the end in one backward over their graphs (about ``2F`` each):
    ``(2N + 2n)F`` for ``n`` kept steps, against ``3NF`` for the exact chain. The graphs
    of steps that are not kept are freed by their state-only backward.

    Attributes:
        states: ``[N - start + 1, B, ...]`` detached; ``velocities`` ``[N - start, B, ...]``.
        start: the first step.
    """

    def __init__(
        self,
        field: ChainField,
        start: int,
        leaves: list[Tensor],
        outputs: list[Tensor],
        states: Tensor,
        times: Sequence[float],
        *,
        velocities: Tensor | None = None,
    ):
        self._field = field
        self.start = start
        self._leaves = leaves
        self._outputs: list[Tensor | None] = list(outputs)
        self._times = list(times)
        self.states = states
        self.velocities = (
            torch.stack([v.detach() for v in outputs]) if velocities is None else velocities
        )
        self._retain_refused = False

    def state_vjp(self, k: int, cotangent: Tensor, *, keep: bool) -> Tensor:
        """``(dv_k/dz_k)^T cotangent`` through step ``k``'s graph; frees it unless ``keep``."""
        index = k - self.start
        output = self._outputs[index]
        assert output is not None, f"step {k}'s graph was already released"
        if keep and self._retain_refused:
            return self._field.state_vjp(self._leaves[index], self._times[index], cotangent)[1]
        try:
            with torch.enable_grad():
                (z_grad,) = torch.autograd.grad(
                    output, self._leaves[index], cotangent, retain_graph=keep, allow_unused=True
                )
        except RuntimeError as err:
            if not (keep and _retain_refused(err)):
                raise
            # A torch.compile'd model: AOTAutograd's compiled backward frees ("donates") its
            # saved activations, so it refuses retain_graph=True, before running (the graph
            # is intact). The kept steps' state VJPs then go through a second forward of
            # the step (one forward more per kept step, counted); the first graph stays
            # for the parameter VJP.
            self._retain_refused = True
            return self._field.state_vjp(self._leaves[index], self._times[index], cotangent)[1]
        if not keep:
            self._outputs[index] = None
        if z_grad is None:  # a model that ignores its state
            z_grad = torch.zeros_like(self._leaves[index])
        check_finite(z_grad, "state gradient", [self._times[index]])
        self._field.meter.state_vjps += 1
        return z_grad

    def release(self, k: int) -> None:
        """Drop step ``k``'s graph without a backward."""
        self._outputs[k - self.start] = None

    def param_vjp(self, steps: Sequence[int], cotangents: Tensor) -> ParamGradient:
        """``sum_j J_j^T c_j`` over kept ``steps`` (``cotangents [M, B, ...]``): one backward
        over their graphs, or in surrogate mode the terms ``<v_j, c_j>``."""
        outputs: list[Tensor] = []
        for k in steps:
            output = self._outputs[k - self.start]
            assert output is not None, f"step {k}'s graph was released before its VJP"
            outputs.append(output)
        self._field.meter.param_vjps += len(steps)
        if self._field.surrogate:
            watch = self._field.watch
            if watch is not None:
                # The kept steps' calls are the surrogate's: watch their backward now (the
                # leaf is the model's own input, so it needs no alias).
                for k, output in zip(steps, outputs, strict=True):
                    index = k - self.start
                    watch.observe(self._leaves[index], output, [self._times[index]])
            return SurrogateTerms([inner(v, c) for v, c in zip(outputs, cotangents, strict=True)])
        inputs = list(self._field.params.values())
        with torch.enable_grad():
            pulled = torch.autograd.grad(outputs, inputs, list(cotangents), allow_unused=True)
        grads = {
            name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(self._field.params.items(), pulled, strict=True)
        }
        check_finite(grads, "parameter gradient", [self._times[k - self.start] for k in steps])
        return grads


class RetainedSteps:
    """The forward of a :class:`RetainedChain`: steps ``start..N-1``, each from a fresh
    leaf with its graph kept (sampled from ``z_start``, the states computed from detached
    velocities so no graph runs across steps, or evaluated at the ``recorded`` states)."""

    def __init__(
        self, field: ChainField, sampler: SamplerSteps, start: int, recorded: Tensor | None
    ):
        self._field = field
        self._sampler = sampler
        self._host_times = host_times(sampler)
        self.start = start
        self.steps = range(start, len(self._host_times) - 1)
        self._recorded = recorded
        self._leaves: list[Tensor] = []
        self._outputs: list[Tensor] = []
        self._detached: list[Tensor] = []

    def run(self, z_start: Tensor) -> RetainedChain:
        times = [self._host_times[k] for k in self.steps]
        with velocities_checked(self._detached, times) as stacked:
            states, _ = integrate(
                self._velocity,
                self._sampler.host_coefficients,
                z_start.detach(),
                self._sampler.step_noise,
                self.steps,
                pin=self._pin,
            )
        self._field.meter.forwards_with_graph += len(self.steps)
        return RetainedChain(
            self._field,
            self.start,
            self._leaves,
            self._outputs,
            torch.stack(states),
            times,
            velocities=stacked[0] if stacked else None,
        )

    def _pin(self, k: int, z: Tensor) -> Tensor:
        return z.detach() if self._recorded is None else self._recorded[k - self.start]

    def _velocity(self, k: int, z: Tensor) -> Tensor:
        leaf = z.detach().requires_grad_(True)
        with torch.enable_grad():
            # Watched in param_vjp, for the kept steps only (the sweep's state-only
            # backward would fire the hooks of every step for nothing).
            v = self._field._graph_forward(
                leaf, [self._host_times[k]], None, low_memory=False, watched=False
            )
        if k == self.start:
            check_model_output(v, z, step=k)
        self._leaves.append(leaf)
        self._outputs.append(v)
        self._detached.append(v.detach())
        return self._detached[-1]
