"""A small CNN digit classifier, of either dataset: the reward model and the feature extractor.

It plays two roles, and both shape the architecture:

* **Reward model.** Fine-tuning maximises ``log p(target | x)`` through the sampler, so
  the reward's gradient in ``x`` must be smooth: SiLU activations (not ReLU, whose
  gradient is piecewise constant) and no max-pooling (whose gradient is a hard switch);
  the convolutions after the first downsample by stride instead.
* **Feature extractor for FID/KID.** :meth:`DigitClassifier.features` returns the
  penultimate activations (64 numbers), the digits analogue of Inception's pool features.

Training uses random translations (one pixel on the 8x8 digits, two on MNIST) so the
classifier judges shapes rather than exact pixel positions, which keeps it honest on
generated samples that are slightly off the training manifold.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradest import InvalidValue
from gradest_digits.datasets import DIGITS, NUM_CLASSES, Dataset


class DigitClassifier(nn.Module):
    """``logits = head(features(x))`` for images ``x [B, 1, size, size]`` in ``[-1, 1]``.

    ``conv 3x3 (1 -> c1) -> SiLU``, then for each further width ``c_k`` a
    ``conv 3x3 stride 2 (c_{k-1} -> c_k) -> SiLU``, then ``flatten -> linear -> SiLU`` is
    :meth:`features`; a final linear layer maps the features to ``num_classes`` logits.
    The 8x8 digits' classifier has widths ``(16, 32)`` (one downsampling, 4x4), MNIST's
    ``(16, 32, 32)`` (two, 7x7): :attr:`gradest_digits.datasets.Dataset.classifier_channels`.

    Attributes:
        config: the options a checkpoint holds (``channels``, ``feature_dim``,
            ``num_classes``): with the image size, enough to rebuild the module.
    """

    def __init__(
        self,
        channels: tuple[int, ...] = DIGITS.classifier_channels,
        feature_dim: int = 64,
        num_classes: int = NUM_CLASSES,
        *,
        image_size: int = DIGITS.image_shape[1],
    ):
        super().__init__()
        widths = [int(c) for c in channels]
        if not widths or min(*widths, feature_dim, num_classes) <= 0:
            raise InvalidValue(
                f"DigitClassifier sizes must be positive, got channels={channels!r}, "
                f"feature_dim={feature_dim!r}, num_classes={num_classes!r}"
            )
        self.config = {"channels": widths, "feature_dim": feature_dim, "num_classes": num_classes}
        self.image_shape = (1, image_size, image_size)
        # conv1, conv2, ...: the shipped checkpoints' names, created in this order (the
        # order the seeded initialisation draws them in).
        self.convs = [f"conv{k + 1}" for k in range(len(widths))]
        for k, (inputs, outputs) in enumerate(zip([1, *widths], widths, strict=False)):
            conv = nn.Conv2d(inputs, outputs, kernel_size=3, padding=1, stride=1 if k == 0 else 2)
            self.add_module(self.convs[k], conv)
        side = image_size // 2 ** (len(widths) - 1)
        self.fc = nn.Linear(widths[-1] * side * side, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def features(self, x: Tensor) -> Tensor:
        """Penultimate activations ``[B, feature_dim]`` (the FID/KID feature space)."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.image_shape:
            size = self.image_shape[1]
            raise InvalidValue(
                f"DigitClassifier expects images of shape [B, 1, {size}, {size}] in [-1, 1], "
                f"got {tuple(x.shape)}"
            )
        h = x
        for name in self.convs:
            h = F.silu(getattr(self, name)(h))
        return F.silu(self.fc(h.flatten(1)))

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]``."""
        return self.head(self.features(x))


def classifier_for(dataset: Dataset, **options: Any) -> DigitClassifier:
    """A :class:`DigitClassifier` of ``dataset``'s widths and image size (``options``:
    the constructor's others, or ``channels`` to override the widths)."""
    options.setdefault("channels", dataset.classifier_channels)
    return DigitClassifier(image_size=dataset.image_shape[1], **options)


