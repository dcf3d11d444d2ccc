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
such as SDXL's ``added_cond_kwargs``, the same nesting). A model that names the keys
carrying its prompt (``prompt_keys``: :class:`~gradest.integrations.DiffusersVelocity`
does, e.g. SD3's ``encoder_hidden_states`` and ``pooled_projections``) needs a
``negative_`` value for each of them: one left out would give the unconditional half the
prompt's value. Other keys are shared by both halves: their per-sample tensors, nested
ones too, are repeated for the second half (:mod:`gradest.conditioning`'s one rule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradest._checks import finite_number
from gradest.conditioning import repeat_per_sample, tensor_leaves, with_tensor_leaves
from gradest.errors import InvalidType, InvalidValue
from gradest.trajectory import check_model_fits_sampler

__all__ = ["NEGATIVE_PREFIX", "ClassifierFreeGuidance", "EmbeddedGuidance"]

#: ``cond[NEGATIVE_PREFIX + k]`` is the unconditional value of ``cond[k]``.
NEGATIVE_PREFIX = "negative_"


def prompt_keys(model: Any) -> tuple[str, ...]:
    """The ``cond`` keys ``model`` says carry its prompt (its ``prompt_keys``, also
    inside a DDP wrapper), or ``()`` for a model that does not say."""
    for candidate in (model, getattr(model, "module", None)):
        keys = getattr(candidate, "prompt_keys", None)
        if keys is not None:
            return tuple(keys)
    return ()


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
        detach_unconditional: differentiate through the conditional half only:
            ``v = sg(v_u) + w (v_c - sg(v_u))`` (``sg``: stop-gradient), as Flow-GRPO's
            ``train_sd3.py`` trains (``noise_pred_uncond.detach()``). The value is
            unchanged; the gradient is ``w J_c^T G`` instead of
            ``(1 - w) J_u^T G + w J_c^T G`` (the unconditional branch's weight ``1 - w`` is
            -3.5 at ``w = 4.5``), for the parameters and for the state alike. False (the
            default) differentiates the guided velocity as written, as a hand-written
            DRaFT / AlignProp loop does.

    Parameters keep the wrapped model's names behind a ``model.`` prefix.

    Raises (at the call, in one line naming the key and the fix): ``negative_k`` without
    ``k``; ``scale != 1`` with no ``negative_*`` key at all (both halves would be the
    conditional prediction: no guidance, silently); a prompt key of the model
    (``prompt_keys``) without its ``negative_`` value; a tensor without one row per
    sample (the one that is wrong is named), or a negative value whose tensors do not
    match the conditional one's.
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float,
        *,
        rescale: float = 0.0,
        detach_unconditional: bool = False,
    ):
        super().__init__()
        self.model = _module(model)
        self.scale = finite_number("scale", scale, 0.0)
        self.rescale = finite_number("rescale", rescale, 0.0, 1.0)
        if not isinstance(detach_unconditional, bool):
            raise InvalidType(
                f"detach_unconditional must be True or False, got "
                f"{type(detach_unconditional).__name__} {detach_unconditional!r}"
            )
        self.detach_unconditional = detach_unconditional

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
        unmatched = [k for k in prompt_keys(self.model) if k in plain and k not in negatives]
        if unmatched:
            key = unmatched[0]
            raise InvalidValue(
                f"ClassifierFreeGuidance(scale={self.scale:g}): cond has {key!r} but no "
                f"{NEGATIVE_PREFIX + key!r}, and the model takes {key!r} from the prompt, so "
                f"the unconditional half would use the conditional prompt's; pass "
                f"cond[{NEGATIVE_PREFIX + key!r}] (the negative / empty prompt's value, one "
                f"row per sample) beside " + ", ".join(repr(NEGATIVE_PREFIX + k) for k in negatives)
            )
        rows = z.shape[0]
        doubled: dict[str, Any] = {}
        for key, value in plain.items():
            if key in negatives:
                doubled[key] = _stacked(key, negatives[key], value, rows)
            else:
                # Shared by both halves: per-sample tensors (nested ones too) repeated.
                doubled[key] = repeat_per_sample(value, rows, 2)
        out = self.model(torch.cat([z, z]), repeat_per_sample(t, rows, 2), **doubled)
        v_uncond, v_cond = out.chunk(2)
        if self.detach_unconditional:
            v_uncond = v_uncond.detach()
        guided = v_uncond + self.scale * (v_cond - v_uncond)
        if self.rescale:
            # diffusers' rescale_noise_cfg: std over every dimension but the batch.
            dims = list(range(1, guided.ndim))
            std_cond = v_cond.std(dim=dims, keepdim=True)
            std_guided = guided.std(dim=dims, keepdim=True)
            rescaled = guided * (std_cond / std_guided)
            guided = self.rescale * rescaled + (1 - self.rescale) * guided
        return guided

    @property
    def prompt_keys(self) -> tuple[str, ...]:
        """The wrapped model's (see :func:`prompt_keys`)."""
        return prompt_keys(self.model)

    def check_sampler(self, sampler: Any) -> None:
        """The wrapped model's own check (a ``DiffusersVelocity`` refuses a sampler that
        cannot drive its network): guidance changes what is predicted, not how it is
        sampled."""
        check_model_fits_sampler(self.model, sampler)

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale:g}"
            + (f", rescale={self.rescale:g}" if self.rescale else "")
            + (", detach_unconditional=True" if self.detach_unconditional else "")
        )


