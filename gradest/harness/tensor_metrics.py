"""Agreement metrics that speak to training with Adam: per tensor, signs, normalised cosine.

The L2 cosine to the exact gradient can hide what an optimizer feels. AdamW rescales
each coordinate by the root of a running second moment of its gradients, so a parameter
tensor whose gradient is small in norm (a time-embedding layer, say) weighs as much in the
update as a large one, and a tensor whose estimate is 80% wrong barely moves an overall
cosine of 0.985 while it moves that tensor's update entirely. For one trajectory with
exact gradient ``g`` and ``n`` draws ``g^_i``:

* **Adam cosine**: ``cos(g^_i / sqrt(v), g / sqrt(v))`` with ``v`` the per-coordinate second
  moment of the *exact* gradients over the compared trajectories (what Adam's ``v`` tends
  to after many steps, ``E[g^2]``; floored at 1% of its tensor's mean, since a few
  trajectories estimate it far more noisily than Adam's thousand steps), plus ``eps``:
  the cosine in the geometry Adam steps in; averaged over draws.
* **sign agreement**: the fraction of coordinates where ``sign(g^_i) = sign(g)``
  (coordinates where ``g`` is exactly zero are left out), averaged over draws; an Adam
  step with a small ``v`` is close to a sign step.
* per parameter tensor: its **relative error** ``||g^_t - g_t|| / ||g_t||``, its sign
  agreement and its Adam cosine, so the report can show the worst tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch
from torch import Tensor

from gradest.reference.dense import relative_error

# Added to sqrt(v) as torch.optim.AdamW adds its default eps: coordinates whose exact gradient
# is (nearly) always zero get a large but finite weight instead of a division by zero.
ADAM_EPS = 1e-8
# Each coordinate's second moment is at least this fraction of its tensor's mean (see
# second_moment).
MOMENT_FLOOR = 0.01


@attrs.frozen
class TensorLayout:
    """Where each parameter tensor sits in a flat gradient."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, grads: dict[str, Tensor]) -> TensorLayout:
        return cls(tuple(grads), tuple(g.numel() for g in grads.values()))

    def split(self, flat: Tensor) -> tuple[Tensor, ...]:
        return torch.split(flat, list(self.sizes))


@attrs.frozen
class TensorStats:
    """One parameter tensor's agreement with the reference (means over draws and trajectories)."""

    name: str
    size: int
    relative_error: float
    sign_agreement: float
    adam_cosine: float

    def to_dict(self) -> dict[str, float | str | int]:
        return attrs.asdict(self)


def second_moment(
    references: Sequence[Tensor], layout: TensorLayout | None = None, floor: float = MOMENT_FLOOR
) -> Tensor:
    """``v``: the per-coordinate mean of the squared exact gradients (float64).

    With a ``layout``, each coordinate's ``v`` is at least ``floor`` times its tensor's
    mean ``v``: Adam's ``v`` averages ~1/(1 - beta2) = 1000 steps of gradients, while a
    comparison has a handful of trajectories, over which a coordinate's exact gradient
    can be near zero by chance and its normalised error would then swamp the cosine.
    The floor is relative to the tensor's own scale, so small tensors still weigh as
    much as large ones (the point of the normalisation).
    """
    moment = torch.stack([r.to(torch.float64) ** 2 for r in references]).mean(0)
    if layout is None or floor <= 0:
        return moment
    parts = [part.clamp_min(floor * float(part.mean())) for part in layout.split(moment)]
    return torch.cat(parts)


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def adam_cosine(estimate: Tensor, reference: Tensor, moment: Tensor) -> float:
    """``cos(estimate / (sqrt(v) + eps), reference / (sqrt(v) + eps))``."""
    scale = moment.sqrt() + ADAM_EPS
    return _cosine(estimate.to(torch.float64) / scale, reference.to(torch.float64) / scale)


def sign_agreement(estimate: Tensor, reference: Tensor) -> float:
    """Fraction of coordinates with a nonzero reference whose signs agree (nan if none)."""
    nonzero = reference != 0
    if not bool(nonzero.any()):
        return float("nan")
    return float((torch.sign(estimate[nonzero]) == torch.sign(reference[nonzero])).double().mean())


def tensor_stats(
    draws: Sequence[Sequence[Tensor]],
    references: Sequence[Tensor],
    moment: Tensor,
    layout: TensorLayout,
) -> list[TensorStats]:
    """Per-tensor means over trajectories (``draws[s]``: the draws on trajectory ``s``)."""
    out = []
    moments = layout.split(moment)
    for index, (name, size) in enumerate(zip(layout.names, layout.sizes, strict=True)):
        errors, signs, cosines = [], [], []
        for seed_draws, reference in zip(draws, references, strict=True):
            ref = layout.split(reference.to(torch.float64))[index]
            for draw in seed_draws:
                part = layout.split(draw.to(torch.float64))[index]
                errors.append(relative_error(part, ref))
                signs.append(sign_agreement(part, ref))
                cosines.append(adam_cosine(part, ref, moments[index]))
        out.append(
            TensorStats(
                name=name,
                size=size,
                relative_error=mean_of(errors),
                sign_agreement=mean_of(signs),
                adam_cosine=mean_of(cosines),
            )
        )
    return out


def mean_of(values: Iterable[float]) -> float:
    """The mean, leaving out nan (a tensor without a nonzero reference coordinate)."""
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def worst_tensors(stats: Sequence[TensorStats], count: int = 3) -> list[TensorStats]:
    """The ``count`` tensors with the largest relative error (the report lists them)."""
    ranked = [s for s in stats if s.relative_error == s.relative_error]  # not nan
    return sorted(ranked, key=lambda s: s.relative_error, reverse=True)[:count]
