"""Parameter gradients as the engine returns them: a gradient dict, or surrogate terms.

``estimate()`` evaluates every parameter VJP into a dict keyed like the model's trainable
parameters; ``surrogate()`` defers them into :class:`SurrogateTerms`, the terms of a loss
whose autograd gradient is the estimate. :func:`add_grads` and :func:`scale_grads`
combine both kinds, so a strategy is written once for both verbs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradest.errors import InvalidType

Grads = dict[str, Tensor]


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
    """``factor`` times a gradient dict, or surrogate terms scaled."""
    if isinstance(grads, SurrogateTerms):
        return grads.scaled(factor)
    return {name: g * factor for name, g in grads.items()}