def _stacked(key: str, negative: Any, positive: Any, rows: int) -> Any:
    """``[negative; positive]`` leaf by leaf (``positive``'s nesting, SDXL's
    ``added_cond_kwargs`` too), for a call on ``rows`` rows."""
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
            raise InvalidValue(_mismatch(key, neg, pos, rows))
        stacked.append(torch.cat([neg, pos]))
    if isinstance(positive, Tensor):
        return stacked[0]
    return with_tensor_leaves(positive, stacked)


def _mismatch(key: str, negative: Tensor, positive: Tensor, rows: int) -> str:
    """Why ``cond[negative_key]`` and ``cond[key]`` cannot be stacked, naming the tensor
    that is wrong: one without a row per sample of the call (``rows``), or, when both
    have them, the negative one's other sizes."""
    negative_key = NEGATIVE_PREFIX + key
    wrong = [
        (name, tensor)
        for name, tensor in ((key, positive), (negative_key, negative))
        if tensor.ndim == 0 or tensor.shape[0] != rows
    ]
    if len(wrong) == 1:
        ((name, tensor),) = wrong
        other, other_tensor = (negative_key, negative) if name == key else (key, positive)
        count = tensor.shape[0] if tensor.ndim else 0
        return (
            f"cond[{name!r}] has {count} row{'' if count == 1 else 's'} (shape "
            f"{tuple(tensor.shape)}) where the model is called on {rows} (one per sample, "
            f"as cond[{other!r}] of shape {tuple(other_tensor.shape)} has); pass "
            f"cond[{name!r}] with one row per sample (expand or repeat a single prompt's "
            f"encoding to the batch)"
        )
    if wrong:
        return (
            f"cond[{key!r}] (shape {tuple(positive.shape)}) and cond[{negative_key!r}] "
            f"(shape {tuple(negative.shape)}) need one row per sample, {rows} in this call; "
            f"expand or repeat the prompts' encodings to the batch"
        )
    return (
        f"cond[{negative_key!r}] has a tensor of shape {tuple(negative.shape)} where "
        f"cond[{key!r}] has {tuple(positive.shape)}; the unconditional value needs the "
        f"conditional one's shape (encode the negative prompt like the prompt: the same "
        f"sequence length and width)"
    )


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

    @property
    def prompt_keys(self) -> tuple[str, ...]:
        """The wrapped model's (see :func:`prompt_keys`)."""
        return prompt_keys(self.model)

    def check_sampler(self, sampler: Any) -> None:
        """The wrapped model's own check (see :meth:`ClassifierFreeGuidance.check_sampler`)."""
        check_model_fits_sampler(self.model, sampler)

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}"
