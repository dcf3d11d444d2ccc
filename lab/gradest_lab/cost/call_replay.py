"""Trace a model call on the meta device once, replay its cost for every repeat.

Every sampling step calls the model on inputs of the same shapes, and on the meta device
nothing depends on values: the FLOPs, the tensors saved for backward and the transient
memory of a call are fixed by its *signature* (input shapes and dtypes, which inputs
require grad, grad mode) and, for its backward, by which inputs the backward pass
needs. :class:`ReplayCalls` wraps the model: the first call of each signature is
calibrated (run for real on meta tensors, in a separate thread so that the step's own
counters do not see it, once per backward pattern), and every call runs as a custom
autograd function that reports the calibrated FLOPs and transient peak to the counters
of the step being measured, saves tensors of the calibrated sizes (the call's own inputs
where the real call saved an input) and, in backward, returns empty gradients for the
inputs the engine needs.

What is exact and what is not: FLOPs and saved-tensor bytes equal a full trace's
(``lab/tests/test_training_cost.py`` compares them for every built-in estimator); the peak of
created storages is exact up to the order in which a backward returns parameter
gradients (a replayed backward returns them together at its end).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest.harness import FlopCounter, StorageTracker
from gradest.plugin import map_tensors, tensor_leaves, with_tensor_leaves
from gradest_lab.cost.fused_attention import MODEL_FLOP_FORMULAS
from gradest_lab.cost.repeated_blocks import Measurement, measure_with_short_runs

__all__ = ["ReplayCalls", "active_counters", "report"]

# The counters of the step being measured (training_step_cost sets them).
_ACTIVE: list[tuple[FlopCounter, StorageTracker]] = []


@contextlib.contextmanager
def active_counters(flops: FlopCounter, storages: StorageTracker) -> Iterator[None]:
    """Replayed calls report their cost to these counters while the context is open."""
    _ACTIVE.append((flops, storages))
    try:
        yield
    finally:
        _ACTIVE.pop()


def report(flops: int, transient_bytes: int) -> None:
    """Add a replayed call's FLOPs and its transient peak to the active counters."""
    for counter, tracker in _ACTIVE:
        counter.total += flops
        tracker.peak = max(tracker.peak, tracker.current + transient_bytes)


@contextlib.contextmanager
def _discounted(nbytes: int) -> Iterator[None]:
    """The active storage trackers count ``nbytes`` less while the context is open."""
    for _, tracker in _ACTIVE:
        tracker.current -= nbytes
    try:
        yield
    finally:
        for _, tracker in _ACTIVE:
            tracker.current += nbytes


@attrs.frozen
class _Cost:
    flops: int
    transient: int  # peak bytes above the level at the start, outputs included


@attrs.frozen
class _Calibration:
    """One signature's forward (for one requires-grad pattern) and its backward passes."""

    forward: _Cost
    flops_until_last_save: int  # what a checkpoint's recomputation runs before it stops
    saved_inputs: tuple[int, ...]  # indices of inputs whose storage the call saves
    # Bytes of the distinct storages the call creates and saves: they live and die
    # together (with the call's node), so one storage of their total stands for them.
    saved_fresh: int
    out_shape: torch.Size
    out_dtype: torch.dtype
    backward: dict[tuple[bool, bool], _Cost]  # (state needed, parameters needed)
    # Measures another backward pattern (a forward and that backward, in a thread).
    measure: Callable[[tuple[bool, bool]], tuple[_Calibration, _Cost]] | None = None

    def backward_cost(self, pattern: tuple[bool, bool]) -> tuple[int, int]:
        """The FLOPs and transient bytes of the backward pass ``pattern`` asks for,
        measured the first time a backward pass needs it."""
        cost = self.backward.get(pattern)
        if cost is None:
            assert self.measure is not None
            measure = self.measure
            cost = self.backward[pattern] = _in_thread(lambda: measure(pattern)[1])
        return cost.flops, cost.transient


