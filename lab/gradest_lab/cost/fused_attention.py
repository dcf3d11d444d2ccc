"""Attention as a GPU runs it, on the meta device, for cost traces.

On the meta device ``F.scaled_dot_product_attention`` takes the math path: it forms the
``[B, H, S_q, S_k]`` attention matrix and saves it for backward. A GPU training step in
bf16 / fp16 / fp32 takes a fused kernel (flash or memory-efficient attention) that saves
only the output and the row log-sum-exp. At SD3's 4,429 tokens the difference is about a
gigabyte per layer and step, so a memory prediction must trace the fused kernel.
:func:`fused_attention` routes meta-device calls to ``aten._scaled_dot_product_efficient_attention``
(which has meta kernels for forward and backward); calls on real tensors are untouched.

FLOPs stay the model's: the fused backward recomputes the attention scores, and PyTorch's
formula counts that recomputation (one extra ``Q K^T``); :data:`MODEL_FLOP_FORMULAS`
counts the backward as the math path does, so a traced step has the FLOPs that
``FlopCounterMode`` gives a plain training loop on the meta device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MODEL_FLOP_FORMULAS", "fused_attention"]

_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def _efficient_backward_without_recompute(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """The fused backward's FLOPs minus its recomputation of the scores ``Q K^T``."""
    # Imported when a trace counts (gradest --help loads this module and must stay light).
    from torch.utils.flop_counter import bmm_flop, flop_registry

    fused = flop_registry[_EFFICIENT_BACKWARD](*args, out_val=out_val, **kwargs)
    query = args[1] if len(args) > 1 else kwargs["query"]
    key = args[2] if len(args) > 2 else kwargs["key"]
    b, h, s_q, d = query.shape
    s_k = key.shape[-2]
    return fused - bmm_flop((b * h, s_q, d), (b * h, d, s_k))


# Formulas that replace torch's own in a cost trace (see the module docstring).
MODEL_FLOP_FORMULAS = {_EFFICIENT_BACKWARD: _efficient_backward_without_recompute}


def _as_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    # A boolean mask keeps True positions; the fused kernel takes an additive bias.
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def _fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        # Grouped-query attention: the heads are shared, as the fused kernels do it.
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query,
        key,
        value,
        _as_bias(attn_mask, query.dtype),
        needs_grad,
        float(dropout_p),
        bool(is_causal),
        scale=scale,
    )[0]


_ACTIVE: list[Any] = []


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Meta-device ``scaled_dot_product_attention`` calls take the fused GPU kernel.

    Registered as the operator's meta-device autograd kernel while the context is open
    (a torch-function mode would not reach the recomputation that gradient checkpointing
    runs inside backward); real tensors are not affected. Re-entrant.
    """
    if _ACTIVE:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _fused_sdpa, "AutogradMeta")
    _ACTIVE.append(library)
    try:
        yield
    finally:
        _ACTIVE.pop()
        library._destroy()
