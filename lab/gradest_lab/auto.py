"""``auto``: measure the candidates on the user's own model, then use the best one.

The first ``probe_batches`` calls (and ``probe_batches`` calls every ``recheck_every``
calls after that) are **probes**: on that call's minibatch the exact gradient is computed
on the sampled path, and every candidate estimator is drawn ``draws`` times on the same
path and measured against it (:mod:`gradest.harness.statistics`):

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
work plus every candidate's times ``draws`` (docs/design.md#cost-formulas, row ``auto``;
a candidate equal to ``exact`` reuses the reference and costs nothing), and the probing
call's ``result.cost`` says so. ``estimate`` and ``surrogate`` share one schedule: on the
same model the first call of either probes (and gives exact's gradient or loss), the next
one runs the pick.

**What a probe costs, said before it runs.** Before any of a probing call's work (its
path's sampling included) a line at INFO on the ``logging`` logger ``"gradest.auto"`` says
what the call is expected to cost, in exact calls and in model units at the cost model's
``3N`` per exact call. After the exact reference (the call's own gradient) the probe plans
its candidate draws, predicting each candidate call at exact's measured cost on this call
(later draws of a candidate at the most its earlier draws cost), and states that plan
before any candidate runs: ``info["auto_probe_planned_units"]`` and a second INFO line;
after it, ``info["auto_probe_units"]`` is what it spent (a third line). Python shows INFO
only where logging is configured (``logging.basicConfig(level=logging.INFO)``; the
recipes show these lines when ``--estimator auto``). Units are model units, forward-equivalents
as :meth:`gradest.Cost.model_units` counts them (an exact call is ``3N`` of them).
``probe_budget`` bounds one probing call's units; see :class:`Auto`.

The schedule belongs to the ``Auto`` instance (:class:`ProbeSchedules`, thread-safe; no
module state): build the estimator once and reuse it across training steps, as one does
an optimizer; a new instance starts a new schedule (it probes again). Within an instance
the choice is kept per model *instance* (a weak reference: it never keeps a model alive)
and its trainable parameters' identity (names, object ids, shapes and dtypes of the
parameters with ``requires_grad``: a differently initialised second model, or one whose
parameters were replaced, probes again), the sampler and its grid, the objective kind and
the state shape. :meth:`Auto.reset` forgets the instance's picks (on one model, or all);
:meth:`Auto.state_dict` / :meth:`Auto.load_state_dict` save and restore one model's
schedule (a checkpoint); a copy or an unpickled ``Auto`` starts with none. Under data
parallelism rank 0's choice is taken by every rank. ``info`` says what was used (``auto_choice``,
``auto_probing``), what was picked and why (``auto_selected``, ``auto_reason``), every
candidate's measurements (``auto_measurements``) and the probe's work
(``auto_probe_planned_units``, ``auto_probe_units``, ``auto_probe_draws``,
``auto_probe_dropped``; zero and empty on calls that do not probe), and the candidates
that cannot run on this objective or chain, each with why (``auto_probe_skipped``,
separated by `` | ``);
``result.decisions`` is :class:`AutoDecisions` (the choice and its own decisions).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import reprlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from gradest import (
    AffineSampler,
    InvalidType,
    InvalidValue,
    TerminalObjective,
    Trajectory,
    rollout,
)
from gradest.harness import TensorLayout, adam_cosine, mean_of, second_moment, trajectory_stats
from gradest.plugin import (
    Cost,
    Decisions,
    Definition,
    EstimatorAxes,
    EstimatorBase,
    GradientEstimate,
    Objective,
    RankAgreement,
    check_estimate_grads,
    check_steps,
    check_surrogate,
    choice_option,
    int_option,
    is_symbolic,
    option,
    optional_float_option,
    supports,
    trainable_parameters,
)

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
    (:func:`gradest.plugin.split_spec_list`), inside a spec wrapped in parentheses:
    ``auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)``."""
    from gradest.plugin import split_spec_list

    return tuple(split_spec_list(text, what="auto option candidates"))


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


_LOG = logging.getLogger("gradest.auto")

Signature = tuple[Any, ...]
"""What a schedule is kept by within one model (:func:`_signature`)."""


class ProbeSchedules:
    """The probe schedules of one :class:`Auto` instance: model -> {signature: schedule}.

    Weak in the model, so a model that is dropped takes its schedules with it; a model
    that cannot be weakly referenced is held strongly (alive for as long as its schedules
    are, until :meth:`reset`). Thread-safe: the mapping and every schedule in it are read
    and written under :attr:`lock` (one lock per instance, never held while a model runs).

    A copy (``copy.copy``, ``copy.deepcopy``, pickle; of the ``Auto`` that owns it too)
    starts empty: a schedule is kept by model *objects* and their parameters' ids, which a
    copy (another process, copied models) does not share. To carry a schedule over, use
    :meth:`Auto.state_dict` / :meth:`Auto.load_state_dict`, which name the parameters.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary[Any, dict[Signature, _Schedule]] = (
            weakref.WeakKeyDictionary()
        )
        self._strong: dict[int, tuple[Any, dict[Signature, _Schedule]]] = {}

    def __reduce__(self) -> tuple[type[ProbeSchedules], tuple[()]]:
        return (type(self), ())  # a copy starts empty (see the class)

    def for_model(self, model: Any) -> dict[Signature, _Schedule]:
        """The schedules of ``model`` (created empty); call under :attr:`lock`."""
        try:
            per_model = self._weak.get(model)
            if per_model is None:
                per_model = self._weak[model] = {}
            return per_model
        except TypeError:  # not weakly referenceable
            return self._strong.setdefault(id(model), (model, {}))[1]

    def replace(self, model: Any, schedules: Mapping[Signature, _Schedule]) -> None:
        """Make ``schedules`` the whole of ``model``'s, under the lock."""
        with self.lock:
            table = self.for_model(model)
            table.clear()
            table.update(schedules)

    def reset(self, model: Any = None) -> None:
        """Forget the schedules of ``model``, or of every model when None."""
        with self.lock:
            if model is None:
                self._weak.clear()
                self._strong.clear()
                return
            try:
                self._weak.pop(model, None)
            except TypeError:  # not weakly referenceable
                self._strong.pop(id(model), None)

    def __len__(self) -> int:
        """How many models have schedules here."""
        with self.lock:
            return len(self._weak) + len(self._strong)


