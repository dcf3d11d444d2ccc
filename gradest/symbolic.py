"""Tensors without values: the meta device and ``FakeTensorMode``.

gradest traces costs on such tensors (``gradest cost``, fake-tensor runs of every
estimator). Nothing there has a value to read, so value-dependent work (finiteness
checks, loss values, jagg's gate) is skipped or refused, and host-side schedules are
computed outside the fake mode. A module of its own so that the finiteness checks
(:mod:`gradest.nonfinite`) and the input checks (:mod:`gradest._checks`) can both use it
without importing each other in a circle.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor


def is_symbolic(t: Any) -> bool:
    """Whether ``t`` has no values to read: a meta-device or fake tensor
    (``torch._subclasses.FakeTensorMode``), run to trace costs without data or weights.

    On such tensors no data-dependent decision is taken: finiteness is not checked, loss
    values are NaN, and options that need values (jagg's gate, auto) refuse to run.
    """
    if not isinstance(t, Tensor):
        return False
    if t.is_meta:
        return True
    if type(t) is Tensor and not _functorch_wrapped(t) and not torch._is_functional_tensor(t):
        return False  # a plain tensor (what is_fake would conclude, ~10x cheaper per step)
    from torch._subclasses.fake_tensor import FakeTensor, is_fake

    return isinstance(t, FakeTensor) or is_fake(t)


def host_value(value: Tensor) -> float:
    """``float(value)`` of a one-element tensor (a loss, for ``info``), or NaN where it has
    no value to read (:func:`is_symbolic`: cost tracing on fake or meta tensors)."""
    return float("nan") if is_symbolic(value) else float(value)


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """A block computed on real tensors even under ``FakeTensorMode``: the sampler's
    schedule (grid, coefficients) is a host object, read as floats, never data-dependent.
    """
    if torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is None:
        return contextlib.nullcontext()  # no fake mode active: nothing to unset
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
