"""The recipes' decoder checkpointing (issue 31, item 1): the VAE decode of a pixel reward
recomputes its blocks in backward, on by default; the images, the reward's gradient into
the latents and a recipe step's LoRA gradient are bit for bit those of the plain decode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from gradest_recipes.config import load_config  # noqa: E402
from gradest_recipes.embeddings import tiny_embeddings  # noqa: E402
from gradest_recipes.families import build_family, tiny_vae  # noqa: E402
from gradest_recipes.rewards import decode_images, resolve_reward, reward_objective  # noqa: E402

import gradest  # noqa: E402


def _decode_and_grad(checkpointing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vae = tiny_vae().requires_grad_(False).eval()
    if checkpointing:
        vae.enable_gradient_checkpointing()
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    latents.requires_grad_(True)
    images = decode_images(vae, latents)
    images.mul(torch.linspace(0, 1, images.numel()).view_as(images)).sum().backward()
    assert latents.grad is not None
    return images.detach(), latents.grad


def test_checkpointed_decode_is_bitwise_the_plain_one() -> None:
    plain_images, plain_grad = _decode_and_grad(False)
    images, grad = _decode_and_grad(True)
    assert torch.equal(images, plain_images)
    assert torch.equal(grad, plain_grad)
    assert grad.abs().sum() > 0


def _lora_gradient(decoder_checkpointing: bool) -> dict[str, torch.Tensor]:
    config = load_config(
        "sd3", overrides={"tiny": True, "decoder_checkpointing": decoder_checkpointing}
    )
    torch.manual_seed(0)  # the same LoRA initialisation in both builds
    family = build_family("sd3", config, tiny_embeddings("sd3"))
    assert family.vae.decoder.gradient_checkpointing is decoder_checkpointing
    embeddings = tiny_embeddings("sd3")
    index = torch.tensor([0, 1])
    cond = family.make_cond(embeddings, index, torch.device("cpu"))
    goal = reward_objective(
        resolve_reward("contrast"), family.vae, family.to_vae_latents, ["a"] * 2
    )
    noise = torch.randn(2, *family.latent_shape, generator=torch.Generator().manual_seed(3))
    sur = gradest.estimator("exact").surrogate(
        family.velocity, family.sampler, goal, noise=noise, cond=cond
    )
    sur.loss.backward()
    return {
        name: p.grad.clone()
        for name, p in family.denoiser.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def test_recipe_step_lora_gradient_is_bitwise_with_and_without() -> None:
    """On by default; a recipe's exact step through the checkpointed decode gives the
    plain decode's LoRA gradient bit for bit."""
    assert load_config("sd3", overrides={"tiny": True}).decoder_checkpointing is True
    plain = _lora_gradient(False)
    checkpointed = _lora_gradient(True)
    assert plain and plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name
    assert any(g.abs().sum() > 0 for g in plain.values())
