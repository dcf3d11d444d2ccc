"""The two VJP engines behind one interface: autograd and torch.func.

An :class:`Engine` differentiates a *forward* ``forward(params, z) -> (output, aux)``: it
runs the forward once, recording what its pullback needs, and returns the output, the
forward's ``aux`` (detached values the caller keeps) and a :class:`Pullback` that maps a
cotangent of the output to the gradient w.r.t. the parameters, the input state, or both.
The forward reads ``params`` as the engine hands them: ``None`` means "call the module as
itself" (autograd), a dict means "call it functionally with these tensors" (torch.func;
:meth:`gradest.vjp.model_call.ModelCalls.bound` does either). Everything else (which
forward, the finiteness checks, the cost meter) is the caller's,
:class:`gradest.vjp.VelocityField`.

* :class:`AutogradEngine` (``engine="autograd"``, the default): the forward runs under
  ``torch.enable_grad()`` on the module as itself, from a fresh leaf when the state
  gradient is wanted; the pullback is one ``torch.autograd.grad`` call. Forward hooks and
  layer checkpointing run; ``.grad`` is never written. In surrogate mode
  (``deferred=True``) a parameter pullback is not evaluated: it returns the term
  ``<output, cotangent>`` of the surrogate loss (:class:`~gradest.vjp.SurrogateTerms`)
  for the caller's ``loss.backward()``.
* :class:`FuncEngine` (``engine="func"``): ``torch.func.vjp`` of the forward on an
  explicit dict of detached parameters, the module called through ``functional_call``
  (composable with ``vmap`` / ``jacrev``). Saved-tensor hooks (layer checkpointing) are
  refused by torch.func.

Every pullback is called once and frees the forward's graph.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.func import vjp as _torch_vjp

from gradest.vjp.gradients import Grads, ParamGradient, SurrogateTerms, inner
from gradest.vjp.model_call import ModelCalls

#: ``forward(params, z) -> (output, aux)``: ``params`` as the engine hands them.
Forward = Callable[[Grads | None, Tensor], tuple[Tensor, Any]]

# torch.func.vjp's annotations do not distinguish has_aux=True (three results) from the
# default (two); typed loosely here rather than silenced at every call.
_func_vjp: Callable[..., Any] = _torch_vjp

# Every pullback here is called once and its result is detached: do not build a
# second-order graph (torch.func follows grad mode by default, which costs ~20% of a
# backward) and free the saved activations as soon as the backward has run.
_ONE_SHOT = {"retain_graph": False, "create_graph": False}


class Pullback(abc.ABC):
    """``pull(cotangent) -> (parameter gradient, state gradient or None)``; called once.

    The parameter gradient is ``{}`` when only the state was differentiated, and
    :class:`~gradest.vjp.SurrogateTerms` in surrogate mode.
    """

    @abc.abstractmethod
    def __call__(self, cotangent: Tensor) -> tuple[ParamGradient, Tensor | None]: ...


class Engine(abc.ABC):
    """How a forward's VJP is evaluated (see the module docstring).

    Attributes:
        name: the ``engine=`` value that selects it.
        params: the tensors parameter gradients are taken w.r.t., keyed like the model's
            trainable parameters; ``gradest.base`` orders estimates by them.
    """

    name: ClassVar[str]
    params: Grads

    @abc.abstractmethod
    def __init__(
        self, calls: ModelCalls, trainable: Mapping[str, Tensor], *, deferred: bool = False
    ):
        """Prepare for the model's ``trainable`` parameters (called under the model's
        lock, shared); ``deferred``: surrogate mode (parameter VJPs as loss terms)."""

    @abc.abstractmethod
    def vjp(
        self, forward: Forward, z: Tensor, *, params: bool, state: bool
    ) -> tuple[Tensor, Any, Pullback]:
        """Run ``forward`` on ``z`` with what a VJP w.r.t. the parameters (``params``) and
        the state (``state``) needs; returns ``(output, aux, pullback)``. The output may
        carry a graph (autograd): detach it before handing it out."""


def _filled(inputs: list[Tensor], pulled: tuple[Tensor | None, ...]) -> list[Tensor]:
    """Zeros for the inputs the output does not depend on (``allow_unused``)."""
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, pulled, strict=True)]


class _AutogradPullback(Pullback):
    """One ``torch.autograd.grad`` from the output into the parameters and/or the leaf."""

    __slots__ = ("_output", "_params", "_leaf")

    def __init__(self, output: Tensor, params: Grads, leaf: Tensor | None):
        self._output, self._params, self._leaf = output, params, leaf

    def __call__(self, cotangent: Tensor) -> tuple[Grads, Tensor | None]:
        inputs = list(self._params.values())
        if self._leaf is not None:
            inputs.append(self._leaf)
        pulled = torch.autograd.grad(self._output, inputs, cotangent, allow_unused=True)
        filled = _filled(inputs, pulled)
        grads = dict(zip(self._params, filled[: len(self._params)], strict=True))
        return grads, filled[-1] if self._leaf is not None else None


class _DeferredPullback(Pullback):
    """Surrogate mode: the parameter VJP left to the caller's backward, as a loss term."""

    __slots__ = ("_output",)

    def __init__(self, output: Tensor):
        self._output = output

    def __call__(self, cotangent: Tensor) -> tuple[SurrogateTerms, None]:
        return SurrogateTerms([inner(self._output, cotangent)]), None


