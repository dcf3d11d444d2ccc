"""Flow-GRPO's per-prompt advantages, with the statistics gathered across processes.

Flow-GRPO's training script (``yifan123/flow_grpo``, ``scripts/train_sd3.py`` with
``flow_grpo/stat_tracking.py``'s ``PerPromptStatTracker``) spreads the ``k`` images of a
prompt over the processes, gathers every process's rewards and prompts of the epoch, and
normalises each reward by the statistics of its prompt over *all* processes::

    A_i = (r_i - mean_{j: p_j = p_i} r_j) / (std + 1e-4)

where ``std`` is the population standard deviation of every gathered reward
(``global_std=True``, the official configs') or of the prompt's own rewards
(``global_std=False``). Each process then keeps the advantages of its own samples.
:func:`prompt_advantages` does this with ``torch.distributed.all_gather`` when a process
group is initialized (any backend: gloo on CPUs, NCCL with the tensors on the GPU), and
on the local samples otherwise; the result equals the single-process computation on the
union of the samples. Prompts are identified by integers (an index into the prompt list;
Flow-GRPO decodes its gathered token ids back to strings to the same end).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.rl.flow_grpo import ADVANTAGE_EPS

__all__ = ["gather_samples", "prompt_advantages", "zero_std_ratio"]


def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def gather_samples(values: Tensor, group: Any = None) -> Tensor:
    """Every process's ``values [B, ...]`` concatenated in rank order (``[world * B, ...]``);
    ``values`` itself without an initialized process group. Every process must call it
    with the same ``B`` (checked: one line naming the sizes)."""
    rank, world = _world(group)
    if world == 1:
        return values
    size = torch.tensor([values.shape[0]], dtype=torch.int64, device=values.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s) for s in sizes]
    if len(set(counts)) != 1:
        raise InvalidValue(
            f"the processes hold different numbers of samples ({counts} by rank; this is "
            f"rank {rank}); every process must sample the same batch size"
        )
    parts = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(parts, values.contiguous(), group=group)
    return torch.cat(parts)


def _check_samples(rewards: Any, prompts: Any) -> None:
    """``rewards`` a 1-D float tensor ``[B]``, ``prompts`` integer ids of the same shape."""
    if not isinstance(rewards, Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise InvalidValue(f"rewards must be a 1-D floating-point tensor [B], got {shape}")
    if (
        not isinstance(prompts, Tensor)
        or prompts.shape != rewards.shape
        or prompts.is_floating_point()
        or prompts.is_complex()
        or prompts.dtype == torch.bool
    ):
        shape = tuple(prompts.shape) if isinstance(prompts, Tensor) else type(prompts).__name__
        raise InvalidValue(
            f"prompts must be an integer tensor [B] = [{rewards.shape[0]}] of prompt ids, "
            f"got {shape}; pass the index of each sample's prompt"
        )


def prompt_advantages(
    rewards: Tensor,
    prompts: Tensor,
    *,
    global_std: bool = True,
    group: Any = None,
) -> Tensor:
    """``[B]`` advantages of this process's samples from per-prompt statistics of every
    process's samples (see the module docstring).

    Args:
        rewards: ``[B]`` rewards of this process's samples (any floating dtype; the
            statistics are computed in float64, as Flow-GRPO's numpy tracker does).
        prompts: ``[B]`` integer prompt ids of the same samples: equal ids are one prompt,
            across processes too.
        global_std: normalise by the standard deviation of all gathered rewards (True,
            Flow-GRPO's ``sample.global_std`` in its configs) or of each prompt's own
            rewards (False). Both are population standard deviations, plus ``1e-4``.
        group: the ``torch.distributed`` process group (default: the default group, if
            initialized; a single process otherwise).

    Returns:
        ``[B]`` advantages in ``rewards``' dtype, in the order of ``rewards``.
    """
    _check_samples(rewards, prompts)
    if not isinstance(global_std, bool):
        raise InvalidValue(f"global_std must be True or False, got {global_std!r}")
    if not bool(torch.isfinite(rewards).all()):
        raise InvalidValue("rewards contain NaN or Inf; check the reward function")
    rank, _ = _world(group)
    batch = rewards.shape[0]
    values = gather_samples(rewards.detach().to(torch.float64), group)
    ids = gather_samples(prompts.detach().to(device=rewards.device, dtype=torch.int64), group)
    unique, inverse = torch.unique(ids, return_inverse=True)
    counts = torch.zeros(unique.numel(), dtype=torch.float64, device=values.device)
    counts.index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, inverse, values)
    means = sums / counts
    centred = values - means[inverse]
    if global_std:
        std = values.std(correction=0)
    else:
        squares = torch.zeros_like(counts).index_add_(0, inverse, centred * centred)
        std = torch.sqrt(squares / counts)[inverse]
    advantages = centred / (std + ADVANTAGE_EPS)
    return advantages[rank * batch : (rank + 1) * batch].to(rewards.dtype)


def zero_std_ratio(rewards: Tensor, prompts: Tensor, *, group: Any = None) -> float:
    """The fraction of the distinct prompts whose rewards, over every process, are all equal.

    Flow-GRPO's ``calculate_zero_std_ratio`` (``scripts/train_sd3.py``), logged once per
    epoch as ``zero_std_ratio``: a prompt whose gathered rewards have zero standard
    deviation gives every one of its samples a zero advantage, so it adds nothing to the
    surrogate's gradient. The rewards and prompt ids are gathered as in
    :func:`prompt_advantages` (every process gets the same value). "Zero standard
    deviation" is tested as "every reward of the prompt is the same number": numpy's
    ``std`` of equal values can be a rounding residue (``np.std([0.1] * 3)`` is about
    ``1e-17``), which Flow-GRPO's ``== 0`` would count as spread.

    Args:
        rewards: ``[B]`` rewards of this process's samples (floating point).
        prompts: ``[B]`` integer prompt ids of the same samples (equal ids: one prompt,
            across processes too).
        group: the ``torch.distributed`` process group (default: the default group, if
            initialized; a single process otherwise).

    Returns:
        A float in ``[0, 1]``: prompts with no spread over the distinct prompts gathered.
    """
    _check_samples(rewards, prompts)
    if rewards.numel() == 0:
        raise InvalidValue("rewards is empty: there are no prompts to count")
    if not bool(torch.isfinite(rewards).all()):
        raise InvalidValue("rewards contain NaN or Inf; check the reward function")
    values = gather_samples(rewards.detach().to(torch.float64), group)
    ids = gather_samples(prompts.detach().to(device=rewards.device, dtype=torch.int64), group)
    unique, inverse = torch.unique(ids, return_inverse=True)
    empty = torch.empty(unique.numel(), dtype=torch.float64, device=values.device)
    low = empty.scatter_reduce(0, inverse, values, "amin", include_self=False)
    high = empty.scatter_reduce(0, inverse, values, "amax", include_self=False)
    return float((low == high).to(torch.float64).mean())
