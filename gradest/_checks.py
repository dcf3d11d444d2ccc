"""Input validation shared by every public entry point.

Errors name the argument, the value and the fix, and are raised before any work starts,
so users never see a torch traceback from deep inside a sampling loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from gradest.conditioning import suspect_leaves
from gradest.errors import GradestError, InvalidType, InvalidValue
from gradest.nonfinite import NonFiniteError, _all_finite, defer_finite

# Re-exported: the engine's modules take these two from the boundary checks.
from gradest.symbolic import is_symbolic, outside_fake_mode  # noqa: F401


def all_finite(value: Tensor) -> bool:
    """Whether every element of ``value`` is finite (one host sync), by one wide sum per
    tensor (``gradest.nonfinite``): ``isfinite(value).all()`` materialises a boolean per
    element and took half a millisecond per call on a 17-step recorded path."""
    return _all_finite([value])


def require(condition: bool, message: str, error: type[Exception] = InvalidValue) -> None:
    if not condition:
        raise error(message)


def finite_number(name: str, value: Any, minimum: float, maximum: float = math.inf) -> float:
    """``value`` as a float if it is a real number (not a bool) in ``[minimum, maximum]``,
    else one line naming the argument, its bounds and the value given."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not minimum <= value <= maximum:
        bound = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"
        raise InvalidValue(f"{name} must be a finite number {bound}, got {name}={value!r}")
    return float(value)


def check_model(model: Any) -> None:
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        raise InvalidType(
            f"model must be a torch.nn.Module instance called as model(z, t, **cond), got the "
            f"class {model.__name__}; construct it first, e.g. model = {model.__name__}(...)"
        )
    if not isinstance(model, torch.nn.Module):
        raise InvalidType(
            f"model must be a torch.nn.Module called as model(z, t, **cond), "
            f"got {type(model).__name__}; wrap plain functions in an nn.Module"
        )
    inner = _unwrapped(model)
    if type(inner).__module__.split(".")[0] == "diffusers" and hasattr(inner, "config"):
        raise InvalidType(
            f"model is the bare diffusers {type(inner).__name__}, which gradest cannot call as "
            f"model(z, t, **cond); pass gradest.integrations.DiffusersVelocity(transformer) "
            f"(DiffusersVelocity.for_sampler(unet, sampler) with gradest.DDIM)"
        )


