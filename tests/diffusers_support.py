"""Tiny diffusers models shared by the diffusers tests (test_diffusers.py,
test_training_stack.py); diffusers is imported where used, so importing this module does
not need it."""

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
