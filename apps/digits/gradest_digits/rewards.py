"""Classifier rewards for fine-tuning: ``r(x) = log p(target | x)`` under a frozen classifier.

The reward is differentiable in the image ``x`` (the classifier uses smooth activations),
so it can drive a :class:`gradest.TerminalObjective` directly::

    reward = ClassifierReward(load_digit_classifier(), target=3)
    objective = gradest.TerminalObjective(reward.loss)   # loss = -mean reward

The classifier is frozen (``requires_grad_(False)``, eval mode): the gradient flows to
the sample, and through the sampler to the generator, never into the reward model.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor, nn

from gradest import InvalidType, InvalidValue


def _check_classifier(instance: object, attribute: attrs.Attribute, value: object) -> None:
    del instance, attribute
    if not isinstance(value, nn.Module):
        raise InvalidType(
            f"classifier must be an nn.Module returning logits [B, classes], got "
            f"{type(value).__name__}; e.g. gradest_digits.assets.load_digit_classifier()"
        )


def _num_classes(classifier: nn.Module) -> int:
    classes = getattr(classifier, "num_classes", None)
    if isinstance(classes, int):
        return classes
    raise InvalidType(
        f"classifier {type(classifier).__name__} has no integer num_classes attribute; "
        f"use a DigitClassifier or give the module a num_classes attribute"
    )


def _as_target(value: int | Tensor) -> int | Tensor:
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise InvalidType(
                f"target must be an int or an integer tensor of class labels, got dtype "
                f"{value.dtype}; e.g. torch.tensor([3, 7]) or target=3"
            )
        if value.ndim > 1:
            raise InvalidValue(
                f"target must be a class label or a [B] tensor of labels, got shape "
                f"{tuple(value.shape)}"
            )
        return value.detach().long()
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"target must be an int or an integer tensor, got {value!r}")
    return value


@attrs.frozen(eq=False)
class ClassifierReward:
    """``reward(x)[i] = log softmax(classifier(x))[i, target_i]``, a per-sample log-probability.

    Construction freezes the classifier in place (eval mode, ``requires_grad=False``).

    Attributes:
        classifier: a module mapping images ``[B, ...]`` to logits ``[B, num_classes]``
            with a ``num_classes`` attribute (a :class:`DigitClassifier`).
        target: one class for every sample (``int``) or a ``[B]`` tensor of classes,
            each in ``[0, num_classes)``.
    """

    classifier: nn.Module = attrs.field(validator=_check_classifier)
    target: int | Tensor = attrs.field(converter=_as_target)

    def __attrs_post_init__(self) -> None:
        classes = _num_classes(self.classifier)
        labels = (
            self.target.reshape(-1).tolist() if isinstance(self.target, Tensor) else [self.target]
        )
        if not labels:
            raise InvalidValue("target is an empty tensor; pass a class label or one per sample")
        bad = [label for label in labels if not 0 <= label < classes]
        if bad:
            raise InvalidValue(
                f"target class {bad[0]} is out of range for a classifier with {classes} "
                f"classes; targets must be in [0, {classes - 1}]"
            )
        self.classifier.eval().requires_grad_(False)

    def log_probs(self, x: Tensor) -> Tensor:
        """``log softmax(classifier(x))``, ``[B, num_classes]``, differentiable in ``x``."""
        return torch.log_softmax(self.classifier(x), dim=1)

    def reward(self, x: Tensor) -> Tensor:
        """Per-sample reward ``log p(target | x)``, shape ``[B]`` (at most 0)."""
        log_probs = self.log_probs(x)
        batch = log_probs.shape[0]
        if isinstance(self.target, Tensor):
            target = self.target.to(log_probs.device)
            if target.ndim == 1 and target.shape[0] != batch:
                raise InvalidValue(
                    f"target has {target.shape[0]} labels but x has batch size {batch}; "
                    f"pass one label per sample or a single int"
                )
            target = target.expand(batch)
        else:
            target = torch.full((batch,), self.target, dtype=torch.long, device=log_probs.device)
        return log_probs.gather(1, target[:, None])[:, 0]

    def loss(self, x: Tensor) -> Tensor:
        """``-mean(reward(x))``: the scalar loss for :class:`gradest.TerminalObjective`."""
        return -self.reward(x).mean()

    def __call__(self, x: Tensor) -> Tensor:
        return self.reward(x)
