"""Classifier-free guidance as a velocity model, so every estimator differentiates through it.

``v = v_uncond + w (v_cond - v_uncond)``, with both predictions from **one** call of the
wrapped model on a doubled batch ``[uncond rows; cond rows]`` (the order diffusers
pipelines use), as :class:`ClassifierFreeGuidance.forward` shows. The wrapper is an
ordinary ``nn.Module`` ``model(z, t, **cond)``: gradest stacks states, repeats
per-sample conditioning and takes VJPs through it like through any model.

Conditioning: for every key ``k`` that has an unconditional counterpart, ``cond`` holds
``k`` (the prompt's value) and ``negative_k`` (the negative / empty prompt's value, with
the same batch rows). Other keys are shared by both halves (a tensor whose first dimension
is the batch is repeated for the second half).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradest.errors import InvalidValue

__all__ = ["NEGATIVE_PREFIX", "ClassifierFreeGuidance"]

NEGATIVE_PREFIX = "negative_"


class ClassifierFreeGuidance(nn.Module):
    """``model(z, t, **cond)`` guided: ``v_u + scale * (v_c - v_u)`` in one batched call.

    Args:
        model: the velocity (or epsilon / v) model, e.g. a ``DiffusersVelocity``.
        scale: the guidance scale ``w``. With ``w = 1`` the guided velocity is ``v_c``
            and only the conditional half is evaluated (one call on the plain batch).

    Parameters keep the wrapped model's names behind a ``model.`` prefix.
    """

    def __init__(self, model: nn.Module, scale: float):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise InvalidValue(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale >= 0:
            raise InvalidValue(f"guidance scale must be a number >= 0, got {scale!r}")
        self.model = model
        self.scale = float(scale)

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        negatives = {
            key[len(NEGATIVE_PREFIX) :]: value
            for key, value in cond.items()
            if key.startswith(NEGATIVE_PREFIX)
        }
        for key in negatives:
            if key not in cond:
                raise InvalidValue(
                    f"cond has {NEGATIVE_PREFIX + key!r} (the unconditional value) but no "
                    f"{key!r} (the conditional one); pass both"
                )
        plain = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE_PREFIX)}
        if self.scale == 1.0:
            return self.model(z, t, **plain)
        rows = z.shape[0]
        doubled: dict[str, Any] = {}
        for key, value in plain.items():
            if key in negatives:
                doubled[key] = torch.cat([negatives[key], value])
            elif isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == rows:
                doubled[key] = torch.cat([value, value])
            else:
                doubled[key] = value
        out = self.model(torch.cat([z, z]), torch.cat([t, t]), **doubled)
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + self.scale * (v_cond - v_uncond)

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}"
