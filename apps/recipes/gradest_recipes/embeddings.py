"""Precomputed prompt embeddings: the ``.pt`` file a recipe trains on, and tiny random ones.

Text encoders (CLIP, T5) are large and frozen; a recipe reads their outputs from one file,
written once by :mod:`gradest_recipes.prompts` (or by your own code), a dict of:

============================  ===============  ==========================================
key                           shape            families
============================  ===============  ==========================================
``family``                    str              ``"sd3"``, ``"flux"``, ``"sd_unet"``, ``"sdxl"``
``prompts``                   list of P str    all (logged, passed to reward hooks)
``prompt_embeds``             ``[P, S, D]``    all (``encoder_hidden_states``)
``pooled_prompt_embeds``      ``[P, D_pool]``  sd3, flux (``pooled_projections``), sdxl
                                               (``added_cond_kwargs["text_embeds"]``)
``negative_prompt_embeds``    ``[1, S, D]``    sd3, sd_unet, sdxl (the unconditional prompt);
                                               flux with ``true_cfg_scale > 1``
``negative_pooled_prompt_embeds``  ``[1, D_pool]``  sd3, sdxl; flux with ``true_cfg_scale > 1``
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

from gradest import InvalidValue
from gradest_recipes.file_schema import describe, file_bytes, load_torch_bytes

__all__ = ["PromptEmbeddings", "load_embeddings", "required_keys", "tiny_embeddings"]

FORMAT = "gradest_recipes.embeddings/1"
#: The families with a pooled text embedding.
POOLED_FAMILIES = ("sd3", "flux", "sdxl")


def required_keys(family: str, guided: bool) -> tuple[str, ...]:
    """The tensors ``family`` needs (``guided``: classifier-free guidance is on, Flux's
    true CFG included)."""
    keys = ["prompt_embeds"]
    if family in POOLED_FAMILIES:
        keys.append("pooled_prompt_embeds")
    if guided:
        keys.append("negative_prompt_embeds")
        if family in POOLED_FAMILIES:
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
        from gradest_lab.storage.files import atomic_save

        atomic_save(
            {"format": FORMAT, "family": self.family, "prompts": list(self.prompts),
             **{k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}},
            path,
        )  # fmt: skip


#: The tensors a file may hold, and how many dimensions each has.
TENSOR_DIMS = {
    "prompt_embeds": 3,
    "pooled_prompt_embeds": 2,
    "negative_prompt_embeds": 3,
    "negative_pooled_prompt_embeds": 2,
    "text_ids": 2,
}


def load_embeddings(path: str | Path, family: str, *, guided: bool) -> PromptEmbeddings:
    """Read and check a ``.pt`` embeddings file for ``family``.

    Loaded with ``weights_only=True`` (a file that would run code when unpickled is
    refused, its code never run) and checked field by field: ``format`` (when there) this
    format, ``family`` (when there) this recipe's, ``prompts`` (when there) one string per
    row, and each tensor of the table in the module docstring (those the family needs,
    :func:`required_keys`, and any other one present) a floating-point tensor of its
    number of dimensions whose sizes agree with ``prompt_embeds``.

    Raises:
        InvalidValue: one line naming the file and the key, and the fix; the file is left
            as it is.
    """
    file = Path(path)
    shown = f"setting embeddings={str(file)!r}"

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{shown}: {field} {why}; re-encode the prompts with python -m "
            f"gradest_recipes.prompts (docs/recipes.md)"
        )

    if not file.exists():
        raise InvalidValue(
            f"{shown}: no such file; write one with python -m gradest_recipes.prompts "
            f"(docs/recipes.md)"
        )
    data = load_torch_bytes(file_bytes(file, refuse), refuse)
    if not isinstance(data, dict):
        raise refuse("the file", f"holds {describe(data)}, not a dict of tensors")
    if "format" in data and data["format"] != FORMAT:
        raise refuse("format", f"is {describe(data['format'])}, expected {FORMAT!r}")
    saved_family = data.get("family", family)
    if not isinstance(saved_family, str):
        raise refuse("family", f"is {describe(saved_family)}, not a family name")
    if saved_family != family:
        raise InvalidValue(
            f"{shown}: family is {saved_family!r}: it holds {saved_family!r} embeddings but "
            f"this is the {family!r} recipe; encode the prompts with the {family} text encoders"
        )
    missing = [k for k in required_keys(family, guided) if k not in data]
    if missing:
        why = " (classifier-free guidance needs the negative prompt's)" if guided else ""
        fix = ""
        if guided:
            fix = (
                " --negative-prompt '', or set true_cfg_scale = 1"
                if family == "flux"
                else ", or set guidance_scale = 1"
            )
        raise InvalidValue(
            f"{shown} lacks {missing}{why}; it has {sorted(map(str, data))}. Re-encode with "
            f"python -m gradest_recipes.prompts" + fix
        )
    tensors: dict[str, Tensor] = {}
    for key, dims in TENSOR_DIMS.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, Tensor) or not value.is_floating_point() or value.ndim != dims:
            wanted = f"a floating-point tensor of {dims} dimensions"
            raise refuse(key, f"is {describe(value)}, not {wanted}")
        tensors[key] = value
    tensors.update({k: v for k, v in data.items() if isinstance(v, Tensor) and k not in tensors})
    prompt_embeds = tensors["prompt_embeds"]
    count, tokens = prompt_embeds.shape[0], prompt_embeds.shape[1]
    if count < 1:
        raise refuse("prompt_embeds", f"has shape {tuple(prompt_embeds.shape)}: no prompts")
    prompts = data.get("prompts", [f"prompt {i}" for i in range(count)])
    if not isinstance(prompts, list | tuple) or not all(isinstance(p, str) for p in prompts):
        raise refuse("prompts", f"is {describe(prompts)}, not a list of prompt strings")
    if len(prompts) != count:
        raise refuse("prompts", f"has {len(prompts)} prompts but prompt_embeds has {count} rows")
    pooled = tensors.get("pooled_prompt_embeds")
    if pooled is not None and pooled.shape[0] != count:
        raise refuse("pooled_prompt_embeds", f"has shape {tuple(pooled.shape)}, not [{count}, dim]")
    for key in ("negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        value = tensors.get(key)
        base = tensors.get(key[len("negative_") :])
        if value is None:
            continue
        if value.shape[0] < 1:
            raise refuse(key, f"has shape {tuple(value.shape)}: no negative prompt")
        if base is not None and value.shape[1:] != base.shape[1:]:
            raise refuse(
                key,
                f"has shape {tuple(value.shape)}, which does not match "
                f"{key[len('negative_') :]} {tuple(base.shape)} past the first dimension "
                f"(encode both with the same max_sequence_length)",
            )
    text_ids = tensors.get("text_ids")
    if text_ids is not None and tuple(text_ids.shape) != (tokens, 3):
        raise refuse("text_ids", f"has shape {tuple(text_ids.shape)}, not [{tokens}, 3]")
    return PromptEmbeddings(family=family, prompts=tuple(prompts), tensors=tensors)


def check_fits(embeddings: PromptEmbeddings, config: Any, where: str) -> None:
    """The embedding widths match the denoiser's config (``joint_attention_dim``, ...)."""
    checks = [
        ("prompt_embeds", -1, "joint_attention_dim"),
        ("prompt_embeds", -1, "cross_attention_dim"),
        ("pooled_prompt_embeds", -1, "pooled_projection_dim"),
    ]
    if getattr(config, "addition_embed_type", None) == "text_time":
        # SDXL: the pooled embedding and 6 size / crop ids share one projection's input.
        pooled = embeddings.tensors.get("pooled_prompt_embeds")
        width = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        if pooled is not None and pooled.shape[-1] != width:
            raise InvalidValue(
                f"setting embeddings={where!r}: pooled_prompt_embeds has width "
                f"{pooled.shape[-1]} but the UNet takes {width} (config."
                f"projection_class_embeddings_input_dim - 6 x addition_time_embed_dim); "
                f"encode the prompts with this model's text encoders"
            )
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
    if family in POOLED_FAMILIES:
        tensors["pooled_prompt_embeds"] = normal(TINY_PROMPTS, TINY_POOLED_DIM)
    # Every family's negative prompt (Flux's for true CFG), drawn after the prompts'.
    tensors["negative_prompt_embeds"] = normal(1, TINY_TOKENS, TINY_TEXT_DIM)
    if family in POOLED_FAMILIES:
        tensors["negative_pooled_prompt_embeds"] = normal(1, TINY_POOLED_DIM)
    prompts = tuple(f"tiny prompt {i}" for i in range(TINY_PROMPTS))
    return PromptEmbeddings(family=family, prompts=prompts, tensors=tensors)
