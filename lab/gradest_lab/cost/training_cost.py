"""What one training step of an estimator costs: FLOPs, retained activations, peak memory.

:func:`training_step_cost` runs one optimizer step (``surrogate(...)``, ``loss.backward()``,
``optimizer.step()``) once per draw and measures it in the same pass three ways:

* **FLOPs**: :func:`gradest.harness.cost.count_flops`' formulas (PyTorch's
  ``FlopCounterMode`` table) summed over every operator, forward and backward.
* **Retained bytes**: what autograd keeps for backward, counted by
  ``torch.autograd.graph.saved_tensors_hooks``: the peak, over the step, of the bytes of
  distinct storages held by saved tensors, parameters and buffers excluded (they are
  counted once, as the model's bytes). Inside ``torch.utils.checkpoint`` regions the
  checkpoint's own hooks hold the tensors, so with gradient checkpointing this counts the
  saved tensors outside the checkpointed blocks; the peak below counts everything.
* **Peak bytes**: parameters + buffers + optimizer state (present before the step, as in
  every step after the first) + the peak of every storage the step creates and holds at
  the same time (activations, the largest transient, gradients, the optimizer's
  temporaries). The CPU analogue of ``torch.cuda.max_memory_allocated``, without the
  caching allocator's rounding and fragmentation.

On the meta device no data exists and nothing is computed, so a step of SD3 or Flux is
traced on a CPU in seconds to minutes; the same code on real tensors counts the same
numbers (``lab/tests/test_training_cost.py`` compares them). A model call that records no
graph (sampling without gradient) has FLOPs and transients fixed by its input shapes, so
on the meta device its first occurrence is traced and the repeats are replayed from that
trace (:class:`_ReplayNoGradCalls`), which changes no count and saves most of the time of
estimators that sample without a graph. The optimizer's step is elementwise and the same in
every training step of a model, so on the meta device it is traced once
(:func:`prepare_optimizer`) and each step reports that trace's FLOPs and transient peak.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest import FlowSDE, InvalidValue, StepwiseObjective, TerminalObjective, rollout
from gradest.harness import FlopCounter, StorageTracker
from gradest.plugin import Objective, check_surrogate
from gradest.rl import separable_over_steps, single_step
from gradest_lab.cost.call_replay import ReplayCalls, active_counters, report
from gradest_lab.cost.fused_attention import MODEL_FLOP_FORMULAS, fused_attention

__all__ = [
    "PreparedOptimizer",
    "StepCost",
    "TrainingCost",
    "decisions_vary",
    "measure_step",
    "prepare_optimizer",
    "training_step_cost",
]


@attrs.frozen
class StepCost:
    """One measured training step.

    Attributes:
        flops: FLOPs of every operator with a formula, forward and backward.
        retained_bytes: peak bytes of saved tensors (parameters and buffers excluded).
        step_peak_bytes: peak bytes of storages created during the step and alive at once.
    """

    flops: int
    retained_bytes: int
    step_peak_bytes: int


class _SavedBytes:
    """Peak bytes of distinct storages that saved tensors hold (saved-tensor hooks).

    Each packed tensor is boxed; a weak reference to the box tells when autograd drops
    it. A storage counts while at least one box holds it.
    """

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.holders: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def pack(self, tensor: Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            return tensor
        box = _Box(tensor)
        if self.holders.get(key, 0) == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.holders[key] = self.holders.get(key, 0) + 1
        weakref.finalize(box, self._release, key, storage.nbytes())
        return box

    def _release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            del self.holders[key]
            self.current -= nbytes

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Box) else packed


class _Box:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


def _storage_keys(tensors: Iterable[Tensor]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def measure_step(
    step: Callable[[], Any],
    *,
    excluded: Iterable[Tensor] = (),
    counters: tuple[FlopCounter, StorageTracker] | None = None,
) -> StepCost:
    """FLOPs, saved-tensor bytes and peak created bytes of one call of ``step()``.

    Args:
        step: the work to measure (e.g. surrogate + backward + optimizer step).
        excluded: tensors whose storages are not activations (parameters, buffers).
        counters: the FLOP counter and storage tracker to use (replayed calls report to
            the ones in ``_ACTIVE``); fresh ones by default.

    Deterministic: the cycle collector is paused, so storages are freed by reference
    counting alone, at the same point on every run.
    """
    flops, storages = counters or (FlopCounter(), StorageTracker(count_meta=True))
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    saved = _SavedBytes(_storage_keys(excluded))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack))
            stack.enter_context(storages)
            stack.enter_context(flops)
            step()
    finally:
        if was_enabled:
            gc.enable()
    return StepCost(flops=flops.total, retained_bytes=saved.peak, step_peak_bytes=storages.peak)


@attrs.frozen
class TrainingCost:
    """What one training step with one estimator costs (means over draws, with ranges).

    Attributes:
        spec: the estimator.
        flops, retained_bytes, peak_bytes: expected values (the mean over ``draws``);
            ``peak_bytes`` includes parameters, buffers and optimizer state.
        flops_range, retained_range, peak_range: ``(min, max)`` over the draws (equal
            ends for an estimator whose work does not depend on its draw).
        draws: traced draws (1 for an estimator whose draws do not vary).
        parameter_bytes, optimizer_bytes: the persistent part of the peak.
        trainable_parameters: parameters the optimizer updates.
    """

    spec: str
    flops: float
    retained_bytes: float
    peak_bytes: float
    flops_range: tuple[int, int]
    retained_range: tuple[int, int]
    peak_range: tuple[int, int]
    draws: int
    parameter_bytes: int
    optimizer_bytes: int
    trainable_parameters: int

    def fits(self, memory_bytes: int) -> bool:
        """Whether the largest peak over the draws fits in ``memory_bytes``."""
        return self.peak_range[1] <= memory_bytes

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        for key in ("flops_range", "retained_range", "peak_range"):
            out[key] = list(out[key])
        return out


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@attrs.frozen(eq=False)
class PreparedOptimizer:
    """An optimizer with the state every step after the first carries, and (on the meta
    device) its step's cost, traced once.

    Attributes:
        optimizer: the optimizer over ``trained``.
        trained: the parameters it updates.
        state_tensors: its state (excluded from the step's storages, like parameters).
        optimizer_bytes: the state's bytes.
        step_flops, step_transient: one ``optimizer.step()``'s FLOPs and its peak above
            the level it starts at, with every gradient present; None on real tensors
            (there the step runs).
    """

    optimizer: torch.optim.Optimizer
    trained: list[nn.Parameter]
    state_tensors: list[Tensor]
    optimizer_bytes: int
    step_flops: int | None
    step_transient: int | None

    def step(self) -> None:
        """``optimizer.step()``, or on the meta device its traced cost reported."""
        if self.step_flops is None or self.step_transient is None:
            self.optimizer.step()
        else:
            report(self.step_flops, self.step_transient)


def prepare_optimizer(
    model: nn.Module,
    optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> PreparedOptimizer:
    """``optimizer(trained parameters)`` (default AdamW) with its state created from zero
    gradients, and on the meta device one step traced (every step's is the same: the
    same elementwise operators on the same shapes)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if not trained:
        raise InvalidValue(
            f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train"
        )
    make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-4))
    opt = make_optimizer(trained)
    # The state every later step carries: created once from zero gradients.
    for p in trained:
        p.grad = torch.zeros_like(p)
    opt.step()
    step_flops = step_transient = None
    if all(p.device.type == "meta" for p in trained):
        flops, storages = FlopCounter(MODEL_FLOP_FORMULAS), StorageTracker(count_meta=True)
        with storages, flops:
            opt.step()
        step_flops, step_transient = flops.total, storages.peak
    opt.zero_grad(set_to_none=True)
    state_tensors = [
        v for state in opt.state.values() for v in state.values() if isinstance(v, Tensor)
    ]
    return PreparedOptimizer(
        opt, trained, state_tensors, _nbytes(state_tensors), step_flops, step_transient
    )


