"""LoRA adapters through ``peft``, ready for gradest estimators.

gradest differentiates exactly the parameters with ``requires_grad=True``, so a model
with ``peft`` LoRA adapters injected needs nothing special: peft freezes the base
weights, and every estimator returns gradients for the adapter matrices only
(``result.grads`` is keyed like ``model.named_parameters()``, e.g.
``blocks.0.attn.qkv.lora_A.default.weight``). :func:`add_lora` injects adapters with
settings that are safe for gradest and fails early, with the fix, when they are not.

Requires ``peft`` (``pip install peft``); it is imported only when :func:`add_lora` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradest.errors import InvalidType, InvalidValue, MissingDependency

__all__ = ["DIT_ATTENTION_TARGETS", "add_lora", "lora_parameters", "lora_state_dict"]

#: The attention projections of :class:`gradest.models.dit.DiT` (``blocks.*.attn.qkv`` and
#: ``blocks.*.attn.proj``): the usual LoRA targets of a diffusion transformer.
DIT_ATTENTION_TARGETS: tuple[str, ...] = ("qkv", "proj")

_ADAPTER_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _matches(module_name: str, targets: Sequence[str]) -> bool:
    # peft's rule for a list of names: the full module name, or its last dotted parts.
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


def add_lora(
    model: nn.Module,
    rank: int,
    *,
    target_modules: Sequence[str] = DIT_ATTENTION_TARGETS,
    alpha: float | None = None,
    adapter_name: str = "default",
) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else.

    Each targeted layer ``W`` becomes ``W + (alpha / rank) B A`` with trainable ``A``
    (``rank x in``, random) and ``B`` (``out x rank``, zeros, so the model is unchanged
    at first). After this, ``gradest`` estimators differentiate ``A`` and ``B`` only.

    Load pretrained weights *before* calling this: peft renames each targeted layer's
    weight to ``<name>.base_layer.weight``. Save adapters with :func:`lora_state_dict`.

    LoRA dropout is always 0: gradest evaluates the model several times per step (the
    rollout, then the VJPs), and a random dropout mask would make those evaluations
    different functions, so the gradient would belong to none of them.

    Args:
        model: any ``nn.Module``; by default targets gradest's DiT attention layers.
        rank: the LoRA rank ``r >= 1``.
        target_modules: module names to adapt, matched like peft matches a list: a full
            module name or its trailing dotted parts (``"qkv"`` matches
            ``blocks.0.attn.qkv``). Names, not regular expressions. For diffusers
            transformers e.g. ``("to_q", "to_k", "to_v", "to_out.0")``.
        alpha: the LoRA scale numerator (default ``rank``: scale 1).
        adapter_name: peft's adapter name (parameter names contain it).

    Returns:
        ``model`` itself, with adapters injected.

    Raises:
        ValueError: ``rank < 1``, or no module matches ``target_modules`` (the message
            lists the adaptable layers).
        ImportError: peft is not installed.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidValue(f"LoRA rank must be an int >= 1, got rank={rank!r}; e.g. rank=4")
    if isinstance(target_modules, str):
        target_modules = (target_modules,)
    targets = tuple(target_modules)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise InvalidValue(
            f"target_modules must be a non-empty list of module names, got {target_modules!r}"
        )
    if alpha is not None and not (isinstance(alpha, int | float) and alpha > 0):
        raise InvalidValue(f"LoRA alpha must be a number > 0 (or None for rank), got {alpha!r}")
    if not isinstance(model, nn.Module):
        raise InvalidType(f"model must be a torch.nn.Module, got {type(model).__name__}")
    matched = [name for name, _ in model.named_modules() if name and _matches(name, targets)]
    if not matched:
        layers = [n for n, m in model.named_modules() if isinstance(m, _ADAPTER_LAYERS)]
        shown = ", ".join(layers[:12])
        if len(layers) > 12:
            shown += f", ... ({len(layers)} in all)"
        raise InvalidValue(
            f"no module of {type(model).__name__} matches target_modules={list(targets)}; "
            f"pass names of its layers (a full name or its last dotted parts), e.g. from: "
            f"{shown or 'none (the model has no linear, convolution or embedding layers)'}"
        )
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise MissingDependency(
            "add_lora needs peft: pip install peft (or gradest's integrations extra)"
        ) from err
    scale_numerator: Any = rank if alpha is None else alpha  # peft annotates int, takes float
    config = LoraConfig(
        r=rank,
        lora_alpha=scale_numerator,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=adapter_name)
    return model


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA adapter parameters of ``model`` by name (what an optimizer should update)."""
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the adapter tensors only: a small fine-tuning checkpoint.

    Load it back with ``model.load_state_dict(state, strict=False)`` after
    :func:`add_lora` with the same rank and targets on the same base model.
    """
    return {name: p.detach().clone() for name, p in lora_parameters(model).items()}