@attrs.frozen
class Auto(EstimatorBase):
    """Measure the candidate estimators on your model and use the best within a budget.

    Preferred for long runs on a model whose best estimator is unknown: its probes (exact
    plus each candidate's draws on a few minibatches, repeated every ``recheck_every``
    calls) pay back over hundreds of steps. Not recommended for short budgets (a probe at
    the defaults costs many exact steps; cap it with ``probe_budget``) or where progress
    per unit cost on one batch does not predict reward at equal compute: race the
    candidates instead (``gradest race``).

    Source: gradest's own measuring policy (no paper); the candidates cite theirs.

    What it optimises: predicted progress per unit cost, ``max(progress, 0) / cost``, where
    progress is the mean cosine of one draw to the exact gradient after Adam-style
    normalisation (``metric="adam_cosine"``; ``"cosine"``: the plain one) and cost is the
    candidate's model units as a ratio to exact's. Bias is not in the score: it lowers a
    biased candidate's cosine, but only ``max_bias`` excludes biased candidates (the
    default, None, does not), and ``min_progress`` / ``max_slowdown`` are further filters.
    Progress per unit cost favours cheap, noisy candidates (they need more steps for the
    same reward); a proxy for a step's progress, not validated against reward.

    Attributes:
        candidates: estimator specs to choose from; in a spec string the one list syntax
            (:func:`gradest.plugin.split_spec_list`) in parentheses, e.g.
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
        probe_budget: at most this many model units (forward-equivalents,
            :meth:`gradest.Cost.model_units`; one exact call is ``3N``) of work in one
            probing call, the exact reference included (None, the default: no bound).
            The plan predicts every candidate call at exact's cost on this call; when it
            would exceed the budget the probe takes fewer draws (the most, from ``draws``
            down to 2, that fit), then, at 2 draws, only the first candidates in the
            order given that fit (the rest are listed in ``info["auto_probe_dropped"]``);
            while it runs, a draw predicted (at the most that candidate cost so far) to
            overrun the budget is not taken, and a candidate left with fewer than 2
            draws is dropped. When not even 2 draws of one candidate fit it raises
            ``InvalidValue`` naming ``probe_budget``. A candidate whose first call costs
            more than exact (jagg falling back, checkpointing) can overrun the budget by
            that call's excess. Why no bound by default: units scale with the model and
            ``N``, so no one number fits every chain; the default probe (5 candidates
            besides exact x 4 draws, on the path and from noise) plans 42 exact calls
            (21 on a recorded ``trajectory=``), and every
            probe says what it plans before it runs (``info``, the ``"gradest.auto"``
            logger) so that a training script can decide. ``probe_budget=20 * 3 * N``
            bounds a probe to about 20 exact calls.
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
    probe_budget: float | None = optional_float_option(
        minimum=0,
        doc="at most this many model units in one probing call (None: no bound); fewer "
        "draws, then fewer candidates, to fit",
    )

    def __attrs_post_init__(self) -> None:
        from gradest import estimator

        self._own_schedules()
        for spec in self.candidates:
            if spec.partition(":")[0] == self.name:
                raise InvalidValue(f"estimator 'auto': candidates={self.candidates!r} holds auto")
            estimator(spec)  # an unknown name or a bad option fails here, not mid-training

    # -- the schedules this instance owns ----------------------------------------------------

    # Not an attrs field (nor annotated here, which would make it one): the options are
    # the fields, which specs, equality, hashing, the repr, `gradest list` and
    # `option_names` read, and the schedules are state, not an option. The instance keeps
    # them in its __dict__ (EstimatorBase has no __slots__); pickling and copying carry the
    # options only, and the copy gets new, empty schedules (see ProbeSchedules).

    def _own_schedules(self) -> None:
        object.__setattr__(self, "_schedules", ProbeSchedules())

    def __getstate__(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in attrs.fields(type(self))}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._own_schedules()

    @property
    def schedules(self) -> ProbeSchedules:
        """This instance's probe schedules (its picks, calls and probes, per model)."""
        schedules: ProbeSchedules = self.__dict__["_schedules"]
        return schedules

    def reset(self, model: torch.nn.Module | None = None) -> None:
        """Forget this instance's picks, on ``model`` only when given: the next call
        probes again. Other instances (equal ones included) keep theirs."""
        self.schedules.reset(model)

    # -- the schedule of one model, saved and restored (resume bit for bit) ------------------

    STATE_FORMAT: ClassVar[str] = "gradest.auto.schedule/1"

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """This instance's schedules on ``model``, as plain data: the pick, the
        reason, the calls so far, the probe in progress and its measurements.

        Saved in a training checkpoint (``torch.save``; it loads with ``weights_only=True``)
        and restored by :meth:`load_state_dict` on the resumed model, a run continues the
        same schedule (the same probes at the same calls) as an uninterrupted one. The
        parameters are named, not identified by object, so the state fits a new model
        instance with the same trainable parameters.
        """
        mine = repr(self)
        schedules = []
        with self.schedules.lock:  # a consistent copy, even while another thread probes
            for key, schedule in self.schedules.for_model(model).items():
                model_name, params, *rest = key
                schedules.append(
                    {
                        "signature": [
                            model_name,
                            [[name, list(shape), dtype] for name, _, shape, dtype in params],
                            *[list(part) if isinstance(part, tuple) else part for part in rest],
                        ],
                        "choice": schedule.choice,
                        "reason": schedule.reason,
                        "calls": schedule.calls,
                        "probes_done": schedule.probes_done,
                        "measured": {
                            spec: {
                                "progress": list(m.progress),
                                "bias": list(m.bias),
                                "cost": list(m.cost),
                            }
                            for spec, m in schedule.measured.items()
                        },
                        "exact_grads": [g.detach().clone() for g in schedule.exact_grads],
                        "table": {spec: dict(row) for spec, row in schedule.table.items()},
                    }
                )
        return {"format": self.STATE_FORMAT, "auto": mine, "schedules": schedules}

    def load_state_dict(self, model: torch.nn.Module, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s schedules on ``model`` (replacing this instance's
        schedules there).

        The state is checked whole against the schema :meth:`state_dict` writes before
        any of it is kept (:class:`_StateReader`): the keys of every record (none
        missing, none unknown), every field's type (an int is an int, not a bool or a
        float; a float is finite), its bounds (counts at least 0, cosines within
        [-1, 1], costs above 0), the signature's trainable parameters (this model's, in
        order, of the same shapes and dtypes), the specs measured (among this auto's
        candidates) and the choice (one its table holds), the counts agreeing
        (one exact gradient per probe) and the gradients (1-D, one value per trainable
        parameter entry, the parameters' dtype, finite). A refused state changes
        nothing: the schedules there before stay. The gradients are moved to the
        parameters' device (a checkpoint is often loaded onto the CPU).

        Raises:
            InvalidType: a field of the wrong type (a list where a mapping belongs, a
                bool or a float where an int does, a string where a number does).
            InvalidValue: ``state`` is not an ``auto`` schedule of this configuration,
                is not of this model's trainable parameters, or a field is missing,
                unknown, out of its bounds or disagrees with another. Each is one line
                naming the field's path in ``state`` (``state['schedules'][0]['choice']``),
                its value and what is expected.
        """
        restored = _StateReader(self, model).state(state)
        self.schedules.replace(model, restored)  # only once every schedule is read

    # -- a whole call, handed to the estimator this call runs -----------------------------

    @staticmethod
    def _refuse_symbolic(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """``auto`` measures candidates on real values: refuse fake/meta tensors."""
        trajectory = inputs.get("trajectory")
        tensors = [inputs.get("noise"), getattr(trajectory, "states", None)]
        if isinstance(model, torch.nn.Module):
            tensors += list(model.parameters())[:1]
        if any(is_symbolic(t) for t in tensors):
            raise InvalidValue(
                "estimator 'auto' measures its candidates on real values and cannot run on "
                "fake/meta tensors; pick an estimator (e.g. 'exact') to trace costs"
            )

    def _whole_call(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        inputs: dict[str, Any],
        *,
        engine: str,
        surrogate: bool,
    ) -> Any:
        """The base class's two verbs hand every call here (after their own checks of the
        arguments): a probe returns exact's gradient or loss on the probed path, any
        other call the pick's."""
        from gradest import estimator
        from gradest.plugin import is_builtin

        self._refuse_symbolic(model, inputs)
        kind = "terminal" if isinstance(objective, TerminalObjective) else "stepwise"
        key = _signature(model, sampler, kind, inputs)
        with self.schedules.lock:
            schedule = self.schedules.for_model(model).setdefault(key, _Schedule())
            schedule.calls += 1
            due = schedule.choice is None or (schedule.calls - 1) % self.recheck_every == 0
            if due and schedule.choice is not None:
                schedule.choice, schedule.probes_done = None, 0  # a recheck starts over
                schedule.measured, schedule.exact_grads = {}, []
            probing = schedule.choice is None
            probe_number = schedule.probes_done + 1
        if probing:
            # Said before any of the probe's work (the path's sampling included), so that a
            # training script shows what the call will cost before it spends it.
            self._announce(sampler, kind, probe_number, sampled=inputs.get("noise") is not None)
            # The probe's path: the given recording, or sampled once here from the noise
            # (with the caller's generator, as exact would), shared by every candidate.
            trajectory = inputs.get("trajectory")
            if trajectory is None:
                trajectory = rollout(
                    model,
                    sampler,
                    inputs["noise"],
                    cond=inputs.get("cond"),
                    generator=inputs.get("generator"),
                )
            on_path = {k: v for k, v in inputs.items() if k != "noise"} | {"trajectory": trajectory}
            exact, probe_cost, probe_info = self._probe(
                model, sampler, objective, kind, on_path, inputs.get("noise"), schedule
            )
            choice = "exact"
            result: Any
            if surrogate:
                # The loss to train on: exact's, on the probed path (its work is on top of
                # the probe's, which result.cost includes).
                result = estimator(choice).surrogate(
                    model, sampler, objective, engine=engine, **on_path
                )
                result = attrs.evolve(result, cost=result.cost + probe_cost)
            else:
                # The gradient the candidates were measured against; its cost is the probe's.
                result = attrs.evolve(exact, cost=probe_cost)
        else:
            assert schedule.choice is not None
            choice = schedule.choice
            probe_info = _no_probe()
            chosen: Any = estimator(choice)
            if surrogate:
                result = chosen.surrogate(model, sampler, objective, engine=engine, **inputs)
                if not is_builtin(chosen):  # built-ins build their own losses
                    check_surrogate(chosen, result)
            else:
                result = chosen.estimate(model, sampler, objective, engine=engine, **inputs)
                if not is_builtin(chosen):  # built-ins check their own results
                    check_estimate_grads(chosen, result, trainable_parameters(model))
        info = {
            **result.info,
            # Flat strings and flags, so training logs keep them (gradest finetune does).
            "auto_choice": choice,
            "auto_probing": probing,
            "auto_selected": schedule.choice or "",
            "auto_reason": schedule.reason,
            "auto_measurements": schedule.table,
            **probe_info,
        }
        return attrs.evolve(
            result,
            info=info,
            decisions=AutoDecisions(choice=choice, probing=probing, inner=result.decisions),
        )

    # -- probing and choosing ---------------------------------------------------------------

    def _eligible(self, sampler: AffineSampler, kind: str) -> tuple[list[str], list[str]]:
        """The candidates that can run on this objective and chain (``exact`` when none
        can), and a phrase per candidate that cannot, with why."""
        from gradest import estimator

        eligible, skipped = [], []
        for spec in self.candidates:
            est = estimator(spec)
            if not supports(est, kind):
                skipped.append(f"{spec} (takes no {kind} objective)")
                continue
            try:
                check_steps(est, sampler.num_steps)
            except InvalidValue as err:
                skipped.append(f"{spec} ({err})")
                continue
            eligible.append(spec)
        return eligible or ["exact"], skipped

    def _probe(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        kind: str,
        inputs: Mapping[str, Any],
        noise: torch.Tensor | None,
        schedule: _Schedule,
    ) -> tuple[GradientEstimate, Cost, dict[str, Any]]:
        """Measure the eligible candidates against exact on this batch's path; choose
        after the last probe batch. Returns exact's estimate on the path, the cost of the
        whole probe (every estimate it made, exact's included), which the probing call
        reports as its cost, so training logs count what probing spends, and the probe's
        ``info`` entries (planned and spent units, draws, dropped candidates).

        The gradients are compared on the recorded path (every candidate sees the same
        states). When training samples from ``noise``, the cost is measured from the
        noise too, since estimators differ in how they sample (exact and jagg keep the
        sampling graph, truncation samples its head without one, sdo all of it).

        Order (deterministic): exact on the path (the reference), exact from the noise
        (the cost baseline, when sampling from noise), the plan (logged), then per
        candidate in the order given its draws, each on the path and then from the noise,
        with generator seeds ``1000 * probe + draw``. A candidate equal to ``exact``
        reuses the reference.
        """
        from gradest import estimator

        common = {k: v for k, v in inputs.items() if k != "generator"}
        exact_est = estimator("exact")
        exact = exact_est.estimate(model, sampler, objective, **common)
        reference = exact.flat()
        sampled = (
            None
            if noise is None
            else {k: v for k, v in common.items() if k != "trajectory"} | {"noise": noise}
        )
        probe = schedule.probes_done

        def generator(draw: int) -> torch.Generator:
            return torch.Generator().manual_seed(1000 * probe + draw)

        spent = [exact.cost]

        def units_spent() -> float:
            return float(sum(cost.model_units() for cost in spent))

        path_units = float(exact.cost.model_units())
        noise_units = 0.0
        if sampled is not None:
            # Exact's cost from the noise: the baseline of the candidates' cost ratios.
            from_noise = exact_est.estimate(
                model, sampler, objective, generator=generator(0), **sampled
            )
            spent.append(from_noise.cost)
            noise_units = float(from_noise.cost.model_units())
        exact_units = noise_units if sampled is not None else path_units

        eligible, skipped = self._eligible(sampler, kind)
        reused = [spec for spec in eligible if estimator(spec) == exact_est]
        drawn = [spec for spec in eligible if spec not in reused]
        draws, kept = self._plan(units_spent(), path_units + noise_units, drawn)
        dropped = [spec for spec in drawn if spec not in kept]
        planned = units_spent() + draws * len(kept) * (path_units + noise_units)
        budget = (
            "no probe_budget"
            if self.probe_budget is None
            else f"probe_budget {self.probe_budget:g}"
        )
        _LOG.info(
            "auto: probing %d candidate(s) x %d draws on this call: planned %.0f model units "
            "(%.1fx an exact call's %.0f; %s)%s%s",
            len(kept),
            draws,
            planned,
            planned / path_units,
            path_units,
            budget,
            f"; dropped to fit: {', '.join(dropped)}" if dropped else "",
            f"; cannot run here: {' | '.join(skipped)}" if skipped else "",
        )

        measured: dict[str, tuple[list[torch.Tensor], float]] = {
            spec: ([reference, reference], 1.0) for spec in reused
        }
        for spec in kept:
            est = estimator(spec)
            flats: list[torch.Tensor] = []
            on_path: list[float] = []
            from_noise_units: list[float] = []
            for draw in range(draws):
                predicted = max(on_path, default=path_units) + (
                    0.0 if sampled is None else max(from_noise_units, default=noise_units)
                )
                if self.probe_budget is not None and units_spent() + predicted > self.probe_budget:
                    break
                result = est.estimate(
                    model, sampler, objective, generator=generator(draw), **common
                )
                # A candidate's (a plugin's) gradients cover every trainable parameter.
                check_estimate_grads(est, result, trainable_parameters(model))
                spent.append(result.cost)
                flats.append(result.flat())
                on_path.append(float(result.cost.model_units()))
                if sampled is not None:
                    # Model units of one estimate sampling from the noise itself.
                    again = est.estimate(
                        model, sampler, objective, generator=generator(draw), **sampled
                    )
                    spent.append(again.cost)
                    from_noise_units.append(float(again.cost.model_units()))
            if len(flats) < 2:
                dropped.append(spec)
                continue
            units = mean_of(from_noise_units if sampled is not None else on_path)
            measured[spec] = (flats, units / exact_units)
        with self.schedules.lock:
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
        total = sum(spent[1:], spent[0])
        _LOG.info(
            "auto: the probe spent %.0f model units (planned %.0f)%s",
            total.model_units(),
            planned,
            f"; picked {schedule.choice}" if schedule.choice else "",
        )
        info = {
            "auto_probe_planned_units": float(planned),
            "auto_probe_units": float(total.model_units()),
            "auto_probe_draws": draws,
            "auto_probe_dropped": ",".join(dropped),
            "auto_probe_skipped": " | ".join(skipped),
        }
        return exact, total, info

    def _announce(self, sampler: AffineSampler, kind: str, probe: int, *, sampled: bool) -> None:
        """Log (INFO, ``"gradest.auto"``) what this probing call is expected to cost, before
        it runs: in exact calls and in model units at the cost model's ``3N`` per exact
        call. A prediction; the plan from exact's measured cost on this call follows the
        reference (:meth:`_probe`), the units spent follow the probe."""
        if not _LOG.isEnabledFor(logging.INFO):
            return
        from gradest import estimator

        exact_est = estimator("exact")
        drawn = [spec for spec in self._eligible(sampler, kind)[0] if estimator(spec) != exact_est]
        sources = 2 if sampled else 1  # on the path, and from the noise when sampling
        unit = 3.0 * sampler.num_steps
        budget = "no probe_budget"
        draws, kept = self.draws, drawn
        if self.probe_budget is not None:
            budget = f"probe_budget {self.probe_budget:g}"
            try:
                draws, kept = self._plan(sources * unit, sources * unit, drawn)
            except InvalidValue:
                budget += " (too small, unless exact costs less than 3N here)"
        calls = sources * (1 + draws * len(kept))
        _LOG.info(
            "auto: probe %d of %d on this call, before it trains: about %d exact calls' work, "
            "%.0f model units at 3N = %.0f per exact call (the exact reference, then %d "
            "candidate(s) x %d draws%s; %s)",
            probe,
            self.probe_batches,
            calls,
            calls * unit,
            unit,
            len(kept),
            draws,
            ", each on the path and from the noise" if sampled else "",
            budget,
        )

    def _plan(self, base: float, per_draw: float, drawn: list[str]) -> tuple[int, list[str]]:
        """Draws per candidate and the candidates to draw, so that ``base`` (the reference
        work done) plus ``draws x candidates x per_draw`` (each draw predicted at exact's
        cost) fits ``probe_budget``: the most draws from ``draws`` down to 2, then at 2 draws
        the longest prefix of ``drawn``; raises when not even one candidate fits."""
        budget = self.probe_budget
        if budget is None or not drawn:
            return self.draws, list(drawn)
        for draws in range(self.draws, 1, -1):
            if base + draws * len(drawn) * per_draw <= budget:
                return draws, list(drawn)
        fit = int((budget - base) // (2 * per_draw)) if budget > base else 0
        if fit < 1:
            need = base + 2 * per_draw
            raise InvalidValue(
                f"estimator 'auto': probe_budget={budget:g} model units is below the smallest "
                f"probe on this model, {need:g} (the exact reference {base:g} plus 2 draws of "
                f"one candidate at exact's {per_draw:g}); raise probe_budget or set it to None"
            )
        return 2, list(drawn[:fit])

    def _choose(self, model: torch.nn.Module, schedule: _Schedule) -> None:
        table = {spec: record.summary() for spec, record in schedule.measured.items()}
        if not table:  # every candidate was dropped to fit probe_budget
            schedule.choice, schedule.table = "exact", {}
            schedule.reason = (
                f"no candidate fit probe_budget={self.probe_budget:g}: exact over "
                f"{schedule.probes_done} probe batch(es)"
            )
            return
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
        from gradest import estimator

        chosen: Any = estimator(decisions.choice)
        return chosen.definition(chain, objective, decisions.inner)


# -- reading a saved schedule back (Auto.load_state_dict) -----------------------------------

_MISSING: Any = object()
"""A field the state lacks (a refusal shows it as ``missing``)."""

_RESAVE = "save the state with auto.state_dict(model) and load it unchanged"
_OTHER_MODEL = (
    "load it into a model like the one it was saved from (the same class and trainable "
    "parameters), or save this model's with auto.state_dict(model)"
)
_OTHER_AUTO = "load it into an auto of the options it was saved with"

_ROUNDING = 1e-6
"""How far a saved cosine may lie past +-1: it is computed in float64 and rounds there
(a draw equal to its reference measures 1.0000000000000004)."""

_STATE_KEYS = ("format", "auto", "schedules")
# Derived from the records state_dict writes, so that the schema cannot drift from them.
_SCHEDULE_KEYS = ("signature", *(field.name for field in attrs.fields(_Schedule)))
_MEASURES = tuple(field.name for field in attrs.fields(_Measured))
_ROW_KEYS = (*_MEASURES, "score")
_SIGNATURE_PARTS = (
    "the model class",
    "its trainable parameters",
    "the sampler class",
    "its time grid",
    "the objective kind",
    "the state shape",
)
_KINDS = ("terminal", "stepwise")


def _bounds(measure: str) -> tuple[str, Callable[[float], bool]]:
    """What a saved measurement (a table's score too) may be, and the test of it; every
    one is finite besides."""
    if measure == "progress":
        return "a finite float in [-1, 1] (a cosine)", lambda v: abs(v) <= 1 + _ROUNDING
    if measure == "cost":
        # The score divides by it: a cost of 0 would fail the next pick, not this load.
        return "a finite float > 0 (units as a ratio to exact's)", lambda v: v > 0
    what = "a relative bias" if measure == "bias" else "progress per unit cost"
    return f"a finite float >= 0 ({what})", lambda v: v >= 0


class _ShortRepr(reprlib.Repr):
    """:mod:`reprlib`'s truncated repr, with a tensor described (dtype, shape), not printed."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = limit
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 4
        self.maxlevel = 3

    def repr_Tensor(self, value: torch.Tensor, level: int) -> str:  # noqa: N802 - reprlib's name
        return f"<{_tensor_text(value)}>"


def _tensor_text(value: torch.Tensor) -> str:
    dtype = str(value.dtype).removeprefix("torch.")
    where = "" if value.device.type == "cpu" else f" on {value.device}"
    layout = "" if value.layout == torch.strided else f" ({value.layout})"
    return f"{dtype} tensor of shape {tuple(value.shape)}{where}{layout}"


def _short(value: Any, limit: int) -> str:
    """``value``'s repr on one line (a nested tensor's repr would span lines), at most
    about ``limit`` characters."""
    text = " ".join(_ShortRepr(limit).repr(value).split())
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as a refusal shows it: its repr truncated to about ``limit`` characters
    and its type named (``True (a bool)``), a tensor by its dtype and shape."""
    if value is _MISSING:
        return "missing"
    if isinstance(value, torch.Tensor):
        return f"a {_tensor_text(value)}"
    text = _short(value, limit)
    if value is None or isinstance(value, str):
        return text
    noun = type(value).__name__
    return f"{text} ({'an' if noun[:1] in 'aeiouAEIOU' else 'a'} {noun})"


