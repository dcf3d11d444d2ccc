"""The one VJP engine: every model call and vector-Jacobian product of every estimator.

Strategies evaluate the model only through a :class:`VelocityField`, which keeps in one
place which parameters are differentiated (``requires_grad=True`` only), how
conditioning is repeated when several states are stacked into one batched call, the
:class:`~gradest.protocol.Cost` bookkeeping (exact by construction), replayed randomness
for stochastic layers (:mod:`gradest.replay`) and the non-finite checks.

Three ways to evaluate the parameter part, chosen per estimate:

* ``engine="autograd"`` (the default of ``estimate()``): the module is called as itself
  and VJPs are ``torch.autograd.grad`` calls. Forward hooks, ``torch.utils.checkpoint``
  and diffusers' gradient checkpointing run; ``.grad`` is never written.
* ``engine="func"``: ``torch.func.functional_call`` + ``torch.func.vjp`` on an explicit
  parameter dict, composable with ``vmap``/``jacrev``. ``functional_call`` swaps the
  module's parameters during the forward, so those forwards hold the model's exclusive
  lock (:mod:`gradest.model_lock`); it cannot differentiate a model that uses
  saved-tensor hooks (layer checkpointing).
* surrogate mode (``surrogate()``): parameter VJPs are not evaluated at all. Each one
  becomes a term ``<v_theta(z_j, t_j), G_j>`` of a loss whose autograd gradient is the
  estimate (:class:`SurrogateTerms`); the caller's ``loss.backward()`` evaluates them,
  through DDP/FSDP wrappers and AMP like any loss.

Cotangent work (no-graph forwards, state-only VJPs of the adjoint sweep, the gate) is
the same in every mode: the module is called as itself (the inner module of a
``DistributedDataParallel`` wrapper, so the reducer sees only the parameter terms) and
state VJPs differentiate the state only, so nothing lands in ``.grad``.

Batched calls stack ``M`` states of batch ``B`` along the batch dimension (one model
call on ``M*B`` rows), which assumes the model treats rows independently, as diffusion
transformers and MLPs do (no batch norm in training mode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.func import functional_call
from torch.func import vjp as _torch_vjp
from torch.utils.checkpoint import checkpoint as _checkpoint

from gradest._checks import (
    check_model_output,
    outside_fake_mode,
    trainable_parameters,
)
from gradest.conditioning import model_kwargs
from gradest.errors import InvalidType, InvalidValue
from gradest.mixed_dtypes import first_call
from gradest.model_lock import (
    compiled_code_eager,
    has_compiled_code,
    has_shared_submodules,
    lock_for,
    tensors_restored,
)
from gradest.model_state import ModelState
from gradest.nonfinite import BackwardWatch, NonFiniteError, check_finite
from gradest.replay import StepRandomness
from gradest.trajectory import SamplerSteps, integrate

Grads = dict[str, Tensor]

ENGINES = ("autograd", "func")

# torch.func.vjp's annotations do not distinguish has_aux=True (three results) from the
# default (two); typed loosely here rather than silenced at every call.
vjp: Callable[..., Any] = _torch_vjp

# Every pullback here is called once and its result is detached: do not build a
# second-order graph (torch.func follows grad mode by default, which costs ~20% of a
# backward) and free the saved activations as soon as the backward has run.
_ONE_SHOT = {"retain_graph": False, "create_graph": False}


@attrs.define
class CostMeter:
    """Mutable counters behind :class:`gradest.protocol.Cost`; one per estimate call."""

    forwards_with_graph: int = 0
    forwards_without_graph: int = 0
    param_vjps: int = 0
    state_vjps: int = 0

    def freeze(self) -> Any:
        from gradest.protocol import Cost

        return Cost(**attrs.asdict(self))


def inner(velocity: Tensor, cotangent: Tensor) -> Tensor:
    """``<v, G>`` summed over every element, in float32 or wider (safe under fp16 autocast)."""
    dtype = torch.promote_types(velocity.dtype, torch.float32)
    return (velocity.to(dtype) * cotangent.detach().to(dtype)).sum()


class SurrogateTerms:
    """A parameter gradient left to autograd: ``sum_i <v_i, G_i>`` with graphs into theta.

    What the engine returns in surrogate mode wherever it would return a gradient dict;
    :func:`add_grads` and :func:`scale_grads` combine both kinds, so a strategy is written
    once for ``estimate()`` and ``surrogate()``.
    """

    __slots__ = ("terms",)

    def __init__(self, terms: Sequence[Tensor]):
        self.terms = list(terms)

    def __add__(self, other: SurrogateTerms) -> SurrogateTerms:
        return SurrogateTerms(self.terms + other.terms)

    def scaled(self, factor: float) -> SurrogateTerms:
        return SurrogateTerms([term * factor for term in self.terms])

    def _not_a_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidType(
            "in surrogate() the engine defers parameter VJPs, so a pullback returns "
            "SurrogateTerms, not a gradient dict; combine gradients with "
            "gradest.vjp.add_grads / scale_grads so the strategy serves both estimate() and "
            "surrogate()"
        )

    items = keys = values = __getitem__ = __iter__ = _not_a_dict

    def loss(self) -> Tensor:
        """The surrogate loss (0-dim); its gradient w.r.t. the parameters is the estimate."""
        if len(self.terms) == 1:
            return self.terms[0]
        dtype = self.terms[0].dtype
        for term in self.terms[1:]:
            dtype = torch.promote_types(dtype, term.dtype)
        return torch.stack([term.to(dtype) for term in self.terms]).sum()


ParamGradient = Grads | SurrogateTerms


def add_grads(total: ParamGradient | None, extra: ParamGradient) -> ParamGradient:
    """Accumulate ``extra`` into ``total`` (None for "nothing yet") and return it.

    Gradient dicts: the first term is copied once into a buffer the caller owns; later
    terms are added in place, so summing ``N`` per-step gradients allocates one buffer,
    not ``N``. Surrogate terms are concatenated.
    """
    if isinstance(extra, SurrogateTerms):
        assert total is None or isinstance(total, SurrogateTerms)
        return extra if total is None else total + extra
    if total is None:
        return {name: g.clone() for name, g in extra.items()}
    assert isinstance(total, dict)
    for name, g in extra.items():
        total[name].add_(g)
    return total


def scale_grads(grads: ParamGradient, factor: float) -> ParamGradient:
    if isinstance(grads, SurrogateTerms):
        return grads.scaled(factor)
    return {name: g * factor for name, g in grads.items()}


def unwrap_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``model`` otherwise)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _saved_tensor_hooks_error(err: RuntimeError) -> bool:
    return "saved tensor hooks" in str(err).lower()


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


@attrs.frozen(eq=False)
class ChainPullback:
    """A chain sampled with its graph, waiting for the terminal adjoint ``a_N``.

    Attributes:
        states: ``[N - start + 1, B, ...]`` detached.
        velocities: ``[N - start, B, ...]`` detached.
        pull: ``pull(a_N) -> (parameter gradient, gradient w.r.t. the chain's first
            state or None)``; callable once.
    """

    states: Tensor
    velocities: Tensor
    pull: Callable[..., tuple[ParamGradient, Tensor | None]]


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
        field: VelocityField,
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
        engine: ``"autograd"`` or ``"func"`` (see the module docstring).
        surrogate: defer parameter VJPs into :class:`SurrogateTerms`; every such forward
            is then watched for non-finite gradients in the caller's backward
            (:class:`~gradest.nonfinite.BackwardWatch`, ``watch``).
        generator: the estimate's generator; a stochastic model's draws come from a
            stream seeded from it (:mod:`gradest.replay`).
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
    ):
        if engine not in ENGINES:
            raise InvalidValue(f"engine must be one of {ENGINES}, got {engine!r}")
        self.model = model
        # DDP's reducer must see only the forwards whose parameter gradient autograd will
        # compute (the surrogate's terms); everything else goes to the module inside.
        self.module = unwrap_data_parallel(model)
        self.engine = "autograd" if surrogate else engine
        self.surrogate = surrogate
        self._lock = lock_for(self.module)
        # Read the parameters under the shared lock: a func-engine estimate in another
        # thread may have swapped detached tensors into the module for its forward.
        with self._lock.shared():
            self.trainable = trainable_parameters(model)
            self.params: Grads = (
                {n: p.detach() for n, p in self.trainable.items()}
                if self.engine == "func"
                else dict(self.trainable)
            )
            if self.engine == "func":
                module_params = {id(p): n for n, p in self.module.named_parameters()}
                self._func_names = {n: module_params[id(p)] for n, p in self.trainable.items()}
                self.frozen = {
                    n: p.detach() for n, p in self.module.named_parameters() if not p.requires_grad
                }
                self.frozen.update(dict(self.module.named_buffers()))
                self._shared_submodules = has_shared_submodules(self.module)
        self._compiled = has_compiled_code(self.module)
        self.cond = dict(cond)
        self.batch_size = batch_size
        self.meter = meter
        self._checked_output = False
        first = next(iter(self.trainable.values()))
        self.randomness = StepRandomness(self.module, first.device, generator)
        self.watch = BackwardWatch() if surrogate else None

    def model_state(self) -> ModelState:
        """The model's fingerprint now (:mod:`gradest.model_state`), read under the shared
        lock: a func-engine forward in another thread swaps tensors into the module, and
        its temporary tensors are not a change of the model."""
        with self._lock.shared():
            return ModelState.of(self.model)

    # -- plumbing -------------------------------------------------------------------------

    def _row_times(self, times: Sequence[float], like: Tensor) -> Tensor:
        """Per-row model times for ``len(times)`` stacked states of batch ``B``."""
        if len(times) == 1:  # one op, as a hand-written loop makes it
            return torch.full((self.batch_size,), times[0], dtype=like.dtype, device=like.device)
        t = torch.tensor(list(times), dtype=like.dtype).to(like.device)
        return t.repeat_interleave(self.batch_size)

    @staticmethod
    def _floats(times: Sequence[float] | Tensor | float) -> list[float]:
        # float64: a list of Python floats would otherwise become float32 and round t.
        # One transfer (tolist), not a host sync per element.
        if isinstance(times, float | int):
            return [float(times)]
        if isinstance(times, list | tuple) and all(isinstance(t, float | int) for t in times):
            return [float(t) for t in times]
        with outside_fake_mode():  # the sampler's grid: real values under FakeTensorMode
            return torch.as_tensor(times, dtype=torch.float64).reshape(-1).tolist()

    def _module_call(
        self, module: torch.nn.Module, params: Grads | None
    ) -> Callable[[Tensor, Tensor], Tensor]:
        """``(z, t) -> v`` for stacked rows: the module as itself, or functionally."""

        def call(z: Tensor, t: Tensor) -> Tensor:
            cond = model_kwargs(self.cond, self.batch_size, z.shape[0] // self.batch_size)
            if params is None:
                if self._compiled and z.storage_offset():
                    # States are views into the stacked path; torch.compile guards a
                    # view's storage offset (0 apart from the others) and would recompile
                    # for it, running into its recompile limit (then eager, for good).
                    z = z.clone()
                with self._lock.shared():
                    return module(z, t, **cond)
            named = {self._func_names[n]: p for n, p in params.items()}
            restored = tensors_restored(module) if self._shared_submodules else nullcontext()
            # Always under a torch.func transform, which torch.compile'd code cannot run
            # in: eager here, compiled everywhere else (gradest.model_lock). ~10us a
            # call, so only for models that hold a compiled module.
            eager = compiled_code_eager() if self._compiled else nullcontext()
            with self._lock.exclusive(), restored, eager:
                return functional_call(module, (named, self.frozen), (z, t), cond)

        return call

    def _evaluate(
        self,
        z: Tensor,
        times: Sequence[float],
        *,
        params: Grads | None = None,
        through_wrapper: bool = False,
    ) -> Tensor:
        """The model on ``z`` (``M*B`` stacked rows at ``M`` times), randomness replayed."""
        call = self._module_call(self.model if through_wrapper else self.module, params)
        t = self._row_times(times, z)
        if not self._checked_output:
            # First call of an estimate: turn shape mismatches into a readable error.
            self._checked_output = True
            first = call

            def call(z_: Tensor, t_: Tensor) -> Tensor:
                return first_call(
                    lambda a, b, **_: first(a, b),
                    z_,
                    t_,
                    model_kwargs(self.cond, self.batch_size),
                    owner=self.module,
                )

        try:
            return self.randomness.evaluate(call, z, t, list(times))
        except RuntimeError as err:
            if params is not None and _saved_tensor_hooks_error(err):
                raise InvalidValue(
                    "engine='func' cannot differentiate this model: torch.func refuses the "
                    "saved-tensor hooks of torch.utils.checkpoint / gradient checkpointing "
                    "inside it; use engine='autograd' (the default) or est.surrogate(...)"
                ) from err
            raise

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
                lambda z_: self._evaluate(z_, times, through_wrapper=True),
                z,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            v = self._evaluate(z, times, params=params, through_wrapper=self.surrogate)
        if watch is not None:
            watch.observe(z, v, times)
        return v

    @staticmethod
    def _stack(states: Tensor) -> Tensor:
        """``[M, B, ...] -> [M*B, ...]``."""
        return states.reshape(-1, *states.shape[2:])

    def _param_grads(self, outputs: Tensor, cotangent: Tensor, extra: Sequence[Tensor] = ()):
        """``torch.autograd.grad`` of ``outputs`` into the parameters (and ``extra`` inputs)."""
        inputs = [*self.params.values(), *extra]
        pulled = torch.autograd.grad(outputs, inputs, cotangent, allow_unused=True)
        filled = [
            torch.zeros_like(x) if g is None else g for x, g in zip(inputs, pulled, strict=True)
        ]
        grads = dict(zip(self.params, filled[: len(self.params)], strict=True))
        return grads, filled[len(self.params) :]

    # -- cotangent work: no parameter gradient in any mode --------------------------------

    def velocity(self, z: Tensor, t: float | Tensor, *, check: bool = True) -> Tensor:
        """``v(z, t)`` without a graph (one forward; the module as itself in every engine).

        ``check=False`` leaves the finiteness check to the caller (a sampling loop checks
        all its velocities at once, :func:`velocities_checked`)."""
        self.meter.forwards_without_graph += 1
        times = self._floats(t)
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
        step_times = self._floats(times)
        with torch.no_grad():
            v = self._evaluate(self._stack(states), step_times).reshape(states.shape)
        check_finite(v, "velocity", step_times)
        return v

    def state_vjp(self, z: Tensor, t: float | Tensor, cotangent: Tensor) -> tuple[Tensor, Tensor]:
        """``(v, (dv/dz)^T cotangent)``: a forward with graph in ``z``, no parameter part."""
        times = self._floats(t)
        if self.engine == "func":
            v, pullback = vjp(lambda z_: self._evaluate(z_, times, params=self.params), z)
            check_finite(v, "velocity", times)
            (z_grad,) = pullback(cotangent, **_ONE_SHOT)
        else:
            with torch.enable_grad():
                leaf = z.detach().requires_grad_(True)
                v = self._evaluate(leaf, times)
                check_finite(v, "velocity", times)
                (z_grad,) = torch.autograd.grad(v, leaf, cotangent, allow_unused=True)
            v = v.detach()
            if z_grad is None:  # a model that ignores its state
                z_grad = torch.zeros_like(leaf)
        check_finite(z_grad, "state gradient", times)
        self.meter.forwards_with_graph += 1
        self.meter.state_vjps += 1
        return v, z_grad

    # -- parameter gradients --------------------------------------------------------------

    def joint_vjp(
        self, z: Tensor, t: float | Tensor, cotangent: Tensor
    ) -> tuple[Tensor, Tensor, Grads]:
        """``(v, (dv/dz)^T c, J^T c)``: one forward with graph and one full VJP (estimate only)."""
        assert not self.surrogate, "joint VJPs are evaluated immediately; not in surrogate mode"
        times = self._floats(t)
        if self.engine == "func":
            v, pullback = vjp(lambda p, z_: self._evaluate(z_, times, params=p), self.params, z)
            check_finite(v, "velocity", times)
            grads, z_grad = pullback(cotangent, **_ONE_SHOT)
        else:
            with torch.enable_grad():
                leaf = z.detach().requires_grad_(True)
                v = self._evaluate(leaf, times)
                check_finite(v, "velocity", times)
                grads, (z_grad,) = self._param_grads(v, cotangent, [leaf])
            v = v.detach()
        check_finite(z_grad, "state gradient", times)
        check_finite(grads, "parameter gradient", times)
        self.meter.forwards_with_graph += 1
        self.meter.param_vjps += 1
        return v, z_grad, grads

    def param_pullback(
        self, states: Tensor, times: Sequence[float] | Tensor, *, low_memory: bool = False
    ) -> tuple[Tensor, Callable[[Tensor], ParamGradient]]:
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
        step_times = self._floats(times)
        z = self._stack(states)
        if self.engine == "func":
            v, pullback = vjp(lambda p: self._evaluate(z, step_times, params=p), self.params)
        else:
            with torch.enable_grad():
                v = self._graph_forward(z, step_times, None, low_memory=low_memory)
        self.meter.forwards_with_graph += count
        if low_memory and self.surrogate:
            self.meter.forwards_without_graph += count
        check_finite(v.detach().reshape(states.shape), "velocity", step_times)

        def pull(cotangents: Tensor) -> ParamGradient:
            if cotangents.shape != states.shape:
                raise InvalidValue(
                    f"cotangents shape {tuple(cotangents.shape)} != states {tuple(states.shape)}"
                )
            self.meter.param_vjps += count
            flat = self._stack(cotangents)
            if self.surrogate:
                return SurrogateTerms([inner(v, flat)])
            if self.engine == "func":
                (grads,) = pullback(flat, **_ONE_SHOT)
            else:
                grads, _ = self._param_grads(v, flat)
            check_finite(grads, "parameter gradient", step_times)
            return grads

        return v.detach().reshape(states.shape), pull

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
        with outside_fake_mode():
            times = sampler.times.tolist()  # host floats: no sync per step
        steps = range(start, len(times) - 1)
        leaves: list[Tensor] = []
        outputs: list[Tensor] = []

        def pin(k: int, z: Tensor) -> Tensor:
            return z.detach() if recorded is None else recorded[k - start]

        detached: list[Tensor] = []

        def velocity(k: int, z: Tensor) -> Tensor:
            leaf = z.detach().requires_grad_(True)
            with torch.enable_grad():
                # Watched in param_vjp, for the kept steps only (the sweep's state-only
                # backward would fire the hooks of every step for nothing).
                v = self._graph_forward(leaf, [times[k]], None, low_memory=False, watched=False)
            if k == start:
                check_model_output(v, z, step=k)
            leaves.append(leaf)
            outputs.append(v)
            detached.append(v.detach())
            return detached[-1]

        with velocities_checked(detached, [times[k] for k in steps]) as stacked:
            states, _ = integrate(
                velocity, sampler.coefficients, z_start.detach(), sampler.step_noise, steps, pin=pin
            )
        self.meter.forwards_with_graph += len(steps)
        return RetainedChain(
            self,
            start,
            leaves,
            outputs,
            torch.stack(states),
            [times[k] for k in steps],
            velocities=stacked[0] if stacked else None,
        )

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
        coefficients, step_noise = sampler.coefficients, sampler.step_noise
        with outside_fake_mode():
            times = sampler.times.tolist()  # host floats: no sync per step
        steps = range(start, len(times) - 1)
        chain_times = [times[k] for k in steps]

        def pin(k: int, z: Tensor) -> Tensor:
            if recorded is None or k == start:
                return z
            # Value of the recording, derivative of the chain (z - z.detach() is 0).
            return z - z.detach() + recorded[k - start]

        watch = self.watch

        def run(params: Grads | None, z0: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
            velocities: list[Tensor] = []

            def velocity(k: int, z: Tensor) -> Tensor:
                v = self._graph_forward(z, [times[k]], params, low_memory=low_memory, watched=False)
                if watch is not None:
                    # Its output only: the gradient step k's model sends into z_k reaches
                    # step k-1's output (z_k = alpha z_{k-1} + beta v_{k-1}), whose flag
                    # stands for it (one hook a step instead of two, no alias of z_k).
                    previous = None if k == start else [times[k - 1]]
                    watch.observe_chain_step(z, v, [times[k]], previous)
                if k == start:
                    check_model_output(v, z, step=k)
                velocities.append(v)
                return v

            with velocities_checked(velocities, chain_times) as stacked:
                states, _ = integrate(velocity, coefficients, z0, step_noise, steps, pin=pin)
            return states[-1], (torch.stack(states).detach(), stacked[0])

        count = len(steps)
        self.meter.forwards_with_graph += count
        if low_memory:
            self.meter.forwards_without_graph += count

        if self.engine == "func":
            if state_grad:
                z_final, pullback, (states, velocities) = vjp(
                    run, self.params, z_start, has_aux=True
                )
            else:
                z_final, pullback, (states, velocities) = vjp(
                    lambda p: run(p, z_start), self.params, has_aux=True
                )
        else:
            with torch.enable_grad():
                z0 = z_start.detach().requires_grad_(state_grad and not self.surrogate)
                z_final, (states, velocities) = run(None, z0)

        def pull(
            terminal_adjoint: Tensor,
            locate: Callable[[], NonFiniteError | None] | None = None,
        ) -> tuple[ParamGradient, Tensor | None]:
            """``locate()`` (failure path only) may name the step a non-finite gradient
            came from more precisely than the fused backward can."""
            self.meter.param_vjps += count
            if self.surrogate:
                return SurrogateTerms([inner(z_final, terminal_adjoint)]), None
            z_grad: Tensor | None = None
            if self.engine == "func":
                pulled = pullback(terminal_adjoint, **_ONE_SHOT)
                grads = pulled[0]
                z_grad = pulled[1] if state_grad else None
            else:
                grads, extra = self._param_grads(
                    z_final, terminal_adjoint, [z0] if state_grad else []
                )
                z_grad = extra[0] if state_grad else None
            check_finite(grads, "parameter gradient", chain_times, refine=locate)
            if z_grad is not None:
                check_finite(z_grad, "state gradient", chain_times, refine=locate)
            return grads, z_grad

        return ChainPullback(states=states, velocities=velocities, pull=pull)
