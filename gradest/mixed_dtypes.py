"""A model whose weights and inputs are of different floating-point dtypes, said as such.

The usual case: a base model loaded in bfloat16 with float32 LoRA adapters (peft's default)
called outside autocast. torch then fails inside the first layer with ``mat1 and mat2 must
have the same dtype, but got Float and BFloat16`` (or ``expected m1 and m2 to have the
same dtype``, ``expected scalar type Float but found BFloat16``, ``Input type (float) and
bias type (c10::BFloat16) should be the same``, ...). :func:`first_call` is the first model
call of a rollout or an estimate (:func:`gradest._checks.first_model_call`, which reads any
error there as a shape or ``cond`` problem) with that case told apart: one line naming the
dtypes and the fix (autocast, accelerate's / the recipes' ``mixed_precision``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from gradest._checks import first_model_call
from gradest.errors import InvalidValue

__all__ = ["dtypes_named", "first_call", "mixed_dtype_message"]

# The words torch's messages name floating-point dtypes with (``Float``, ``c10::BFloat16``,
# ``torch.cuda.HalfTensor``, ``float32``), lower-cased -> the dtype.
_DTYPE_WORDS: Mapping[str, torch.dtype] = MappingProxyType(
    {
        **dict.fromkeys(("bfloat16", "bfloat16tensor"), torch.bfloat16),
        **dict.fromkeys(("half", "float16", "halftensor"), torch.float16),
        **dict.fromkeys(("float", "float32", "floattensor"), torch.float32),
        **dict.fromkeys(("double", "float64", "doubletensor"), torch.float64),
    }
)
_HALF = (torch.bfloat16, torch.float16)
# accelerate's (and the recipes') mixed_precision value of each half-precision dtype.
_MIXED_PRECISION: Mapping[torch.dtype, str] = MappingProxyType(
    {torch.bfloat16: "bf16", torch.float16: "fp16"}
)


def dtypes_named(err: BaseException) -> list[torch.dtype]:
    """The distinct floating-point dtypes ``err``'s message names, in order of mention.

    Two or more is torch's dtype-mismatch error (its messages differ by op and device but
    all name both dtypes); a shape or ``cond`` error names at most one.
    """
    found: list[torch.dtype] = []
    for word in re.findall(r"[A-Za-z0-9]+", str(err)):
        dtype = _DTYPE_WORDS.get(word.lower())
        if dtype is not None and dtype not in found:
            found.append(dtype)
    return found


def _parameter_dtypes(model: Any) -> str:
    """``; its frozen parameters are torch.bfloat16, its trainable ones torch.float32``
    (empty when ``model`` is not a module or all its parameters share one dtype)."""
    if not isinstance(model, torch.nn.Module):
        return ""
    trainable: list[torch.dtype] = []
    frozen: list[torch.dtype] = []
    for p in model.parameters():
        kind = trainable if p.requires_grad else frozen
        if p.is_floating_point() and p.dtype not in kind:
            kind.append(p.dtype)
    if len(set(trainable) | set(frozen)) < 2:
        return ""

    def named(dtypes: list[torch.dtype]) -> str:
        return "/".join(str(d) for d in dtypes)

    parts = [f"its frozen parameters are {named(frozen)}"] if frozen else []
    if trainable:
        parts.append(f"its trainable ones {named(trainable)}")
    return "; " + ", ".join(parts)


def mixed_dtype_message(
    model: Any, z: Tensor, err: BaseException, dtypes: list[torch.dtype]
) -> str:
    """One line: torch's mismatch, the model's dtypes and the fix."""
    torch_says = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    head = (
        f"model(z, t, **cond) mixes floating-point dtypes on a state of dtype {z.dtype}: "
        f"{torch_says}{_parameter_dtypes(model)}"
    )
    half = next((d for d in dtypes if d in _HALF), None)
    if half is None:  # float32 against float64: no autocast to run under
        return (
            f"{head}; give the model and the noise one dtype (model.to({z.dtype}) or "
            f"noise.to(...)), or cast inside the model's forward"
        )
    precision = _MIXED_PRECISION[half]
    return (
        f"{head}; run the model under autocast (with torch.autocast({z.device.type!r}, "
        f"dtype={half}): ...; with accelerate, Accelerator(mixed_precision={precision!r}) or "
        f"accelerate launch --mixed_precision {precision}; the recipes: --mixed_precision "
        f"{precision}), or give the model, its adapters and the noise one dtype"
    )


def first_call(
    model: Callable[..., Tensor],
    z: Tensor,
    t: Tensor,
    cond: Mapping[str, Any],
    *,
    owner: Any = None,
    cond_given: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
) -> Tensor:
    """:func:`gradest._checks.first_model_call`, with a dtype mismatch inside the model
    raised as its own one-line :class:`~gradest.errors.InvalidValue` (naming autocast and
    ``mixed_precision``), not as a shape problem. ``owner``: the module whose parameters
    the message lists when ``model`` is a function calling it (default: ``model``);
    ``cond_given`` and ``batch_size`` as in ``first_model_call``."""
    try:
        return first_model_call(model, z, t, cond, cond_given=cond_given, batch_size=batch_size)
    except InvalidValue as err:
        cause = err.__cause__
        if not isinstance(cause, RuntimeError):  # torch raises its dtype errors as these
            raise
        dtypes = dtypes_named(cause)
        if len(dtypes) < 2:
            raise
        module = model if owner is None else owner
        raise InvalidValue(mixed_dtype_message(module, z, cause, dtypes)) from cause
