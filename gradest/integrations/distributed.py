"""Data-parallel training with gradest under ``torch.distributed``: the helpers around DDP.

gradest needs no gradient plumbing of its own under data parallelism: the surrogate loss
(``est.surrogate(ddp_model, ...).loss``) is backpropagated through the wrapper, so
``DistributedDataParallel`` averages the gradients from its backward hooks and FSDP2
(``fully_shard``) reduce-scatters them, exactly as for any other loss. Estimators'
random draws and gates agree across ranks (:mod:`gradest.ranks`), so every rank makes
the same model calls. This module holds what remains around that:

* :func:`rank_generator`: a ``torch.Generator`` per rank, so each rank draws its own
  noise, reproducibly from one seed.
* :func:`check_same_estimator`: every rank uses the same estimator options and trainable
  parameters (a mismatch would mix different estimators in one average).
* :func:`launched_world` / :func:`process_group_from_env`: the rank and world size a
  launcher (``torchrun``) put in the environment, and a process group made from them
  for the duration of a ``with`` block (used by ``gradest finetune``).
* :func:`replicas_in_sync`: check bit for bit that the replicas stayed equal.

DDP's average equals the full-batch gradient when every rank holds an equal share of the
batch and the objective is a *mean* over samples.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradest.errors import InvalidType, InvalidValue

__all__ = [
    "check_same_estimator",
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
            "torch.distributed.init_process_group(...) on every rank first"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wrapper holds (``model`` itself otherwise)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if not isinstance(model, nn.Module):
        raise InvalidType(
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
            raise InvalidValue(f"{what} differ across ranks ({detail}); {fix}")


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
        raise InvalidValue(f"seed must be an int >= 0, got {seed!r}")
    if rank is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if initialized else 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidValue(f"rank must be an int >= 0, got {rank!r}")
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
        raise InvalidValue(
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
        raise InvalidValue(
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
        # A DistributedDataParallel wrapper still alive (in a reference cycle) when the
        # group is destroyed aborts the process at exit in about half the runs (torch
        # 2.14, gloo, measured): collect it, and let every rank get here first.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- replicas: start equal, stay equal ------------------------------------------------------


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
