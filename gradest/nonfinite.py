"""Detecting NaN / Inf where it first appears, instead of in a poisoned ``.grad``.

The VJP engine checks every velocity, state gradient and parameter gradient it
produces, the adjoint sweep checks each adjoint, and objectives check losses and their
gradients. The first non-finite tensor raises :class:`NonFiniteError` naming the tensor
and the sampling step(s). Within an estimator call (:func:`deferred_checks`) each check
only records device-side flags; the call decides them all with one host sync at its end
and raises the first failing check's error (located from the flags, on the failure path
only). ``estimate``/``backward`` add the estimator and either re-raise
(``on_nonfinite="raise"``, the default) or return an estimate marked unusable with
``.grad`` untouched (``on_nonfinite="skip"``).

``surrogate()`` leaves the parameter VJPs to the caller's backward, where the checks
above cannot run: a NaN produced only by a step's *backward* (a custom autograd function,
``sqrt`` at 0) would reach ``.grad`` silently. :class:`BackwardWatch` covers it: hooks on
every surrogate model call's output and input (and, during the backward, on the trainable
parameters) record whether each gradient is finite as device tensors (one reduction per
hook, no host sync), and one check at the end of the backward raises
:class:`NonFiniteError` naming the step(s) where the non-finite value first appeared (a
step whose input gradient is non-finite while its output gradient is finite). Under a
loss scaler (the gradient reaching ``sur.loss`` is larger than 1: ``GradScaler``,
``accelerate``'s fp16) overflow is the scaler's signal to skip the step, so the watch
stands aside.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from gradest.errors import GradestError
from gradest.symbolic import is_symbolic

ON_NONFINITE = ("raise", "skip")
_HALF = (torch.float16, torch.bfloat16)
# A tensor description that names its step itself ("loss at step 2").
_STEP_IN_TEXT = re.compile(r"\bat step (\d+)\b")


class NonFiniteError(GradestError, ValueError):
    """A NaN or Inf appeared in an estimate.

    Attributes:
        tensor: what was non-finite ("velocity", "adjoint", "parameter gradient", ...).
        steps: the sampling steps it was computed at (empty if not step-specific).
        times: the sampler's times of those steps.
        estimator: the estimator that was running (filled in by ``estimate``).
    """

    def __init__(self, tensor: str, *, times: Sequence[float] = (), steps: Sequence[int] = ()):
        self.tensor = tensor
        self.times = tuple(float(t) for t in times)
        self.steps = tuple(int(k) for k in steps)
        # The description may name the step itself ("loss at step 2"): then .steps says so.
        named = _STEP_IN_TEXT.search(tensor)
        self._step_in_text = named is not None and not self.steps and not self.times
        if self._step_in_text:
            assert named is not None
            self.steps = (int(named.group(1)),)
        self.estimator = ""
        super().__init__(self._message())

    def locate(self, sampler_times: Tensor, estimator: str) -> NonFiniteError:
        """Translate times to step indices on ``sampler_times`` and record the estimator."""
        if self.times and not self.steps:
            grid = sampler_times.tolist()
            self.steps = tuple(
                min(range(len(grid) - 1), key=lambda k: abs(grid[k] - t)) for t in self.times
            )
        self.estimator = estimator
        self.args = (self._message(),)
        return self

    def _message(self) -> str:
        where = ""
        if self._step_in_text:
            pass
        elif self.steps:
            where = (
                f" at step {self.steps[0]}"
                if len(self.steps) == 1
                else f" at steps {list(self.steps)}"
            )
        elif self.times:
            where = f" at t={', '.join(f'{t:g}' for t in self.times)}"
        by = f" in estimator {self.estimator}" if self.estimator else ""
        return (
            f"non-finite (NaN/Inf) {self.tensor}{where}{by}; check the model and loss for "
            f"overflow (lower the learning rate, use float32/bfloat16 autocast carefully), or "
            f"pass on_nonfinite='skip' to drop such estimates"
        )


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element is finite, at the cost of one sum per tensor.

    A sum is non-finite iff an element is (NaN and Inf propagate), except when finite
    values overflow the sum; half-precision tensors are summed in float32 so that cannot
    happen for them, and a non-finite sum is confirmed element-wise before reporting.
    ``isfinite(t).all()`` directly is ~20x slower on CPU, which showed in wall time.
    """
    items = list(tensors)
    if not items:
        return True
    if len(items) == 1:  # one tensor (the noise checked up front): its sum alone, no stack
        (t,) = items
        total = t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()
        return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())
    sums = torch.stack(
        [
            (t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()).to(torch.float64)
            for t in items
        ]
    )
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in items)


