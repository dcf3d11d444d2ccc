"""Shipped checkpoints of the MNIST (28x28) workload: their format and loaders.

Same format as the 8x8 checkpoints (:mod:`gradest_digits.assets`): plain dicts (``kind``,
a float32 ``state_dict``, a config dict, an ``info`` dict of settings and measured
numbers) saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``,
read by the same reader (:func:`gradest_digits.assets.read_model_checkpoint`: every field
checked, a damaged file one line naming it and the field).
``python -m gradest_digits.mnist_pretrain`` regenerates both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from gradest.models.dit import DiT
from gradest_digits.assets import (
    ModelCheckpoint,
    ModelKind,
    asset_path,
    build_model,
    check_classifier_config,
    check_dit_config,
    check_model_checkpoint,
    read_model_checkpoint,
)
from gradest_digits.mnist_classifier import MnistClassifier

MNIST_DIT_CHECKPOINT = "mnist_dit.pt"
MNIST_CLASSIFIER_CHECKPOINT = "mnist_classifier.pt"
REGENERATE_COMMAND = "python -m gradest_digits.mnist_pretrain"
DIT_KIND = "mnist_dit"
CLASSIFIER_KIND = "mnist_classifier"


def _float32_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}


def mnist_classifier_checkpoint(model: MnistClassifier, info: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.load(weights_only=True)``-safe dict of the classifier."""
    return {
        "kind": CLASSIFIER_KIND,
        "config": dict(model.config),
        "state_dict": _float32_state(model),
        "info": dict(info),
    }


def mnist_dit_checkpoint(model: DiT, info: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.load(weights_only=True)``-safe dict of the DiT."""
    return {
        "kind": DIT_KIND,
        "config": attrs.asdict(model.config),
        "state_dict": _float32_state(model),
        "info": dict(info),
    }


def _build_classifier(config: dict[str, Any]) -> MnistClassifier:
    return MnistClassifier(
        channels=tuple(config["channels"]),
        feature_dim=config["feature_dim"],
        num_classes=config["num_classes"],
    )


MNIST_CLASSIFIER = ModelKind(
    kind=CLASSIFIER_KIND,
    title=f"an {CLASSIFIER_KIND}",
    check_config=check_classifier_config(3),
    build=_build_classifier,
    fix=f"make one with {REGENERATE_COMMAND}",
)
MNIST_DIT = ModelKind(
    kind=DIT_KIND,
    title=f"an {DIT_KIND}",
    check_config=check_dit_config,
    build=lambda config: DiT(**config),
    fix=f"make one with {REGENERATE_COMMAND}",
)
KINDS = {MNIST_DIT_CHECKPOINT: MNIST_DIT, MNIST_CLASSIFIER_CHECKPOINT: MNIST_CLASSIFIER}


def mnist_classifier_from_checkpoint(checkpoint: Mapping[str, Any]) -> MnistClassifier:
    """Rebuild the classifier (eval mode), every field checked."""
    model = build_model(check_model_checkpoint(checkpoint, MNIST_CLASSIFIER))
    assert isinstance(model, MnistClassifier)
    return model


def mnist_dit_from_checkpoint(checkpoint: Mapping[str, Any]) -> DiT:
    """Rebuild the DiT (eval mode), every field checked."""
    model = build_model(check_model_checkpoint(checkpoint, MNIST_DIT))
    assert isinstance(model, DiT)
    return model


def read_mnist_asset(name: str, folder: Path | None = None) -> ModelCheckpoint:
    """The MNIST checkpoint ``name`` in ``folder`` (default: the package assets), checked.

    Raises:
        MissingFile / InvalidValue: missing or damaged; one line naming the file, the field
            and the regenerating command.
    """
    path = asset_path(name) if folder is None else Path(folder) / name
    fix = f"regenerate it from the repository root with: {REGENERATE_COMMAND}"
    return read_model_checkpoint(path, KINDS[name], fix=fix)


def load_mnist_checkpoint(name: str) -> dict[str, Any]:
    """The dict stored in ``apps/digits/gradest_digits/assets/<name>`` (CPU tensors),
    every field checked.

    Raises:
        FileNotFoundError: the file is missing; the message names the regenerating command.
        ValueError: the file is damaged (one line naming it and the field).
    """
    return read_mnist_asset(name).as_dict()


def load_mnist_dit(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DiT:
    """The shipped class-conditional rectified-flow DiT on 28x28 MNIST, in eval mode.

    Parameters are trainable (the starting point of fine-tuning). Label ``10`` (or
    ``y=None``) samples unconditionally.
    """
    model = build_model(read_mnist_asset(MNIST_DIT_CHECKPOINT))
    assert isinstance(model, DiT)
    return model.to(device=device, dtype=dtype)


def load_mnist_classifier(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MnistClassifier:
    """The shipped MNIST classifier, in eval mode and frozen (``requires_grad=False``)."""
    model = build_model(read_mnist_asset(MNIST_CLASSIFIER_CHECKPOINT))
    assert isinstance(model, MnistClassifier)
    return model.to(device=device, dtype=dtype).requires_grad_(False)
