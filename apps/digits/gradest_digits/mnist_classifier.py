"""A small CNN classifier of 28x28 MNIST digits: the reward model of the ``mnist`` race task.

As for the 8x8 :class:`gradest_digits.classifier.DigitClassifier`, the reward's gradient in
the image must be smooth: SiLU activations, no max-pooling (strided convolutions
downsample instead). Training uses random translations of up to two pixels so the
classifier judges shapes rather than exact pixel positions.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradest.errors import InvalidValue
from gradest_digits.classifier import accuracy, random_translate
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
    if epochs < 1 or batch_size < 1:
        raise InvalidValue(
            f"train_mnist_classifier needs epochs >= 1 and batch_size >= 1, got "
            f"epochs={epochs}, batch_size={batch_size}"
        )
    if max_shift < 0:
        raise InvalidValue(f"max_shift must be >= 0 pixels, got {max_shift}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        start = time.perf_counter()
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        train_x, train_y = load_mnist_dataset("train")
        heldout_x, heldout_y = load_mnist_dataset("heldout")
        model = MnistClassifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        batches_per_epoch = -(-len(train_x) // batch_size)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=epochs * batches_per_epoch
        )
        model.train()
        bar = tqdm(range(epochs), desc="mnist classifier", unit="epoch", disable=not progress)
        for _ in bar:
            order = torch.randperm(len(train_x), generator=generator)
            for first in range(0, len(train_x), batch_size):
                index = order[first : first + batch_size]
                images = random_translate(train_x[index], max_shift, generator)
                loss = F.cross_entropy(model(images), train_y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        with torch.no_grad():
            predicted = model(heldout_x).argmax(dim=1)
        per_class = [
            float((predicted[heldout_y == c] == c).float().mean()) for c in range(NUM_CLASSES)
        ]
        info = {
            "seed": seed,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "max_shift": max_shift,
            "train_accuracy": accuracy(model, train_x, train_y),
            "heldout_accuracy": accuracy(model, heldout_x, heldout_y),
            "heldout_accuracy_per_class": per_class,
            "seconds": time.perf_counter() - start,
        }
    finally:
        torch.set_num_threads(previous_threads)
    return model, info
