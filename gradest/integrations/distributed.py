"""Data-parallel training with gradest estimators under ``torch.distributed``.

``DistributedDataParallel`` averages gradients from autograd hooks that fire during
``loss.backward()``. gradest never calls ``loss.backward()`` on the wrapped module: it
evaluates the model through ``torch.func.functional_call`` on the module's parameters and
writes ``p.grad`` itself, so DDP's hooks do not fire and each rank would keep its own
gradient. This module does the averaging DDP would have done:

* :func:`distributed_backward`: ``estimator.backward`` on ``ddp_model.module``, with the
  new gradient contribution averaged across ranks (sum, then divide by the world size)
  in flattened buckets before it is added to ``p.grad``.
* :func:`allreduce_gradients`: average whatever ``p.grad`` holds across ranks, for code
  that calls ``estimator.backward`` itself.
* :func:`rank_generator`: a ``torch.Generator`` per rank, so each rank draws its own
  noise and random steps, reproducibly from one seed.
* :func:`launched_world` / :func:`process_group_from_env`: the rank and world size a
  launcher (``torchrun``) put in the environment, and a process group made from them
  for the duration of a ``with`` block (used by ``gradest finetune``).
* :func:`broadcast_module` / :func:`replicas_in_sync`: start every rank from rank 0's
  weights (what DDP's constructor does), and check bit for bit that they stayed equal.

Averaging equals the full-batch gradient when every rank holds an equal share of the
batch and the objective is a *mean* over samples (as for DDP with a mean-reduced loss).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradest.flow import AffineSampler
from gradest.nonfinite import ON_NONFINITE, NonFiniteError
from gradest.objectives import Objective
from gradest.protocol import GradientEstimate

__all__ = [
    "allreduce_gradients",
    "broadcast_module",
    "check_same_estimator",
    "distributed_backward",
    "launched_world",
    "process_group_from_env",
    "rank_generator",
    "replicas_in_sync",
    "unwrap",
]


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) on every rank first "
            "(or use estimator.backward for single-process training)"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wrapper holds (``model`` itself otherwise)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module or a DistributedDataParallel wrapper, "
            f"got {type(model).__name__}"
        )
    return model


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _signature(module: nn.Module) -> str:
    """A digest of the trainable parameters' names, shapes and dtypes (what buckets need)."""
    lines = "\n".join(
        f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in _trainable(module)
    ).encode()
    return f"{len(_trainable(module))} tensors, sha256 {hashlib.sha256(lines).hexdigest()[:12]}"


def check_same_estimator(
    estimator: Any, model: nn.Module, group: dist.ProcessGroup | None = None
) -> None:
    """Raise on every rank unless all ranks use the same estimator and trainable parameters.

    Compares ``repr(estimator)`` (its name and every option) and the names, shapes and
    dtypes of the trainable parameters with one ``all_gather_object``. Different options
    would silently average different estimators; different parameter sets would average
    unrelated tensors.

    Raises:
        ValueError: naming the ranks and what differs.
    """
    _require_initialized()
    module = unwrap(model)
    mine = (repr(estimator), _signature(module))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for index, what in ((0, "estimator options"), (1, "trainable parameters")):
        values = [entry[index] for entry in gathered]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(value, []).append(rank)
            detail = "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())
            fix = (
                "build the same estimator on every rank (per-rank randomness belongs in the "
                "generator: gradest.integrations.distributed.rank_generator(seed))"
                if index == 0
                else "freeze and unfreeze the same parameters on every rank"
            )
            raise ValueError(f"{what} differ across ranks ({detail}); {fix}")


def _world_size(group: dist.ProcessGroup | None) -> int:
    _require_initialized()
    return dist.get_world_size(group)


def _average_in_buckets(
    tensors: list[Tensor], group: dist.ProcessGroup | None, flags: Tensor | None = None
) -> tuple[list[Tensor], Tensor | None]:
    """Sum across ranks then divide by the world size, one flat bucket per dtype and device.

    ``flags`` (summed, not divided) ride along in the first bucket, so agreeing on whether
    any rank failed costs no extra collective.
    """
    world = _world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        buckets.setdefault((tensor.dtype, tensor.device), []).append(index)
    out: list[Tensor] = list(tensors)
    summed_flags = None
    for position, ((dtype, device), indices) in enumerate(buckets.items()):
        parts = [tensors[i].reshape(-1) for i in indices]
        carry_flags = flags is not None and position == 0
        if carry_flags:
            assert flags is not None
            parts.append(flags.to(dtype=dtype, device=device))
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for i in indices:
            size = tensors[i].numel()
            out[i] = (flat[offset : offset + size] / world).reshape(tensors[i].shape)
            offset += size
        if carry_flags:
            summed_flags = flat[offset:]
    return out, summed_flags