class _SavedStorages:
    """Saved-tensor hooks recording which storages the forward saves (kept alive)."""

    def __init__(self, flops: FlopCounter) -> None:
        self.saved: dict[int, int] = {}
        self.flops = flops
        self.flops_at_last_save = 0

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        self.saved[storage._cdata] = storage.nbytes()
        self.flops_at_last_save = self.flops.total
        return tensor

    @staticmethod
    def unpack(tensor: Tensor) -> Tensor:
        return tensor


def _measured(work: Callable[[], Any], flops: FlopCounter | None = None) -> tuple[Any, _Cost]:
    flops = flops or FlopCounter(MODEL_FLOP_FORMULAS)
    storages = StorageTracker(count_meta=True)
    with storages, flops:
        out = work()
    return out, _Cost(flops.total, storages.peak)


def _calibrate(
    model: nn.Module,
    inputs: Sequence[Tensor],
    state_requires_grad: bool,
    parameters: Sequence[nn.Parameter],
    call: Callable[[Sequence[Tensor]], Tensor],
) -> _Calibration:
    """Run the call for real (meta tensors) and measure its forward, and the backward a
    step most often takes first (every input that requires grad); the other backward
    patterns are measured when a backward pass first needs them."""
    pattern = (state_requires_grad, bool(parameters))

    def measure(pattern: tuple[bool, bool]) -> tuple[_Calibration, _Cost]:
        # A model with long runs of identical blocks is measured on short runs.
        def once() -> Measurement:
            return _as_measurement(
                *_measure(model, inputs, state_requires_grad, parameters, call, pattern)
            )

        return _from_measurement(measure_with_short_runs(model, once))

    forward, backward = measure(pattern)
    return attrs.evolve(forward, backward={pattern: backward}, measure=measure)


def _as_measurement(calibration: _Calibration, backward: _Cost) -> Measurement:
    numbers = (
        calibration.forward.flops,
        calibration.forward.transient,
        calibration.flops_until_last_save,
        calibration.saved_fresh,
        backward.flops,
        backward.transient,
    )
    structure = (calibration.saved_inputs, calibration.out_shape, calibration.out_dtype)
    return Measurement(numbers, structure)


def _from_measurement(measured: Measurement) -> tuple[_Calibration, _Cost]:
    flops, transient, until_last_save, fresh, backward_flops, backward_transient = measured.numbers
    saved_inputs, out_shape, out_dtype = measured.structure
    calibration = _Calibration(
        _Cost(flops, transient),
        until_last_save,
        saved_inputs,
        fresh,
        out_shape,
        out_dtype,
        {},
    )
    return calibration, _Cost(backward_flops, backward_transient)


def _measured_forward(
    model: nn.Module, call: Callable[[], Tensor]
) -> tuple[_Cost, torch.Size, torch.dtype]:
    """A call without a graph, measured (on short runs of identical blocks)."""

    def once() -> Measurement:
        out, cost = _measured(call)
        return Measurement((cost.flops, cost.transient), (out.shape, out.dtype))

    measured = measure_with_short_runs(model, once)
    shape, dtype = measured.structure
    return _Cost(*measured.numbers), shape, dtype


