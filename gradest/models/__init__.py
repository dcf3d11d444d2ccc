"""Velocity models: a small MLP for vector states and the adaLN-Zero DiT."""

from gradest.models.dit import DIT_CONFIGS, DiT, DiTConfig, dit_parameter_count
from gradest.models.embeddings import TimestepEmbedder, sinusoidal_embedding
from gradest.models.mlp import MLPVelocity

__all__ = [
    "DIT_CONFIGS",
    "DiT",
    "DiTConfig",
    "MLPVelocity",
    "TimestepEmbedder",
    "dit_parameter_count",
    "sinusoidal_embedding",
]
