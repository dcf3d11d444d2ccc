"""A new user's tiny SD3 training step, written by hand and through gradest.

The workload of ``python -m benchmarks.overhead --sections sd3``: a 2-layer
``SD3Transformer2DModel`` with LoRA on its attention projections (peft), classifier-free
guidance with an unconditional prompt embedding, fp32, sampled on the Euler grid of a
``FlowMatchEulerDiscreteScheduler`` and backpropagated from a loss on the final latents.
The hand-written loop is what such a user writes with diffusers alone (one batched call
over ``[uncond; cond]`` per step, ``z += (sigma_next - sigma) v``, ``loss.backward()``);
gradest's is ``exact``'s surrogate through ``ClassifierFreeGuidance(DiffusersVelocity(...))``
on ``sampler_from_scheduler``'s grid. Both accumulate into the LoRA parameters' ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import gradest

STEPS = 8
BATCH = 2
SCALE = 4.5  # SD3's default guidance scale
LORA_RANK = 4


def sd3_calls(
    seed: int = 0,
) -> tuple[dict[str, Callable[[], Any]], list[torch.nn.Parameter]]:
    """``({"hand-written loop": ..., "exact": ...}, the trained parameters)``: one training
    step each (the gradients zeroed before each call), on the same transformer, noise,
    prompts and grid."""
    import diffusers

    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler
    from gradest.integrations.guidance import ClassifierFreeGuidance
    from gradest.integrations.peft import add_lora

    torch.manual_seed(seed)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        pos_embed_max_size=8,
    ).eval()
    add_lora(transformer, LORA_RANK, target_modules=("to_q", "to_k", "to_v", "to_out.0"))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sampler = sampler_from_scheduler(scheduler, STEPS)
    sigmas = [float(s) for s in sampler.times]
    generator = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(BATCH, 4, 8, 8, generator=generator)
    prompt = torch.randn(BATCH, 6, 16, generator=generator)
    pooled = torch.randn(BATCH, 8, generator=generator)
    empty_prompt, empty_pooled = torch.zeros_like(prompt), torch.zeros_like(pooled)
    trainable = [p for p in transformer.parameters() if p.requires_grad]

    def loss_of(z: torch.Tensor) -> torch.Tensor:
        return z.square().mean()  # a stand-in for -reward(vae.decode(z))

    def handwritten() -> None:
        for p in trainable:
            p.grad = None
        z = noise
        hidden = torch.cat([empty_prompt, prompt])
        pooled_both = torch.cat([empty_pooled, pooled])
        for k in range(STEPS):
            t = torch.full((2 * BATCH,), sigmas[k] * 1000.0)
            out = transformer(
                hidden_states=torch.cat([z, z]),
                timestep=t,
                encoder_hidden_states=hidden,
                pooled_projections=pooled_both,
                return_dict=False,
            )[0]
            uncond, cond = out.chunk(2)
            z = z + (sigmas[k + 1] - sigmas[k]) * (uncond + SCALE * (cond - uncond))
        loss_of(z).backward()

    model = ClassifierFreeGuidance(DiffusersVelocity(transformer), SCALE)
    objective = gradest.TerminalObjective(loss_of)
    estimator = gradest.estimator("exact")
    cond = {
        "encoder_hidden_states": prompt,
        "negative_encoder_hidden_states": empty_prompt,
        "pooled_projections": pooled,
        "negative_pooled_projections": empty_pooled,
    }

    def through_gradest() -> None:
        for p in trainable:
            p.grad = None
        estimator.surrogate(model, sampler, objective, noise=noise, cond=cond).loss.backward()

    return {"hand-written loop": handwritten, "exact": through_gradest}, trainable


def same_gradient(
    calls: dict[str, Callable[[], Any]], parameters: list[torch.nn.Parameter]
) -> float:
    """The largest relative difference of the two calls' gradients (a sanity check that
    the benchmark compares the same computation)."""
    grads = []
    for call in calls.values():
        call()
        grads.append(torch.cat([p.grad.reshape(-1) for p in parameters]))
    return float((grads[0] - grads[1]).norm() / grads[0].norm())
