"""``functional_call`` without side effects: one lock per model, and tensors put back.

``torch.func.functional_call`` puts the tensors it is given into the module's attributes
for the duration of the call and puts the originals back afterwards. Two threads doing
that on one module interleave: the second saves the first one's (detached) tensors as
"originals" and restores them last, so the module loses its parameters for good; a
thread calling the module as itself meanwhile computes with tensors that autograd cannot
trace back to the parameters.

Calls of the module as itself only read its attributes, so they may run together
(shared); a ``functional_call`` writes them and runs alone (exclusive). The lock is held
for the forward only: backward passes read saved tensors, never module attributes.

A second hazard, in one thread: when one submodule is registered under two names
(``self.again = self.shared``), torch 2.14's ``functional_call`` puts a plain tensor back
instead of the original ``Parameter`` (measured: the model then trains a copy the optimizer
does not hold). :func:`tensors_restored` records every module's parameter and buffer
slots before the call and puts back any that changed.

A third, with ``torch.compile``: TorchDynamo cannot trace a compiled module called from
eager code inside a ``torch.func`` transform (``torch.func.vjp(compiled)``, PyTorch issue
128711). It then marks the module's ``forward`` code as "skip", so from that call on
*every* call of that module class runs eagerly, silently (or raises, with
``fullgraph=True``). :func:`compiled_code_eager` runs the ``functional_call`` forwards
with the compiler's ``force_eager`` stance instead: those forwards run the module's
Python code, and its compiled code stays in use for every other call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


class _Shared:
    """The shared section of one lock as a context manager object (no per-entry state, so
    one object serves every thread and nesting): entered around every model call, where a
    generator-based context manager cost a few microseconds per step."""

    __slots__ = ("_lock",)

    def __init__(self, lock: _SharedExclusiveLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        lock = self._lock
        me = threading.get_ident()
        with lock._condition:
            # A thread already inside its own exclusive section may call the module too.
            if lock._writer != me:
                while lock._writer is not None:
                    lock._condition.wait()
            lock._readers += 1

    def __exit__(self, *exc: object) -> None:
        lock = self._lock
        with lock._condition:
            lock._readers -= 1
            lock._condition.notify_all()


class _SharedExclusiveLock:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writer: int | None = None
        self._depth = 0
        self._shared = _Shared(self)

    def shared(self) -> _Shared:
        return self._shared

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._condition:
            if self._writer == me:
                self._depth += 1
            else:
                while self._writer is not None or self._readers:
                    self._condition.wait()
                self._writer, self._depth = me, 1
        try:
            yield
        finally:
            with self._condition:
                self._depth -= 1
                if self._depth == 0:
                    self._writer = None
                    self._condition.notify_all()


_locks: weakref.WeakKeyDictionary[nn.Module, _SharedExclusiveLock] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def lock_for(model: nn.Module) -> _SharedExclusiveLock:
    """The lock of ``model`` (created on first use, forgotten with the model)."""
    with _registry_lock:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = _SharedExclusiveLock()
        return lock


def has_shared_submodules(model: nn.Module) -> bool:
    """Whether a submodule is registered under more than one name."""
    return sum(1 for _ in model.named_modules(remove_duplicate=False)) != sum(
        1 for _ in model.modules()
    )


@contextlib.contextmanager
def tensors_restored(model: nn.Module) -> Iterator[None]:
    """Put back every parameter and buffer slot of ``model``'s modules on exit."""
    slots: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for module in model.modules():
        slots.append((module._parameters, dict(module._parameters)))
        slots.append((module._buffers, dict(module._buffers)))
    try:
        yield
    finally:
        for live, saved in slots:
            for name, tensor in saved.items():
                if live.get(name) is not tensor:
                    live[name] = tensor


def has_compiled_code(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> bool:
    """Whether ``model`` is or holds a ``torch.compile``'d module (``torch.compile(m)``, an
    ``OptimizedModule``, or ``m.compile()`` in place); ``modules``: ``model.modules()``
    when the caller already listed them."""
    return any(
        _has_attribute(module, "_orig_mod")
        or getattr(module, "_compiled_call_impl", None) is not None
        for module in (model.modules() if modules is None else modules)
    )


def _has_attribute(module: nn.Module, name: str) -> bool:
    """``hasattr(module, name)`` without ``Module.__getattr__``'s raise and catch for a
    missing name (a few microseconds per module, on every estimate): where ``hasattr``
    looks, the instance, its registered slots and its class."""
    if name in module.__dict__ or name in module._modules:
        return True
    if name in module._parameters or name in module._buffers:
        return True
    return hasattr(type(module), name) and hasattr(module, name)


_stance_lock = threading.Lock()
_eager_depth = 0
_eager_stance: Any = None


@contextlib.contextmanager
def compiled_code_eager() -> Iterator[None]:
    """Run ``torch.compile``'d code inside the block eagerly (``force_eager`` stance).

    For forwards under a ``torch.func`` transform, which Dynamo cannot trace (see the
    module docstring). The stance is process-wide, not per thread, so it is entered by
    the first of overlapping blocks (any thread) and left by the last: nested and
    concurrent blocks never restore each other's stance. Meanwhile compiled code in other
    threads runs eagerly too (same values; only slower). A no-op on torch without
    ``torch.compiler.set_stance`` (before 2.6) and when called from inside a compiled
    region, where torch refuses to change the stance.
    """
    global _eager_depth, _eager_stance
    with _stance_lock:
        if _eager_depth == 0:
            set_stance = getattr(torch.compiler, "set_stance", None)
            try:
                _eager_stance = set_stance("force_eager") if set_stance is not None else None
            except RuntimeError:  # "attempted to set_stance in a torch.compile region"
                _eager_stance = None
        _eager_depth += 1
    try:
        yield
    finally:
        with _stance_lock:
            _eager_depth -= 1
            if _eager_depth == 0 and _eager_stance is not None:
                _eager_stance.__exit__(None, None, None)  # back to the stance before
                _eager_stance = None
