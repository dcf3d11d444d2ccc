"""Input validation shared by every public entry point.

Errors name the argument, the value and the fix, and are raised before any work starts,
so users never see a torch traceback from deep inside a sampling loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gradest.errors import InvalidType, InvalidValue


def require(condition: bool, message: str, error: type[Exception] = InvalidValue) -> None:
    if not condition:
        raise error(message)


def check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidType(
            f"model must be a torch.nn.Module called as model(z, t, **cond), "
            f"got {type(model).__name__}; wrap plain functions in an nn.Module"
        )


def trainable_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    check_model(model)
    params: dict[str, Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise InvalidValue(
            f"model {type(model).__name__} has no parameters with requires_grad=True; "
            f"unfreeze the ones to fine-tune (p.requires_grad_(True)) or add an adapter"
        )
    return params


def check_noise(model: torch.nn.Module, noise: Any, name: str = "noise") -> None:
    check_model(model)
    if not isinstance(noise, Tensor):
        raise InvalidType(
            f"{name} must be a torch.Tensor of shape [B, ...], got {type(noise).__name__}"
        )
    require(
        noise.is_floating_point(),
        f"{name} must be a floating-point tensor, got dtype {noise.dtype}",
        InvalidType,
    )
    require(
        noise.ndim >= 2,
        f"{name} must have a batch dimension and a state dimension ([B, ...]), "
        f"got shape {tuple(noise.shape)}; for a single sample use noise[None]",
    )
    require(
        noise.shape[0] >= 1 and noise.numel() > 0,
        f"{name} is empty (shape {tuple(noise.shape)}): there is nothing to sample; pass at "
        f"least one sample with a non-empty state",
    )
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if floating:
        # A model may keep some parameters in another precision (float32 norms beside
        # bfloat16 weights) and cast inside; the noise must match one of them.
        dtypes = sorted({str(p.dtype) for p in floating})
        first = floating[0]
        require(
            any(noise.dtype == p.dtype for p in floating),
            f"{name} has dtype {noise.dtype} but the model's parameters are "
            f"{' / '.join(dtypes)}; pass {name}.to({first.dtype}) or convert the model",
            InvalidType,
        )
        require(
            noise.device == first.device,
            f"{name} is on {noise.device} but the model is on {first.device}; "
            f"pass {name}.to('{first.device}')",
        )
    if not bool(torch.isfinite(noise).all()):
        bad = sorted({int(i) for i in torch.nonzero(~torch.isfinite(noise))[:, 0].tolist()})
        raise InvalidValue(
            f"{name} contains NaN or Inf values (samples {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}); draw it with torch.randn and check what made it"
        )


def check_cond(cond: Any) -> dict[str, Any]:
    if cond is None:
        return {}
    if not isinstance(cond, Mapping):
        raise InvalidType(
            f"cond must be a dict of keyword arguments for model(z, t, **cond), "
            f"got {type(cond).__name__}; e.g. cond={{'y': labels}}"
        )
    return dict(cond)


def check_model_output(v: Any, z: Tensor) -> None:
    if not isinstance(v, Tensor):
        raise InvalidType(
            f"model(z, t) must return a velocity tensor, got {type(v).__name__}; "
            f"wrap models that return tuples or dataclasses so they return the velocity"
        )
    require(
        v.is_floating_point(),
        f"model(z, t) returned a tensor of dtype {v.dtype}; a velocity must be floating point "
        f"(no .long()/.round() at the output): integers have no gradient",
        InvalidType,
    )
    require(
        v.shape == z.shape,
        f"model(z, t) returned shape {tuple(v.shape)} for a state of shape {tuple(z.shape)}; "
        f"a velocity model must return a tensor shaped like its input",
    )


def first_model_call(
    model: Callable[..., Tensor], z: Tensor, t: Tensor, cond: Mapping[str, Any]
) -> Tensor:
    """Call the model once with a readable error if the state does not fit it."""
    try:
        v = model(z, t, **cond)
    except (RuntimeError, IndexError, TypeError) as err:
        if "saved tensor hooks" in str(err).lower():
            raise  # not a shape problem: the engine explains it (gradest.vjp)
        raise InvalidValue(
            f"model(z, t, **cond) failed on a state of shape {tuple(z.shape)} "
            f"(dtype {z.dtype}) with cond keys {sorted(cond)}: {err}. "
            f"Check that the noise has the shape the model expects ([B, ...]) "
            f"and that cond holds the model's keyword arguments"
        ) from err
    check_model_output(v, z)
    return v


def check_scalar_loss(loss: Any, where: str) -> Tensor:
    if not isinstance(loss, Tensor):
        raise InvalidType(
            f"the loss {where} must return a scalar tensor, got {type(loss).__name__}"
        )
    require(
        loss.numel() == 1,
        f"the loss {where} must be a scalar, got shape {tuple(loss.shape)}; "
        f"reduce it with .mean() or .sum()",
    )
    if not bool(torch.isfinite(loss).all()):
        from gradest.nonfinite import NonFiniteError

        raise NonFiniteError(f"loss {where} ({loss.item()})")
    return loss.reshape(())


def check_generator(generator: Any, like: Tensor | None = None) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InvalidType(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}; "
            f"e.g. generator=torch.Generator().manual_seed(0)"
        )
    if generator is not None:
        # torch draws on the generator's device: the CPU, or the device the noise lives on.
        like = like if isinstance(like, Tensor) else None
        allowed = {"cpu"} | ({like.device.type} if like is not None else set())
        require(
            generator.device.type in allowed,
            f"generator is on {generator.device} but draws must happen on the CPU or on the "
            f"noise's device ({like.device if like is not None else 'cpu'}); e.g. "
            f"generator=torch.Generator().manual_seed(0)",
        )
    return generator


def check_model_modes(model: torch.nn.Module) -> None:
    """Refuse layers whose output mixes the samples of a batch (batch norm in training)."""
    check_model(model)
    mixing = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training
    ]
    require(
        not mixing,
        f"model has batch-norm layers in training mode ({', '.join(mixing[:4])}"
        f"{', ...' if len(mixing) > 4 else ''}): their output depends on the other samples "
        f"of the call, and estimators stack several steps' states into one call (and "
        f"evaluate a step several times, each updating the running statistics); call .eval() "
        f"on them, or use GroupNorm / LayerNorm",
    )