def random_translate(images: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Shift each image by its own random offset in ``[-max_shift, max_shift]^2``.

    Pixels shifted in from outside are background (-1), as on the digits' blank border.
    """
    if max_shift == 0:
        return images
    batch, _, height, width = images.shape
    padded = F.pad(images, (max_shift,) * 4, value=-1.0)
    offsets = torch.randint(0, 2 * max_shift + 1, (2, batch), generator=generator)
    rows = offsets[0][:, None] + torch.arange(height)
    cols = offsets[1][:, None] + torch.arange(width)
    index = torch.arange(batch)[:, None, None]
    return padded[index, 0, rows[:, :, None], cols[:, None, :]][:, None]


@contextlib.contextmanager
def training_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` (at least one) for the body, restored afterwards:
    the training loops' CPU threads (one is fastest for models this small on a shared CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@torch.no_grad()
def accuracy(classifier: nn.Module, images: Tensor, labels: Tensor) -> float:
    """Fraction of ``images`` whose arg-max class is ``labels``."""
    logits = classifier(images)
    return float((logits.argmax(dim=1) == labels.to(logits.device)).float().mean())


def train_classifier(
    seed: int = 0,
    epochs: int | None = None,
    *,
    dataset: Dataset = DIGITS,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    max_shift: int | None = None,
    threads: int = 1,
    progress: bool = True,
) -> tuple[DigitClassifier, dict[str, Any]]:
    """Train ``dataset``'s :class:`DigitClassifier` on its train split (CPU; the 8x8
    digits' in about ten seconds, MNIST's in about a minute).

    AdamW with a cosine learning-rate decay over ``epochs`` passes of the training
    digits, each batch randomly translated by up to ``max_shift`` pixels.

    Args:
        seed: seeds the initialisation, the batch order and the augmentation.
        epochs: passes over the training split (default: the dataset's,
            :attr:`~gradest_digits.datasets.Dataset.classifier_epochs`).
        dataset: :data:`~gradest_digits.datasets.DIGITS` or
            :data:`~gradest_digits.datasets.MNIST`.
        batch_size, lr, weight_decay: optimiser settings.
        max_shift: translation augmentation in pixels (0 turns it off; default: the
            dataset's, :attr:`~gradest_digits.datasets.Dataset.classifier_max_shift`).
        threads: ``torch.set_num_threads`` during training (restored afterwards).
        progress: show a tqdm progress bar.

    Returns:
        ``(classifier, info)``: the trained model in eval mode, and ``info`` with the
        settings, ``train_accuracy``, ``heldout_accuracy``,
        ``heldout_accuracy_per_class`` and ``seconds``.
    """
    epochs = dataset.classifier_epochs if epochs is None else epochs
    max_shift = dataset.classifier_max_shift if max_shift is None else max_shift
    if epochs < 1 or batch_size < 1:
        raise InvalidValue(
            f"train_classifier needs epochs >= 1 and batch_size >= 1, got epochs={epochs}, "
            f"batch_size={batch_size}"
        )
    if max_shift < 0:
        raise InvalidValue(f"max_shift must be >= 0 pixels, got {max_shift}")
    with training_threads(threads):
        start = time.perf_counter()
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        train_x, train_y = dataset.load("train")
        heldout_x, heldout_y = dataset.load("heldout")
        model = classifier_for(dataset)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        batches_per_epoch = -(-len(train_x) // batch_size)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=epochs * batches_per_epoch
        )
        model.train()
        description = f"{dataset.name} classifier"
        bar = tqdm(range(epochs), desc=description, unit="epoch", disable=not progress)
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
        info = {
            "seed": seed,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "max_shift": max_shift,
            "train_accuracy": accuracy(model, train_x, train_y),
            "heldout_accuracy": accuracy(model, heldout_x, heldout_y),
            "heldout_accuracy_per_class": per_class_accuracy(model, heldout_x, heldout_y),
            "seconds": time.perf_counter() - start,
        }
    return model, info


@torch.no_grad()
def per_class_accuracy(classifier: nn.Module, images: Tensor, labels: Tensor) -> list[float]:
    """For each class ``c``, the fraction of the ``images`` of label ``c`` classified ``c``."""
    predicted = classifier(images).argmax(dim=1)
    labels = labels.to(predicted.device)
    classes: int = getattr(classifier, "num_classes", NUM_CLASSES)
    return [float((predicted[labels == c] == c).float().mean()) for c in range(classes)]
