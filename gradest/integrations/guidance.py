"""Guidance as velocity models, so every estimator differentiates through it.

* :class:`ClassifierFreeGuidance`: ``v = v_u + w (v_c - v_u)``, with both predictions
  from **one** call of the wrapped model on a doubled batch ``[uncond rows; cond rows]``
  (the order diffusers pipelines use), optionally rescaled as diffusers'
  ``guidance_rescale`` (Lin et al. 2023, SDXL's pipeline).
* :class:`EmbeddedGuidance`: a guidance-distilled model (FLUX.1-dev,
  ``guidance_embeds=True``) takes the scale as an input, ``guidance [B]``, as FluxPipeline
  passes it: one call, no doubled batch.

Both are ordinary ``nn.Module`` models ``model(z, t, **cond)``: gradest stacks states,
repeats per-sample conditioning and takes VJPs through them like through any model, and
they compose (``ClassifierFreeGuidance(EmbeddedGuidance(flux, 3.5), 2.0)`` is Flux's
"true CFG" on a guidance-distilled model).

Conditioning of :class:`ClassifierFreeGuidance`: for every key ``k`` that has an
unconditional counterpart, ``cond`` holds ``k`` (the prompt's value) and ``negative_k``
(the negative / empty prompt's value, with the same batch rows and, for a nested value
such as SDXL's ``added_cond_kwargs``, the same nesting). Other keys are shared by both
halves: their per-sample tensors, nested ones too, are repeated for the second half
(:mod:`gradest.conditioning`'s one rule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradest._checks import finite_number
from gradest.conditioning import repeat_per_sample, tensor_leaves, with_tensor_leaves
from gradest.errors import InvalidType, InvalidValue

__all__ = ["NEGATIVE_PREFIX", "ClassifierFreeGuidance", "EmbeddedGuidance"]

#: ``cond[NEGATIVE_PREFIX + k]`` is the unconditional value of ``cond[k]``.
NEGATIVE_PREFIX = "negative_"


def _module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidType(
            f"model must be an nn.Module model(z, t, **cond), got {type(model).__name__}; "
            f"wrap a diffusers model in gradest.integrations.diffusers.DiffusersVelocity"
        )
    return model


class ClassifierFreeGuidance(nn.Module):
    """``model(z, t, **cond)`` guided: ``v_u + scale * (v_c - v_u)`` in one batched call.

    Args:
        model: the velocity (or epsilon / v) model, e.g. a ``DiffusersVelocity``.
        scale: the guidance scale ``w`` (>= 0). With ``w = 1`` the guided velocity is
            ``v_c`` and only the conditional half is evaluated (one call on the plain
            batch; ``negative_*`` keys are then ignored).
        rescale: diffusers' ``guidance_rescale`` (``rescale_noise_cfg``): the guided
            output's per-sample standard deviation is pulled towards the conditional
            one's, ``phi * v * std(v_c) / std(v) + (1 - phi) * v``; 0 (the default) is
            plain CFG.

    Parameters keep the wrapped model's names behind a ``model.`` prefix.

    Raises (at the call, in one line naming the key and the fix): ``negative_k`` without
    ``k``; ``scale != 1`` with no ``negative_*`` key at all (both halves would be the
    conditional prediction: no guidance, silently); a negative value whose tensors do
    not match the conditional one's.
    """

    def __init__(self, model: nn.Module, scale: float, *, rescale: float = 0.0):
        super().__init__()
        self.model = _module(model)
        self.scale = finite_number("scale", scale, 0.0)
        self.rescale = finite_number("rescale", rescale, 0.0, 1.0)

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
        if not negatives:
            raise InvalidValue(
                f"ClassifierFreeGuidance(scale={self.scale:g}) got no unconditional "
                f"conditioning: cond has no '{NEGATIVE_PREFIX}*' key (keys {sorted(cond)}), so "
                f"both halves would be the conditional prediction; pass e.g. "
                f"'{NEGATIVE_PREFIX}encoder_hidden_states' (the empty prompt's encoding, one "
                f"row per sample), or scale=1 for no guidance"
            )
        rows = z.shape[0]
        doubled: dict[str, Any] = {}
        for key, value in plain.items():
            if key in negatives:
                doubled[key] = _stacked(key, negatives[key], value)
            else:
                # Shared by both halves: per-sample tensors (nested ones too) repeated.
                doubled[key] = repeat_per_sample(value, rows, 2)
        out = self.model(torch.cat([z, z]), repeat_per_sample(t, rows, 2), **doubled)
        v_uncond, v_cond = out.chunk(2)
        guided = v_uncond + self.scale * (v_cond - v_uncond)
        if self.rescale:
            # diffusers' rescale_noise_cfg: std over every dimension but the batch.
            dims = list(range(1, guided.ndim))
            std_cond = v_cond.std(dim=dims, keepdim=True)
            std_guided = guided.std(dim=dims, keepdim=True)
            rescaled = guided * (std_cond / std_guided)
            guided = self.rescale * rescaled + (1 - self.rescale) * guided
        return guided

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}" + (f", rescale={self.rescale:g}" if self.rescale else "")


def _stacked(key: str, negative: Any, positive: Any) -> Any:
    """``[negative; positive]`` leaf by leaf (``positive``'s nesting, SDXL's
    ``added_cond_kwargs`` too)."""
    if isinstance(positive, Tensor) and isinstance(negative, Tensor):
        pairs = [(negative, positive)]
    else:
        negative_leaves, positive_leaves = tensor_leaves(negative), tensor_leaves(positive)
        if len(negative_leaves) != len(positive_leaves):
            raise InvalidValue(
                f"cond[{NEGATIVE_PREFIX + key!r}] has {len(negative_leaves)} tensors but "
                f"cond[{key!r}] has {len(positive_leaves)}; give the unconditional value the "
                f"conditional one's nesting"
            )
        pairs = list(zip(negative_leaves, positive_leaves, strict=True))
    stacked = []
    for neg, pos in pairs:
        if neg.shape != pos.shape:
            raise InvalidValue(
                f"cond[{NEGATIVE_PREFIX + key!r}] has a tensor of shape {tuple(neg.shape)} "
                f"where cond[{key!r}] has {tuple(pos.shape)}; the unconditional value needs "
                f"the conditional one's shape (one row per sample: expand the empty prompt's "
                f"encoding to the batch)"
            )
        stacked.append(torch.cat([neg, pos]))
    if isinstance(positive, Tensor):
        return stacked[0]
    return with_tensor_leaves(positive, stacked)


class EmbeddedGuidance(nn.Module):
    """A guidance-distilled model with its scale as an input: ``model(z, t, **cond,
    guidance=full([B], scale))``, as FluxPipeline passes ``guidance_scale`` to a
    ``FluxTransformer2DModel`` with ``guidance_embeds=True`` (FLUX.1-dev).

    Args:
        model: e.g. ``DiffusersVelocity(flux_transformer)``.
        scale: the guidance value (FLUX.1-dev's pipeline default is 3.5).
        name: the keyword the model takes it as.

    Raises:
        InvalidValue: ``model`` wraps a diffusers model whose config has
            ``guidance_embeds=False`` (FLUX.1-schnell: it has no guidance input), or,
            at the call, ``cond`` already holds ``guidance``.
    """

    def __init__(self, model: nn.Module, scale: float, *, name: str = "guidance"):
        super().__init__()
        self.model = _module(model)
        self.scale = finite_number("scale", scale, 0.0)
        self.name = name
        config = getattr(model, "config", None)
        if getattr(config, "guidance_embeds", True) is False:
            raise InvalidValue(
                f"EmbeddedGuidance(scale={self.scale:g}): this model has "
                f"config.guidance_embeds=False (e.g. FLUX.1-schnell), so it takes no guidance "
                f"input; use the model without EmbeddedGuidance"
            )

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        if self.name in cond:
            raise InvalidValue(
                f"cond has {self.name!r} and EmbeddedGuidance(scale={self.scale:g}) sets it; "
                f"pass the scale once (drop cond[{self.name!r}] or the wrapper)"
            )
        # FluxPipeline: torch.full([1], guidance_scale, dtype=float32).expand(batch).
        guidance = torch.full((z.shape[0],), self.scale, dtype=torch.float32, device=z.device)
        return self.model(z, t, **cond, **{self.name: guidance})

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}"