# Wrappers that call the module they hold with the caller's arguments unchanged.
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers (what
    ``accelerator.prepare`` returns); any other module as it is."""
    for _ in range(8):
        if type(model).__name__ in _WRAPPERS:
            inner = getattr(model, "module", None)
        else:
            inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


NamedModules = list[tuple[str, torch.nn.Module]]


def _parameters_in(named_modules: NamedModules) -> Iterator[tuple[str, Tensor]]:
    """The parameters of a model's walk (``list(model.named_modules())``) as
    ``named_parameters`` yields them: each tensor once, under its first name."""
    seen: set[int] = set()
    for prefix, module in named_modules:
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield (f"{prefix}.{name}" if prefix else name), p


def _named_parameters(
    model: torch.nn.Module, named_modules: NamedModules | None
) -> Iterator[tuple[str, Tensor]]:
    """``model.named_parameters()``, read from the caller's walk when there is one and the
    model does not override ``named_parameters`` (FSDP does: its answer is the model's)."""
    if (
        named_modules is not None
        and type(model).named_parameters is torch.nn.Module.named_parameters
    ):
        return _parameters_in(named_modules)
    return model.named_parameters()


def trainable_parameters(
    model: torch.nn.Module, named_modules: NamedModules | None = None
) -> dict[str, Tensor]:
    """``model``'s parameters with ``requires_grad=True``, keyed and ordered as
    ``model.named_parameters()`` gives them.

    ``named_modules``: ``list(model.named_modules())`` when the caller already walked the
    model (one walk per estimate serves every check); the parameters are then read from
    it as ``named_parameters`` reads them (each tensor once, under its first name), unless
    the model overrides ``named_parameters``.
    """
    check_model(model)
    params: dict[str, Tensor] = {
        n: p for n, p in _named_parameters(model, named_modules) if p.requires_grad
    }
    if not params:
        raise InvalidValue(
            f"model {type(model).__name__} has no parameters with requires_grad=True; "
            f"unfreeze the ones to fine-tune (p.requires_grad_(True)) or add an adapter"
        )
    return params


def check_noise(
    model: torch.nn.Module,
    noise: Any,
    name: str = "noise",
    named_modules: NamedModules | None = None,
) -> None:
    """Refuse ``noise`` that is not a finite floating-point ``[B, ...]`` tensor in one of
    the model's parameter dtypes on its device (``named_modules``: the model's walk, if
    the caller has one)."""
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
    parameters = (p for _, p in _named_parameters(model, named_modules))
    floating = (p for p in parameters if p.is_floating_point())
    first = next(floating, None)
    if first is not None:
        # A model may keep some parameters in another precision (float32 norms beside
        # bfloat16 weights) and cast inside; the noise must match one of them (read
        # further than the first parameter only when it does not match it).
        if noise.dtype != first.dtype and not any(noise.dtype == p.dtype for p in floating):
            dtypes = sorted(
                {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
            )  # the message only
            raise InvalidType(
                f"{name} has dtype {noise.dtype} but the model's parameters are "
                f"{' / '.join(dtypes)}; pass {name}.to({first.dtype}) or convert the model"
            )
        require(
            noise.device == first.device,
            f"{name} is on {noise.device} but the model is on {first.device}; "
            f"pass {name}.to('{first.device}')",
        )
    if not is_symbolic(noise) and not all_finite(noise):
        bad = sorted({int(i) for i in torch.nonzero(~torch.isfinite(noise))[:, 0].tolist()})
        raise InvalidValue(
            f"{name} contains NaN or Inf values (samples {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}); draw it with torch.randn and check what made it"
        )


def check_model_output(v: Any, z: Tensor, *, step: int | None = None) -> None:
    """The model's output is a real floating-point tensor shaped like the state.

    Host metadata only (type, dtype, shape): no device sync, cheap enough for every step.
    ``step`` names the sampling step in the message (every step after the first is
    checked by :func:`gradest.trajectory.integrate`).
    """
    at = "" if step is None else f" at step {step}"
    if not isinstance(v, Tensor):
        raise InvalidType(
            f"model(z, t) must return a velocity tensor{at}, got {type(v).__name__}; "
            f"wrap models that return tuples or dataclasses so they return the velocity"
        )
    if v.is_complex():
        raise InvalidType(
            f"model(z, t) returned a complex tensor (dtype {v.dtype}){at}; a velocity must "
            f"be real floating point like the state ({z.dtype}): return v.real or stack the "
            f"real and imaginary parts as channels"
        )
    require(
        v.is_floating_point(),
        f"model(z, t) returned a tensor of dtype {v.dtype}{at}; a velocity must be floating "
        f"point (no .long()/.round() at the output): integers have no gradient",
        InvalidType,
    )
    if v.shape != z.shape:
        changed = (
            ""
            if step is None or step == 0
            else " (its shape changed during sampling: every step must return the state's shape)"
        )
        raise InvalidValue(
            f"model(z, t) returned shape {tuple(v.shape)}{at} for a state of shape "
            f"{tuple(z.shape)}{changed}; a velocity model must return a tensor shaped like "
            f"its input"
        )


def first_model_call(
    model: Callable[..., Tensor],
    z: Tensor,
    t: Tensor,
    cond: Mapping[str, Any],
    *,
    cond_given: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
) -> Tensor:
    """Call the model once with a readable error if the state does not fit it.

    ``cond`` is the call's keyword arguments; ``cond_given`` the caller's ``cond`` they
    were made from (default: ``cond``), for a batch of ``batch_size`` (default: ``z``'s
    rows). A failure names the tensors of ``cond_given`` that may have caused it (rows
    that are not the batch's, another device than the state's)."""
    try:
        v = model(z, t, **cond)
    except (RuntimeError, IndexError, TypeError, ValueError) as err:
        if isinstance(err, GradestError) or "saved tensor hooks" in str(err).lower():
            raise  # already one line, or not a shape problem (gradest.vjp explains it)
        rows = z.shape[0] if batch_size is None else batch_size
        suspects = suspect_leaves(cond if cond_given is None else cond_given, rows, z.device)
        hint = (
            "; ".join(suspects)
            if suspects
            else "Check that the noise has the shape the model expects ([B, ...]) and that "
            "cond holds the model's keyword arguments"
        )
        shown = " ".join(str(err).split()) or type(err).__name__
        raise InvalidValue(
            f"model(z, t, **cond) failed on a state of shape {tuple(z.shape)} "
            f"(dtype {z.dtype}) with cond keys {sorted(cond)}: {shown}. {hint}"
        ) from err
    check_model_output(v, z)
    return v


def check_scalar_loss(loss: Any, where: str) -> Tensor:
    if not isinstance(loss, Tensor):
        raise InvalidType(
            f"the loss {where} must return a scalar tensor, got {type(loss).__name__}"
        )
    if loss.is_complex():
        raise InvalidType(
            f"the loss {where} must be a real scalar, got a complex tensor (dtype "
            f"{loss.dtype}); gradients are defined for real losses: return e.g. "
            f"loss.abs() or loss.real"
        )
    require(
        loss.numel() == 1,
        f"the loss {where} must be a scalar, got shape {tuple(loss.shape)}; "
        f"reduce it with .mean() or .sum()",
    )
    # A copy: holding the loss's own storage until the end of the call would keep what
    # its graph saved alive (memory measured as retained activations).
    value = loss.detach().clone()
    # Decided at the end of an estimator call (one host sync for all checks), or now.
    defer_finite(value, lambda _: NonFiniteError(f"loss {where} ({value.item()})"))
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


def _uses_batch_statistics(module: torch.nn.Module) -> bool:
    """Whether a batch-norm layer normalizes with the statistics of the call's batch.

    ``torch.nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, the lazy
    variants, and any subclass) uses the batch's statistics in training mode, and in
    eval mode too when it keeps no running statistics (``track_running_stats=False``).
    """
    if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return False
    return bool(module.training) or getattr(module, "running_mean", None) is None


def check_model_modes(model: torch.nn.Module, named_modules: NamedModules | None = None) -> None:
    """Refuse layers whose output mixes the samples of a batch (batch-statistics norms).

    Estimators stack several steps' states into one model call (and evaluate a step
    several times), so a layer normalizing with the call's batch statistics would see
    other steps' samples: the gradient would be of another function than the sampled one.
    """
    check_model(model)
    if named_modules is None:
        if not any(_uses_batch_statistics(module) for module in model.modules()):
            return  # the common case, without building every module's name
        named_modules = list(model.named_modules())
    mixing = [
        (name or type(module).__name__, module)
        for name, module in named_modules
        if _uses_batch_statistics(module)
    ]
    if not mixing:
        return
    name, module = mixing[0]
    others = f" and {len(mixing) - 1} more" if len(mixing) > 1 else ""
    why = (
        "in training mode"
        if module.training
        else "with track_running_stats=False, which uses batch statistics in eval mode too"
    )
    raise InvalidValue(
        f"model has batch-norm layers that normalize with the statistics of the call's batch "
        f"({name}: {type(module).__name__} {why}{others}): their output depends on the other "
        f"samples of the call, and estimators stack several steps' states into one call (and "
        f"evaluate a step several times); call .eval() on layers that keep running statistics "
        f"(track_running_stats=True), or use GroupNorm / LayerNorm"
    )


# -- bounds on what a call allocates -----------------------------------------------------------


def memory_limit(device: torch.device | str | None = None) -> int:
    """Bytes one allocation may at most take on ``device``: the device's total memory
    (CUDA), or the machine's physical memory (CPU and anything else)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def _bytes(count: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} bytes"


def check_allocation(
    what: str,
    value: int,
    bytes_per_unit: int,
    *,
    name: str,
    device: torch.device | str | None = None,
    detail: str = "",
) -> None:
    """Refuse an option whose allocation cannot fit, before torch's allocator fails.

    ``value`` units of ``bytes_per_unit`` bytes each (e.g. copies x batch x state numel x
    element size) must fit into :func:`memory_limit` of ``device``; the message names the
    option (``what``, e.g. ``"estimator 'draft_lv': option copies=10**12"``), what it would
    allocate, and the largest ``name`` that fits.
    """
    limit = memory_limit(device)
    needed = int(value) * max(int(bytes_per_unit), 1)
    if needed <= limit:
        return
    largest = max(limit // max(int(bytes_per_unit), 1), 0)
    where = torch.device(device).type if device is not None else "cpu"
    raise InvalidValue(
        f"{what} would allocate {_bytes(needed)}{f' ({detail})' if detail else ''}, more than "
        f"the {where} memory ({_bytes(limit)}); use {name} <= {largest}"
    )


# -- output paths -------------------------------------------------------------------------------


# -- what an estimator (a plugin) returns ------------------------------------------------------


def estimator_label(est: Any) -> str:
    """``estimator 'name' (module.Class)``: how messages name an estimator, plugin or not."""
    if est is None:
        return "the estimate"
    cls = est if isinstance(est, type) else type(est)
    name = getattr(cls, "name", None)
    shown = name if isinstance(name, str) else cls.__name__
    return f"estimator {shown!r} ({cls.__module__}.{cls.__qualname__})"


def check_surrogate(est: Any, result: Any) -> Any:
    """What ``est.surrogate(...)`` returned: a record whose ``loss`` is a real scalar tensor.

    Checked wherever gradest backpropagates a surrogate it did not build (a plugin's:
    ``gradest cost``, ``gradest check``, ``auto``, the applications' training loops), so
    that a plugin returning a bare tensor or a vector loss is one line naming it, not
    torch's ``grad can be implicitly created only for scalar outputs`` (or an
    ``AttributeError``) from inside the backward. Host metadata only (no device sync).

    Returns:
        ``result``, unchanged.
    """
    label = estimator_label(est)
    expected = (
        "expected a gradest.Surrogate whose loss is a scalar tensor (its autograd gradient "
        "is the estimate)"
    )
    if not hasattr(result, "loss"):
        if isinstance(result, Tensor):
            raise InvalidType(
                f"{label} returned a bare tensor of shape {tuple(result.shape)} from "
                f"surrogate(); {expected}: return gradest.Surrogate(loss=..., value=..., "
                f"cost=...)"
            )
        raise InvalidType(f"{label} returned {type(result).__name__} from surrogate(); {expected}")
    loss = result.loss
    if not isinstance(loss, Tensor):
        raise InvalidType(
            f"{label} returned a surrogate whose loss is a {type(loss).__name__}; {expected}"
        )
    if loss.numel() != 1:
        raise InvalidValue(
            f"{label} returned a surrogate loss of shape {tuple(loss.shape)}; a surrogate "
            f"loss must be a scalar (one backward gives the estimate): reduce it with "
            f".sum() in the plugin"
        )
    if not loss.is_floating_point():
        raise InvalidType(
            f"{label} returned a surrogate loss of dtype {loss.dtype}; it must be a real "
            f"floating-point scalar (integers and complex numbers have no such gradient)"
        )
    return result


def check_estimate_grads(
    est: Any, result: Any, params: Mapping[str, Tensor], *, finite: bool = True
) -> dict[str, Tensor]:
    """The gradients of an estimate, checked against the trainable parameters.

    Every trainable parameter has one tensor of its shape, dtype and device, no other
    name appears, and (``finite``) every value is finite; anything else is one line naming
    the estimator, so a plugin that returns gradients for some tensors only cannot train
    the others with zeros. A result marked unusable (``on_nonfinite="skip"``) passes with
    its empty ``grads``.

    Returns:
        The gradients, in ``params``' order.
    """
    label = estimator_label(est)
    grads = getattr(result, "grads", None)
    if grads is None and not hasattr(result, "grads"):
        raise InvalidType(
            f"{label} returned {type(result).__name__} from estimate(); expected a "
            f"gradest.GradientEstimate whose grads hold one tensor per trainable parameter"
        )
    if not isinstance(grads, Mapping):
        raise InvalidType(
            f"{label} returned grads of type {type(grads).__name__}; expected a dict "
            f"{{parameter name: tensor}} over the model's trainable parameters"
        )
    if not grads and getattr(result, "usable", True) is False:
        return {}
    missing = [name for name in params if name not in grads]
    extra = [str(name) for name in grads if name not in params]
    if missing:
        raise InvalidValue(
            f"{label} returned no gradient for {len(missing)} of the model's "
            f"{len(params)} trainable parameters ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}); return one tensor for every parameter "
            f"with requires_grad=True (zeros where the gradient is zero)"
        )
    if extra:
        raise InvalidValue(
            f"{label} returned gradients for {', '.join(extra[:4])}"
            f"{', ...' if len(extra) > 4 else ''}, which are not trainable parameters of the "
            f"model; key grads by model.named_parameters() names with requires_grad=True"
        )
    checked: dict[str, Tensor] = {}
    for name, param in params.items():
        grad = grads[name]
        if not isinstance(grad, Tensor):
            raise InvalidType(
                f"{label} returned a {type(grad).__name__} as the gradient of {name}; "
                f"expected a tensor shaped like the parameter {tuple(param.shape)}"
            )
        if grad.shape != param.shape:
            raise InvalidValue(
                f"{label} returned a gradient of shape {tuple(grad.shape)} for {name}, whose "
                f"shape is {tuple(param.shape)}"
            )
        if grad.dtype != param.dtype or grad.device != param.device:
            raise InvalidType(
                f"{label} returned a gradient for {name} of dtype {grad.dtype} on "
                f"{grad.device}, but the parameter is {param.dtype} on {param.device}"
            )
        checked[name] = grad
    if finite and checked and not any(is_symbolic(g) for g in checked.values()):
        bad = [
            name
            for name, ok in zip(
                checked,
                torch.stack([torch.isfinite(g).all() for g in checked.values()]).tolist(),
                strict=True,
            )
            if not ok
        ]
        if bad:
            raise InvalidValue(
                f"{label} returned non-finite (NaN/Inf) gradients for {', '.join(bad[:4])}"
                f"{', ...' if len(bad) > 4 else ''}; a gradient with NaN/Inf cannot be "
                f"compared or trained with"
            )
    return checked
