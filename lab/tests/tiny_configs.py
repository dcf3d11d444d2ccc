"""Tiny configs of the real architectures the cost tests price (an SD3 transformer, a
VAE, CLIP/BLIP reward models): small enough to build on the CPU in a test, shaped like the
real ones so the prediction walks the same code."""

from __future__ import annotations

from typing import Any

TINY_SD3: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2,
    "in_channels": 4, "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2,
    "joint_attention_dim": 16, "caption_projection_dim": 16, "pooled_projection_dim": 8,
    "out_channels": 4, "pos_embed_max_size": 16,
}  # fmt: skip
# Three blocks: 8x downsampling, as every family's VAE (the latents are image / 8).
TINY_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [4, 8, 8, 8], "layers_per_block": 1, "latent_channels": 4,
    "norm_num_groups": 4, "sample_size": 32, "scaling_factor": 1.5, "shift_factor": 0.1,
}  # fmt: skip
TINY_VISION: dict[str, Any] = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "patch_size": 8, "image_size": 16, "projection_dim": 8,
}  # fmt: skip
TINY_TEXT: dict[str, Any] = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "max_position_embeddings": 8, "projection_dim": 8,
    "vocab_size": 32,
}  # fmt: skip
TINY_CLIP_SCORE: dict[str, Any] = {
    "kind": "clip-score", "vision": TINY_VISION, "text": TINY_TEXT, "image_size": 16,
    "text_tokens": 6, "logit_scale": True,
}  # fmt: skip
