"""Velocity models: a small MLP for vector states (and the DiT, see ``gradest.models.dit``)."""

from gradest.models.embeddings import TimestepEmbedder, sinusoidal_embedding
from gradest.models.mlp import MLPVelocity

__all__ = ["MLPVelocity", "TimestepEmbedder", "sinusoidal_embedding"]
