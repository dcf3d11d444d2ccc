"""A small CNN classifier of 28x28 MNIST digits: the reward model of the ``mnist`` race task.

As for the 8x8 :class:`gradest_digits.classifier.DigitClassifier`, the reward's gradient in
the image must be smooth: SiLU activations, no max-pooling (strided convolutions
downsample instead). Training uses random translations of up to two pixels so the
classifier judges shapes rather than exact pixel positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradest.errors import InvalidValue
from gradest_digits.classifier import fit_classifier
from gradest_digits.mnist import IMAGE_SHAPE, NUM_CLASSES, load_mnist_dataset


class MnistClassifier(nn.Module):
    """``logits = head(features(x))`` for images ``x [B, 1, 28, 28]`` in ``[-1, 1]``.

    ``conv 3x3 (1 -> c1) -> SiLU -> conv 3x3 s2 (c1 -> c2) -> SiLU -> conv 3x3 s2 (c2 -> c3)
    -> SiLU -> flatten (c3 * 7 * 7) -> linear -> SiLU`` is :meth:`features`; a final linear
    layer gives ``num_classes`` logits.
    """

    def __init__(
        self,
        channels: tuple[int, int, int] = (16, 32, 32),
        feature_dim: int = 64,
        num_classes: int = NUM_CLASSES,
    ):
        super().__init__()
        c1, c2, c3 = (int(c) for c in channels)
        if min(c1, c2, c3, feature_dim, num_classes) <= 0:
            raise InvalidValue(
                f"MnistClassifier sizes must be positive, got channels={channels!r}, "
                f"feature_dim={feature_dim!r}, num_classes={num_classes!r}"
            )
        self.config = {
            "channels": [c1, c2, c3],
            "feature_dim": feature_dim,
            "num_classes": num_classes,
        }
        self.conv1 = nn.Conv2d(1, c1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, padding=1, stride=2)
        self.conv3 = nn.Conv2d(c2, c3, kernel_size=3, padding=1, stride=2)
        side = IMAGE_SHAPE[1] // 4
        self.fc = nn.Linear(c3 * side * side, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def features(self, x: Tensor) -> Tensor:
        """Penultimate activations ``[B, feature_dim]``."""
        if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            raise InvalidValue(
                f"MnistClassifier expects images of shape [B, 1, 28, 28] in [-1, 1], got "
                f"{tuple(x.shape)}"
            )
        h = F.silu(self.conv1(x))
        h = F.silu(self.conv2(h))
        h = F.silu(self.conv3(h))
        return F.silu(self.fc(h.flatten(1)))

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]``."""
        return self.head(self.features(x))


def train_mnist_classifier(
    seed: int = 0,
    epochs: int = 15,
    *,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    max_shift: int = 2,
    threads: int = 1,
    progress: bool = True,
) -> tuple[MnistClassifier, dict[str, Any]]:
    """Train a :class:`MnistClassifier` on the 4,000 training digits (CPU, about a minute).

    AdamW with cosine decay over ``epochs`` passes, each batch randomly translated by up
    to ``max_shift`` pixels. Returns ``(classifier in eval mode, info)`` with
    ``train_accuracy``, ``heldout_accuracy`` (the 1,000 held-out digits), per-class
    held-out accuracy, ``seconds`` and the settings.
    """
    return fit_classifier(
        MnistClassifier,
        load_mnist_dataset,
        name="train_mnist_classifier",
        description="mnist classifier",
        seed=seed,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        max_shift=max_shift,
        threads=threads,
        progress=progress,
        heldout_metrics=_per_class_accuracy,
    )


def _per_class_accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> dict[str, Any]:
    with torch.no_grad():
        predicted = model(images).argmax(dim=1)
    per_class = [float((predicted[labels == c] == c).float().mean()) for c in range(NUM_CLASSES)]
    return {"heldout_accuracy_per_class": per_class}
