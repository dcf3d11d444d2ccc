"""The hand-written measurement the cost tests compare ``gradest cost`` against: the peak
bytes of distinct storages that autograd's saved tensors hold while a step runs, weights
and buffers excluded (they are not activations), counted by saved-tensor hooks."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn


class _Box:
    """A saved tensor's stand-in: its finaliser tells when autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def saved_bytes(modules: Iterable[nn.Module], step: Callable[[], object]) -> int:
    """Peak bytes held by ``step``'s saved tensors, the modules' parameters and buffers
    excluded; a storage saved twice counts once."""
    excluded = {
        t.untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())
    }
    holders: dict[int, int] = {}
    state = {"now": 0, "peak": 0}

    def release(key: int, nbytes: int) -> None:
        holders[key] -= 1
        if not holders[key]:
            state["now"] -= nbytes

    def pack(tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in excluded:
            return tensor
        if not holders.get(key):
            state["now"] += storage.nbytes()
            state["peak"] = max(state["peak"], state["now"])
        holders[key] = holders.get(key, 0) + 1
        box = _Box(tensor)
        weakref.finalize(box, release, key, storage.nbytes())
        return box

    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Box) else saved  # type: ignore[return-value]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    return state["peak"]
