"""A small MLP velocity model for vector states, with optional class conditioning."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradest.errors import InvalidType, InvalidValue
from gradest.models.embeddings import TimestepEmbedder


class MLPVelocity(nn.Module):
    """``v(z, t, y=None)`` for states ``z`` of shape ``[B, dim]``.

    The time embedding (and the class embedding, if ``num_classes`` is set) is added to
    the first hidden layer. SiLU activations keep the model smooth in ``(z, t)``, which
    the interpolation-error tests of JAGG rely on.

    Args:
        dim: state dimension.
        hidden: width of the hidden layers.
        depth: number of hidden layers (>= 1).
        num_classes: if given, ``forward`` takes ``y`` (int labels ``[B]``); label
            ``num_classes`` is the null (unconditional) class.
    """

    def __init__(self, dim: int, hidden: int = 64, depth: int = 2, num_classes: int | None = None):
        super().__init__()
        if depth < 1:
            raise InvalidValue(f"depth must be >= 1, got {depth}")
        self.dim = dim
        self.num_classes = num_classes
        self.time_embed = TimestepEmbedder(hidden, frequency_dim=32)
        self.class_embed = (
            nn.Embedding(num_classes + 1, hidden) if num_classes is not None else None
        )
        self.input = nn.Linear(dim, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth - 1))
        self.output = nn.Linear(hidden, dim)
        self.act = nn.SiLU()

    def forward(self, z: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        h = self.input(z) + self.time_embed(t)
        if self.class_embed is not None and self.num_classes is not None:
            null_class = self.num_classes
            labels = y if y is not None else torch.full_like(t, null_class, dtype=torch.long)
            h = h + self.class_embed(labels)
        elif y is not None:
            raise InvalidType("this MLPVelocity was built without num_classes; do not pass y")
        h = self.act(h)
        for layer in self.hidden:
            h = self.act(layer(h))
        return self.output(h)