class AutogradEngine(Engine):
    """The module called as itself, VJPs by ``torch.autograd.grad``; ``deferred``: the
    parameter VJPs become surrogate loss terms instead (``surrogate()``)."""

    name = "autograd"

    def __init__(
        self, calls: ModelCalls, trainable: Mapping[str, Tensor], *, deferred: bool = False
    ):
        del calls  # the module is called as itself: nothing to prepare
        self.params = dict(trainable)
        self.deferred = deferred

    def vjp(
        self, forward: Forward, z: Tensor, *, params: bool, state: bool
    ) -> tuple[Tensor, Any, Pullback]:
        with torch.enable_grad():
            if state:
                z = z.detach().requires_grad_(True)
            output, aux = forward(None, z)
        if params and self.deferred:
            assert not state, "surrogate mode defers parameter VJPs only"
            return output, aux, _DeferredPullback(output)
        return (
            output,
            aux,
            _AutogradPullback(output, self.params if params else {}, z if state else None),
        )


def _state_fixed(forward: Forward, z: Tensor, params: Grads) -> tuple[Tensor, Any]:
    """``forward`` as a function of the parameters alone (the state held fixed)."""
    return forward(params, z)


class _FuncPullback(Pullback):
    """``torch.func.vjp``'s pullback, its results as ``(parameter gradient, state gradient)``."""

    __slots__ = ("_pull", "_params", "_state")

    def __init__(self, pull: Callable[..., tuple[Any, ...]], *, params: bool, state: bool):
        self._pull, self._params, self._state = pull, params, state

    def __call__(self, cotangent: Tensor) -> tuple[Grads, Tensor | None]:
        pulled = self._pull(cotangent, **_ONE_SHOT)
        if not self._params:
            return {}, pulled[0]
        return pulled[0], pulled[1] if self._state else None


class FuncEngine(Engine):
    """``torch.func.vjp`` on a dict of detached parameters, the module called by
    ``functional_call`` (:meth:`~gradest.vjp.model_call.ModelCalls.functional`)."""

    name = "func"

    def __init__(
        self, calls: ModelCalls, trainable: Mapping[str, Tensor], *, deferred: bool = False
    ):
        assert not deferred, "surrogate mode runs on the autograd engine"
        self.params = {n: p.detach() for n, p in trainable.items()}
        calls.prepare_functional(trainable)

    def vjp(
        self, forward: Forward, z: Tensor, *, params: bool, state: bool
    ) -> tuple[Tensor, Any, Pullback]:
        if params and state:
            output, pull, aux = _func_vjp(forward, self.params, z, has_aux=True)
        elif params:
            output, pull, aux = _func_vjp(
                partial(_state_fixed, forward, z), self.params, has_aux=True
            )
        else:
            output, pull, aux = _func_vjp(partial(forward, self.params), z, has_aux=True)
        return output, aux, _FuncPullback(pull, params=params, state=state)


#: The engines by their ``engine=`` name (``gradest.base`` validates the name).
ENGINE_CLASSES: dict[str, type[Engine]] = {
    AutogradEngine.name: AutogradEngine,
    FuncEngine.name: FuncEngine,
}
ENGINES = tuple(ENGINE_CLASSES)