def allreduce_gradients(model_or_ddp: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average ``p.grad`` across ranks, like DDP after ``loss.backward()``.

    Every parameter with ``requires_grad=True`` takes part (a ``None`` gradient counts as
    zeros and is replaced by the average, so all ranks end with the same ``.grad``);
    gradients are summed with one ``all_reduce`` per flat bucket (per dtype and device)
    and divided by the world size. Call it on every rank, after ``estimator.backward``.

    Args:
        model_or_ddp: the module or its ``DistributedDataParallel`` wrapper.
        group: the process group (default: the world).
    """
    trainable = [p for _, p in _trainable(unwrap(model_or_ddp))]
    if not trainable:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
    averaged, _ = _average_in_buckets(grads, group)
    with torch.no_grad():
        for param, grad in zip(trainable, averaged, strict=True):
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)


def distributed_backward(
    estimator: Any,
    ddp_model: nn.Module,
    flow: AffineSampler,
    objective: Objective,
    *,
    group: dist.ProcessGroup | None = None,
    check_options: bool = True,
    on_nonfinite: str = "raise",
    **kwargs: Any,
) -> GradientEstimate:
    """``estimator.backward`` on a data-parallel model: estimate, average across ranks, accumulate.

    Call on every rank with that rank's share of the batch (``noise=`` or
    ``trajectory=``, and its ``cond``). The estimate's gradients are averaged across
    ranks (sum, then divide by the world size, in flat buckets) and added into ``p.grad``
    of ``ddp_model.module``, so gradient accumulation and ``optimizer.step()`` work as
    with DDP and ``loss.backward()``. With a mean-over-samples objective and equal shares,
    the result equals the full-batch gradient.

    Args:
        estimator: any gradest estimator (``gradest.estimator("sdo")``).
        ddp_model: a ``DistributedDataParallel`` wrapper (or the bare module).
        flow, objective: as for ``estimator.backward``.
        group: the process group (default: the world).
        check_options: first check with :func:`check_same_estimator` that every rank
            uses the same estimator options and trainable parameters (one small
            ``all_gather_object``; turn off once the setup is known to be consistent).
        on_nonfinite: ``"raise"``: if any rank's estimate is non-finite, *every* rank
            raises :class:`~gradest.NonFiniteError` naming the ranks (instead of the
            others waiting forever in the collective); ``"skip"``: every rank returns an
            unusable estimate and leaves ``.grad`` untouched.
        **kwargs: passed to ``estimator.estimate`` (``noise``, ``trajectory``, ``cond``,
            ``generator``, ``noise_grad``). ``noise_grad`` stays per rank (it belongs to
            that rank's samples) and is not averaged.

    Returns:
        The rank's :class:`~gradest.protocol.GradientEstimate` with ``grads`` replaced
        by the cross-rank average; ``cost`` and ``info`` stay the rank's own.
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    world = _world_size(group)
    rank = dist.get_rank(group)
    module = unwrap(ddp_model)
    if check_options:
        check_same_estimator(estimator, module, group)
    # Always "skip" locally, and hold back any other error until the collective: a rank
    # that raised before it would leave the others blocked in all_reduce forever. The
    # decision to raise or skip is then taken on every rank together.
    error: Exception | None = None
    try:
        result = estimator.estimate(module, flow, objective, on_nonfinite="skip", **kwargs)
    except Exception as err:  # re-raised below, after the collective
        error, result = err, None
    trainable = _trainable(module)
    usable = result is not None and result.usable
    grads = [
        result.grads[name] if usable and result is not None else torch.zeros_like(param)
        for name, param in trainable
    ]
    # Per-rank status in the same bucket: 0 fine, 1 non-finite, 2 raised.
    status = torch.zeros(world, dtype=torch.float64)
    status[rank] = 2.0 if error is not None else (0.0 if usable else 1.0)
    averaged, status_sum = _average_in_buckets(grads, group, status)
    assert status_sum is not None
    raised = [r for r in range(world) if float(status_sum[r]) == 2.0]
    if raised:
        if error is not None:
            raise error
        raise RuntimeError(
            f"estimator.estimate raised on rank(s) {raised} of {world}; see the error "
            f"printed by those ranks (this rank's estimate was discarded)"
        )
    assert result is not None
    failed_ranks = [r for r in range(world) if float(status_sum[r]) == 1.0]
    if failed_ranks:
        local = result.info.get("nonfinite", "")
        if on_nonfinite == "raise":
            if not local:
                raise NonFiniteError(f"estimate on rank(s) {failed_ranks} of {world}")
            # This rank's own message (tensor, step, estimator), located to the rank.
            error = NonFiniteError("estimate")
            error.args = (f"rank {rank} of {world}: {local}",)
            raise error
        info = dict(result.info)
        info["nonfinite"] = local or f"non-finite estimate on rank(s) {failed_ranks}"
        return attrs.evolve(result, grads={}, noise_grad=None, info=info)
    averaged_grads = {name: g for (name, _), g in zip(trainable, averaged, strict=True)}
    _accumulate(trainable, averaged_grads)
    return attrs.evolve(result, grads=averaged_grads)


def _accumulate(trainable: list[tuple[str, nn.Parameter]], grads: Mapping[str, Tensor]) -> None:
    with torch.no_grad():
        for name, param in trainable:
            grad = grads[name]
            if param.grad is None:
                param.grad = grad.to(param.dtype).clone()
            else:
                param.grad.add_(grad.to(param.grad.dtype))


def rank_generator(
    seed: int,
    *,
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: str | torch.device = "cpu",
) -> torch.Generator:
    """A generator for this rank, seeded from ``(seed, rank)``.

    Pass it as ``generator=`` (and use it to draw the rank's noise) so that ranks draw
    different samples and random steps, and a rerun with the same ``seed`` and world
    reproduces every rank. The two numbers are mixed with ``numpy.random.SeedSequence``,
    so ``(seed, rank)`` pairs give well-separated streams (``seed + rank`` would make
    rank 1 of seed 0 collide with rank 0 of seed 1).

    Args:
        seed: the run's seed, the same on every rank.
        rank: this process's rank (default: ``torch.distributed.get_rank(group)``, or 0
            when torch.distributed is not initialized).
        device: where the generator lives (a CUDA generator for CUDA noise).
    """
    import numpy as np

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if rank is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if initialized else 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    state = np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


# -- launching: the world from the environment, one process group per run --------------------


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={text!r} must be an int; it is set by the launcher "
            f"(torchrun); unset it to run as a single process"
        ) from None