def _measure(
    model: nn.Module,
    inputs: Sequence[Tensor],
    state_requires_grad: bool,
    parameters: Sequence[nn.Parameter],
    call: Callable[[Sequence[Tensor]], Tensor],
    pattern: tuple[bool, bool],
) -> tuple[_Calibration, _Cost]:
    """One forward with a graph and one backward pass of ``pattern`` (state needed,
    parameters needed), measured: the forward's calibration and the backward's cost."""
    needs_state, needs_params = pattern
    input_keys = {t.untyped_storage()._cdata: i for i, t in enumerate(inputs)}
    state = inputs[0].detach().requires_grad_(state_requires_grad)
    args = [state, *inputs[1:]]
    counter = FlopCounter(MODEL_FLOP_FORMULAS)
    recorder = _SavedStorages(counter)
    # One storage tracker over forward and backward: the backward frees the forward's
    # activations as it goes, and its peak is measured from the level they leave.
    storages = StorageTracker(count_meta=True)
    with storages, counter:
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack),
        ):
            out = call(args)
        forward_cost = _Cost(counter.total, storages.peak)
        level = storages.current
        grad_out = torch.empty_like(out)
        level += grad_out.untyped_storage().nbytes()
        storages.peak = storages.current
        flops_before = counter.total
        wanted = [state] if needs_state else []
        wanted += list(parameters) if needs_params else []
        until_last_save = recorder.flops_at_last_save
        param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
        param_keys |= {b.untyped_storage()._cdata for b in model.buffers()}
        # The state's detached copy shares its storage: it counts as input 0.
        saved_inputs = tuple(sorted({input_keys[k] for k in recorder.saved if k in input_keys}))
        saved_fresh = sum(
            nbytes for k, nbytes in recorder.saved.items()
            if k not in input_keys and k not in param_keys
        )  # fmt: skip
        calibration = _Calibration(
            forward_cost, until_last_save, saved_inputs, saved_fresh, out.shape, out.dtype, {}
        )
        del recorder
        grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
        backward = _Cost(counter.total - flops_before, storages.peak - level)
        del out, grad_out, grads
    return calibration, backward


class _ReplayedCall(torch.autograd.Function):
    """The call up to its last saved tensor; :class:`_ReplayedTail` does the rest.

    Two functions because a non-reentrant checkpoint (gradest's ``checkpoint=True``)
    stops its recomputation as soon as the last saved tensor is recomputed: the real
    model's operators after that point do not run again, and the tail's FLOPs must not
    be counted then.
    """

    @staticmethod
    def forward(
        ctx: Any,
        calibration: _Calibration,
        count: int,
        gradients: _ParameterGradients,
        *tensors: Tensor,
    ) -> Tensor:
        report(calibration.flops_until_last_save, calibration.forward.transient)
        inputs = tensors[:count]
        kept = [inputs[i] for i in calibration.saved_inputs]
        if calibration.saved_fresh:
            kept.append(torch.empty(calibration.saved_fresh, dtype=torch.uint8, device="meta"))
        ctx.save_for_backward(*kept)
        ctx.calibration = calibration
        ctx.count = count
        ctx.gradients = gradients
        ctx.likes = [(t.shape, t.dtype) for t in tensors]
        return torch.empty(calibration.out_shape, dtype=calibration.out_dtype, device="meta")

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        nodes = [node for node, _ in ctx.next_functions]
        # Every differentiable input was passed through a view (a non-leaf node), so the
        # engine can say which of them this backward pass needs (autograd.grad w.r.t. the
        # state only skips the weight gradients, as it does in the real model).
        needed = [
            node is not None and torch._C._will_engine_execute_node(node) for node in nodes
        ]  # one node per tensor input (calibration, count and gradients are not tensors)
        count = ctx.count
        needs_state = needed[0]
        needs_params = any(needed[count:])
        if needs_state or needs_params:
            report(*ctx.calibration.backward_cost((needs_state, needs_params)))
        saved = ctx.saved_tensors  # unpacked as the real backward would
        del saved
        # The parameters' gradients leave the first replayed call of a backward pass;
        # every later call's would only be summed into them in place (no FLOPs, no new
        # storage), so those calls report their gradients' bytes as a transient (alive
        # until summed, the call's activations already freed) instead of returning
        # gradients the engine adds one operator at a time: thousands of operators per
        # step, most of a replayed step's time.
        first = needs_params and ctx.gradients.first_in_backward()
        if needs_params and not first:
            new = sum(
                _nbytes(shape, dtype)
                for (shape, dtype), need in zip(ctx.likes[count:], needed[count:], strict=True)
                if need
            )
            report(0, new - ctx.calibration.saved_fresh)
        # A real backward frees each layer's activations before the next layer's
        # gradients exist; the replayed activations are freed only after this returns,
        # so the gradients are allocated as if they were gone already.
        with _discounted(ctx.calibration.saved_fresh):
            grads = [
                torch.empty(shape, dtype=dtype, device="meta")
                if need and (i < count or first)
                else None
                for i, ((shape, dtype), need) in enumerate(zip(ctx.likes, needed, strict=True))
            ]
        return (None, None, None, *grads)


