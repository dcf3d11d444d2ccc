"""Shipped checkpoints of the MNIST (28x28) workload: their format and loaders.

Same format as the 8x8 checkpoints (:mod:`gradest_digits.assets`): plain dicts (``kind``,
a float32 ``state_dict``, a config dict, an ``info`` dict of settings and measured
numbers) saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``.
``python -m gradest_digits.mnist_pretrain`` regenerates both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from gradest.errors import InvalidValue, MissingFile
from gradest.models.dit import DiT
from gradest_digits.assets import asset_path
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


def _check_kind(checkpoint: Mapping[str, Any], kind: str) -> None:
    if checkpoint.get("kind") != kind:
        raise InvalidValue(
            f"not an {kind} checkpoint (kind={checkpoint.get('kind')!r}); make one with "
            f"{REGENERATE_COMMAND}"
        )


def mnist_classifier_from_checkpoint(checkpoint: Mapping[str, Any]) -> MnistClassifier:
    """Rebuild the classifier (eval mode)."""
    _check_kind(checkpoint, CLASSIFIER_KIND)
    config = dict(checkpoint["config"])
    model = MnistClassifier(
        channels=tuple(config["channels"]),
        feature_dim=config["feature_dim"],
        num_classes=config["num_classes"],
    )
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def mnist_dit_from_checkpoint(checkpoint: Mapping[str, Any]) -> DiT:
    """Rebuild the DiT (eval mode)."""
    _check_kind(checkpoint, DIT_KIND)
    model = DiT(**dict(checkpoint["config"]))
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def load_mnist_checkpoint(name: str) -> dict[str, Any]:
    """The dict stored in ``apps/digits/gradest_digits/assets/<name>`` (CPU tensors).

    Raises:
        FileNotFoundError: the file is missing; the message names the regenerating command.
    """
    path = asset_path(name)
    if not path.is_file():
        raise MissingFile(
            f"checkpoint {path} is missing; regenerate it from the repository root with: "
            f"{REGENERATE_COMMAND}"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def load_mnist_dit(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DiT:
    """The shipped class-conditional rectified-flow DiT on 28x28 MNIST, in eval mode.

    Parameters are trainable (the starting point of fine-tuning). Label ``10`` (or
    ``y=None``) samples unconditionally.
    """
    model = mnist_dit_from_checkpoint(load_mnist_checkpoint(MNIST_DIT_CHECKPOINT))
    return model.to(device=device, dtype=dtype)


def load_mnist_classifier(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MnistClassifier:
    """The shipped MNIST classifier, in eval mode and frozen (``requires_grad=False``)."""
    model = mnist_classifier_from_checkpoint(load_mnist_checkpoint(MNIST_CLASSIFIER_CHECKPOINT))
    return model.to(device=device, dtype=dtype).requires_grad_(False)