def _at(path: str, key: Any) -> str:
    """The path of ``key`` within the field at ``path``: ``state['schedules'][0]``."""
    return f"{path}[{_short(key, 80)}]"


def _listed(values: Sequence[Any]) -> str:
    return ", ".join(repr(value) for value in values)


def _refusal(
    path: str,
    value: Any,
    expected: str,
    *,
    wrong_type: bool = False,
    fix: str = _RESAVE,
    problem: str | None = None,
    limit: int = 80,
) -> InvalidValue | InvalidType:
    """The one-line error for the field at ``path``: its value (``problem`` when a value
    alone does not say what is wrong), what is expected and how to get it. A field of the
    wrong type is an :class:`InvalidType`; a missing one, or one of the right type that
    does not fit, an :class:`InvalidValue`."""
    error = InvalidType if wrong_type and value is not _MISSING else InvalidValue
    said = problem or f"is {_shown(value, limit)}"
    return error(
        f"estimator 'auto' cannot load the saved schedule: {path} {said}, expected "
        f"{expected}; {fix}"
    )


def _record(path: str, value: Any, keys: Sequence[str]) -> Mapping[str, Any]:
    """``value``, a mapping with exactly ``keys``."""
    if not isinstance(value, Mapping):
        raise _refusal(path, value, f"a mapping with the keys {_listed(keys)}", wrong_type=True)
    for key in value:
        if key not in keys:
            raise _refusal(_at(path, key), value[key], f"only the keys {_listed(keys)}")
    for key in keys:
        if key not in value:
            raise _refusal(_at(path, key), _MISSING, f"every one of the keys {_listed(keys)}")
    return value


