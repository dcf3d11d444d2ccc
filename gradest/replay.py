"""Replaying a stochastic model's random numbers, so every evaluation of a step agrees.

Estimators evaluate the same sampling step more than once: the no-graph rollout that
produces the path, the adjoint sweep, the node or checkpoint recomputation with a graph
(``exact:checkpoint=true`` even in the caller's backward). A model in training mode with
dropout (or any layer drawing from torch's default generator) would see a different mask
each time, so the gradient would belong to a different network than the path it was
taken along, and the same ``generator`` would give different results.

:class:`StepRandomness` (one per estimate) makes every evaluation of step ``k`` draw the
same random numbers as the first one. The design, and why:

* **Switched on by what the model does at any step.** Every model with a module in
  training mode is watched: the *first* evaluation of each step compares the RNG state
  before and after the call (a small state copy, no host sync beyond it). A step that
  drew is recorded with the state it started from; a step that drew nothing is marked
  so, and its later evaluations run as plain calls. So a model whose dropout is active
  only at some times (``t < 0.6``) is replayed at those steps, whatever its first call
  did. Models in eval mode pay nothing.
* **The call's own random stream.** Layers draw from torch's *default* generator, which
  is process-global. With a ``generator=`` given to the estimate, the model's draws come
  from a private stream seeded from that generator's state at the start of the call (the
  generator is read through a copy, so the estimator's own draws are unchanged; it is
  advanced by one draw at the end of an estimate whose model drew, so the next call gets
  fresh masks): the default generator is swapped to the stream for each drawing call and
  put back, so the same generator state gives the same masks in any thread, and the
  global RNG is neither read nor consumed. Without a ``generator`` the stream *is* the
  default generator, consumed like a hand-written loop consumes it (so
  ``torch.manual_seed`` reproduces the loop's masks, single-threaded).
* **Thread-safe.** Swapping the default generator is process-global, so every
  evaluation that may draw or replays a recorded state (first evaluations and replays of
  drawing steps) runs under one process-wide lock (:data:`RNG_LOCK`), with the swap, the
  call and the restore inside it: no other gradest evaluation's draws or restores
  interleave. Calls of steps known to draw nothing run outside it. Code outside gradest
  that draws from (or reseeds) the default generator in another thread meanwhile is not
  locked out; pass ``generator=`` and keep other threads' ``torch.manual_seed`` away
  from a training model's forwards.
* **One step per call while drawing.** A stacked call over several steps draws
  different numbers than one call per step (``M*B`` rows at once), so a stacked call
  that drew is undone (the stream put back) and redone step by step.

``torch.utils.checkpoint`` around gradest's own per-step checkpoints is run with
``preserve_rng_state=False``: the replay above restores the step's state itself, and
torch's fork of the global RNG is not thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gradest._checks import outside_fake_mode

RngState = tuple[Tensor, Tensor | None]

#: Held around every model evaluation that may draw from, or replays, the default generator.
RNG_LOCK = threading.RLock()

_UNKNOWN = object()  # a step not evaluated yet in this estimate


def model_rng_seed(generator: torch.Generator) -> int:
    """The seed of the stream a model's random layers draw from in an estimate given
    ``generator=generator`` (read from a copy: ``generator`` is unchanged).

    With ``generator=`` an estimate's dropout masks come from a stream of their own,
    ``torch.Generator().manual_seed(model_rng_seed(generator))`` swapped in as torch's
    default generator for the model's calls, so they depend on ``generator`` alone (not on
    ``torch.manual_seed``, other threads or earlier calls) and the global RNG is neither
    read nor advanced. A hand-written loop draws its masks from the global RNG; seeded
    with ``torch.manual_seed(gradest.model_rng_seed(g))`` before its first model call, it
    draws the masks of the estimate given ``g`` in that state (on CPU; on CUDA the CUDA
    generator is seeded likewise). Without ``generator=`` the model draws from the global
    RNG as a hand-written loop does, so ``torch.manual_seed(s)`` before either gives the
    same masks.
    """
    copy = generator.clone_state()
    with outside_fake_mode():  # the generator is a real object even under FakeTensorMode
        return int(torch.randint(0, 2**62, (1,), generator=copy, device=generator.device).item())


class StepRandomness:
    """The RNG state each step was first evaluated with, for one estimate.

    Args:
        model: the velocity model (checked for modules in training mode).
        device: where the model runs; a CUDA device's generator is replayed beside the
            CPU generator.
        generator: the estimate's generator; the model's draws then come from a private
            stream seeded from it (see the module docstring). None: the default generator.
        modules: ``list(model.modules())`` if the caller has it.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        generator: torch.Generator | None = None,
        modules: list[nn.Module] | None = None,
    ):
        self.watched = any(
            module.training for module in (model.modules() if modules is None else modules)
        )
        #: Whether some step's first evaluation drew random numbers.
        self.stochastic = False
        self._cuda = device if device.type == "cuda" else None
        self._generator = generator
        # Per step time: the state its first evaluation started from, or None (drew nothing).
        self._recorded: dict[float, RngState | None] = {}
        # The private stream's current state (generator given), created on first use.
        self._stream: RngState | None = None

    # -- RNG states -------------------------------------------------------------------------

    def _snapshot(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self._cuda) if self._cuda is not None else None
        return torch.get_rng_state(), cuda

    def _restore(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if self._cuda is not None and state[1] is not None:
            torch.cuda.set_rng_state(state[1], self._cuda)

    @staticmethod
    def _same(a: RngState, b: RngState) -> bool:
        with outside_fake_mode():  # RNG states are real host tensors
            if not torch.equal(a[0], b[0]):
                return False
            return a[1] is None or b[1] is None or torch.equal(a[1], b[1])

    def _private(self) -> bool:
        return self._generator is not None

    def _stream_state(self) -> RngState:
        """Where the model's next draw starts (caller holds :data:`RNG_LOCK`)."""
        if not self._private():
            return self._snapshot()
        if self._stream is None:
            assert self._generator is not None
            seed = model_rng_seed(self._generator)
            cpu = torch.Generator().manual_seed(seed).get_state()
            cuda = (
                torch.Generator(device=self._cuda).manual_seed(seed).get_state()
                if self._cuda is not None
                else None
            )
            self._stream = (cpu, cuda)
        return self._stream

    def _set_stream(self, state: RngState) -> None:
        if self._private():
            self._stream = state
        else:
            self._restore(state)

    # -- evaluations ------------------------------------------------------------------------

    def _first(self, call: Callable[[Tensor, Tensor], Tensor], z: Tensor, t: Tensor):
        """A first evaluation from the stream: ``(output, state it started from, drew)``.

        The stream's state is the CPU generator's, with the CUDA generator's beside it when
        the model runs on a CUDA device (:meth:`_snapshot`)."""
        before = self._stream_state()
        if self._private():
            outside = self._snapshot()
            self._restore(before)
            try:
                out = call(z, t)
                after = self._snapshot()
            finally:
                self._restore(outside)
            self._stream = after
        else:
            out = call(z, t)
            after = self._snapshot()
        return out, before, not self._same(before, after)

    def _replay(self, call: Callable[[Tensor, Tensor], Tensor], z: Tensor, t: Tensor, state):
        outside = self._snapshot()
        self._restore(state)
        try:
            return call(z, t)
        finally:
            self._restore(outside)

    def evaluate(
        self,
        call: Callable[[Tensor, Tensor], Tensor],
        z: Tensor,
        t: Tensor,
        times: list[float],
    ) -> Tensor:
        """``call(z, t)`` on ``len(times)`` stacked states, each step with its own randomness."""
        if not self.watched:
            return call(z, t)
        if len(times) == 1:  # one step (every step of a chain): the same rules, inlined
            return self._evaluate_one(call, z, t, times[0])
        known = [self._recorded.get(time, _UNKNOWN) for time in times]
        if all(state is None for state in known):
            return call(z, t)  # every step drew nothing at its first evaluation
        with RNG_LOCK:
            known = [self._recorded.get(time, _UNKNOWN) for time in times]
            if not any(isinstance(state, tuple) for state in known):
                # Nothing recorded as drawing: try the (stacked) call as a first evaluation.
                out, before, drew = self._first(call, z, t)
                if not drew:
                    for time in times:
                        self._recorded.setdefault(time, None)
                    return out
                self.stochastic = True
                if len(times) == 1:
                    self._recorded[times[0]] = before
                    return out
                # One stacked call drew numbers for M*B rows at once; redo it step by step.
                self._set_stream(before)
            return self._step_by_step(call, z, t, times)

    def _evaluate_one(self, call, z: Tensor, t: Tensor, time: float) -> Tensor:
        """:meth:`evaluate` for one step: a plain call if its first evaluation drew
        nothing, its recorded state replayed if it drew, a first evaluation otherwise."""
        state = self._recorded.get(time, _UNKNOWN)
        if state is None:
            return call(z, t)
        with RNG_LOCK:
            state = self._recorded.get(time, _UNKNOWN)
            if state is None:
                return call(z, t)
            if state is not _UNKNOWN:
                return self._replay(call, z, t, state)
            out, before, drew = self._first(call, z, t)
            self._recorded[time] = before if drew else None
            self.stochastic |= drew
            return out

    def _step_by_step(self, call, z: Tensor, t: Tensor, times: list[float]) -> Tensor:
        rows = z.shape[0] // len(times)
        chunks = []
        for index, time in enumerate(times):
            part = slice(index * rows, (index + 1) * rows)
            state = self._recorded.get(time, _UNKNOWN)
            if state is None:
                chunks.append(call(z[part], t[part]))
            elif state is _UNKNOWN:
                out, before, drew = self._first(call, z[part], t[part])
                self._recorded[time] = before if drew else None
                self.stochastic |= drew
                chunks.append(out)
            else:
                chunks.append(self._replay(call, z[part], t[part], state))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def finish(self) -> None:
        """End of the estimate: advance the caller's generator by one draw if the model
        drew from a stream seeded from it, so the next call gets other masks."""
        if self.stochastic and self._generator is not None:
            torch.randint(0, 2, (1,), generator=self._generator, device=self._generator.device)