def training_step_cost(
    estimator: Any,
    model: nn.Module,
    sampler: Any,
    objective: Objective,
    *,
    noise: Tensor,
    cond: Mapping[str, Any] | None = None,
    optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
    | PreparedOptimizer
    | None = None,
    draws: int = 4,
    seed: int = 0,
    attention: str = "fused",
    varies: bool | None = None,
    replay: bool = True,
    frozen: Sequence[nn.Module] = (),
    per_timestep: bool = False,
) -> TrainingCost:
    """Measure one training step of ``estimator`` on ``model`` (meta or real tensors).

    The step is ``estimator.surrogate(model, sampler, objective, noise=noise, cond=cond,
    generator=g).loss.backward()``, then ``optimizer.step()`` and ``zero_grad()``; for a
    stepwise objective the path is first sampled without a graph (``gradest.rollout``)
    and the surrogate takes ``trajectory=`` (the sampling is part of the step). The
    optimizer's state is created before the measurement (it persists between steps).

    Args:
        estimator: a gradest estimator (instance).
        model: the model; its parameters with ``requires_grad=True`` are trained.
        sampler: as for ``surrogate``.
        objective: as for ``surrogate``.
        noise: as for ``surrogate``.
        cond: as for ``surrogate``.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (default AdamW, which
            keeps two state tensors per trained parameter), or one
            :func:`prepare_optimizer` made for ``model`` (several estimators share it).
        draws: draws of a stochastic estimator to average; an estimator whose draws do
            not vary with the generator (checked on a stand-in model) is traced once.
        seed: generator seed of draw 0 (draw ``d`` uses ``seed + d``).
        attention: on the meta device, ``"fused"`` traces attention as a GPU's fused
            kernel stores it (:mod:`gradest_lab.cost.fused_attention`), ``"math"`` as the
            math path does (the ``S_q x S_k`` matrix saved). Real tensors run as they are.
        varies: whether the estimator's draws vary with the generator, if known
            (:func:`decisions_vary`); found out on a stand-in model when None.
        replay: on the meta device, trace each model-call signature once and replay it
            (:mod:`gradest_lab.cost.call_replay`; same FLOPs and saved bytes, minutes
            faster on SD3 / Flux). False traces every call.
        frozen: models the objective runs that are not trained (a VAE decoder, a reward
            model): their parameters and buffers are resident (in ``parameter_bytes``)
            and never count as saved activations.
        per_timestep: a stepwise objective trained one step at a time, as Flow-GRPO and
            the grpo recipe with ``exact`` train: per step, the surrogate on that step's
            term alone (:func:`gradest.rl.single_step`, ``sampler`` a
            :class:`gradest.FlowSDE`) and its backward, one step's graph held at a time.
            Only for an estimator :func:`gradest.rl.separable_over_steps` names
            (``exact``), whose gradient this leaves unchanged.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise InvalidValue(f"draws must be an int >= 1, got draws={draws!r}")
    if attention not in ("fused", "math"):
        raise InvalidValue(f"attention must be 'fused' or 'math', got attention={attention!r}")
    prepared = (
        optimizer
        if isinstance(optimizer, PreparedOptimizer)
        else prepare_optimizer(model, optimizer)
    )
    opt, trained, state_tensors = prepared.optimizer, prepared.trained, prepared.state_tensors
    optimizer_bytes = prepared.optimizer_bytes
    persistent = list(model.parameters()) + list(model.buffers())
    persistent += [t for part in frozen for t in (*part.parameters(), *part.buffers())]
    parameter_bytes = _nbytes(persistent)
    if isinstance(model, ReplayCalls) or not replay or noise.device.type != "meta":
        wrapped = model  # a ReplayCalls shared by several estimators keeps its traces
    else:
        wrapped = ReplayCalls(model)

    stepwise = isinstance(objective, StepwiseObjective)
    steps_of = objective if isinstance(objective, StepwiseObjective) else None
    if per_timestep:
        _check_per_timestep(estimator, sampler, stepwise)
    # The draws a stochastic estimator takes are the same on any model with this sampler
    # and kind of objective, so a one-weight stand-in tells cheaply whether one traced
    # draw is enough (exact, truncated:k=1, ...) or the cost must be averaged.
    if varies is None and draws > 1:
        varies = decisions_vary(estimator, sampler, objective, seed=seed)
    if not varies:
        draws = 1

    measured: list[StepCost] = []
    for draw in range(draws):
        generator = torch.Generator().manual_seed(seed + draw)

        def step(generator: torch.Generator = generator) -> None:
            if stepwise:
                # A policy-gradient step samples first (no graph), then trains on the path.
                path = rollout(wrapped, sampler, noise, cond=cond)
                parts = (
                    [single_step(sampler, path, steps_of, k) for k in range(path.num_steps)]
                    if per_timestep and steps_of is not None
                    else [(sampler, path, objective)]
                )
                for part_sampler, part_path, part_objective in parts:
                    sur = estimator.surrogate(
                        wrapped, part_sampler, part_objective, trajectory=part_path, cond=cond,
                        generator=generator,
                    )  # fmt: skip
                    # A plugin's surrogate is checked before its backward (one line naming it).
                    check_surrogate(estimator, sur).loss.backward()
            else:
                sur = estimator.surrogate(
                    wrapped, sampler, objective, noise=noise, cond=cond, generator=generator
                )
                check_surrogate(estimator, sur).loss.backward()
            prepared.step()
            opt.zero_grad(set_to_none=True)

        counters = (FlopCounter(MODEL_FLOP_FORMULAS), StorageTracker(count_meta=True))
        attention_mode = fused_attention() if attention == "fused" else contextlib.nullcontext()
        with attention_mode, active_counters(*counters):
            measured.append(
                measure_step(step, excluded=persistent + state_tensors, counters=counters)
            )

    def summary(values: list[int]) -> tuple[float, tuple[int, int]]:
        return sum(values) / len(values), (min(values), max(values))

    flops, flops_range = summary([m.flops for m in measured])
    retained, retained_range = summary([m.retained_bytes for m in measured])
    fixed = parameter_bytes + optimizer_bytes
    peak, peak_range = summary([fixed + m.step_peak_bytes for m in measured])
    return TrainingCost(
        spec=repr(estimator),
        flops=flops,
        retained_bytes=retained,
        peak_bytes=peak,
        flops_range=flops_range,
        retained_range=retained_range,
        peak_range=peak_range,
        draws=len(measured),
        parameter_bytes=parameter_bytes,
        optimizer_bytes=optimizer_bytes,
        trainable_parameters=sum(p.numel() for p in trained),
    )


def _check_per_timestep(estimator: Any, sampler: Any, stepwise: bool) -> None:
    """``per_timestep`` only where it keeps the estimator's gradient (one line each)."""
    if not stepwise:
        raise InvalidValue(
            "per_timestep=True trains a stepwise objective one step at a time; a terminal "
            "objective's steps share the adjoint: price it with per_timestep=False"
        )
    if not separable_over_steps(estimator):
        raise InvalidValue(
            f"per_timestep=True gives the gradient of an estimator separable over steps "
            f"(exact) only; {getattr(estimator, 'name', type(estimator).__name__)!r} "
            f"chooses among the steps: price it with per_timestep=False"
        )
    if not isinstance(sampler, FlowSDE):
        raise InvalidValue(
            f"per_timestep=True cuts a FlowSDE path into its steps; got sampler "
            f"{type(sampler).__name__}: pass gradest.FlowSDE(steps=N, noise_level=0.7)"
        )


