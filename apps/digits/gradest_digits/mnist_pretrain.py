"""Pretraining of the MNIST (28x28) workload: the classifier, then a class-conditional DiT.

``python -m gradest_digits.mnist_pretrain`` trains both on the 4,000 training digits of
:mod:`gradest_digits.mnist` (seeded, single-threaded CPU) and writes
``mnist_classifier.pt`` and ``mnist_dit.pt`` to ``apps/digits/gradest_digits/assets/``
(``--out-dir`` elsewhere). The DiT is ``DiT.from_config("digits")`` (28x28x1, 4x4 patches:
49 tokens, hidden 128, depth 3, 4 heads, about 0.96M parameters), trained by rectified
flow matching exactly as the 8x8 DiT (:func:`gradest_digits.pretrain.pretrain_dit`):
``z_t = (1 - t) x + t eps``, target ``eps - x``, logit-normal ``t``, 10% null-label
dropout, AdamW with warm-up and cosine decay, and an EMA of the weights is shipped. Its
evaluation: conditional samples (``RectifiedFlow(20)``) classified by the new classifier,
overall and per class. Each file it writes is held as ``gradest pretrain`` holds its
``--out`` (:func:`gradest_digits.pretrain.claim_output_file`): a lock beside it for the
run, and an existing file replaced only when it is a checkpoint of the same kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradest.errors import GradestError, InvalidValue
from gradest.files import check_output_dir
from gradest.models.dit import DiT
from gradest.samplers import RectifiedFlow
from gradest.trajectory import rollout
from gradest_digits.assets import asset_path
from gradest_digits.mnist import IMAGE_SHAPE, NUM_CLASSES, load_mnist_dataset
from gradest_digits.mnist_assets import (
    CLASSIFIER_KIND,
    DIT_KIND,
    MNIST_CLASSIFIER_CHECKPOINT,
    MNIST_DIT_CHECKPOINT,
    mnist_classifier_checkpoint,
    mnist_dit_checkpoint,
)
from gradest_digits.mnist_classifier import MnistClassifier, train_mnist_classifier
from gradest_digits.pretrain import claim_output_file, pretrain_dit, write_claimed

DIT_CONFIG = "digits"
# The command its lock files name.
COMMAND = "python -m gradest_digits.mnist_pretrain"


def pretrain_mnist_dit(
    steps: int = 2000,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    *,
    label_dropout: float = 0.1,
    ema_decay: float = 0.999,
    warmup: int = 100,
    threads: int = 1,
    progress: bool = True,
) -> tuple[DiT, dict[str, Any]]:
    """Rectified-flow matching of ``DiT.from_config("digits")`` on the MNIST train split.

    Returns ``(EMA model in eval mode, info)``; ``info`` holds the settings, the parameter
    count, the final (smoothed) training loss and the seconds taken.
    """
    return pretrain_dit(
        steps,
        batch_size,
        lr,
        seed,
        config=DIT_CONFIG,
        label_dropout=label_dropout,
        ema_decay=ema_decay,
        warmup=warmup,
        threads=threads,
        progress=progress,
        load_split=load_mnist_dataset,
        image_shape=IMAGE_SHAPE,
        description="MNIST DiT",
    )


@torch.no_grad()
def sample_mnist(
    model: nn.Module, labels: torch.Tensor, *, steps: int = 20, seed: int = 0
) -> torch.Tensor:
    """Conditional samples ``[B, 1, 28, 28]`` of ``labels`` with ``RectifiedFlow(steps)``."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((labels.shape[0], *IMAGE_SHAPE), generator=generator)
    return rollout(model, RectifiedFlow(steps=steps), noise, cond={"y": labels}).states[-1]


