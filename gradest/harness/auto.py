"""``auto``: measure the candidates on the user's own model, then use the best one.

The first ``probe_batches`` calls (and ``probe_batches`` calls every ``recheck_every``
calls after that) are **probes**: on that call's minibatch the exact gradient is computed
on the sampled path, and every candidate estimator is drawn ``draws`` times on the same
path and measured against it (``gradest.harness`` statistics):

* progress: the mean cosine of a single draw to the exact gradient, after Adam-style
  normalisation by the exact gradients' second moment (``metric="adam_cosine"``,
  :mod:`gradest.harness.tensor_metrics`), or the plain L2 cosine (``metric="cosine"``);
  a proxy for how far one optimizer step moves the loss, not validated against reward;
* cost: model units from the estimator's own ``Cost`` (docs/design.md#measuring-cost), as
  a ratio to exact's; deterministic;
* bias: ``||mean of draws - exact|| / ||exact||`` with the noise of the mean removed.

After the last probe it picks the candidate with the best progress per unit cost among
those within the budget (``max_bias``; ``min_progress``: at least this predicted progress
per step, exact's being 1; ``max_slowdown``: at most this many times the cost of the
cheapest candidate), which may be ``exact``, and uses it until the next recheck. A
probe call returns the exact gradient it measured against (the candidates' draws are
discarded), so probing never hurts the update, only the time: a probe costs exact's
work plus every candidate's times ``draws`` (docs/design.md#cost-formulas, row ``auto``),
and the probing call's ``result.cost`` says so.

The choice is cached per model signature (the trainable parameters' names, shapes and
dtypes, the sampler and its grid, the objective kind, the state shape) and per ``auto``
configuration, so a new ``auto`` instance in the next training step continues the same
schedule. Under data parallelism rank 0's choice is taken by every rank. ``info`` says what
was used (``auto_choice``, ``auto_probing``), what was picked and why (``auto_selected``,
``auto_reason``) and every candidate's measurements (``auto_measurements``);
``result.decisions`` is :class:`AutoDecisions` (the choice and its own decisions).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, ClassVar, Unpack

import attrs
import torch

from gradest._deprecation import sampler_keyword
from gradest.axes import EstimatorAxes
from gradest.base import DEFAULT_ENGINE, EstimatorBase
from gradest.errors import InvalidValue
from gradest.harness.statistics import trajectory_stats
from gradest.harness.tensor_metrics import TensorLayout, adam_cosine, mean_of, second_moment
from gradest.objectives import Objective, TerminalObjective
from gradest.options import choice_option, int_option, option, optional_float_option
from gradest.protocol import (
    Cost,
    Decisions,
    Definition,
    EstimateOptions,
    GradientEstimate,
    SamplingInputs,
    Surrogate,
    check_steps,
    supports,
)
from gradest.ranks import RankAgreement
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory, rollout

DEFAULT_CANDIDATES = (
    "exact",
    "jagg:window=4",
    "jagg:window=4,shared_knots=true",
    "jagg:window=8",
    "sdo:samples=4",
    "truncated:random=uniform",
)
METRICS = ("adam_cosine", "cosine")


def _parse_candidates(text: str) -> tuple[str, ...]:
    """``exact,jagg:window=4,tau=0.9,sdo``: a spec list in the one list syntax
    (:mod:`gradest.specs`), inside a spec wrapped in parentheses:
    ``auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)``. The old ``exact/jagg/sdo``
    still works with a deprecation warning."""
    from gradest.specs import split_spec_list

    return tuple(split_spec_list(text, what="auto option candidates", legacy_separator="/"))


@attrs.frozen
class AutoDecisions(Decisions):
    """What ``auto`` used for this call.

    Attributes:
        choice: the spec of the estimator whose gradient this is (``exact`` on a probe).
        probing: whether this call was a probe.
        inner: that estimator's own decisions.
    """

    choice: str
    probing: bool
    inner: Decisions | None


@attrs.define
class _Measured:
    """One candidate's measurements over the probe batches so far."""

    progress: list[float] = attrs.field(factory=list)
    bias: list[float] = attrs.field(factory=list)
    cost: list[float] = attrs.field(factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "progress": mean_of(self.progress),
            "bias": mean_of(self.bias),
            "cost": mean_of(self.cost),
        }


