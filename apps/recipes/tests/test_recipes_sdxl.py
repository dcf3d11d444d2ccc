"""The SDXL recipe (``examples/recipes/sdxl_reward.py``) samples what SDXL's pipeline samples.

The end-to-end runs, diffusers' flags, resume and the LoRA export are the shared
family-parametrized tests (test_recipes.py, test_recipes_diffusers.py: ``sdxl`` is one of
``recipe_support.FAMILIES``). Here: the recipe's model, sampler and nested conditioning,
with guidance, roll out to the latents ``StableDiffusionXLPipeline`` returns for the same
embeddings, initial latents and steps (``output_type="latent"``); the pooled width is
checked against the UNet's ``text_time`` embedding before training; the RL objectives are
refused for it.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_recipes import RecipeConfigError, load_config  # noqa: E402
from gradest_recipes.embeddings import PromptEmbeddings, tiny_embeddings  # noqa: E402
from gradest_recipes.families import build_family, tiny_scheduler, tiny_vae  # noqa: E402
from recipe_support import RECIPE_WARNINGS  # noqa: E402

import gradest  # noqa: E402
from gradest.integrations.guidance import ClassifierFreeGuidance  # noqa: E402

pytestmark = RECIPE_WARNINGS


def test_the_sdxl_recipe_samples_what_the_pipeline_samples():
    config = load_config("sdxl", overrides={"tiny": True, "guidance_scale": 5.0})
    embeddings = tiny_embeddings("sdxl")
    family = build_family("sdxl", config, embeddings)
    assert isinstance(family.velocity, ClassifierFreeGuidance)
    assert family.lora_prefix == "unet"
    index = torch.tensor([0, 2])
    cond = family.make_cond(embeddings, index, torch.device("cpu"))
    side = config.resolution
    ids = torch.tensor([[side, side, 0, 0, side, side]] * 2, dtype=torch.float32)
    assert torch.equal(cond["added_cond_kwargs"]["time_ids"], ids)
    assert torch.equal(cond["negative_added_cond_kwargs"]["time_ids"], ids)
    noise = torch.randn((2, *family.latent_shape), generator=torch.Generator().manual_seed(0))
    unet = family.denoiser
    unet.eval()  # the LoRA matrices start at B = 0: the base UNet's prediction
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=tiny_vae(), text_encoder=None, text_encoder_2=None, tokenizer=None,
        tokenizer_2=None, unet=unet, scheduler=tiny_scheduler("sdxl"),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    tensors = embeddings.tensors
    with torch.no_grad():
        ours = gradest.rollout(family.velocity, family.sampler, noise, cond=cond).states[-1]
        theirs = pipe(
            prompt_embeds=tensors["prompt_embeds"][index],
            pooled_prompt_embeds=tensors["pooled_prompt_embeds"][index],
            negative_prompt_embeds=tensors["negative_prompt_embeds"].expand(2, -1, -1),
            negative_pooled_prompt_embeds=tensors["negative_pooled_prompt_embeds"].expand(2, -1),
            latents=noise.clone(), num_inference_steps=config.num_inference_steps,
            guidance_scale=5.0, height=side, width=side, output_type="latent",
        ).images  # fmt: skip
    # DDIM's step written another way: float32 round-off.
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_a_pooled_width_the_unet_does_not_take_is_refused_before_training():
    tiny = tiny_embeddings("sdxl")
    tensors = dict(tiny.tensors, pooled_prompt_embeds=torch.zeros(tiny.count, 5))
    wrong = PromptEmbeddings(family="sdxl", prompts=tiny.prompts, tensors=tensors)
    config = load_config("sdxl", overrides={"tiny": True})
    with pytest.raises(ValueError) as caught:
        build_family("sdxl", config, wrong)
    message = str(caught.value)
    assert "\n" not in message
    assert "pooled_prompt_embeds has width 5 but the UNet takes 8" in message
    assert "text encoders" in message


def test_the_rl_objectives_are_refused_for_sdxl():
    with pytest.raises(RecipeConfigError, match=r"objective='grpo'.*sdxl recipe"):
        load_config("sdxl", overrides={"tiny": True, "objective": "grpo"})
