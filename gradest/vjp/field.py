"""``VelocityField``: every model call and vector-Jacobian product of an estimate.

The field keeps in one place which parameters are differentiated, the cost meter, the
replayed randomness of stochastic layers, the surrogate's backward watch and the
finiteness checks; how a VJP is evaluated is its engine's
(:mod:`gradest.vjp.engines`), how the model is called is
:class:`~gradest.vjp.model_call.ModelCalls`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from gradest._checks import NamedModules, outside_fake_mode, trainable_parameters
from gradest.errors import InvalidValue
from gradest.model_state import ModelState
from gradest.nonfinite import BackwardWatch, check_finite
from gradest.replay import StepRandomness
from gradest.trajectory import SamplerSteps
from gradest.vjp.chains import ChainForward, ChainPullback, RetainedChain, RetainedSteps
from gradest.vjp.engines import ENGINE_CLASSES, AutogradEngine, Pullback
from gradest.vjp.gradients import Grads, ParamGradient
from gradest.vjp.meter import CostMeter
from gradest.vjp.model_call import ModelCalls


def _as_floats(times: Sequence[float] | Tensor | float) -> list[float]:
    """Step times as host floats, in float64: a list of Python floats would otherwise
    become float32 and round ``t``. One transfer (``tolist``), not a host sync per element."""
    if isinstance(times, float | int):
        return [float(times)]
    if isinstance(times, list | tuple) and all(isinstance(t, float | int) for t in times):
        return [float(t) for t in times]
    with outside_fake_mode():  # the sampler's grid: real values under FakeTensorMode
        return torch.as_tensor(times, dtype=torch.float64).reshape(-1).tolist()


def _stack(states: Tensor) -> Tensor:
    """``[M, B, ...] -> [M*B, ...]``."""
    return states.reshape(-1, *states.shape[2:])


class ParamPullback:
    """``pull(cotangents [M, B, ...]) -> sum_j J_j^T cotangents_j`` after
    :meth:`VelocityField.param_pullback`; callable once."""

    def __init__(
        self, field: VelocityField, shape: torch.Size, pullback: Pullback, times: list[float]
    ):
        self._field = field
        self._shape = shape
        self._pullback = pullback
        self._times = times

    def __call__(self, cotangents: Tensor) -> ParamGradient:
        if cotangents.shape != self._shape:
            raise InvalidValue(
                f"cotangents shape {tuple(cotangents.shape)} != states {tuple(self._shape)}"
            )
        self._field.meter.param_vjps += self._shape[0]
        grads, _ = self._pullback(_stack(cotangents))
        if isinstance(grads, dict):
            check_finite(grads, "parameter gradient", self._times)
        return grads


class VelocityField:
    """``v_theta(z, t, **cond)`` as the estimators see it.

    Args:
        model: the velocity model, called as ``model(z, t, **cond)``.
        cond: keyword arguments for every call; per-sample tensors (first dimension the
            batch size, at any depth of dict / list / tuple nesting) are repeated when
            ``M`` states are stacked into one call, shared values are not (the one rule,
            :mod:`gradest.conditioning`).
        batch_size: ``B``, the number of samples in one state.
        meter: where calls are counted.
        engine: ``"autograd"`` or ``"func"`` (:mod:`gradest.vjp.engines`), a name
            ``gradest.base`` has validated.
        surrogate: defer parameter VJPs into :class:`~gradest.vjp.SurrogateTerms` (on
            the autograd engine, whatever ``engine`` says); every such forward is then
            watched for non-finite gradients in the caller's backward
            (:class:`~gradest.nonfinite.BackwardWatch`, ``watch``).
        generator: the estimate's generator; a stochastic model's draws come from a
            stream seeded from it (:mod:`gradest.replay`).
        named_modules: ``list(model.named_modules())`` if the caller walked the model
            already (one walk per estimate serves every reader of it).

    Attributes:
        engine: the engine's name (``"autograd"`` in surrogate mode).
        params: the tensors parameter gradients are taken w.r.t., keyed like the model's
            trainable parameters (the model's own with autograd, detached with func).
        trainable: the model's parameters with ``requires_grad=True``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cond: Mapping[str, Any],
        batch_size: int,
        meter: CostMeter,
        *,
        engine: str = "autograd",
        surrogate: bool = False,
        generator: torch.Generator | None = None,
        named_modules: NamedModules | None = None,
    ):
        modules = None if named_modules is None else [module for _, module in named_modules]
        self._calls = ModelCalls(model, cond, batch_size, modules)
        self.model = model
        self.module = self._calls.module
        self.surrogate = surrogate
        engine_class = AutogradEngine if surrogate else ENGINE_CLASSES[engine]
        # Read the parameters under the shared lock: a func-engine estimate in another
        # thread may have swapped detached tensors into the module for its forward.
        with self._calls.lock.shared():
            self.trainable = trainable_parameters(model, named_modules)
            self._engine = engine_class(self._calls, self.trainable, deferred=surrogate)
        self.engine = self._engine.name
        self.params: Grads = self._engine.params
        self.cond = self._calls.cond
        self.batch_size = batch_size
        self.meter = meter
        self._checked_output = False
        first = next(iter(self.trainable.values()))
        self.randomness = StepRandomness(self.module, first.device, generator, self._calls.modules)
        self.watch = BackwardWatch() if surrogate else None

    def model_state(self) -> ModelState:
        """The model's fingerprint now (:mod:`gradest.model_state`), read under the shared
        lock: a func-engine forward in another thread swaps tensors into the module, and
        its temporary tensors are not a change of the model."""
        with self._calls.lock.shared():
            return ModelState.of(self.model)

    # -- evaluating the model -------------------------------------------------------------

    def _row_times(self, times: Sequence[float], like: Tensor) -> Tensor:
        """Per-row model times for ``len(times)`` stacked states of batch ``B``."""
        if len(times) == 1:  # one op, as a hand-written loop makes it
            return torch.full((self.batch_size,), times[0], dtype=like.dtype, device=like.device)
        t = torch.tensor(list(times), dtype=like.dtype).to(like.device)
        return t.repeat_interleave(self.batch_size)

    def _evaluate(
        self,
        z: Tensor,
        times: Sequence[float],
        *,
        params: Grads | None = None,
        through_wrapper: bool = False,
    ) -> Tensor:
        """The model on ``z`` (``M*B`` stacked rows at ``M`` times), randomness replayed:
        functionally with ``params``, else the module as itself (through a DDP wrapper
        with ``through_wrapper``)."""
        call = self._calls.bound(params, through_wrapper=through_wrapper)
        if not self._checked_output:
            # First call of an estimate: turn shape mismatches into a readable error.
            self._checked_output = True
            call = partial(self._calls.checked_first, call)
        return self.randomness.evaluate(call, z, self._row_times(times, z), list(times))

    def _graph_forward(
        self,
        z: Tensor,
        times: Sequence[float],
        params: Grads | None,
        *,
        low_memory: bool,
        watched: bool = True,
    ) -> Tensor:
        """A forward whose graph reaches the parameters (estimate or surrogate term).

        In surrogate mode the call is watched (:class:`~gradest.nonfinite.BackwardWatch`):
        its input is an alias of ``z`` (so the hook sees the model's own input gradient)
        and its output is hooked; the hooks only record device flags. ``watched=False``:
        the caller observes the call itself, later (a retained chain's kept steps).
        """
        watch = self.watch if watched else None
        if watch is not None and z.requires_grad:
            z = z.view_as(z)
        if low_memory and self.surrogate:
            # Keep only the inputs; autograd recomputes the forward in the caller's backward.
            # The step's randomness is replayed by gradest.replay, not by torch's RNG fork
            # (process-global, not thread-safe).
            v = _checkpoint(
                partial(self._evaluate, times=times, through_wrapper=True),
                z,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            v = self._evaluate(z, times, params=params, through_wrapper=self.surrogate)
        if watch is not None:
            watch.observe(z, v, times)
        return v

    def _step_forward(
        self, times: list[float], params: Grads | None, z: Tensor
    ) -> tuple[Tensor, tuple[()]]:
        """One evaluation as an engine's forward (no aux)."""
        return self._evaluate(z, times, params=params), ()

    def _term_forward(
        self, times: list[float], low_memory: bool, params: Grads | None, z: Tensor
    ) -> tuple[Tensor, tuple[()]]:
        """A parameter term's forward as an engine's forward (no aux)."""
        return self._graph_forward(z, times, params, low_memory=low_memory), ()

    # -- cotangent work: no parameter gradient in any mode --------------------------------

    def velocity(self, z: Tensor, t: float | Tensor, *, check: bool = True) -> Tensor:
        """``v(z, t)`` without a graph (one forward; the module as itself in every engine).

        ``check=False`` leaves the finiteness check to the caller (a sampling loop checks
        all its velocities at once, :func:`~gradest.vjp.velocities_checked`)."""
        self.meter.forwards_without_graph += 1
        times = _as_floats(t)
        with torch.no_grad():
            v = self._evaluate(z, times)
        if check:
            check_finite(v, "velocity", times)
        return v

    def velocities(self, states: Tensor, times: Sequence[float] | Tensor) -> Tensor:
        """``v`` at ``M`` stacked states ``[M, B, ...]`` without a graph: one model call on
        ``M*B`` rows (``M`` forwards), ``[M, B, ...]``."""
        count = states.shape[0]
        self.meter.forwards_without_graph += count
        step_times = _as_floats(times)
        with torch.no_grad():
            v = self._evaluate(_stack(states), step_times).reshape(states.shape)
        check_finite(v, "velocity", step_times)
        return v

    def state_vjp(self, z: Tensor, t: float | Tensor, cotangent: Tensor) -> tuple[Tensor, Tensor]:
        """``(v, (dv/dz)^T cotangent)``: a forward with graph in ``z``, no parameter part."""
        times = _as_floats(t)
        v, _, pullback = self._engine.vjp(
            partial(self._step_forward, times), z, params=False, state=True
        )
        check_finite(v, "velocity", times)
        _, z_grad = pullback(cotangent)
        assert z_grad is not None
        check_finite(z_grad, "state gradient", times)
        self.meter.forwards_with_graph += 1
        self.meter.state_vjps += 1
        return v.detach(), z_grad

    # -- parameter gradients --------------------------------------------------------------

    def joint_vjp(
        self, z: Tensor, t: float | Tensor, cotangent: Tensor
    ) -> tuple[Tensor, Tensor, Grads]:
        """``(v, (dv/dz)^T c, J^T c)``: one forward with graph and one full VJP (estimate only)."""
        assert not self.surrogate, "joint VJPs are evaluated immediately; not in surrogate mode"
        times = _as_floats(t)
        v, _, pullback = self._engine.vjp(
            partial(self._step_forward, times), z, params=True, state=True
        )
        check_finite(v, "velocity", times)
        grads, z_grad = pullback(cotangent)
        assert isinstance(grads, dict) and z_grad is not None
        check_finite(z_grad, "state gradient", times)
        check_finite(grads, "parameter gradient", times)
        self.meter.forwards_with_graph += 1
        self.meter.param_vjps += 1
        return v.detach(), z_grad, grads

    def param_pullback(
        self, states: Tensor, times: Sequence[float] | Tensor, *, low_memory: bool = False
    ) -> tuple[Tensor, ParamPullback]:
        """Forward ``M`` stacked states with a graph now; pull parameter cotangents later.

        Args:
            states: ``[M, B, ...]``.
            times: ``M`` times.
            low_memory: in surrogate mode, keep only the inputs of this forward and let
                the caller's backward recompute it (``torch.utils.checkpoint``): one more
                forward, activations of one call at a time. No effect in ``estimate()``,
                where the pullback runs at once.

        Returns:
            ``(velocities [M, B, ...] detached, pull)`` where ``pull(cotangents [M, B, ...])``
            is ``sum_j J_j^T cotangents_j``: a gradient dict from one batched VJP, or in
            surrogate mode the term ``sum_j <v_j, cotangents_j>``. Holding the pullback
            holds the ``M`` graphs until it is called; it can be called once.
        """
        count = states.shape[0]
        step_times = _as_floats(times)
        forward = partial(self._term_forward, step_times, low_memory)
        v, _, pullback = self._engine.vjp(forward, _stack(states), params=True, state=False)
        self.meter.forwards_with_graph += count
        if low_memory and self.surrogate:
            self.meter.forwards_without_graph += count
        velocities = v.detach().reshape(states.shape)
        check_finite(velocities, "velocity", step_times)
        return velocities, ParamPullback(self, states.shape, pullback, step_times)

    def param_vjp(
        self, states: Tensor, times: Sequence[float] | Tensor, cotangents: Tensor
    ) -> ParamGradient:
        """``sum_j J(z_j, t_j)^T c_j`` over ``M`` stacked states in one batched VJP."""
        _, pull = self.param_pullback(states, times)
        return pull(cotangents)

    def retained_chain(
        self, sampler: SamplerSteps, start: int, z_start: Tensor, *, recorded: Tensor | None = None
    ) -> RetainedChain:
        """Steps ``start..N-1`` with each step's graph kept from its own leaf (autograd).

        Samples from ``z_start`` (the states are computed from detached velocities, so no
        graph runs across steps), or evaluates the ``recorded`` states
        ``[N - start + 1, B, ...]`` as they are.
        """
        assert self.engine == "autograd", "retained chains need the autograd engine"
        return RetainedSteps(self, sampler, start, recorded).run(z_start)

    def chain(
        self,
        sampler: SamplerSteps,
        start: int,
        z_start: Tensor,
        *,
        recorded: Tensor | None = None,
        low_memory: bool = False,
        state_grad: bool = False,
    ) -> ChainPullback:
        """Steps ``start..N-1`` with the graph kept, for the exact VJP of ``z_N``.

        Args:
            recorded: in surrogate mode, the recorded states ``[N - start + 1, B, ...]`` the
                chain must pass through: each state's value is pinned to the recording and
                its graph kept, so the gradient is the one along the recorded path.
            low_memory: in surrogate mode, each step's forward is recomputed in the
                caller's backward (``torch.utils.checkpoint``): one forward more per step,
                the activations of one step at a time.
            state_grad: also return the gradient w.r.t. ``z_start`` (``estimate()`` only).

        ``estimate()`` runs this only for the fused chain (no ``recorded``, no
        ``low_memory``): one VJP through all steps on ``(theta, z_start)``.
        """
        assert self.surrogate or (recorded is None and not low_memory)
        forward = ChainForward(self, sampler, start, recorded=recorded, low_memory=low_memory)
        wants_state = state_grad and not self.surrogate
        _, (states, velocities), pullback = self._engine.vjp(
            forward, z_start.detach(), params=True, state=wants_state
        )
        count = len(forward.steps)
        self.meter.forwards_with_graph += count
        if low_memory:
            self.meter.forwards_without_graph += count
        return ChainPullback(self, states, velocities, pullback, forward.times)