@attrs.define
class _Schedule:
    """Per signature: the current choice, the calls so far, the probes in progress."""

    choice: str | None = None
    reason: str = ""
    calls: int = 0
    probes_done: int = 0
    measured: dict[str, _Measured] = attrs.field(factory=dict)
    exact_grads: list[torch.Tensor] = attrs.field(factory=list)
    table: dict[str, dict[str, float]] = attrs.field(factory=dict)


_SCHEDULES: dict[tuple[Any, ...], _Schedule] = {}
_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every cached choice (tests; a model whose behaviour changed completely)."""
    with _LOCK:
        _SCHEDULES.clear()


@attrs.frozen
class Auto(EstimatorBase):
    """Measure the candidate estimators on your model and use the best within a budget.

    Attributes:
        candidates: estimator specs to choose from; in a spec string the one list syntax
            (:mod:`gradest.specs`) in parentheses, e.g.
            ``auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)``.
        max_bias: exclude candidates whose relative bias to exact exceeds this (None: no
            bound).
        min_progress: exclude candidates whose predicted progress per step is below this
            (exact's is 1; None: no bound). Progress per unit cost favours cheap, noisy
            estimators that need more steps for the same reward; set e.g. 0.95 when the
            number of training steps is fixed and the reward reached must stay near
            exact's.
        max_slowdown: exclude candidates costing more than this many times the cheapest
            candidate (None: no bound).
        metric: ``"adam_cosine"`` or ``"cosine"``: how progress per step is predicted.
        probe_batches: minibatches measured before choosing.
        draws: draws per stochastic candidate and probe batch.
        recheck_every: calls between re-checks (probes again on the then-current model).
    """

    name: ClassVar[str] = "auto"
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="those of the chosen candidate (a probe call: exact adjoint)",
        evaluation="chooses among candidates, measured against exact on probe calls; then "
        "the chosen candidate's",
        memory="the chosen candidate's; a probe call holds exact's, then each candidate's",
    )

    candidates: tuple[str, ...] = option(
        DEFAULT_CANDIDATES,
        kind=tuple,
        doc="estimator specs to choose from (in a spec string: a list in parentheses, "
        "e.g. candidates=(exact,jagg:window=4,tau=0.9,sdo))",
        valid=lambda value: len(value) >= 1 and all(isinstance(s, str) for s in value),
        expect="a non-empty tuple of estimator spec strings (in a spec string: "
        "candidates=(exact,jagg:window=4,sdo))",
        parse=_parse_candidates,
    )
    max_bias: float | None = optional_float_option(
        minimum=0, doc="exclude candidates with a larger relative bias to exact (None: no bound)"
    )
    min_progress: float | None = optional_float_option(
        minimum=0, doc="exclude candidates with a lower predicted progress per step (exact: 1)"
    )
    max_slowdown: float | None = optional_float_option(
        minimum=1, doc="exclude candidates costing more than this x the cheapest (None: no bound)"
    )
    metric: str = choice_option(
        "adam_cosine", METRICS, doc="predicted progress: Adam-normalised or plain cosine"
    )
    probe_batches: int = int_option(1, minimum=1, doc="minibatches measured before choosing")
    draws: int = int_option(4, minimum=2, doc="draws per stochastic candidate per probe")
    recheck_every: int = int_option(200, minimum=1, doc="calls between re-checks")

    def __attrs_post_init__(self) -> None:
        from gradest.registry import estimator  # the registry imports the strategies

        for spec in self.candidates:
            if spec.partition(":")[0] == self.name:
                raise InvalidValue(f"estimator 'auto': candidates={self.candidates!r} holds auto")
            estimator(spec)  # an unknown name or a bad option fails here, not mid-training

    # -- the two entry points delegate ----------------------------------------------------

    @sampler_keyword
    def estimate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = DEFAULT_ENGINE,
        **options: Unpack[EstimateOptions],
    ) -> GradientEstimate:
        """As :meth:`EstimatorBase.estimate`; a probe call returns the exact gradient."""
        return self._call(model, sampler, objective, dict(options), engine=engine, surrogate=False)

    @sampler_keyword
    def surrogate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = DEFAULT_ENGINE,
        **inputs: Unpack[SamplingInputs],
    ) -> Surrogate:
        """As :meth:`EstimatorBase.surrogate`; a probe call gives exact's loss."""
        return self._call(model, sampler, objective, dict(inputs), engine=engine, surrogate=True)

    def _call(
        self,
        model: torch.nn.Module,
        flow: AffineSampler,
        objective: Objective,
        inputs: dict[str, Any],
        *,
        engine: str,
        surrogate: bool,
    ) -> Any:
        from gradest.registry import estimator

        kind = "terminal" if isinstance(objective, TerminalObjective) else "stepwise"
        key = (repr(self), *_signature(model, flow, kind, inputs))
        with _LOCK:
            schedule = _SCHEDULES.setdefault(key, _Schedule())
            schedule.calls += 1
            due = schedule.choice is None or (schedule.calls - 1) % self.recheck_every == 0
            if due and schedule.choice is not None:
                schedule.choice, schedule.probes_done = None, 0  # a recheck starts over
                schedule.measured, schedule.exact_grads = {}, []
            probing = schedule.choice is None
        if probing:
            # The probe's path: the given recording, or sampled once here from the noise
            # (with the caller's generator, as exact would), shared by every candidate.
            trajectory = inputs.get("trajectory")
            if trajectory is None:
                trajectory = rollout(
                    model,
                    flow,
                    inputs["noise"],
                    cond=inputs.get("cond"),
                    generator=inputs.get("generator"),
                )
            on_path = {k: v for k, v in inputs.items() if k != "noise"} | {"trajectory": trajectory}
            exact, probe_cost = self._probe(
                model, flow, objective, kind, on_path, inputs.get("noise"), schedule
            )
            choice = "exact"
            result: Any
            if surrogate:
                result = estimator(choice).surrogate(
                    model, flow, objective, engine=engine, **on_path
                )
                result = attrs.evolve(result, cost=result.cost + probe_cost)
            else:
                # The gradient the candidates were measured against; its cost is the probe's.
                result = attrs.evolve(exact, cost=probe_cost)
        else:
            assert schedule.choice is not None
            choice = schedule.choice
            chosen: Any = estimator(choice)
            if surrogate:
                result = chosen.surrogate(model, flow, objective, engine=engine, **inputs)
            else:
                result = chosen.estimate(model, flow, objective, engine=engine, **inputs)
        info = {
            **result.info,
            # Flat strings and flags, so training logs keep them (gradest finetune does).
            "auto_choice": choice,
            "auto_probing": probing,
            "auto_selected": schedule.choice or "",
            "auto_reason": schedule.reason,
            "auto_measurements": schedule.table,
        }
        return attrs.evolve(
            result,
            info=info,
            decisions=AutoDecisions(choice=choice, probing=probing, inner=result.decisions),
        )

    # -- probing and choosing ---------------------------------------------------------------

    def _eligible(self, flow: AffineSampler, kind: str) -> list[str]:
        from gradest.registry import estimator

        eligible = []
        for spec in self.candidates:
            est = estimator(spec)
            if not supports(est, kind):
                continue
            try:
                check_steps(est, flow.num_steps)
            except InvalidValue:
                continue
            eligible.append(spec)
        return eligible or ["exact"]

    def _probe(
        self,
        model: torch.nn.Module,
        flow: AffineSampler,
        objective: Objective,
        kind: str,
        inputs: Mapping[str, Any],
        noise: torch.Tensor | None,
        schedule: _Schedule,
    ) -> tuple[GradientEstimate, Cost]:
        """Measure every eligible candidate against exact on this batch's path; choose
        after the last probe batch. Returns exact's estimate on the path and the cost of
        the whole probe (every estimate it made, exact's included), which the probing
        call reports as its cost, so training logs count what probing spends.

        The gradients are compared on the recorded path (every candidate sees the same
        states). When training samples from ``noise``, the cost is measured from the
        noise too, since estimators differ in how they sample (exact and jagg keep the
        sampling graph, truncation samples its head without one, sdo all of it).
        """
        from gradest.registry import estimator

        common = {k: v for k, v in inputs.items() if k != "generator"}
        exact = estimator("exact").estimate(model, flow, objective, **common)
        reference = exact.flat()
        sampled = (
            None
            if noise is None
            else {k: v for k, v in common.items() if k != "trajectory"} | {"noise": noise}
        )

        spent = [exact.cost]

        def units_of(est: Any, draw: int) -> float:
            """Model units of one estimate sampling from the noise itself."""
            assert sampled is not None
            generator = torch.Generator().manual_seed(1000 * schedule.probes_done + draw)
            result = est.estimate(model, flow, objective, generator=generator, **sampled)
            spent.append(result.cost)
            return float(result.cost.model_units())

        exact_units = (
            exact.cost.model_units() if sampled is None else units_of(estimator("exact"), 0)
        )
        probe = schedule.probes_done
        measured: dict[str, tuple[list[torch.Tensor], float]] = {}
        for spec in self._eligible(flow, kind):
            est = estimator(spec)
            results = [
                est.estimate(
                    model,
                    flow,
                    objective,
                    generator=torch.Generator().manual_seed(1000 * probe + draw),
                    **common,
                )
                for draw in range(self.draws)
            ]
            spent += [r.cost for r in results]
            if sampled is None:
                units = sum(r.cost.model_units() for r in results) / len(results)
            else:
                units = sum(units_of(est, draw) for draw in range(self.draws)) / self.draws
            measured[spec] = ([r.flat() for r in results], units / exact_units)
        with _LOCK:
            schedule.exact_grads.append(reference)
            moment = second_moment(schedule.exact_grads, TensorLayout.of(exact.grads))
            for spec, (flats, cost) in measured.items():
                stats = trajectory_stats(flats, reference)
                if self.metric == "adam_cosine":
                    progress = mean_of(adam_cosine(f, reference, moment) for f in flats)
                else:
                    progress = stats.cosine
                record = schedule.measured.setdefault(spec, _Measured())
                record.progress.append(progress)
                record.bias.append(stats.bias_squared**0.5)
                record.cost.append(cost)
            schedule.probes_done += 1
            if schedule.probes_done >= self.probe_batches:
                self._choose(model, schedule)
        return exact, sum(spent[1:], spent[0])

    def _choose(self, model: torch.nn.Module, schedule: _Schedule) -> None:
        table = {spec: record.summary() for spec, record in schedule.measured.items()}
        cheapest = min(row["cost"] for row in table.values())
        within = {
            spec: row
            for spec, row in table.items()
            if (self.max_bias is None or row["bias"] <= self.max_bias)
            and (self.min_progress is None or row["progress"] >= self.min_progress)
            and (self.max_slowdown is None or row["cost"] <= self.max_slowdown * cheapest)
        }
        note = ""
        if not within:
            within = table
            note = " (no candidate met the budget; chose among all)"
        scores = {spec: max(row["progress"], 0.0) / row["cost"] for spec, row in within.items()}
        order = list(table)
        best = max(scores, key=lambda spec: scores[spec])
        # Data-parallel ranks must use the same estimator: rank 0's pick.
        (index,) = RankAgreement(model).same_ints([order.index(best)])
        best = order[index]
        row = table[best]
        schedule.choice = best
        schedule.table = {
            spec: {**row, "score": scores.get(spec, 0.0)} for spec, row in table.items()
        }
        schedule.reason = (
            f"best {self.metric.replace('_', ' ')} per unit cost within the budget{note}: "
            f"{best} (progress {row['progress']:.3f}, cost {row['cost']:.3f}x exact, "
            f"bias {row['bias']:.3g}); {len(table)} candidates over "
            f"{schedule.probes_done} probe batch(es)"
        )

    # -- the contract -----------------------------------------------------------------------

    def definition(self, chain: Any, objective: Objective, decisions: AutoDecisions) -> Definition:
        """The chosen estimator's definition at its own decisions."""
        from gradest.registry import estimator

        chosen: Any = estimator(decisions.choice)
        return chosen.definition(chain, objective, decisions.inner)


def _signature(
    model: torch.nn.Module, flow: AffineSampler, kind: str, inputs: Mapping[str, Any]
) -> tuple[Any, ...]:
    """What the choice is cached by: the trainable parameters, the sampler, the objective
    kind and the state shape."""
    params = tuple(
        (name, tuple(p.shape), str(p.dtype))
        for name, p in model.named_parameters()
        if p.requires_grad
    )
    source = inputs.get("noise")
    if source is None and isinstance(inputs.get("trajectory"), Trajectory):
        source = inputs["trajectory"].states[0]
    shape = tuple(source.shape[1:]) if isinstance(source, torch.Tensor) else None
    grid = tuple(float(t) for t in flow.times)
    return (type(model).__name__, params, type(flow).__name__, grid, kind, shape)


__all__ = ["Auto", "AutoDecisions", "clear_cache"]
