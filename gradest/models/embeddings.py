"""Time embeddings shared by the velocity models."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_embedding(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Transformer-style sin/cos features of ``t`` (shape ``[B]``) -> ``[B, dim]``.

    Flow times live in [0, 1]; they are scaled by 1000 so the low frequencies still vary
    across the trajectory (the DiT / ADM convention for diffusion timesteps).
    """
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=t.dtype, device=t.device) / half
    )
    angles = 1000.0 * t[:, None] * freqs[None, :]
    embedding = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    """Sinusoidal features followed by a two-layer MLP (as in DiT)."""

    def __init__(self, hidden: int, frequency_dim: int = 64):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(
            nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(sinusoidal_embedding(t, self.frequency_dim))