def _sum_dtype(value: Tensor) -> torch.dtype | None:
    """What a finiteness sum accumulates in: wide enough that finite values cannot
    overflow it (float32 for half precision, float64 for float32/bfloat16; float64 and
    complex tensors in their own dtype)."""
    if value.dtype == torch.float16:
        return torch.float32
    if value.dtype == torch.float64 or not value.is_floating_point():
        return None
    return torch.float64


def finite_sums(value: Tensor, rows: int = 0) -> Tensor:
    """The sums whose finiteness is ``value``'s (one op, no host sync): 0-dim, or ``[rows]``
    sums, one per leading row, when ``rows`` is given (see :func:`_all_finite`)."""
    if value.requires_grad:
        value = value.detach()  # no graph for the check (an op: only when there is one)
    dtype = _sum_dtype(value)
    if rows:
        flat = value.reshape(rows, -1)
        return flat.sum(1, dtype=dtype) if dtype is not None else flat.sum(1)
    return value.sum(dtype=dtype) if dtype is not None else value.sum()


class DeferredChecks:
    """Finiteness checks of one estimator call, decided once at its end.

    Each check records sums that are finite iff the checked tensor is
    (:func:`finite_sums`; one op per check, no host sync) and how to build its
    :class:`NonFiniteError` (:meth:`add_sums`). :meth:`resolve` takes the ``isfinite``
    of every sum at once (the 0-dim sums stacked in one op), makes one host sync and,
    only if one failed, raises the error of the first failing check in the order they
    were recorded: the error the check would have raised where it ran.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[Tensor, Callable[[Tensor], NonFiniteError]]] = []
        # The fast path's view of the same sums: 0-dim ones per device, and the rows.
        self._scalars: dict[torch.device, list[Tensor]] = {}
        self._rows: list[Tensor] = []

    def add_sums(self, sums: Tensor, error: Callable[[Tensor], NonFiniteError]) -> None:
        """Record sums (from :func:`finite_sums`, real tensors) for one check."""
        self._entries.append((sums, error))
        if sums.ndim:
            self._rows.append(sums)
        else:
            self._scalars.setdefault(sums.device, []).append(sums)

    def _passed(self) -> bool:
        """One host sync: whether every recorded check passed."""
        parts = [torch.isfinite(torch.stack(sums)) for sums in self._scalars.values()]
        device = parts[0].device if parts else self._rows[0].device
        if self._rows:
            rows = torch.cat([v.reshape(-1).to(device) for v in self._rows])
            parts.append(torch.isfinite(rows))
        parts = [part.to(device) for part in parts]
        return bool((parts[0] if len(parts) == 1 else torch.cat(parts)).all())

    def first_error(self) -> NonFiniteError | None:
        """The first failing check's error, or None (one host sync unless one failed)."""
        entries = self._entries
        if not entries:
            return None
        passed = self._passed()
        self._entries, self._scalars, self._rows = [], {}, []
        if passed:
            return None
        for sums, error in entries:  # the failure path only
            flags = torch.isfinite(sums)
            if not bool(flags.all()):
                return error(flags)
        return None  # pragma: no cover

    def resolve(self) -> None:
        error = self.first_error()
        if error is not None:
            raise error