class _ParameterGradients:
    """Which backward pass (autograd graph task) has had the parameters' gradients.

    One per :class:`ReplayCalls`: its calls share the parameters.
    """

    def __init__(self) -> None:
        self.task: int | None = None

    def first_in_backward(self) -> bool:
        """True once per backward pass: at its first replayed call needing them."""
        task = torch._C._current_graph_task_id()
        if task == self.task:
            return False
        self.task = task
        return True


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


class _ReplayedTail(torch.autograd.Function):
    """The call's operators after its last saved tensor (no saves, free backward)."""

    @staticmethod
    def forward(ctx: Any, flops: int, out: Tensor) -> Tensor:
        report(flops, 0)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        return None, grad_out


class ReplayCalls(nn.Module):
    """``model`` on the meta device with each call signature traced once, then replayed.

    Calls on real tensors, and calls whose conditioning requires grad, run the model.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._calibrations: dict[tuple, _Calibration] = {}
        self._no_grad: dict[tuple, tuple[_Cost, torch.Size, torch.dtype]] = {}
        # The model's parameters, listed once (a module walk per call cost seconds).
        self._listed_parameters = tuple(model.parameters())
        self._gradients = _ParameterGradients()

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        # Every tensor of cond, nested ones too (SDXL's added_cond_kwargs): all are inputs
        # of the traced call, whose saved storages and gradients they may be.
        leaves = tensor_leaves(cond)
        tensors = [z, t, *leaves]
        if z.device.type != "meta" or any(c.requires_grad for c in tensors[1:]):
            return self.model(z, t, **cond)
        parameters = [p for p in self._listed_parameters if p.requires_grad]
        records_graph = torch.is_grad_enabled() and (z.requires_grad or bool(parameters))
        key = (
            _signature(tensors, cond),
            z.requires_grad,
            bool(parameters),
            records_graph,
            torch.is_autocast_enabled(),
        )

        def call(args: Sequence[Tensor]) -> Tensor:
            return self.model(args[0], args[1], **with_tensor_leaves(cond, list(args[2:])))

        if not records_graph:
            known = self._no_grad.get(key)
            if known is None:
                known = _in_thread(lambda: _measured_forward(self.model, lambda: call(tensors)))
                self._no_grad[key] = known
            cost, shape, dtype = known
            report(cost.flops, cost.transient)
            return torch.empty(shape, dtype=dtype, device="meta")
        calibration = self._calibrations.get(key)
        if calibration is None:
            calibration = _in_thread(
                lambda: _calibrate(self.model, tensors, z.requires_grad, parameters, call)
            )
            self._calibrations[key] = calibration
        # Views give every differentiable input a node of its own (see backward).
        # (Views allocate nothing: made out of sight of the step's counters, which would
        # otherwise spend milliseconds per call on a few hundred of them.)
        with torch._C._DisableTorchDispatch():
            differentiable = [t.view_as(t) if t.requires_grad else t for t in tensors + parameters]
        out = _ReplayedCall.apply(calibration, len(tensors), self._gradients, *differentiable)
        tail = calibration.forward.flops - calibration.flops_until_last_save
        return _ReplayedTail.apply(tail, out)


def _in_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` where the step's thread-local counters and saved-tensor hooks are not
    active (a fresh thread), so calibration is not counted as part of the step."""
    grad_mode = torch.is_grad_enabled()  # thread-local: carried over by hand

    def in_grad_mode() -> Any:
        with torch.set_grad_enabled(grad_mode):
            return work()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(in_grad_mode).result()


def _signature(tensors: Sequence[Tensor], cond: Mapping[str, Any]) -> tuple:
    """The tensors' shapes, dtypes and grad flags, and cond's structure with every other
    value (the tensors' places only: their values do not change a meta call)."""
    shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
    others = repr(sorted(map_tensors(cond, lambda _: "<tensor>").items()))
    return shapes, others