def _items(path: str, value: Any, what: str) -> Sequence[Any]:
    """``value``, a list (or a tuple) of ``what``."""
    if not isinstance(value, list | tuple):
        raise _refusal(path, value, f"a list of {what}", wrong_type=True)
    return value


def _int(path: str, value: Any, what: str, minimum: int = 0) -> int:
    """``value``, an int (not a bool, not a float) of at least ``minimum``."""
    expected = f"an int >= {minimum} ({what})"
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refusal(path, value, expected, wrong_type=True)
    if value < minimum:
        raise _refusal(path, value, expected)
    return value


def _float(path: str, value: Any, expected: str, within: Callable[[float], bool]) -> float:
    """``value``, a finite number (an int will do; a bool will not) that is ``within``."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _refusal(path, value, expected, wrong_type=True)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not (math.isfinite(number) and within(number)):
        raise _refusal(path, value, expected)
    return number


def _text(path: str, value: Any, what: str) -> str:
    """``value``, a str."""
    if not isinstance(value, str):
        raise _refusal(path, value, f"a str ({what})", wrong_type=True)
    return value


def _one_of(path: str, value: Any, allowed: Sequence[str], what: str) -> str:
    """``value``, one of the strings ``allowed``."""
    expected = (
        f"{what}, one of {_listed(allowed)}" if len(allowed) > 1 else f"{allowed[0]!r} ({what})"
    )
    if not isinstance(value, str):
        raise _refusal(path, value, expected, wrong_type=True)
    if value not in allowed:
        raise _refusal(path, value, expected)
    return value


class _StateReader:
    """Reads a saved state (:meth:`Auto.state_dict`) back for one ``Auto`` and one model,
    checked against the schema ``state_dict`` writes; builds the schedules without
    touching the estimator's, so that a refused state changes nothing.

    Checked, by principle rather than case by case: the keys of every record (none
    missing, none unknown); every field's type (an int is not a bool or a float, a float
    is a finite number, a str a str, a list where a list is, a mapping where a mapping
    is); the bounds of counts (>= 0) and measurements (a cosine within [-1, 1], a cost
    above 0); membership (the format and the auto's options are this one's; the specs
    measured are among its candidates; a choice is one its schedule can have made; the
    objective kind is one there is); agreement (the signature is of this model's class
    and trainable parameters, in order, with their shapes and dtypes; no schedule's
    signature twice; at most one probe per call; one exact gradient per probe, each 1-D
    over every trainable parameter entry, in the parameters' dtype and finite; each
    candidate's measurements as many as each other and at most one per probe).
    The first field that does not fit raises one line (:func:`_refusal`).
    """

    def __init__(self, auto: Auto, model: torch.nn.Module) -> None:
        self.auto, self.model = auto, model
        self.trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # A probe may measure exact in place of every candidate when none can run
        # (Auto._eligible), so exact is a spec of every auto's schedules.
        self.specs = tuple(dict.fromkeys((*auto.candidates, "exact")))
        # A probe keeps exact's gradient flattened (GradientEstimate.flat): one value per
        # trainable parameter entry, in the dtype torch.cat gives the parameters' dtypes.
        self.size = sum(p.numel() for _, p in self.trainable)
        dtypes = [p.dtype for _, p in self.trainable]
        self.dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else None
        self.device = self.trainable[0][1].device if self.trainable else None

    def state(self, value: Any) -> dict[Signature, _Schedule]:
        """The schedules of the saved ``value``, by signature."""
        path = "state"
        if not isinstance(value, Mapping):
            raise _refusal(
                path, value, "a mapping, as auto.state_dict(model) returns", wrong_type=True
            )
        # The format first: a state of another kind is named as such, not by its keys.
        fmt = self.auto.STATE_FORMAT
        _one_of(_at(path, "format"), value.get("format", _MISSING), (fmt,), "the format")
        state = _record(path, value, _STATE_KEYS)
        mine = repr(self.auto)
        saved = _text(_at(path, "auto"), state["auto"], "the repr of the auto it was saved by")
        if saved != mine:
            # Shown up to this repr's length and more, so that the option that differs
            # can be found.
            raise _refusal(_at(path, "auto"), saved, mine, fix=_OTHER_AUTO, limit=len(mine) + 80)
        where = _at(path, "schedules")
        schedules = _items(where, state["schedules"], "schedules (mappings)")
        restored: dict[Signature, _Schedule] = {}
        first: dict[Signature, int] = {}
        for index, saved_schedule in enumerate(schedules):
            at = _at(where, index)
            key, schedule = self.schedule(at, saved_schedule)
            if key in first:
                # A second schedule of one signature would silently replace the first.
                raise _refusal(
                    _at(at, "signature"),
                    saved_schedule["signature"],
                    f"a signature of its own, not that of {_at(where, first[key])}",
                )
            first[key], restored[key] = index, schedule
        return restored

    def schedule(self, path: str, value: Any) -> tuple[Signature, _Schedule]:
        """One saved schedule, and the signature it is kept by."""
        saved = _record(path, value, _SCHEDULE_KEYS)
        key = self.signature(_at(path, "signature"), saved["signature"])
        reason = _text(_at(path, "reason"), saved["reason"], "why it picked its choice")
        calls = _int(_at(path, "calls"), saved["calls"], "the calls so far")
        probes = _int(_at(path, "probes_done"), saved["probes_done"], "the probes so far")
        if probes > calls:
            raise _refusal(
                _at(path, "probes_done"),
                probes,
                f"an int from 0 to its calls, {calls}: every probe is a call",
            )
        measured = self.measured(_at(path, "measured"), saved["measured"], probes)
        table = self.table(_at(path, "table"), saved["table"])
        grads = self.gradients(_at(path, "exact_grads"), saved["exact_grads"], probes)
        choice = self.choice(_at(path, "choice"), saved["choice"], table)
        schedule = _Schedule(
            choice=choice,
            reason=reason,
            calls=calls,
            probes_done=probes,
            measured=measured,
            exact_grads=grads,
            table=table,
        )
        return key, schedule

    def signature(self, path: str, value: Any) -> Signature:
        """The signature (:func:`_signature`) a saved one names, with this model's
        parameters: it must be of this model's class and trainable parameters."""
        parts = _items(path, value, ", ".join(_SIGNATURE_PARTS))
        if len(parts) != len(_SIGNATURE_PARTS):
            raise _refusal(
                path, parts, f"a list of {len(_SIGNATURE_PARTS)}: {', '.join(_SIGNATURE_PARTS)}"
            )
        own = type(self.model).__name__
        model_name = _text(_at(path, 0), parts[0], _SIGNATURE_PARTS[0])
        if model_name != own:
            raise _refusal(
                _at(path, 0), model_name, f"{own!r}, this model's class", fix=_OTHER_MODEL
            )
        params = self.parameters(_at(path, 1), parts[1])
        sampler = _text(_at(path, 2), parts[2], _SIGNATURE_PARTS[2])
        where = _at(path, 3)
        times = _items(where, parts[3], "floats (the sampler's times)")
        if not times:
            raise _refusal(where, times, "a non-empty list of floats (the sampler's times)")
        grid = tuple(
            _float(_at(where, i), t, "a finite float (a time of the grid)", lambda _: True)
            for i, t in enumerate(times)
        )
        kind = _one_of(_at(path, 4), parts[4], _KINDS, _SIGNATURE_PARTS[4])
        shape: tuple[int, ...] | None = None
        if parts[5] is not None:  # None: the call had no state tensor to take a shape of
            where = _at(path, 5)
            sizes = _items(where, parts[5], "ints (a state's shape past the batch), or None")
            shape = tuple(_int(_at(where, i), n, "a size") for i, n in enumerate(sizes))
        return (model_name, params, sampler, grid, kind, shape)

    def parameters(
        self, path: str, value: Any
    ) -> tuple[tuple[str, int, tuple[int, ...], str], ...]:
        """A signature's trainable parameters: this model's, in order, of the same shapes
        and dtypes (any other list names a schedule this model never uses, and gradients
        that do not fit it)."""
        entries = _items(path, value, "[name, shape, dtype] entries, one per trainable parameter")
        saved = []
        for i, entry in enumerate(entries):
            at = _at(path, i)
            part = _items(at, entry, "3: [name, shape, dtype]")
            if len(part) != 3:
                raise _refusal(at, entry, "a list of 3: [name, shape, dtype]")
            name = _text(_at(at, 0), part[0], "the parameter's name")
            sizes = _items(_at(at, 1), part[1], "ints (the parameter's shape)")
            shape = tuple(_int(_at(_at(at, 1), j), n, "a size") for j, n in enumerate(sizes))
            dtype = _text(_at(at, 2), part[2], "the parameter's dtype, e.g. 'torch.float32'")
            saved.append((name, shape, dtype))
        own = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.trainable]
        for i, (entry, mine) in enumerate(itertools.zip_longest(saved, own)):
            if entry == mine:
                continue
            if entry is None:
                raise _refusal(
                    path,
                    entries,
                    f"this model's {len(own)} trainable parameters, in order (it stops "
                    f"before {mine[0]!r})",
                    fix=_OTHER_MODEL,
                )
            expected = (
                f"no more entries: this model has {len(own)} trainable parameters"
                if mine is None
                else f"[{mine[0]!r}, {list(mine[1])}, {mine[2]!r}], this model's trainable "
                f"parameter {i}"
            )
            raise _refusal(_at(path, i), entries[i], expected, fix=_OTHER_MODEL)
        return tuple(
            (name, id(p), shape, dtype)
            for (name, shape, dtype), (_, p) in zip(saved, self.trainable, strict=True)
        )

    def specs_in(self, path: str, value: Any, what: str) -> Mapping[str, Any]:
        """A mapping from candidate specs (this auto's) to ``what``."""
        if not isinstance(value, Mapping):
            raise _refusal(path, value, f"a mapping from candidate spec to {what}", wrong_type=True)
        for spec in value:
            if not isinstance(spec, str) or spec not in self.specs:
                raise _refusal(
                    _at(path, spec),
                    spec,
                    f"keys among this auto's candidates: {_listed(self.specs)}",
                    wrong_type=not isinstance(spec, str),
                    problem=(
                        "is a key that is not one of this auto's candidates"
                        if isinstance(spec, str)
                        else f"is a key of type {type(spec).__name__}"
                    ),
                )
        return value

    def measured(self, path: str, value: Any, probes: int) -> dict[str, _Measured]:
        """Each candidate's measurements: as many of each, one per probe batch that
        measured it (at most ``probes``)."""
        measured = {}
        for spec, record in self.specs_in(path, value, "its measurements").items():
            at = _at(path, spec)
            fields = _record(at, record, _MEASURES)
            lists: dict[str, list[float]] = {}
            for name in _MEASURES:
                where = _at(at, name)
                values = _items(where, fields[name], "floats, one per probe batch")
                if not 1 <= len(values) <= probes:
                    raise _refusal(
                        where,
                        values,
                        f"1 to probes_done ({probes}) floats, one per probe batch that "
                        f"measured {spec!r}",
                    )
                if lists and len(values) != len(lists[_MEASURES[0]]):
                    raise _refusal(
                        where,
                        values,
                        f"as many floats as {_at(at, _MEASURES[0])} "
                        f"({len(lists[_MEASURES[0]])}), one per probe batch",
                    )
                expected, within = _bounds(name)
                lists[name] = [
                    _float(_at(where, i), v, expected, within) for i, v in enumerate(values)
                ]
            measured[spec] = _Measured(**lists)
        return measured

    def table(self, path: str, value: Any) -> dict[str, dict[str, float]]:
        """The table of the last pick: per candidate its measurements and score."""
        table = {}
        for spec, row in self.specs_in(path, value, "its row").items():
            at = _at(path, spec)
            fields = _record(at, row, _ROW_KEYS)
            table[spec] = {
                name: _float(_at(at, name), fields[name], *_bounds(name)) for name in _ROW_KEYS
            }
        return table

    def gradients(self, path: str, value: Any, probes: int) -> list[torch.Tensor]:
        """The exact gradients of the probes so far, one per probe, moved to the
        parameters' device."""
        grads = _items(path, value, "exact gradients (tensors), one per probe batch")
        if len(grads) != probes:
            raise _refusal(
                path, grads, f"probes_done ({probes}) exact gradients, one per probe batch"
            )
        return [self.gradient(_at(path, i), g) for i, g in enumerate(grads)]

    def gradient(self, path: str, value: Any) -> torch.Tensor:
        """One exact gradient: 1-D over every trainable parameter entry, finite."""
        dtype = "a" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        expected = (
            f"a finite {dtype} tensor of shape ({self.size},): exact's gradient over this "
            f"model's trainable parameters, flattened"
        )
        if not isinstance(value, torch.Tensor):
            raise _refusal(path, value, expected, wrong_type=True)
        if (
            is_symbolic(value)
            or value.layout != torch.strided
            or tuple(value.shape) != (self.size,)
            or value.dtype != self.dtype
        ):
            raise _refusal(path, value, expected)
        if not bool(torch.isfinite(value).all()):
            raise _refusal(
                path, value, expected, problem=f"is {_shown(value)} holding NaN or infinity"
            )
        return value.detach().to(self.device)

    def choice(self, path: str, value: Any, table: Mapping[str, Any]) -> str | None:
        """The pick: None while probing, else one its table holds (a pick is made from
        the table; ``exact`` when the table is empty, no candidate having fit
        ``probe_budget``)."""
        if value is None:
            return None
        picked_from = list(table) or ["exact"]
        expected = (
            f"None (still probing) or one of its table's candidates: {_listed(picked_from)}"
            if table
            else "None (still probing) or 'exact' (its table is empty)"
        )
        if not isinstance(value, str):
            raise _refusal(path, value, expected, wrong_type=True)
        if value not in picked_from:
            raise _refusal(path, value, expected)
        return value


