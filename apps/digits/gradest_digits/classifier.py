"""A small CNN digit classifier: the reward model and the feature extractor of the workload.

It plays two roles, and both shape the architecture:

* **Reward model.** Fine-tuning maximises ``log p(target | x)`` through the sampler, so
  the reward's gradient in ``x`` must be smooth: SiLU activations (not ReLU, whose
  gradient is piecewise constant) and no max-pooling (whose gradient is a hard switch);
  the second convolution downsamples by stride instead.
* **Feature extractor for FID/KID.** :meth:`DigitClassifier.features` returns the
  penultimate activations (64 numbers), the digits analogue of Inception's pool features.

Training uses random one-pixel translations so the classifier judges shapes rather than
exact pixel positions, which keeps it honest on generated samples that are slightly off
the training manifold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradest.errors import InvalidValue
from gradest_digits.digits import IMAGE_SHAPE, NUM_CLASSES, load_digits_dataset


class DigitClassifier(nn.Module):
    """``logits = head(features(x))`` for images ``x [B, 1, 8, 8]`` in ``[-1, 1]``.

    ``conv 3x3 (1 -> c1) -> SiLU -> conv 3x3 stride 2 (c1 -> c2) -> SiLU -> flatten ->
    linear (c2*16 -> feature_dim) -> SiLU`` is :meth:`features`; a final linear layer maps
    the features to ``num_classes`` logits.

    Attributes:
        config: the constructor arguments, enough to rebuild the module from a checkpoint.
    """

    def __init__(
        self,
        channels: tuple[int, int] = (16, 32),
        feature_dim: int = 64,
        num_classes: int = NUM_CLASSES,
    ):
        super().__init__()
        c1, c2 = (int(c) for c in channels)
        if min(c1, c2, feature_dim, num_classes) <= 0:
            raise InvalidValue(
                f"DigitClassifier sizes must be positive, got channels={channels!r}, "
                f"feature_dim={feature_dim!r}, num_classes={num_classes!r}"
            )
        self.config = {"channels": [c1, c2], "feature_dim": feature_dim, "num_classes": num_classes}
        self.conv1 = nn.Conv2d(1, c1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, padding=1, stride=2)
        side = IMAGE_SHAPE[1] // 2
        self.fc = nn.Linear(c2 * side * side, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def features(self, x: Tensor) -> Tensor:
        """Penultimate activations ``[B, feature_dim]`` (the FID/KID feature space)."""
        if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            raise InvalidValue(
                f"DigitClassifier expects images of shape [B, 1, 8, 8] in [-1, 1], got "
                f"{tuple(x.shape)}"
            )
        h = F.silu(self.conv1(x))
        h = F.silu(self.conv2(h))
        return F.silu(self.fc(h.flatten(1)))

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]``."""
        return self.head(self.features(x))


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


@torch.no_grad()
def accuracy(classifier: nn.Module, images: Tensor, labels: Tensor) -> float:
    """Fraction of ``images`` whose arg-max class is ``labels``."""
    logits = classifier(images)
    return float((logits.argmax(dim=1) == labels.to(logits.device)).float().mean())


def train_classifier(
    seed: int = 0,
    epochs: int = 30,
    *,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    max_shift: int = 1,
    threads: int = 1,
    progress: bool = True,
) -> tuple[DigitClassifier, dict[str, Any]]:
    """Train a :class:`DigitClassifier` on the train split (CPU, about ten seconds).

    AdamW with a cosine learning-rate decay over ``epochs`` passes of the 1437 training
    digits, each batch randomly translated by up to ``max_shift`` pixels.

    Args:
        seed: seeds the initialisation, the batch order and the augmentation.
        epochs: passes over the training split.
        batch_size, lr, weight_decay: optimiser settings.
        max_shift: translation augmentation in pixels (0 turns it off).
        threads: ``torch.set_num_threads`` during training (restored afterwards).
        progress: show a tqdm progress bar.

    Returns:
        ``(classifier, info)``: the trained model in eval mode, and ``info`` with
        ``train_accuracy``, ``heldout_accuracy``, ``seconds`` and the settings.
    """
    return fit_classifier(
        DigitClassifier,
        load_digits_dataset,
        name="train_classifier",
        description="classifier",
        seed=seed,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        max_shift=max_shift,
        threads=threads,
        progress=progress,
    )


def fit_classifier(
    make_model: Callable[[], nn.Module],
    load_split: Callable[[str], tuple[Tensor, Tensor]],
    *,
    name: str,
    description: str,
    seed: int,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    max_shift: int,
    threads: int,
    progress: bool,
    heldout_metrics: Callable[[nn.Module, Tensor, Tensor], dict[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The classifiers' training loop (8x8 digits and MNIST alike).

    Seeds torch and a data generator with ``seed``, builds ``make_model()``, and trains it
    on ``load_split("train")`` with AdamW and a cosine decay over ``epochs`` passes, each
    batch randomly translated by up to ``max_shift`` pixels; ``threads`` CPU threads during
    training (restored afterwards). ``name`` is the caller's name in error messages,
    ``description`` the progress bar's. Returns ``(model in eval mode, info)``: the settings,
    ``train_accuracy``, ``heldout_accuracy`` (on ``load_split("heldout")``), what
    ``heldout_metrics(model, images, labels)`` adds, and ``seconds``.
    """
    if epochs < 1 or batch_size < 1:
        raise InvalidValue(
            f"{name} needs epochs >= 1 and batch_size >= 1, got epochs={epochs}, "
            f"batch_size={batch_size}"
        )
    if max_shift < 0:
        raise InvalidValue(f"max_shift must be >= 0 pixels, got {max_shift}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        start = time.perf_counter()
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        train_x, train_y = load_split("train")
        heldout_x, heldout_y = load_split("heldout")
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        batches_per_epoch = -(-len(train_x) // batch_size)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=epochs * batches_per_epoch
        )
        model.train()
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
        extra = {} if heldout_metrics is None else heldout_metrics(model, heldout_x, heldout_y)
        info = {
            "seed": seed,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "max_shift": max_shift,
            "train_accuracy": accuracy(model, train_x, train_y),
            "heldout_accuracy": accuracy(model, heldout_x, heldout_y),
            **extra,
            "seconds": time.perf_counter() - start,
        }
    finally:
        torch.set_num_threads(previous_threads)
    return model, info
