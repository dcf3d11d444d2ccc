"""What the lab's commands share on the command line: the estimator list and the device."""

from __future__ import annotations

from gradest import InvalidValue, estimator
from gradest.plugin import SPEC_LIST_HELP, split_spec_list

__all__ = ["SPEC_LIST_HELP", "check_device", "estimator_specs"]


def estimator_specs(text: str, *, example: str) -> list[str]:
    """The specs of ``--estimators``, each built once so that a bad one fails before any
    work starts; an empty list is refused with ``example`` as the fix."""
    specs = split_spec_list(text, what="--estimators")
    if not specs:
        raise InvalidValue(f"--estimators is empty; e.g. --estimators {example}")
    for spec in specs:
        estimator(spec)
    return specs


def check_device(text: str) -> None:
    """``--device``: cpu or cuda, and cuda only where torch sees a CUDA device (before any
    model is built: one line instead of torch's error from deep inside)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise InvalidValue(f"--device {text!r} is not a torch device; use cpu or cuda") from err
    if device.type not in ("cpu", "cuda"):
        raise InvalidValue(f"--device {text!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidValue(f"--device {text} requested but CUDA is not available; use --device cpu")