def _no_probe() -> dict[str, Any]:
    """The probe's ``info`` entries on a call that does not probe."""
    return {
        "auto_probe_planned_units": 0.0,
        "auto_probe_units": 0.0,
        "auto_probe_draws": 0,
        "auto_probe_dropped": "",
        "auto_probe_skipped": "",
    }


def _signature(
    model: torch.nn.Module, sampler: AffineSampler, kind: str, inputs: Mapping[str, Any]
) -> Signature:
    """What the choice is cached by within one model instance: the trainable parameters'
    identity (names, object ids, shapes, dtypes: replaced parameters probe again), the
    sampler and its grid, the objective kind and the state shape."""
    params = tuple(
        (name, id(p), tuple(p.shape), str(p.dtype))
        for name, p in model.named_parameters()
        if p.requires_grad
    )
    source = inputs.get("noise")
    if source is None and isinstance(inputs.get("trajectory"), Trajectory):
        source = inputs["trajectory"].states[0]
    shape = tuple(source.shape[1:]) if isinstance(source, torch.Tensor) else None
    grid = tuple(sampler.times.tolist())  # one transfer, not a host sync per step
    return (type(model).__name__, params, type(sampler).__name__, grid, kind, shape)


__all__ = ["Auto", "AutoDecisions", "ProbeSchedules"]
