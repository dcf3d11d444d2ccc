"""Replaying a stochastic model's random numbers, so every evaluation of a step agrees.

Estimators evaluate the same sampling step more than once: the no-graph rollout that
produces the path, the adjoint sweep, the node or checkpoint recomputation with a graph.
A model in training mode with dropout (or any layer drawing from torch's global RNG)
would see a different mask each time, so the gradient would belong to a different
network than the path it was taken along, and the same ``generator`` would give
different results.

:class:`StepRandomness` makes every evaluation of step ``k`` draw the same random
numbers as the first one: the first evaluation of a step records the global RNG state
before it runs (and consumes random numbers like any model call would, so a run is as
reproducible through ``torch.manual_seed`` as a hand-written loop); later evaluations of
that step run from the recorded state and leave the global RNG where it was. Stacked
calls over several steps are split into one call per step while the model is
stochastic, because one call on ``M*B`` rows draws different numbers than ``M`` calls on
``B`` rows.

Only models with a module in training mode are checked (dropout is off in eval mode); a
model is stochastic if its first call in an estimate moved the RNG state. That check
costs one RNG-state copy per estimate; deterministic models pay nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

RngState = tuple[Tensor, Tensor | None]


class StepRandomness:
    """The RNG state each step was first evaluated with, for one estimate.

    Args:
        model: the velocity model (checked for modules in training mode).
        device: where the model runs; a CUDA device's generator is replayed beside the
            CPU generator.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        training = any(module.training for module in model.modules())
        # None: not known yet (decided by the first call).
        self.stochastic: bool | None = None if training else False
        self._cuda = device if device.type == "cuda" else None
        self._recorded: dict[float, RngState] = {}

    def _snapshot(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self._cuda) if self._cuda is not None else None
        return torch.get_rng_state(), cuda

    def _restore(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if self._cuda is not None and state[1] is not None:
            torch.cuda.set_rng_state(state[1], self._cuda)

    @staticmethod
    def _same(a: RngState, b: RngState) -> bool:
        if not torch.equal(a[0], b[0]):
            return False
        return a[1] is None or b[1] is None or torch.equal(a[1], b[1])

    def evaluate(
        self,
        call: Callable[[Tensor, Tensor], Tensor],
        z: Tensor,
        t: Tensor,
        times: list[float],
    ) -> Tensor:
        """``call(z, t)`` on ``len(times)`` stacked states, each step with its own randomness."""
        if self.stochastic is False:
            return call(z, t)
        if self.stochastic is None:
            before = self._snapshot()
            out = call(z, t)
            if self._same(before, self._snapshot()):
                self.stochastic = False
                return out
            self.stochastic = True
            if len(times) == 1:
                self._recorded[times[0]] = before
                return out
            # One stacked call drew numbers for M*B rows at once; redo it step by step.
            self._restore(before)
        rows = z.shape[0] // len(times)
        chunks = []
        for index, time in enumerate(times):
            part = slice(index * rows, (index + 1) * rows)
            recorded = self._recorded.get(time)
            if recorded is None:
                self._recorded[time] = self._snapshot()
                chunks.append(call(z[part], t[part]))
                continue
            current = self._snapshot()
            self._restore(recorded)
            try:
                chunks.append(call(z[part], t[part]))
            finally:
                self._restore(current)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