_PENDING: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar(
    "gradest_deferred_finite_checks", default=None
)


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Within the block, :func:`check_finite` and :func:`defer_finite` record device-side
    sums instead of synchronising; they are decided once when the block ends.

    If the block raises and a recorded check had failed, that check's
    :class:`NonFiniteError` is raised instead (it happened first: later code ran on the
    non-finite values); the block's own exception becomes its context.
    """
    checks = DeferredChecks()
    token = _PENDING.set(checks)
    try:
        yield checks
    except Exception as err:
        _PENDING.reset(token)
        first = checks.first_error()
        if first is not None:
            raise first from err
        raise
    except BaseException:
        _PENDING.reset(token)
        raise
    _PENDING.reset(token)
    checks.resolve()


@contextmanager
def immediate_checks() -> Iterator[None]:
    """Within the block, checks raise where they run (a failure path re-running steps to
    locate a non-finite value)."""
    token = _PENDING.set(None)
    try:
        yield
    finally:
        _PENDING.reset(token)


def defer_finite(value: Tensor, error: Callable[[Tensor], NonFiniteError]) -> None:
    """Raise ``error(flags)`` unless ``value`` is finite: at the end of the enclosing
    :func:`deferred_checks` block if there is one (one sum now), otherwise now."""
    if is_symbolic(value):
        return  # fake/meta tensors: no values to check
    pending = _PENDING.get()
    if pending is not None:
        pending.add_sums(finite_sums(value), error)
    elif not _all_finite([value]):
        raise error(torch.zeros((), dtype=torch.bool))


def check_finite(
    value: Tensor | Mapping[str, Tensor],
    tensor: str,
    times: Sequence[float] = (),
    *,
    refine: Callable[[], NonFiniteError | None] | None = None,
    sequential: bool = False,
) -> None:
    """Raise :class:`NonFiniteError` if ``value`` (a tensor or a gradient dict) has NaN/Inf.

    For ``[M, B, ...]`` stacked values with ``M`` times, only the offending rows' times
    are reported; with ``sequential=True`` (rows computed one after the other, each from
    the previous: a chain's velocities) only the first offending row's, the step where
    the value first went non-finite, which is what one check per step would have
    reported. Inside :func:`deferred_checks` the decision is made at the block's end (one
    sum now, one host sync then). ``refine()``, called on the failure path only, may
    return a more precise error (e.g. from a step-by-step re-run).
    """
    times = tuple(times)
    pending = _PENDING.get()
    if pending is None:
        if any(is_symbolic(t) for t in ([value] if isinstance(value, Tensor) else value.values())):
            return  # fake/meta tensors: no values to check
        try:
            _check_finite_now(value, tensor, times, sequential)
        except NonFiniteError as err:
            better = refine() if refine is not None else None
            if better is None:
                raise
            raise better from err
        return
    if isinstance(value, Tensor):
        if is_symbolic(value):
            return  # fake/meta tensors: no values to check
        if not value.is_floating_point() and not value.is_complex():
            return  # integers and booleans are finite
        if len(times) > 1 and value.ndim and value.shape[0] == len(times):
            pending.add_sums(
                finite_sums(value, len(times)),
                lambda flags: _refined(
                    NonFiniteError(tensor, times=_bad_times(times, flags, sequential)), refine
                ),
            )
        else:
            pending.add_sums(
                finite_sums(value),
                lambda _: _refined(NonFiniteError(tensor, times=times), refine),
            )
        return
    items = list(value.items())
    if not items:
        return
    if is_symbolic(items[0][1]):
        return  # fake/meta tensors: no values to check
    names = [name for name, _ in items]

    def dict_error(flags: Tensor) -> NonFiniteError:
        bad = [n for n, ok in zip(names, flags.tolist(), strict=True) if not ok]
        return _refined(
            NonFiniteError(
                f"{tensor} ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})", times=times
            ),
            refine,
        )

    device = items[0][1].device
    # One sum per gradient, stacked (stack promotes to a common dtype) on one device.
    sums = [finite_sums(g) for _, g in items]
    pending.add_sums(
        torch.stack([s if s.device == device else s.to(device) for s in sums]), dict_error
    )


def _refined(
    error: NonFiniteError, refine: Callable[[], NonFiniteError | None] | None
) -> NonFiniteError:
    better = refine() if refine is not None else None
    return better if better is not None else error


def _bad_times(times: Sequence[float], flags: Tensor, sequential: bool) -> list[float]:
    """The times of the rows whose flag is False (the first of them if ``sequential``)."""
    bad = [t for t, ok in zip(times, flags.tolist(), strict=True) if not ok]
    return bad[:1] if sequential else bad


def _check_finite_now(
    value: Tensor | Mapping[str, Tensor],
    tensor: str,
    times: Sequence[float] = (),
    sequential: bool = False,
) -> None:
    if isinstance(value, Tensor):
        if _all_finite([value]):
            return
        if len(times) > 1 and value.shape[0] == len(times):
            flags = torch.stack([torch.tensor(_all_finite([row])) for row in value])
            raise NonFiniteError(tensor, times=_bad_times(times, flags, sequential))
        raise NonFiniteError(tensor, times=times)
    if not _all_finite(value.values()):
        names = [n for n, g in value.items() if not _all_finite([g])]
        raise NonFiniteError(
            f"{tensor} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})", times=times
        )


class BackwardWatch:
    """Finite-value flags of one surrogate loss's backward, checked once at its end.

    :meth:`observe` hooks each model call of the surrogate (the engine calls it for every
    forward whose graph reaches the parameters); :meth:`start` runs at the beginning of
    the loss's backward (a hook on the loss), hooks the trainable parameters for the
    duration of that backward and queues :meth:`_finish` for its end. The hooks store the
    gradient's sum per step as device tensors (finite iff the gradient is); the one
    ``isfinite`` and the one host sync are in ``_finish``.
    """

    def __init__(self) -> None:
        self._flags: list[tuple[str, tuple[float, ...], Tensor]] = []
        self._calls: list[tuple[tuple[float, ...], bool]] = []
        # (a chain step's times, the previous step's): see observe_chain_step.
        self._links: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._loss_grad: Tensor | None = None
        self.sampler_times: Tensor | None = None
        self.estimator = ""

    def observe(self, z: Tensor, v: Tensor, times: Sequence[float]) -> None:
        """Hook one model call ``v = model(z)`` over ``len(times)`` stacked steps.

        ``z`` must be the call's own input (an alias such as ``z.view_as(z)`` when the
        state is also used elsewhere), so its gradient is the model's contribution only.
        An input that does not require grad (recorded states, the noise) is not hooked:
        its gradient is never computed, and computing it would cost a VJP of its own.
        """
        steps = tuple(map(float, times))
        observed = z.requires_grad
        self._calls.append((steps, observed))
        if observed:
            self._hook(z, "input", steps)
        if v.requires_grad:
            self._hook(v, "output", steps)

    def observe_chain_step(
        self, z: Tensor, v: Tensor, times: Sequence[float], previous: Sequence[float] | None
    ) -> None:
        """Hook step ``k`` of a chain ``z_{k+1} = alpha_k z_k + beta_k v_k (+ sigma_k xi_k)``
        by its output only.

        The gradient w.r.t. ``z_k`` is ``alpha_k a_{k+1}`` plus what step ``k``'s model
        sends back, and it reaches step ``k-1``'s output as ``beta_{k-1}`` times itself:
        if step ``k``'s output gradient is finite, step ``k-1``'s is non-finite exactly
        when step ``k``'s model made a non-finite input gradient. So the flag of the
        ``previous`` step's output (its times; None for the chain's first step) stands
        for this step's input flag in :meth:`_error`, and the step needs one hook instead
        of :meth:`observe`'s two (and no alias of ``z_k``).
        """
        steps = tuple(map(float, times))
        linked = previous is not None and z.requires_grad
        self._calls.append((steps, linked))
        if linked:
            assert previous is not None
            self._links.append((steps, tuple(map(float, previous))))
        if v.requires_grad:
            self._hook(v, "output", steps)

    def _hook(self, tensor: Tensor, kind: str, times: tuple[float, ...]) -> None:
        """Record the sums of ``tensor``'s gradient per step (finite iff the gradient is).

        A pre-hook on the node that made ``tensor`` (it receives the gradient w.r.t. each
        of the node's outputs, ``tensor``'s at ``output_nr``): what ``tensor.register_hook``
        does, at a third of its Python cost per model call.
        """
        count, flags = len(times), self._flags

        def record(grad: Tensor | None) -> None:
            if grad is None:
                return
            if grad.requires_grad:  # a create_graph backward: no graph for the check
                grad = grad.detach()
            if count == 1:  # one op: the sum of the one step's gradient, [1]
                total = grad.sum(dtype=torch.float32) if grad.dtype in _HALF else grad.sum()
                flags.append((kind, times, total))
                return
            rows = grad.reshape(count, -1)
            sums = rows.sum(1, dtype=torch.float32) if rows.dtype in _HALF else rows.sum(1)
            flags.append((kind, times, sums))

        node = tensor.grad_fn
        if node is None:  # a leaf output: the tensor's own hook
            tensor.register_hook(record)
            return
        index = tensor.output_nr
        node.register_prehook(lambda grads: record(grads[index]))

    def _parameter_hook(self, grad: Tensor) -> None:
        if grad.requires_grad:
            grad = grad.detach()
        total = grad.sum(dtype=torch.float32) if grad.dtype in _HALF else grad.sum()
        self._flags.append(("parameter", (), total))

    def start(self, loss_grad: Tensor, parameters: Iterable[Tensor]) -> None:
        """At the start of the loss's backward: forget earlier flags (the cotangent work's
        own VJPs, checked where they ran), hook the parameters, queue the final check."""
        self._remove_hooks()
        self._flags.clear()
        self._loss_grad = loss_grad.detach()
        self._handles = [p.register_hook(self._parameter_hook) for p in parameters]
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _finish(self) -> None:
        self._remove_hooks()
        # (The hooks' closures append to this very list: it is copied, then emptied.)
        recorded = list(self._flags)
        self._flags.clear()
        if any(type(sums) is not Tensor or sums.is_meta for *_, sums in recorded):
            # Cost tracing: fake or meta sums have no values (plain tensors, the usual
            # case, are real: the cheap test first).
            recorded = [entry for entry in recorded if not is_symbolic(entry[2])]
        if not recorded:
            return
        device = recorded[0][2].device
        on_device = [sums if sums.device == device else sums.to(device) for *_, sums in recorded]
        rows = [sums.reshape(-1) for sums in on_device if sums.ndim]
        if rows:
            scalars = [sums for sums in on_device if not sums.ndim]
            everything = torch.cat([torch.stack(scalars), *rows] if scalars else rows)
        else:
            everything = torch.stack(on_device)  # every sum is a scalar
        if bool(torch.isfinite(everything).all()):
            return
        scale = self._loss_grad
        if scale is not None and not bool(scale.abs() <= 1):
            return  # a loss scaler's overflow: GradScaler skips the step and lowers the scale
        raise self._error(
            [(kind, times, torch.isfinite(sums).reshape(-1)) for kind, times, sums in recorded]
        )

    def _error(self, flags: list[tuple[str, tuple[float, ...], Tensor]]) -> NonFiniteError:
        """Name the steps where the non-finite gradient first appeared (failure path only)."""
        bad: dict[str, set[float]] = {"input": set(), "output": set()}
        for kind, times, flag in flags:
            if kind in bad:
                bad[kind].update(t for t, ok in zip(times, flag.tolist(), strict=True) if not ok)
        # A chain step's input gradient went bad iff the previous step's output's did.
        for steps, previous in self._links:
            if bad["output"].intersection(previous):
                bad["input"].update(steps)
        # A step whose model backward turned a finite output gradient non-finite.
        origins = bad["input"] - bad["output"]
        if not origins:
            # Only parameters (or unhooked inputs) went non-finite: the steps of the calls
            # whose inputs are not hooked and whose output gradient was still finite.
            origins = {
                t
                for times, observed in self._calls
                if not observed
                for t in times
                if t not in bad["output"]
            }
        error = NonFiniteError(
            "gradient in the backward of the surrogate loss", times=sorted(origins, reverse=True)
        )
        if self.sampler_times is not None:
            error.locate(self.sampler_times, self.estimator)
        return error
