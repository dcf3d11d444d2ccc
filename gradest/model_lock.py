"""``functional_call`` without side effects: one lock per model, and tensors put back.

(Also here: :func:`grad_lock_for`, the per-model lock around ``.grad`` writes that
happen outside autograd, such as the deprecated ``EstimatorBase.backward()``.)

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
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn


class _SharedExclusiveLock:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writer: int | None = None
        self._depth = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._condition:
            # A thread already inside its own exclusive section may call the module too.
            if self._writer != me:
                while self._writer is not None:
                    self._condition.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                self._condition.notify_all()

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
_grad_locks: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def lock_for(model: nn.Module) -> _SharedExclusiveLock:
    """The lock of ``model`` (created on first use, forgotten with the model)."""
    with _registry_lock:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = _SharedExclusiveLock()
        return lock


def grad_lock_for(model: nn.Module) -> threading.Lock:
    """The lock around writes of ``model``'s ``.grad`` outside autograd (created on first
    use, forgotten with the model): the deprecated ``backward()`` reads ``p.grad``, then
    assigns or adds to it, which loses updates when two threads interleave."""
    with _registry_lock:
        lock = _grad_locks.get(model)
        if lock is None:
            lock = _grad_locks[model] = threading.Lock()
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
