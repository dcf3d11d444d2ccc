"""Checkpoints of the digits workload: their format and the shipped ones in ``gradest/assets``.

Checkpoints are plain dicts saved with ``torch.save`` (``kind``, a float32 ``state_dict``,
a config dict and an ``info`` dict of training settings and measured numbers), loaded with
``torch.load(weights_only=True)`` so that loading never runs pickled code.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import torch

from gradest.errors import InvalidValue, MissingFile
from gradest.models.dit import DiT
from gradest_digits.classifier import DigitClassifier

DIT_CHECKPOINT = "digits_dit.pt"
CLASSIFIER_CHECKPOINT = "digit_classifier.pt"
REGENERATE = {
    DIT_CHECKPOINT: "python -m gradest_digits.pretrain --what dit "
    "--out apps/digits/gradest_digits/assets/digits_dit.pt",
    CLASSIFIER_CHECKPOINT: "python -m gradest_digits.pretrain --what classifier "
    "--out apps/digits/gradest_digits/assets/digit_classifier.pt",
}


def classifier_checkpoint(model: DigitClassifier, info: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.load(weights_only=True)``-safe dict: float32 state_dict, config, info."""
    return {
        "kind": "digit_classifier",
        "config": dict(model.config),
        "state_dict": {
            k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()
        },
        "info": dict(info),
    }


def classifier_from_checkpoint(checkpoint: Mapping[str, Any]) -> DigitClassifier:
    """Rebuild a :class:`DigitClassifier` from :func:`classifier_checkpoint`'s dict."""
    if checkpoint.get("kind") != "digit_classifier":
        raise InvalidValue(
            f"not a digit-classifier checkpoint (kind={checkpoint.get('kind')!r}); "
            f"make one with gradest_digits.assets.classifier_checkpoint"
        )
    config = dict(checkpoint["config"])
    model = DigitClassifier(
        channels=tuple(config["channels"]),
        feature_dim=config["feature_dim"],
        num_classes=config["num_classes"],
    )
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def dit_checkpoint(model: DiT, info: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.load(weights_only=True)``-safe dict: float32 state_dict, DiT config, info."""
    return {
        "kind": "digits_dit",
        "config": attrs.asdict(model.config),
        "state_dict": {
            k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()
        },
        "info": dict(info),
    }


def dit_from_checkpoint(checkpoint: Mapping[str, Any]) -> DiT:
    """Rebuild the :class:`DiT` saved by :func:`dit_checkpoint` (eval mode)."""
    if checkpoint.get("kind") != "digits_dit":
        raise InvalidValue(
            f"not a digits-DiT checkpoint (kind={checkpoint.get('kind')!r}); "
            f"make one with gradest_digits.assets.dit_checkpoint"
        )
    model = DiT(**dict(checkpoint["config"]))
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def asset_path(name: str) -> Path:
    """Path of a file in ``apps/digits/gradest_digits/assets/`` (it may not exist)."""
    return Path(str(resources.files("gradest_digits").joinpath("assets", name)))


def load_checkpoint(name: str) -> dict[str, Any]:
    """The dict stored in ``apps/digits/gradest_digits/assets/<name>`` (CPU tensors).

    Raises:
        FileNotFoundError: the file is missing; the message names the command that
            regenerates it.
    """
    path = asset_path(name)
    if not path.is_file():
        command = REGENERATE.get(name, "see apps/digits/gradest_digits/assets/README.md")
        raise MissingFile(
            f"checkpoint {path} is missing; regenerate it from the repository root with: {command}"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def load_pretrained_dit(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DiT:
    """The shipped class-conditional rectified-flow DiT on 8x8 digits, in eval mode.

    Its parameters are trainable (``requires_grad=True``): it is the starting point of
    fine-tuning. Label ``10`` (or ``y=None``) samples unconditionally.
    """
    return dit_from_checkpoint(load_checkpoint(DIT_CHECKPOINT)).to(device=device, dtype=dtype)


def load_digit_classifier(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DigitClassifier:
    """The shipped digit classifier, in eval mode and frozen (``requires_grad=False``)."""
    classifier = classifier_from_checkpoint(load_checkpoint(CLASSIFIER_CHECKPOINT))
    return classifier.to(device=device, dtype=dtype).requires_grad_(False)