def launched_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process.

    From the initialized default process group if there is one; otherwise from the
    ``RANK`` and ``WORLD_SIZE`` environment variables that ``torchrun`` (and other
    ``env://`` launchers) set; otherwise ``(0, 1)``, a single process.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"environment variables RANK={rank} and WORLD_SIZE={world} are inconsistent "
            f"(need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE); launch with torchrun, or "
            f"unset both to run as a single process"
        )
    return rank, world


@contextlib.contextmanager
def process_group_from_env(device: str | torch.device = "cpu") -> Iterator[tuple[int, int]]:
    """A process group for the ``with`` block; yields ``(rank, world_size)``.

    * A default group the caller already initialized is used and left initialized.
    * Otherwise, with ``WORLD_SIZE > 1`` in the environment (``torchrun``), one is
      initialized from it (``init_method="env://"``: ``RANK``, ``WORLD_SIZE``,
      ``MASTER_ADDR``, ``MASTER_PORT``) and destroyed when the block exits, also on an
      error. The backend is ``"nccl"`` for a CUDA ``device`` (made the current device when
      it has an index: each rank needs its own GPU, e.g. ``cuda:LOCAL_RANK``) and
      ``"gloo"`` otherwise.
    * Otherwise no group is made and ``(0, 1)`` is yielded.
    """
    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    rank, world = launched_world()
    if world == 1:
        yield rank, world
        return
    if not dist.is_available():
        raise RuntimeError(
            f"WORLD_SIZE={world} asks for {world} processes, but this torch build has no "
            f"torch.distributed; run a single process (unset WORLD_SIZE)"
        )
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


# -- replicas: start equal, stay equal ------------------------------------------------------


def broadcast_module(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's parameters and buffers with those of the group's rank 0.

    What ``DistributedDataParallel``'s constructor does, so replicas start equal even
    when each rank built (or randomly initialized) its own copy.
    """
    _require_initialized()
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*unwrap(model).parameters(), *unwrap(model).buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)


def _state_digest(module: nn.Module) -> str:
    """sha256 of the names and raw bytes of every parameter and buffer: equal bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def replicas_in_sync(model: nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank iff all ranks hold bit-identical parameters and buffers.

    One ``all_gather_object`` of a sha256 digest of the state dict; call it on every rank.
    """
    _require_initialized()
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, _state_digest(unwrap(model)), group=group)
    return len(set(digests)) == 1