@torch.no_grad()
def evaluate_mnist_dit(
    model: nn.Module,
    classifier: nn.Module,
    *,
    samples_per_class: int = 20,
    steps: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """The classifier's accuracy on conditional samples (the label conditioned on; chance
    0.1), overall and per class."""
    labels = torch.arange(NUM_CLASSES).repeat_interleave(samples_per_class)
    samples = sample_mnist(model, labels, steps=steps, seed=seed)
    predicted = classifier(samples).argmax(dim=1)
    per_class = [float((predicted[labels == c] == c).float().mean()) for c in range(NUM_CLASSES)]
    return {
        "accuracy": float((predicted == labels).float().mean()),
        "accuracy_per_class": per_class,
        "samples": int(labels.shape[0]),
        "sampler_steps": steps,
        "seed": seed,
    }


def mnist_pretrain(
    out_dir: str | Path | None = None,
    *,
    what: str = "all",
    seed: int = 0,
    dit_steps: int = 2000,
    classifier_epochs: int = 15,
    progress: bool = True,
) -> dict[str, Any]:
    """Train and save the classifier and/or the DiT; returns their ``info`` dicts.

    ``what="dit"`` evaluates the DiT with the classifier already in ``out_dir``.
    """
    if what not in ("all", "classifier", "dit"):
        raise InvalidValue(f"what={what!r} is not one of all, classifier, dit")
    folder = Path(out_dir) if out_dir is not None else asset_path("")
    folder = check_output_dir(folder, what="--out-dir") if out_dir is not None else folder
    result: dict[str, Any] = {}
    from gradest_digits.assets import build_model
    from gradest_digits.mnist_assets import read_mnist_asset

    written = {
        name: kind
        for name, kind, wanted in (
            (MNIST_CLASSIFIER_CHECKPOINT, CLASSIFIER_KIND, ("all", "classifier")),
            (MNIST_DIT_CHECKPOINT, DIT_KIND, ("all", "dit")),
        )
        if what in wanted
    }
    held = {"what": "the checkpoint", "flag": "--out-dir", "command": COMMAND}
    with contextlib.ExitStack() as stack:
        # Both files are held (and checked) before either is trained.
        for name, kind in written.items():
            stack.enter_context(claim_output_file(folder / name, kind, **held))
        if what in ("all", "classifier"):
            classifier, info = train_mnist_classifier(
                seed=seed, epochs=classifier_epochs, progress=progress
            )
            checkpoint = mnist_classifier_checkpoint(classifier, info)
            write_claimed(checkpoint, folder / MNIST_CLASSIFIER_CHECKPOINT, **held)
            result["classifier"] = info
        else:
            path = folder / MNIST_CLASSIFIER_CHECKPOINT
            if not path.is_file():
                raise InvalidValue(f"--what dit evaluates with {path}; train the classifier first")
            # The one reader of the format: a damaged file is one line naming it.
            saved = build_model(read_mnist_asset(MNIST_CLASSIFIER_CHECKPOINT, folder))
            assert isinstance(saved, MnistClassifier)
            classifier = saved
        if what in ("all", "dit"):
            model, info = pretrain_mnist_dit(steps=dit_steps, seed=seed, progress=progress)
            info["evaluation"] = evaluate_mnist_dit(
                model, classifier.requires_grad_(False), seed=seed
            )
            write_claimed(mnist_dit_checkpoint(model, info), folder / MNIST_DIT_CHECKPOINT, **held)
            result["dit"] = info
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradest_digits.mnist_pretrain",
        description="Pretrain the MNIST workload's classifier and DiT and save the checkpoints.",
    )
    parser.add_argument("--out-dir", default=None, help="folder (default: the package assets)")
    parser.add_argument("--what", choices=("all", "classifier", "dit"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dit-steps", type=int, default=2000)
    parser.add_argument("--classifier-epochs", type=int, default=15)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        result = mnist_pretrain(
            args.out_dir,
            what=args.what,
            seed=args.seed,
            dit_steps=args.dit_steps,
            classifier_epochs=args.classifier_epochs,
            progress=not args.quiet,
        )
    except GradestError as err:
        print(f"mnist_pretrain: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
