"""Precompute prompt embeddings with a model's real text encoders (run once, on a GPU).

::

    python -m gradest.recipes.prompts --family sd3 \\
        --pretrained /models/stable-diffusion-3-medium-diffusers \\
        --prompts prompts.txt --out prompts_sd3.pt [--negative-prompt ""] [--device cuda]

``prompts.txt`` holds one prompt per line. The text encoders and tokenizers are loaded
from the local diffusers folder through the family's pipeline (its transformer / UNet and
VAE are not loaded) and the pipeline's own ``encode_prompt`` writes the embeddings, so
they are what the pipeline would feed the model: SD3's CLIP-L + CLIP-G + T5, Flux's CLIP
+ T5, SD 1.x/2.x's CLIP. The file format is in :mod:`gradest.recipes.embeddings`.

Not run in CI (it needs real weights): the recipes' tests use tiny random embeddings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from gradest.recipes.config import FAMILIES
from gradest.recipes.embeddings import PromptEmbeddings

__all__ = ["encode_prompts", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def encode_prompts(
    family: str,
    pretrained: str,
    prompts: Sequence[str],
    *,
    negative_prompt: str = "",
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    max_sequence_length: int | None = None,
    batch_size: int = 16,
) -> PromptEmbeddings:
    """Encode ``prompts`` (and the negative prompt, for CFG) with ``pretrained``'s encoders."""
    import diffusers

    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to encode")
    chunks: dict[str, list[torch.Tensor]] = {}

    def keep(**tensors: torch.Tensor) -> None:
        for key, value in tensors.items():
            chunks.setdefault(key, []).append(value.float().cpu())

    if family == "sd3":
        pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(
            pretrained, transformer=None, vae=None, torch_dtype=dtype
        ).to(device)
        length = max_sequence_length or 256
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=batch, prompt_2=None, prompt_3=None, device=device,
                do_classifier_free_guidance=True, negative_prompt=negative_prompt,
                max_sequence_length=length,
            )  # fmt: skip
            keep(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        keep(negative_prompt_embeds=negative[:1], negative_pooled_prompt_embeds=negative_pooled[:1])
    elif family == "flux":
        pipe = diffusers.FluxPipeline.from_pretrained(
            pretrained, transformer=None, vae=None, torch_dtype=dtype
        ).to(device)
        length = max_sequence_length or 512
        text_ids = None
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, pooled, text_ids = pipe.encode_prompt(
                prompt=batch, prompt_2=None, device=device, max_sequence_length=length
            )
            keep(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        assert text_ids is not None
        chunks["text_ids"] = [text_ids.float().cpu()]
    elif family == "sd_unet":
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            pretrained, unet=None, vae=None, safety_checker=None, torch_dtype=dtype,
            requires_safety_checker=False,
        ).to(device)  # fmt: skip
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            embeds, negative = pipe.encode_prompt(
                batch, device, 1, True, negative_prompt=[negative_prompt] * len(batch)
            )
            keep(prompt_embeds=embeds)
        keep(negative_prompt_embeds=negative[:1])
    else:
        raise ValueError(f"unknown family {family!r}; one of {list(FAMILIES)}")
    tensors = {key: torch.cat(values) for key, values in chunks.items()}
    return PromptEmbeddings(family=family, prompts=tuple(prompts), tensors=tensors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--pretrained", required=True, help="local diffusers model folder")
    parser.add_argument("--prompts", required=True, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, help="the .pt file to write")
    parser.add_argument("--negative-prompt", default="", help="CFG's unconditional prompt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--max-sequence-length", type=int, default=None)
    args = parser.parse_args(argv)
    lines = Path(args.prompts).read_text("utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip()]
    embeddings = encode_prompts(
        args.family, args.pretrained, prompts, negative_prompt=args.negative_prompt,
        device=args.device, dtype=DTYPES[args.dtype],
        max_sequence_length=args.max_sequence_length,
    )  # fmt: skip
    embeddings.to_file(args.out)
    shapes = {key: tuple(value.shape) for key, value in embeddings.tensors.items()}
    print(f"wrote {args.out}: {len(prompts)} prompts, {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