class _StandIn(nn.Module):
    """The cheapest velocity an estimator can run on the meta device: one weight, one
    multiply per call (a real layer's meta kernels cost a millisecond per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones((), dtype=torch.float64, device="meta"))

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        return z * self.weight


def decisions_vary(estimator: Any, sampler: Any, objective: Objective, *, seed: int = 0) -> bool:
    """Whether two generators give ``estimator`` different decisions.

    Asked on a one-weight stand-in model on the meta device with an objective of the
    same kind: the draws depend on the sampler's steps and the kind of objective, not on
    the model, and the stand-in costs milliseconds. An estimator that cannot run on the
    meta device (jagg with its gate on, auto) raises here, before any long trace.
    """
    model = _StandIn()
    noise = torch.zeros(1, 2, dtype=torch.float64, device="meta")
    stand_in: Objective
    inputs: dict[str, Any]
    if isinstance(objective, StepwiseObjective):
        stand_in = StepwiseObjective(lambda k, v, trajectory: v.square().sum())
        inputs = {"trajectory": rollout(model, sampler, noise)}
    else:
        stand_in = TerminalObjective(lambda z: z.square().sum())
        inputs = {"noise": noise}
    seen = []
    for offset in (0, 1):
        generator = torch.Generator().manual_seed(seed + offset)
        result = estimator.estimate(model, sampler, stand_in, generator=generator, **inputs)
        seen.append(repr(getattr(result, "decisions", None)))
    return seen[0] != seen[1]
