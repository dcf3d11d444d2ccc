"""Conditioning (``cond``): keyword arguments of ``model(z, t, **cond)``, per sample or shared.

Estimators stack ``M`` states of a batch of ``B`` into one model call on ``M*B`` rows; every
per-sample conditioning tensor must then be repeated ``M`` times, and everything else
passed as it is. The rule: a tensor whose first dimension is ``B`` is per sample (class
labels ``[B]``, text embeddings ``[B, S, D]``); anything else (scalars, tensors of another
length, non-tensors) is shared by all rows.

A shared tensor that happens to have ``B`` rows (a ``[B, D]`` lookup table, Flux's
position ids when there are ``B`` text tokens) is ambiguous; wrap it in
:class:`SharedCondition` and it is never repeated::

    est.surrogate(model, sampler, objective, noise=noise,
                  cond={"y": labels, "table": gradest.SharedCondition(table)})

(``Shared`` is the deprecated old name of :class:`SharedCondition`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from torch import Tensor

from gradest._deprecation import module_aliases


@attrs.frozen(eq=False)
class SharedCondition:
    """Marks a ``cond`` value as shared by every sample: passed to the model unrepeated.

    Attributes:
        value: what the model receives.
    """

    value: Any


def model_kwargs(cond: Mapping[str, Any], batch_size: int, copies: int = 1) -> dict[str, Any]:
    """``cond`` as the model's keyword arguments for ``copies`` stacked states of ``batch_size``.

    Per-sample tensors (first dimension ``batch_size``) are repeated ``copies`` times;
    :class:`SharedCondition` values are unwrapped; everything else passes unchanged.
    """
    out: dict[str, Any] = {}
    for key, value in cond.items():
        if isinstance(value, SharedCondition):
            out[key] = value.value
        elif copies > 1 and is_per_sample(value, batch_size):
            out[key] = value.repeat(copies, *([1] * (value.ndim - 1)))
        else:
            out[key] = value
    return out


def is_per_sample(value: Any, batch_size: int) -> bool:
    return isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == batch_size


# Deprecated names, served with a warning that names the replacement.
__getattr__ = module_aliases(
    __name__, {"Shared": (lambda: SharedCondition, "gradest.SharedCondition")}
)
