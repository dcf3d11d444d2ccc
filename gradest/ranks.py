"""Data-parallel ranks take the same random and gate decisions.

Under FSDP every forward all-gathers the parameters, and under DDP with buffers every
forward of the wrapper broadcasts them: a collective per model call. Ranks must then make
the same sequence of model calls, or one waits forever in a collective the other never
joins. An estimator whose calls depend on a random draw (``truncated``'s depth, ``sdo``'s
steps) or on a gate (``jagg``'s fallbacks) would hang as soon as two ranks decided
differently. So when the model is data-parallel, :class:`RankAgreement`:

* replaces every rank's random draw by rank 0's (each rank still draws from its own
  generator, so the generator streams stay as in a single process; the data-parallel
  average stays unbiased, as every rank's draw has the same distribution);
* aggregates the gate's cosines over all ranks (``min`` of the ranks' minima, or the mean
  weighted by sample count), which is the gate of the union batch, so the ranks together
  compute what one process computes on the whole batch.

A model is data-parallel when ``torch.distributed`` is initialized with more than one
rank and the model is a ``DistributedDataParallel`` wrapper or contains an FSDP2
(``fully_shard``) module. Decisions travel with one small collective each, on the default
process group (DDP: the wrapper's group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from gradest.model_state import fsdp_module_class


def _process_group(model: nn.Module) -> tuple[bool, dist.ProcessGroup | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    # The DDP wrapper may sit inside the model (DiffusersVelocity(accelerator.prepare(m))):
    # the ranks must agree on draws and gates wherever the wrapper is.
    wrapper = next(
        (m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)), None
    )
    if wrapper is not None:
        group = getattr(wrapper, "process_group", None)
        return dist.get_world_size(group) > 1, group
    # FSDP2 (torch >= 2.6) is looked up, not imported: a model can only contain an
    # FSDPModule once something imported it.
    fsdp_module = fsdp_module_class()
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        return dist.get_world_size() > 1, None
    return False, None


class RankAgreement:
    """Cross-rank agreement on decisions; a no-op unless the model is data-parallel."""

    def __init__(self, model: nn.Module):
        self.active, self.group = _process_group(model)
        self.device = torch.device("cpu")
        if self.active and dist.get_backend(self.group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _source(self) -> int:
        # broadcast takes a global rank: the group's rank 0.
        if self.group is None:
            return 0
        return dist.get_global_rank(self.group, 0)

    def same_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (same length on every rank)."""
        if not self.active:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=self._source(), group=self.group)
        return [int(v) for v in tensor.tolist()]

    def gate(
        self, cosines: Sequence[float | None], counts: Sequence[int], kind: str
    ) -> list[float | None]:
        """Per-group gate aggregates over the union of the ranks' samples.

        Args:
            cosines: this rank's aggregate per group (None: not gated).
            counts: how many cosines each aggregate was taken over on this rank.
            kind: ``"min"`` or ``"mean"``.
        """
        if not self.active or all(c is None for c in cosines):
            return list(cosines)
        gated = [i for i, c in enumerate(cosines) if c is not None]
        present = [c for c in cosines if c is not None]
        # A NaN cosine fails the gate; -inf does the same and survives min/sum reductions.
        values = [c if c == c else float("-inf") for c in present]
        if kind == "min":
            tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
            agreed = tensor.tolist()
        else:
            weights = [float(counts[i]) for i in gated]
            tensor = torch.tensor(
                [v * w for v, w in zip(values, weights, strict=True)] + weights,
                dtype=torch.float64,
                device=self.device,
            )
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            sums, totals = tensor[: len(gated)], tensor[len(gated) :]
            agreed = (sums / totals).tolist()
        out = list(cosines)
        for index, value in zip(gated, agreed, strict=True):
            out[index] = float(value)
        return out
