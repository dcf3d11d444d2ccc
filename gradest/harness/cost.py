"""Deterministic cost measurements: FLOPs, retained activation bytes, and wall time.

docs/design.md#measuring-cost measures an estimator's cost three ways, each a ratio to ``exact``:

* :func:`count_flops`: FLOPs of the matmul-like operators, from PyTorch's own formulas
  (``torch.utils.flop_counter``). Deterministic, independent of the machine.
* :func:`retained_activation_bytes`: the peak bytes of activations the autograd graph
  holds at the same time. Deterministic (reference counting, garbage collector paused).
  :func:`peak_allocated_bytes` is the CPU analogue of ``torch.cuda.max_memory_allocated``.
* :func:`median_wall_time` / :func:`interleaved_wall_times`: seconds, meaningful only as a
  ratio between functions measured in the same process (see :func:`speedup`).

Why a dispatch mode and not ``saved_tensors_hooks``: gradest takes every VJP with
``torch.func.vjp``, and ``torch.func`` refuses to run while saved-tensor hooks are
registered ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor
hooks"). Below ``torch.func`` every operator still reaches the Python dispatcher, so the
memory functions watch the storages operators *create* (a dispatch mode) and learn from a
weak reference when each storage is freed; a torch-function mode, which still sees
``torch.func``'s tracked tensors, tells which operators record a graph. Likewise
:func:`count_flops` uses the formulas of ``FlopCounterMode`` without its module tracker,
whose backward hooks fail inside ``torch.autograd.grad`` (which ``torch.func.vjp``
calls); on plain autograd code the two counts agree exactly.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._C import DispatchKey
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gradest.errors import InvalidValue

# Draws a stochastic estimator's FLOPs and retained bytes are averaged over (a random depth
# or subset changes the work of each call).
COST_DRAWS = 8

__all__ = [
    "count_flops",
    "interleaved_wall_times",
    "median_wall_time",
    "peak_allocated_bytes",
    "ratio",
    "retained_activation_bytes",
    "speedup",
]


# -- FLOPs ----------------------------------------------------------------------------------


class FlopCounter(TorchDispatchMode):
    """Sums ``torch.utils.flop_counter.flop_registry`` formulas over every operator call."""

    def __init__(self, formulas: Mapping[Any, Callable[..., int]] | None = None) -> None:
        super().__init__()
        # torch's FLOP formulas, imported when a counter is first made (measuring only):
        # ``import gradest`` and its command line never load torch.utils.flop_counter.
        from torch.utils.flop_counter import flop_registry

        self._registry = flop_registry
        self.total = 0
        # Formulas that replace torch's own for some operators (a cost trace counts a
        # fused attention backward as the math path does, without its recomputation).
        self.formulas = dict(formulas or {})
        # Per operator overload: its formula and whether it decomposes. Both are fixed
        # by the operator, and asking the dispatcher on every call made a meta trace of
        # SD3 spend most of its time here.
        self._plans: dict[Any, tuple[Callable[..., int] | None, bool]] = {}

    def _plan(self, func: Any) -> tuple[Callable[..., int] | None, bool]:
        plan = self._plans.get(func)
        if plan is None:
            packet = func._overloadpacket
            formula = self.formulas.get(packet) or self._registry.get(packet)
            # What OpOverload.decompose tries: a Python or a C++ composite kernel.
            composite = DispatchKey.CompositeImplicitAutograd
            decomposes = (
                formula is None
                and func is not torch.ops.prim.device.default
                and (
                    composite in func.py_kernels
                    or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), composite)
                )
            )
            plan = self._plans[func] = (formula, decomposes)
        return plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula, decomposes = self._plan(func)
        if decomposes:
            # As FlopCounterMode does: a composite operator without a formula may
            # decompose into ones that have one.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def count_flops(fn: Callable[[], Any]) -> int:
    """Total FLOPs of calling ``fn()``, counted by PyTorch's ``FlopCounterMode`` formulas.

    Only operators with a formula are counted (matmuls, convolutions, attention; a
    multiply-add is 2 FLOPs); elementwise work is free. That is the right unit for the
    cost model (docs/design.md#cost-model) on models where such layers dominate, and the
    count is exact and machine-independent. Works inside ``torch.func`` transforms
    (``FlopCounterMode`` itself fails there, see the module docstring).
    """
    counter = FlopCounter()
    with counter:
        fn()
    return counter.total


# -- memory ---------------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs.

    Operators take and return tensors, lists and tuples of them, and dicts (kwargs):
    walked directly, as ``tree_flatten`` would, without its generic node lookups (this
    runs on every operator of a cost trace).
    """
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


class _GraphRecording(TorchFunctionMode):
    """Whether the torch function running now records an autograd graph.

    It does when grad mode is on and one of its tensor arguments requires grad. At this
    level ``torch.func`` transforms still show their tracked tensors as requiring grad;
    one level down, in the dispatcher, they are already unwrapped, which is why this
    question is asked here and the allocation is seen in :class:`StorageTracker`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        previous = self.active
        self.active = torch.is_grad_enabled() and any(
            t.requires_grad for t in _tensors((args, kwargs))
        )
        try:
            return func(*args, **kwargs)
        finally:
            self.active = previous


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages that operators create while the mode is active.

    A storage counts from the operator call that creates it until it is freed (a weak
    reference to the storage reports that). Storages an operator merely returns a view
    of, or writes in place, were created elsewhere and are not counted: parameters,
    inputs and anything allocated before the measurement never count. Each storage
    counts once however many tensors view it.

    Args:
        recording: if given, count only storages created while it is active (a
            graph-recording forward computation) and no backward pass is running.
        count_meta: count meta-device storages too (a cost traced without data); off by
            default because fake and meta tensors in a real measurement are bookkeeping.
    """

    def __init__(
        self, recording: _GraphRecording | None = None, *, count_meta: bool = False
    ) -> None:
        super().__init__()
        self.recording = recording
        self.count_meta = count_meta
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        self._refs.pop(key, None)
        self.current -= self.live.pop(key, 0)

    def _counts(self) -> bool:
        if self.recording is None:
            return True
        # The autograd engine sets a graph-task id while it runs backward; what it
        # creates there (gradients, their temporaries) is not an activation.
        return self.recording.active and torch._C._current_graph_task_id() == -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._counts():
            return out
        inputs = {
            t.untyped_storage()._cdata
            for t in _tensors((args, kwargs))
            if self.count_meta or not t.is_meta
        }
        for tensor in _tensors(out):
            if tensor.is_meta and not self.count_meta:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.live:
                continue  # a view or in-place result: allocated elsewhere or already counted
            self.live[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, functools.partial(self._on_free, key))
            self.current += self.live[key]
            self.peak = max(self.peak, self.current)
        return out


def _peak_bytes(fn: Callable[[], Any], *, only_graph_forward: bool) -> int:
    # Pausing the cycle collector makes the result deterministic: storages are freed by
    # reference counting alone, at the same point on every run.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    recording = _GraphRecording() if only_graph_forward else None
    tracker = StorageTracker(recording)
    try:
        with contextlib.ExitStack() as stack:
            if recording is not None:
                stack.enter_context(recording)
            stack.enter_context(tracker)
            fn()
    finally:
        if was_enabled:
            gc.enable()
    return tracker.peak


def retained_activation_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of activations kept for backward at the same time while ``fn()`` runs.

    What it counts, exactly: the storages created by torch functions that record an
    autograd graph (grad mode on and a tensor argument requiring grad, ``torch.func``
    tracked tensors included) outside a backward pass, each from its creation until it
    is freed; the result is the peak of their simultaneous sum. While a graph is kept,
    those storages are the activations it saves (plus the step outputs it produces), and
    they are freed with it, so this is the memory that backpropagation through the chain
    holds. Not counted: parameters, inputs and anything allocated before ``fn``
    (including views of them, such as the weight transpose ``linear`` saves), no-grad
    forwards (sampling without a graph), work on tensors that need no gradient (the
    trajectory bookkeeping, summing gradients), and everything a backward pass creates.
    A storage counts once however many saved tensors view it.

    Tensors the graph forward produces but does not save (the last output, a loss
    scalar) count too, while they are alive; they are a few ``[B, ...]`` tensors.

    Deterministic: the cycle collector is paused, so storages are freed by reference
    counting alone. Works with ``torch.func`` (``saved_tensors_hooks`` does not).
    """
    return _peak_bytes(fn, only_graph_forward=True)


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of all storages created while ``fn()`` runs and alive at the same time.

    The CPU analogue of ``torch.cuda.max_memory_allocated()`` minus the memory in use
    before the call (without the allocator's rounding and caching): activations,
    gradients, temporaries and outputs all count; storages that existed before ``fn``
    do not. Deterministic like :func:`retained_activation_bytes`.
    """
    return _peak_bytes(fn, only_graph_forward=False)


# -- wall time ------------------------------------------------------------------------------


def median_wall_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls.

    Timed with ``time.perf_counter``. Wall times are only comparable as ratios between
    functions measured in the same process on a quiet machine; on a shared machine
    prefer :func:`interleaved_wall_times`, which alternates the functions so that load
    drifts hit all of them alike.
    """
    if repeats < 1 or warmup < 0:
        raise InvalidValue(
            f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}"
        )
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_wall_times(
    fns: Mapping[str, Callable[[], Any]], repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per function, timing them in rounds ``a, b, c, a, b, c, ...``.

    Every function gets ``warmup`` untimed calls first, then ``repeats`` rounds each call
    every function once; the result is each function's median over the rounds.
    """
    if repeats < 1 or warmup < 0:
        raise InvalidValue(
            f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}"
        )
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, ``nan`` when the denominator is zero."""
    return numerator / denominator if denominator else float("nan")


def speedup(baseline: float, candidate: float) -> float:
    """How many times cheaper ``candidate`` is than ``baseline`` (``baseline / candidate``)."""
    return ratio(baseline, candidate)
