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

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gradest.errors import InvalidType, InvalidValue, MissingDependency

__all__ = [
    "DIT_ATTENTION_TARGETS",
    "adapters_disabled",
    "add_lora",
    "lora_parameters",
    "lora_state_dict",
]

#: The attention projections of :class:`gradest.models.dit.DiT` (``blocks.*.attn.qkv`` and
#: ``blocks.*.attn.proj``): the usual LoRA targets of a diffusion transformer.
DIT_ATTENTION_TARGETS: tuple[str, ...] = ("qkv", "proj")

_ADAPTER_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _matches(module_name: str, targets: Sequence[str]) -> bool:
    # peft's rule for a list of names: the full module name, or its last dotted parts.
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


#: ``add_lora``'s ``init`` names and peft's ``init_lora_weights`` for each.
_LORA_INITS: dict[str, Any] = {"default": True, "gaussian": "gaussian"}


def add_lora(
    model: nn.Module,
    rank: int,
    *,
    target_modules: Sequence[str] = DIT_ATTENTION_TARGETS,
    alpha: float | None = None,
    adapter_name: str = "default",
    init: str = "default",
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
        init: how ``A`` starts (``B`` starts at zero either way): ``"default"``, peft's
            Kaiming-uniform; ``"gaussian"``, peft's ``init_lora_weights="gaussian"``,
            ``N(0, 1/rank)`` (Flow-GRPO's SD3 configuration).

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
    if init not in _LORA_INITS:
        raise InvalidValue(
            f"LoRA init must be one of {', '.join(map(repr, _LORA_INITS))}, got init={init!r}"
        )
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
    # A rank at or past a layer's smaller side is not low-rank: B A could be the full
    # update at more cost, and a typo (rank 16000 for 16) would silently price or train
    # a model many times the size.
    sides = {
        name: min(weight.shape[0], weight[0].numel())
        for name, module in model.named_modules()
        if name in matched
        and isinstance(weight := getattr(module, "weight", None), torch.Tensor)
        and weight.dim() >= 2
    }
    if sides and rank >= min(sides.values()):
        layer = min(sides, key=sides.__getitem__)
        raise InvalidValue(
            f"LoRA rank={rank} is not below the smaller side of the adapted layer {layer!r} "
            f"({sides[layer]}); use rank <= {sides[layer] - 1} (typically 4 to 64)"
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
        init_lora_weights=_LORA_INITS[init],
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


def _inner_model(model: Any) -> Any:
    """The adapted model behind gradest / DDP / FSDP / accelerate wrappers."""
    for _ in range(8):
        inner = getattr(model, "transformer", None)  # DiffusersVelocity
        if type(model).__name__ == "DiffusersVelocity" and isinstance(inner, nn.Module):
            model = inner
            continue
        if type(model).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
            "FullyShardedDataParallel",
        ) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
            continue
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
            continue
        break
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model`` computes with its LoRA adapters switched off: the base
    model, as the frozen reference of :mod:`gradest.rl` objectives, without a copy::

        with adapters_disabled(model):
            reference = gradest.rl.reference_velocities(model, sampler, traj)

    Works for a peft ``PeftModel`` (its ``disable_adapter()`` context), a diffusers model
    with adapters loaded (``load_lora_adapter`` / ``add_adapter``; what its
    ``disable_adapters()`` / ``enable_adapters()`` do), a model adapted with
    :func:`add_lora` (``inject_adapter_in_model``), and any of these inside a
    :class:`~gradest.integrations.diffusers.DiffusersVelocity` or a DDP / FSDP /
    ``accelerator.prepare`` wrapper. On exit every adapter layer is restored to the state
    it had before (also on an error). Yields ``model``.

    Raises:
        ValueError: the model has no peft adapter layers.
    """
    inner = _inner_model(model)
    if callable(getattr(inner, "disable_adapter", None)) and hasattr(inner, "peft_config"):
        with inner.disable_adapter():  # peft.PeftModel
            yield model
        return
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError as err:
        raise MissingDependency(
            "adapters_disabled needs peft: pip install peft (or gradest's integrations extra)"
        ) from err
    # peft's tuner layers are nn.Modules (BaseTunerLayer is their mixin).
    layers: list[Any] = [m for m in inner.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise InvalidValue(
            f"{type(inner).__name__} has no LoRA adapters to disable; add them first "
            f"(gradest.integrations.peft.add_lora, peft, or diffusers' load_lora_adapter), or "
            f"use a frozen copy as the reference: copy.deepcopy(model).requires_grad_(False)"
        )
    # What diffusers' disable_adapters() / enable_adapters() do, restoring each layer's
    # previous state (enable_adapters() would also switch on adapters that were off).
    was_disabled = [bool(layer.disable_adapters) for layer in layers]
    trainable = {id(p): p.requires_grad for layer in layers for p in layer.parameters()}
    try:
        for layer in layers:
            layer.enable_adapters(False)
        yield model
    finally:
        for layer, disabled in zip(layers, was_disabled, strict=True):
            layer.enable_adapters(not disabled)
        # peft's enable_adapters(True) marks the active adapters trainable: keep the
        # caller's requires_grad flags as they were.
        for layer in layers:
            for p in layer.parameters():
                p.requires_grad_(trainable[id(p)])
