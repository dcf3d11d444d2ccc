"""Precomputed prompt embeddings: the ``.pt`` file a recipe trains on, and tiny random ones.

Text encoders (CLIP, T5) are large and frozen; a recipe reads their outputs from one file,
written once by :mod:`gradest_recipes.prompts` (or by your own code), a dict of:

============================  ===============  ==========================================
key                           shape            families
============================  ===============  ==========================================
``family``                    str              ``"sd3"``, ``"flux"`` or ``"sd_unet"``
``prompts``                   list of P str    all (logged, passed to reward hooks)
``prompt_embeds``             ``[P, S, D]``    all (``encoder_hidden_states``)
``pooled_prompt_embeds``      ``[P, D_pool]``  sd3, flux (``pooled_projections``)
``negative_prompt_embeds``    ``[1, S, D]``    sd3, sd_unet (the unconditional prompt, CFG)
``negative_pooled_prompt_embeds``  ``[1, D_pool]``  sd3
``text_ids``                  ``[S, 3]``       flux (optional; zeros, as FluxPipeline)
============================  ===============  ==========================================

Each training sample draws one of the ``P`` prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest.errors import InvalidValue

__all__ = ["PromptEmbeddings", "load_embeddings", "required_keys", "tiny_embeddings"]

FORMAT = "gradest_recipes.embeddings/1"


def required_keys(family: str, guided: bool) -> tuple[str, ...]:
    """The tensors ``family`` needs (``guided``: classifier-free guidance is on)."""
    keys = ["prompt_embeds"]
    if family in ("sd3", "flux"):
        keys.append("pooled_prompt_embeds")
    if guided and family in ("sd3", "sd_unet"):
        keys.append("negative_prompt_embeds")
        if family == "sd3":
            keys.append("negative_pooled_prompt_embeds")
    return tuple(keys)


@attrs.frozen(eq=False)
class PromptEmbeddings:
    """Prompts and their encoder outputs (CPU tensors; see the module docstring)."""

    family: str
    prompts: tuple[str, ...]
    tensors: dict[str, Tensor]

    @property
    def count(self) -> int:
        return len(self.prompts)

    def rows(self, key: str, index: Tensor) -> Tensor:
        return self.tensors[key][index]

    def negative(self, key: str, batch: int) -> Tensor:
        value = self.tensors["negative_" + key]
        return value[:1].expand(batch, *value.shape[1:])

    def to_file(self, path: str | Path) -> None:
        """Write the ``.pt`` file :func:`load_embeddings` reads (atomically)."""
        from gradest.files import atomic_save

        atomic_save(
            {"format": FORMAT, "family": self.family, "prompts": list(self.prompts),
             **{k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}},
            path,
        )  # fmt: skip


def load_embeddings(path: str | Path, family: str, *, guided: bool) -> PromptEmbeddings:
    """Read and check a ``.pt`` embeddings file for ``family``.

    Raises:
        ValueError: the file is missing, does not load, is for another family, or lacks a
            key or has a shape that does not fit (the message names the key and the fix).
    """
    file = Path(path)
    if not file.is_file():
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: no such file; write one with "
            f"python -m gradest_recipes.prompts (docs/recipes.md)"
        )
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a damaged file
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: the file does not load: {err}"
        ) from None
    if not isinstance(data, dict):
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: expected a dict of tensors, got "
            f"{type(data).__name__}"
        )
    saved_family = data.get("family", family)
    if saved_family != family:
        raise InvalidValue(
            f"setting embeddings={str(file)!r} holds {saved_family!r} embeddings but this is "
            f"the {family!r} recipe; encode the prompts with the {family} text encoders"
        )
    tensors = {k: v for k, v in data.items() if isinstance(v, Tensor)}
    missing = [k for k in required_keys(family, guided) if k not in tensors]
    if missing:
        why = " (classifier-free guidance needs the negative prompt's)" if guided else ""
        raise InvalidValue(
            f"setting embeddings={str(file)!r} lacks {missing}{why}; it has "
            f"{sorted(tensors)}. Re-encode with python -m gradest_recipes.prompts"
            + (", or set guidance_scale = 1" if guided else "")
        )
    prompt_embeds = tensors["prompt_embeds"]
    if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] < 1:
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: prompt_embeds must be [prompts, tokens, dim], "
            f"got shape {tuple(prompt_embeds.shape)}"
        )
    count = prompt_embeds.shape[0]
    prompts = data.get("prompts") or [f"prompt {i}" for i in range(count)]
    if len(prompts) != count:
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: {len(prompts)} prompts but prompt_embeds has "
            f"{count} rows"
        )
    pooled = tensors.get("pooled_prompt_embeds")
    if pooled is not None and (pooled.ndim != 2 or pooled.shape[0] != count):
        raise InvalidValue(
            f"setting embeddings={str(file)!r}: pooled_prompt_embeds must be [{count}, dim], "
            f"got shape {tuple(pooled.shape)}"
        )
    for key in ("negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        value = tensors.get(key)
        base = tensors.get(key[len("negative_") :])
        if value is not None and base is not None and value.shape[1:] != base.shape[1:]:
            raise InvalidValue(
                f"setting embeddings={str(file)!r}: {key} has shape {tuple(value.shape)}, "
                f"which does not match {key[len('negative_') :]} {tuple(base.shape)} past "
                f"the first dimension (encode both with the same max_sequence_length)"
            )
    return PromptEmbeddings(family=family, prompts=tuple(str(p) for p in prompts),
                            tensors=tensors)  # fmt: skip


def check_fits(embeddings: PromptEmbeddings, config: Any, where: str) -> None:
    """The embedding widths match the denoiser's config (``joint_attention_dim``, ...)."""
    checks = [
        ("prompt_embeds", -1, "joint_attention_dim"),
        ("prompt_embeds", -1, "cross_attention_dim"),
        ("pooled_prompt_embeds", -1, "pooled_projection_dim"),
    ]
    for key, axis, name in checks:
        expected = getattr(config, name, None)
        value = embeddings.tensors.get(key)
        if isinstance(expected, int) and value is not None and value.shape[axis] != expected:
            raise InvalidValue(
                f"setting embeddings={where!r}: {key} has width {value.shape[axis]} but the "
                f"model's config.{name} is {expected}; encode the prompts with this model's "
                f"text encoders"
            )


#: Widths of the tiny random embeddings (the tiny models are built to match).
TINY_TEXT_DIM, TINY_POOLED_DIM, TINY_TOKENS, TINY_PROMPTS = 16, 8, 6, 4


def tiny_embeddings(family: str, seed: int = 0) -> PromptEmbeddings:
    """Random embeddings of ``TINY_PROMPTS`` prompts for the tiny models (tests, ``--tiny``)."""
    generator = torch.Generator().manual_seed(1000 + seed)

    def normal(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator)

    tensors = {"prompt_embeds": normal(TINY_PROMPTS, TINY_TOKENS, TINY_TEXT_DIM)}
    if family in ("sd3", "flux"):
        tensors["pooled_prompt_embeds"] = normal(TINY_PROMPTS, TINY_POOLED_DIM)
    if family in ("sd3", "sd_unet"):
        tensors["negative_prompt_embeds"] = normal(1, TINY_TOKENS, TINY_TEXT_DIM)
    if family == "sd3":
        tensors["negative_pooled_prompt_embeds"] = normal(1, TINY_POOLED_DIM)
    prompts = tuple(f"tiny prompt {i}" for i in range(TINY_PROMPTS))
    return PromptEmbeddings(family=family, prompts=prompts, tensors=tensors)
