"""Tiny diffusers models shared by the diffusers tests (test_diffusers.py,
test_training_stack.py, test_ddim.py, test_diffusers_mistakes.py,
test_nested_conditioning.py); diffusers is imported where used, so importing this module
does not need it."""

from __future__ import annotations

import torch


def tiny_transformer(kind: str, dtype=torch.float64, **overrides):
    """A seeded micro transformer in eval mode: 4x4x2 latents (Flux: 4 tokens x 4)."""
    import diffusers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "dit":
            options = dict(
                num_attention_heads=2,
                attention_head_dim=4,
                in_channels=2,
                out_channels=2,
                num_layers=1,
                norm_num_groups=1,
                sample_size=4,
                patch_size=2,
                num_embeds_ada_norm=3,
            )
            model = diffusers.DiTTransformer2DModel(**{**options, **overrides})
        elif kind == "sd3":
            options = dict(
                sample_size=4,
                patch_size=2,
                in_channels=2,
                out_channels=2,
                num_layers=1,
                attention_head_dim=4,
                num_attention_heads=2,
                joint_attention_dim=6,
                caption_projection_dim=8,
                pooled_projection_dim=5,
                pos_embed_max_size=4,
            )
            model = diffusers.SD3Transformer2DModel(**{**options, **overrides})
        else:
            options = dict(
                patch_size=1,
                in_channels=4,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=8,
                num_attention_heads=2,
                joint_attention_dim=6,
                pooled_projection_dim=5,
                axes_dims_rope=(2, 2, 4),
            )
            model = diffusers.FluxTransformer2DModel(**{**options, **overrides})
    return model.to(dtype).eval()


def tiny_unet(dtype=torch.float64, **overrides):
    """A seeded micro ``UNet2DConditionModel`` in eval mode (8x8x2 latents, cross-attention
    dim 6); ``overrides`` replace its config fields."""
    import diffusers

    options = dict(
        sample_size=8,
        in_channels=2,
        out_channels=2,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=6,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = diffusers.UNet2DConditionModel(**{**options, **overrides})
    return unet.to(dtype).eval()


def tiny_sdxl_unet(pooled: int, dtype=torch.float64):
    """:func:`tiny_unet` configured like SDXL: ``addition_embed_type="text_time"``
    (``added_cond_kwargs``: ``text_embeds [B, pooled]`` and six ``time_ids``)."""
    return tiny_unet(
        dtype,
        block_out_channels=(4, 8),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=2,
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=6 * 4 + pooled,
    )
