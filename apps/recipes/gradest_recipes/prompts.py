"""Precompute prompt embeddings with a model's real text encoders (run once, on a GPU).

::

    python -m gradest_recipes.prompts --family sd3 \\
        --pretrained /models/stable-diffusion-3-medium-diffusers \\
        --prompts prompts.txt --out prompts_sd3.pt [--negative-prompt ""] [--device cuda]

``prompts.txt`` holds one prompt per line. The text encoders and tokenizers are loaded
from the local diffusers folder through the family's pipeline (its transformer / UNet and
VAE are not loaded) and the pipeline's own ``encode_prompt`` writes the embeddings, so
they are what the pipeline would feed the model: SD3's CLIP-L + CLIP-G + T5, Flux's CLIP
+ T5, SD 1.x/2.x's CLIP, SDXL's CLIP-L + CLIP-G (and CLIP-G's pooled projection). The
file format is in :mod:`gradest_recipes.embeddings`.

Tested on CPU with tiny random saved pipelines of each family (CLIP and T5 encoders and
tokenizers built in code: ``tests/test_recipe_prompts.py``, ``tests/test_recipes.py``);
never run with real weights. A documented error (a bad argument, a folder that does not
load) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gradest_lab.storage.files import read_text

from gradest import GradestError, InvalidValue, MissingDependency
from gradest_recipes.config import FAMILIES
from gradest_recipes.embeddings import PromptEmbeddings

__all__ = ["encode_prompts", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The T5 token count the SD3 / Flux pipelines default to, and the most they accept.
T5_TOKENS = {"sd3": 256, "flux": 512}
MAX_T5_TOKENS = 512
#: The pipeline class each family's folder holds (``model_index.json``'s ``_class_name``).
PIPELINES = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "StableDiffusionPipeline": "sd_unet",
    "StableDiffusionXLPipeline": "sdxl",
}


@torch.no_grad()
def encode_prompts(
    family: str,
    pretrained: str,
    prompts: Sequence[str],
    *,
    negative_prompt: str | None = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    max_sequence_length: int | None = None,
    batch_size: int = 16,
) -> PromptEmbeddings:
    """Encode ``prompts`` (and the negative prompt, for CFG) with ``pretrained``'s encoders.

    ``negative_prompt``: CFG's unconditional prompt (default empty); for Flux, whose
    guidance is its embedding, it is encoded only when given (for the Flux recipe's true
    CFG, ``true_cfg_scale``), as FluxPipeline encodes a ``negative_prompt``.

    Raises:
        ValueError: no prompts, an unknown family, a ``max_sequence_length`` the family's
            pipeline refuses, a folder that does not load, or non-finite embeddings (the
            message names the argument and the fix).
    """
    try:
        import diffusers
    except ImportError as err:
        raise MissingDependency(
            "gradest_recipes.prompts needs diffusers and transformers: "
            "pip install ./apps/recipes transformers"
        ) from err

    prompts = list(prompts)
    negative_text = "" if negative_prompt is None else negative_prompt
    if not prompts:
        raise InvalidValue("prompts is empty: give at least one prompt (one per line)")
    if family not in FAMILIES:
        raise InvalidValue(f"family={family!r} is unknown; use one of {list(FAMILIES)}")
    if max_sequence_length is not None:
        if family not in T5_TOKENS:
            raise InvalidValue(
                f"max_sequence_length={max_sequence_length} (--max-sequence-length) is for T5 "
                f"(sd3, flux); the {family} CLIP tokenizer has a fixed length: leave it unset"
            )
        if not 1 <= max_sequence_length <= MAX_T5_TOKENS:
            raise InvalidValue(
                f"max_sequence_length={max_sequence_length} (--max-sequence-length) is "
                f"invalid: the {family} pipeline takes 1 to {MAX_T5_TOKENS} T5 tokens "
                f"(default {T5_TOKENS[family]})"
            )
    length = max_sequence_length or T5_TOKENS.get(family, 0)
    chunks: dict[str, list[torch.Tensor]] = {}

    def keep(**tensors: torch.Tensor) -> None:
        for key, value in tensors.items():
            chunks.setdefault(key, []).append(value.float().cpu())

    def load(cls: Any, **kwargs: Any) -> Any:  # the text encoders only: no denoiser, VAE
        why = "no such folder"
        saved = _saved_pipeline(pretrained)
        if saved in PIPELINES and PIPELINES[saved] != family:
            raise InvalidValue(
                f"pretrained={pretrained!r} (--pretrained) holds a {saved}, not a "
                f"{cls.__name__}; use --family {PIPELINES[saved]}, or a {family} model's folder"
            )
        if Path(pretrained).is_dir():  # never a hub name: no download of a whole model
            try:
                return cls.from_pretrained(pretrained, torch_dtype=dtype, **kwargs).to(device)
            except (OSError, ValueError) as err:
                why = " ".join(str(err).split())
        raise InvalidValue(
            f"pretrained={pretrained!r} (--pretrained): cannot load {cls.__name__}'s text "
            f"encoders ({why}); pass the local folder of a diffusers {family} model (it "
            f"holds model_index.json)"
        )

    if family == "sd3":
        pipe = load(diffusers.StableDiffusion3Pipeline, transformer=None, vae=None)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=batch, prompt_2=None, prompt_3=None, device=device,
                do_classifier_free_guidance=True, negative_prompt=negative_text,
                max_sequence_length=length,
            )  # fmt: skip
            keep(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        keep(negative_prompt_embeds=negative[:1], negative_pooled_prompt_embeds=negative_pooled[:1])
    elif family == "flux":
        pipe = load(diffusers.FluxPipeline, transformer=None, vae=None)
        text_ids = None
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, pooled, text_ids = pipe.encode_prompt(
                prompt=batch, prompt_2=None, device=device, max_sequence_length=length
            )
            keep(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        assert text_ids is not None
        chunks["text_ids"] = [text_ids.float().cpu()]
        if negative_prompt is not None:  # true CFG's: FluxPipeline encodes it alike
            negative_embeds, negative_pooled, _ = pipe.encode_prompt(
                prompt=[negative_prompt], prompt_2=None, device=device,
                max_sequence_length=length,
            )  # fmt: skip
            keep(
                negative_prompt_embeds=negative_embeds[:1],
                negative_pooled_prompt_embeds=negative_pooled[:1],
            )
    elif family == "sdxl":
        pipe = load(diffusers.StableDiffusionXLPipeline, unet=None, vae=None)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=batch, prompt_2=None, device=device, num_images_per_prompt=1,
                do_classifier_free_guidance=True, negative_prompt=negative_text,
            )  # fmt: skip
            keep(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        keep(negative_prompt_embeds=negative[:1], negative_pooled_prompt_embeds=negative_pooled[:1])
    else:
        pipe = load(
            diffusers.StableDiffusionPipeline, unet=None, vae=None, safety_checker=None,
            requires_safety_checker=False,
        )  # fmt: skip
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, negative = pipe.encode_prompt(
                batch, device, 1, True, negative_prompt=[negative_text] * len(batch)
            )
            keep(prompt_embeds=embeds)
        keep(negative_prompt_embeds=negative[:1])
    tensors = {key: torch.cat(values) for key, values in chunks.items()}
    for key, value in tensors.items():
        if not torch.isfinite(value).all():
            raise InvalidValue(
                f"dtype={dtype} (--dtype): the text encoders gave non-finite {key} (T5 "
                f"overflows in float16); use bfloat16 or float32"
            )
    return PromptEmbeddings(family=family, prompts=tuple(prompts), tensors=tensors)


def _saved_pipeline(folder: str) -> str | None:
    """The pipeline class named in ``folder``'s ``model_index.json`` (None: unreadable)."""
    import json

    try:
        index = json.loads((Path(folder) / "model_index.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    return name if isinstance(name, str) else None


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status.

    Raises:
        ValueError: a bad argument or an unusable folder (see :func:`encode_prompts`).
    """
    parser = argparse.ArgumentParser(
        prog="python -m gradest_recipes.prompts", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--pretrained", required=True, help="local diffusers model folder")
    parser.add_argument("--prompts", required=True, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, help="the .pt file to write")
    parser.add_argument(
        "--negative-prompt", default=None,
        help="CFG's unconditional prompt (default empty; flux: written only when given, for "
        "the recipe's true_cfg_scale)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument(
        "--max-sequence-length", type=int, default=None,
        help="T5 tokens (sd3: 256, flux: 512 by default; at most 512)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # gradest's rule for a text file read back: a regular file of UTF-8 text, else one line.
    lines = read_text(args.prompts, what="--prompts").splitlines()
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise InvalidValue(f"--prompts {args.prompts!r} has no prompts; write one per line")
    embeddings = encode_prompts(
        args.family, args.pretrained, prompts, negative_prompt=args.negative_prompt,
        device=args.device, dtype=DTYPES[args.dtype],
        max_sequence_length=args.max_sequence_length,
    )  # fmt: skip
    embeddings.to_file(args.out)
    shapes = {key: tuple(value.shape) for key, value in embeddings.tensors.items()}
    print(f"wrote {args.out}: {len(prompts)} prompts, {shapes}")
    return 0


def script_main(argv: Sequence[str] | None = None) -> int:
    """:func:`main` for ``python -m``: a documented error prints one line and exits 2."""
    try:
        return main(argv)
    except GradestError as err:
        print(f"python -m gradest_recipes.prompts: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(script_main())
