"""Real handwritten digits: scikit-learn's ``load_digits`` as a fixed train / held-out split.

1797 grey-scale 8x8 digits (values 0..16, about 180 per class) ship inside scikit-learn,
so the workload needs no download. Images are scaled to ``[-1, 1]`` (``x / 8 - 1``), the
range the rectified flow interpolates to from standard normal noise.

The split is stratified by label with a fixed seed: 80% train (1437 images) and 20%
held out (360 images), the same on every machine and every call.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from gradest.errors import InvalidValue

SPLITS = ("train", "heldout")
NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
# load_digits stores integer intensities 0..16; 16 is full ink.
MAX_INTENSITY = 16.0


@functools.lru_cache(maxsize=1)
def _split_arrays() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / (MAX_INTENSITY / 2) - 1.0)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        images,
        labels,
        test_size=HELDOUT_FRACTION,
        stratify=labels,
        random_state=SPLIT_SEED,
    )
    return {"train": (train_x, train_y), "heldout": (heldout_x, heldout_y)}


def load_digits_dataset(
    split: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """The ``split`` of the digits as ``(images [n, 1, 8, 8] in [-1, 1], labels [n] long)``.

    Args:
        split: ``"train"`` (80%, 1437 images) or ``"heldout"`` (20%, 360 images); the split
            is stratified by label and fixed (seed :data:`SPLIT_SEED`).
        dtype: floating dtype of the images.
        device: where to put both tensors.

    Returns fresh tensors on every call (callers may modify them in place).

    Raises:
        ValueError: ``split`` is not one of :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise InvalidValue(
            f"split={split!r} is not a digits split; use one of {', '.join(map(repr, SPLITS))}"
        )
    images, labels = _split_arrays()[split]
    return (
        torch.tensor(images, dtype=dtype, device=device),
        torch.tensor(labels, dtype=torch.long, device=device),
    )
