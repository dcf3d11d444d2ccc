"""The compute-matched race: which estimator buys the most reward for the same compute?

Every estimator fine-tunes from the same pretrained model under the same budget, either of
**backward FLOPs** (deterministic) or of **measured wall time**, and the race records the
reward against the compute spent, evaluated at fixed fractions of the budget on **one
fixed evaluation set** (the task's, at least :data:`MIN_EVAL_SAMPLES` samples, shared by
every estimator and seed) together with the task's drift from the pretrained model::

    report = race(task, ["exact", "sdo", "truncated:k=1"], budget_exact_steps=8, seeds=16,
                  out="runs/race")
    print(report.to_markdown())

The library knows nothing of a particular model: a task (:class:`RaceTask`) provides the
pretrained model, the sampler, one training step's objective, the evaluation, the
optimizer and one forward's inputs (for counting FLOPs). Applications register tasks
under the ``gradest.race_tasks`` entry points (``gradest race --model digits``).

**Compute.** A step's compute is its model work in forward-equivalents (the estimator's
:class:`~gradest.protocol.Cost` of the step, including the VJPs its backward runs, plus the
work the task did itself for the step: sampling a trajectory it hands over, a prior loss)
times one forward's FLOPs ``F``, counted once with
:func:`gradest.harness.cost.count_flops` on the task's model and batch. A step is taken
only if it fits: the race computes the step's surrogate (which knows its cost), and when
``spent + cost`` would pass the budget, the estimator stops there (so every estimator ends
with ``spent <= budget < spent + its next step``). With a wall-time budget each step's
seconds (objective, surrogate, backward, optimizer step; not evaluations) are measured
where it runs, and a step is taken while ``spent + the previous step's seconds`` fits.
The estimators of a seed advance in lockstep, one step each in turn with the order
rotating from round to round, so machine load hits all of them alike. Every step's seconds
are kept; a step that took more than :data:`STALL_FACTOR` times its run's median is a
machine stall (another process had the cores), and a wall-time report names those seeds.

**Evaluation points.** Before the step that would carry the compute past ``f * budget``
for a fraction ``f`` (and at the end) the model is evaluated: that point is the reward
at compute ``f * budget``. The pretrained model's evaluation is the point at compute 0.

**Randomness.** Per seed and estimator two generators: the task's data (training noise,
class labels) from ``seed``, so every estimator sees the same training batches as long as
the task draws the same amount per step, and the estimator's own draws from a stream of
their own.

**Resume.** With ``out`` the race claims the folder (:mod:`gradest_lab.storage.run_folder`: its
``run.json`` records the race's settings, and a lock refuses a second process while it
runs) and writes, after every evaluation point, the state of that (seed, estimator)
(model, optimizer, generators, the curve so far) atomically under ``out/state``. A rerun
with the same ``out`` and settings continues where it stopped; with a FLOPs budget the
result equals an uninterrupted race bit for bit (on the same machine; estimators that keep
state across calls, such as ``auto``'s cache, start that state afresh). Different settings
are refused, naming them.

**Statistics** (:mod:`gradest_lab.race.bootstrap`): means over seeds with 95% percentile
bootstrap intervals, resampling seeds; differences to ``exact`` are paired by seed. No
significance test is made on the (deterministic) costs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor, nn

from gradest import AffineSampler, InvalidType, InvalidValue
from gradest import estimator as build_estimator
from gradest.harness import count_flops
from gradest.plugin import (
    Cost,
    Objective,
    callable_entry,
    check_steps,
    check_surrogate,
    estimated_surrogate,
    load_entry_points,
    supports,
)
from gradest_lab.race.bootstrap import (
    BOOTSTRAP_SEED,
    LEVEL,
    RESAMPLES,
    bootstrap_mean,
    paired_bootstrap,
)
from gradest_lab.race.file_schemas import check_progress, check_race_settings
from gradest_lab.race.verdicts import REFERENCE
from gradest_lab.storage.file_schema import first_line
from gradest_lab.storage.files import (
    OutputError,
    atomic_save,
    atomic_write_text,
    check_output_dir,
    refuse_symlinks,
)
from gradest_lab.storage.json_text import parse_json
from gradest_lab.storage.run_folder import RUN_RECORD, RunRecord, claim_run_folder, read_run_record

RACE_TASKS_GROUP = "gradest.race_tasks"
MIN_EVAL_SAMPLES = 256
# The command a race folder's run.json names (a tuned race names its own).
RACE_COMMAND = "gradest race"
DEFAULT_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
REACH_LEVELS = (0.5, 0.9)
SCHEMA = "gradest.race/1"
# The estimators' own draws come from a stream apart from the task's data.
_DRAW_STREAM = 1_000_003
# A step that took this many times its run's median step is counted as a machine stall
# (another process took the cores): on a wall-time budget it spent budget that the
# estimator did not use, so the report names it.
STALL_FACTOR = 5.0

__all__ = [
    "DEFAULT_FRACTIONS",
    "MIN_EVAL_SAMPLES",
    "RACE_TASKS_GROUP",
    "RaceReport",
    "RaceTask",
    "StepProblem",
    "exact_step_units",
    "forward_flops",
    "race",
    "registered_tasks",
]


@attrs.frozen(eq=False)
class StepProblem:
    """One training step of a task: what the estimator differentiates and with what.

    Attributes:
        objective: the step's objective (terminal or stepwise, as the task's
            ``objective_kind``).
        inputs: the estimator's sampling inputs: ``noise=`` (it samples itself) or
            ``trajectory=`` (a recorded path), and ``cond=``.
        extra_cost: model work the task did for this step itself (sampling the trajectory
            it hands over, a prior loss), counted into the step's compute for every
            estimator alike.
        extra_loss: a loss on the model added to the surrogate before the backward (a prior
            term: the flow-matching loss on real data), or None. Its work belongs in
            ``extra_cost``.
    """

    objective: Objective
    inputs: Mapping[str, Any]
    extra_cost: Cost = Cost()
    extra_loss: Callable[[nn.Module], Tensor] | None = None


@runtime_checkable
class RaceTask(Protocol):
    """What a race needs to know about a fine-tuning task.

    Attributes:
        name: the task's name (reports, resume checks).
        objective_kind: ``"terminal"`` or ``"stepwise"``; estimators that do not support it
            are refused before any work.
        eval_samples: the size of the fixed evaluation set (>= :data:`MIN_EVAL_SAMPLES`).
        ceiling: the attainable reward (the report shows the share of it each estimator
            reaches), or None when unknown.
    """

    name: str
    objective_kind: str
    eval_samples: int
    ceiling: float | None

    def settings(self) -> dict[str, Any]:
        """Everything that defines the task, JSON-able (checked when a race resumes)."""
        ...

    def pretrained(self) -> nn.Module:
        """A fresh copy of the pretrained model every estimator starts from."""
        ...

    def sampler(self) -> AffineSampler:
        """The sampler the estimators differentiate through."""
        ...

    def optimizer(self, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over the model's trainable parameters."""
        ...

    def step_problem(
        self, model: nn.Module, sampler: AffineSampler, generator: torch.Generator, step: int
    ) -> StepProblem:
        """The objective of training step ``step``, its data drawn from ``generator``."""
        ...

    def evaluate(self, model: nn.Module) -> Mapping[str, float]:
        """``{"reward": ..., "drift": ...}`` (and any other numbers) on the fixed evaluation
        set: the reward (higher is better) and the drift from the pretrained model."""
        ...

    def flops_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of one forward ``model(*args, **kwargs)`` on a training batch."""
        ...


def registered_tasks() -> dict[str, Callable[..., RaceTask]]:
    """Task factories that installed applications register under ``gradest.race_tasks``.

    A factory is called as ``factory(eval_samples=..., device=...)`` and returns a
    :class:`RaceTask`.
    """
    return load_entry_points(RACE_TASKS_GROUP, what="race task", check=callable_entry)


def forward_flops(task: RaceTask, model: nn.Module | None = None) -> int:
    """``F``: the FLOPs of one forward of the task's model on its training batch."""
    model = task.pretrained() if model is None else model
    args, kwargs = task.flops_inputs()
    with torch.no_grad():
        return count_flops(lambda: model(*args, **kwargs))


def _surrogate(est: Any, model: nn.Module, sampler: Any, problem: StepProblem, gen: Any) -> Any:
    inputs = {"generator": gen, **problem.inputs}
    if callable(getattr(est, "surrogate", None)):
        # A plugin's result is checked like everywhere gradest backpropagates one it did
        # not build: a bare tensor or a vector loss is one line naming the plugin.
        return check_surrogate(est, est.surrogate(model, sampler, problem.objective, **inputs))
    # An estimator object passed in without a surrogate(): the linear one of its estimate.
    return estimated_surrogate(est, model, sampler, problem.objective, **inputs)


def exact_step_units(task: RaceTask, model: nn.Module | None = None) -> float:
    """Model units (forward-equivalents) of one ``exact`` training step of the task.

    Measured on a throwaway copy with a throwaway generator (exact's cost does not depend
    on the data); ``budget_exact_steps=k`` is ``k`` times this times the forward's FLOPs.
    """
    model = task.pretrained() if model is None else copy.deepcopy(model)
    sampler = task.sampler()
    problem = task.step_problem(model, sampler, torch.Generator().manual_seed(0), 0)
    sur = _surrogate(build_estimator(REFERENCE), model, sampler, problem, torch.Generator())
    return float(sur.cost.model_units() + problem.extra_cost.model_units())


# -- validation -----------------------------------------------------------------------------


def _check_task(task: Any) -> None:
    if not isinstance(task, RaceTask):
        missing = [
            name
            for name in (
                "name",
                "objective_kind",
                "eval_samples",
                "ceiling",
                "settings",
                "pretrained",
                "sampler",
                "optimizer",
                "step_problem",
                "evaluate",
                "flops_inputs",
            )
            if not hasattr(task, name)
        ]
        raise InvalidType(
            f"task must follow gradest_lab.race.plain_race.RaceTask; {type(task).__name__} lacks "
            f"{', '.join(missing) or 'a member'}"
        )
    if task.objective_kind not in ("terminal", "stepwise"):
        raise InvalidValue(
            f"task.objective_kind must be 'terminal' or 'stepwise', got {task.objective_kind!r}"
        )
    if not isinstance(task.eval_samples, int) or task.eval_samples < MIN_EVAL_SAMPLES:
        raise InvalidValue(
            f"the task's evaluation set has {task.eval_samples!r} samples; a race evaluates on "
            f"at least {MIN_EVAL_SAMPLES} (the reward of a few samples is noise)"
        )


def _check_specs(specs: Sequence[str], task: RaceTask) -> list[str]:
    """The race's estimator specs, each built and checked against the task (its objective
    kind and its sampler's step count) before any work or any look at the race folder."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise InvalidType(f"specs must be a list of estimator spec strings, got {specs!r}")
    specs = list(specs)
    if not specs:
        raise InvalidValue("specs is empty; e.g. ['exact', 'sdo']")
    if not all(isinstance(s, str) for s in specs):
        raise InvalidType("specs must be estimator spec strings (they name the report's rows)")
    if len(set(specs)) != len(specs):
        twice = sorted({s for s in specs if specs.count(s) > 1})
        raise InvalidValue(f"estimators are listed twice: {', '.join(twice)}")
    if REFERENCE not in specs:
        raise InvalidValue(
            f"the race compares every estimator with {REFERENCE!r}; add it to the estimators"
        )
    kind, steps = task.objective_kind, task.sampler().num_steps
    for spec in specs:
        est = build_estimator(spec)  # a bad spec fails here, before any work
        if not supports(est, kind):
            raise InvalidValue(
                f"estimator {spec!r} does not support {kind} objectives, which this task trains"
            )
        check_steps(est, steps)  # options that need more steps than the task samples
    return specs


def _check_seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, bool):
        raise InvalidType(f"seeds must be a count or a list of ints, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise InvalidValue(f"seeds must be >= 1, got {seeds}")
        return list(range(seeds))
    values = list(seeds)
    if not values or not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise InvalidValue(f"seeds must be a count or a non-empty list of ints, got {seeds!r}")
    if len(set(values)) != len(values):
        raise InvalidValue(f"seeds are listed twice: {values}")
    return values


def _check_fractions(fractions: Sequence[float]) -> list[float]:
    values = [float(f) for f in fractions]
    if not values or any(not (0 < f <= 1) for f in values) or values != sorted(set(values)):
        raise InvalidValue(
            f"fractions must be increasing, distinct, in (0, 1], got {list(fractions)}; e.g. "
            f"{DEFAULT_FRACTIONS}"
        )
    if values[-1] != 1.0:
        raise InvalidValue(f"the last fraction must be 1.0 (the whole budget), got {values}")
    return values


def _check_budget(
    budget_flops: float | None, budget_seconds: float | None, budget_exact_steps: float | None
) -> tuple[str, float]:
    given = {
        k: v
        for k, v in (
            ("budget_flops", budget_flops),
            ("budget_seconds", budget_seconds),
            ("budget_exact_steps", budget_exact_steps),
        )
        if v is not None
    }
    if len(given) != 1:
        raise InvalidValue(
            "give exactly one budget: budget_flops, budget_exact_steps (both backward FLOPs) "
            f"or budget_seconds (wall time); got {', '.join(given) or 'none'}"
        )
    ((name, value),) = given.items()
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise InvalidValue(f"{name} must be a positive number, got {value!r}")
    return name.removeprefix("budget_"), float(value)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's ``lr`` (a tuned race's grid point) on a task's optimizer."""
    for group in optimizer.param_groups:
        if "lr" not in group:
            raise InvalidValue(
                f"the task's optimizer ({type(optimizer).__name__}) has a parameter group "
                f"without an 'lr'; a tuned race sets each group's lr"
            )
        group["lr"] = lr


@attrs.frozen(eq=False)
class MeasuredBudget:
    """A race's budget in its own units, with what it was measured from.

    Attributes:
        pretrained: the task's pretrained model (measured on, and every run's start).
        flops_per_unit: ``F``, one forward's FLOPs on the training batch.
        exact_units: one exact training step in forward-equivalents.
        kind: ``"flops"`` or ``"seconds"``.
        budget: the budget in FLOPs or seconds.
    """

    pretrained: nn.Module
    flops_per_unit: float
    exact_units: float
    kind: str
    budget: float

    @property
    def exact_step_flops(self) -> float:
        return self.exact_units * self.flops_per_unit

    def settings(self) -> dict[str, Any]:
        return {
            "budget_kind": self.kind,
            "budget": self.budget,
            "budget_exact_steps": self.budget / self.exact_step_flops
            if self.kind == "flops"
            else None,
        }

    def config(self) -> dict[str, Any]:
        """The measured numbers and the environment a report records."""
        return {
            "forward_flops": self.flops_per_unit,
            "exact_step_model_units": self.exact_units,
            "exact_step_flops": self.exact_step_flops,
            "torch": torch.__version__,
            "bootstrap": {"resamples": RESAMPLES, "level": LEVEL, "seed": BOOTSTRAP_SEED},
        }


def measure_budget(task: RaceTask, given: str, value: float) -> MeasuredBudget:
    """Load the pretrained model, count ``F`` and an exact step, and convert a budget given
    in exact steps (``given="exact_steps"``) to FLOPs."""
    pretrained = task.pretrained()
    flops_per_unit = float(forward_flops(task, pretrained))
    exact_units = exact_step_units(task, pretrained)
    if given == "exact_steps":
        kind, budget = "flops", value * exact_units * flops_per_unit
    else:
        kind, budget = given, value
    return MeasuredBudget(pretrained, flops_per_unit, exact_units, kind, budget)


def evaluate_pretrained(task: RaceTask, pretrained: nn.Module) -> dict[str, float]:
    """The pretrained model's evaluation (every curve's point at compute 0)."""
    initial_model = copy.deepcopy(pretrained).eval()
    with torch.no_grad():
        initial = {k: float(v) for k, v in task.evaluate(initial_model).items()}
    for key in ("reward", "drift"):
        if key not in initial:
            raise InvalidValue(f"task.evaluate must return {key!r}; it returned {sorted(initial)}")
    return initial


# -- the runs -------------------------------------------------------------------------------


RUN_STATE_SCHEMA = "gradest.race-state/1"
# The fields of a run's state file (besides model and optimizer), with their types.
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "spec": str,
    "seed": int,
    "model": dict,
    "optimizer": dict,
    "data": Tensor,
    "draws": Tensor,
    "step": int,
    "flops": (int, float),
    "seconds": (int, float),
    "last_seconds": (int, float),
    "next_point": int,
    "done": bool,
    "curve": str,
    "stopped_step": str,
    "step_seconds": str,
}


def _state_refused(path: Path, why: str) -> InvalidValue:
    return InvalidValue(
        f"race state {str(path)!r} {why}; it is kept as it is: move it away to rerun that run "
        f"from its start"
    )


def read_run_state(
    path: Path, *, spec: str, seed: int, fractions: Sequence[float]
) -> dict[str, Any]:
    """The state file of a race run in progress, checked field by field.

    It is loaded with ``weights_only=True`` (a file that would run code when unpickled is
    refused, its code not run) and must be this race's state of ``spec`` on ``seed``, its
    progress that of a run evaluated at ``fractions``
    (:func:`gradest_lab.race.file_schemas.check_progress`: counts >= 0, one step time per
    step, one curve point per fraction passed, finite numbers).

    Raises:
        InvalidValue: one line naming the file and what is wrong (it does not load, a
            field is missing or of another type, it is another run's); the file is kept.
    """
    if path.is_symlink() or not path.is_file():
        raise _state_refused(path, "is a symbolic link or not a regular file")
    try:
        with warnings.catch_warnings():
            # torch warns about a foreign pickle's protocol before refusing it: the refusal
            # below says all there is to say.
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a damaged zip or a foreign pickle
        raise _state_refused(path, f"does not load ({first_line(err)})") from None
    if not isinstance(state, dict):
        raise _state_refused(path, f"holds a {type(state).__name__}, not a run's state")
    if state.get("schema") != RUN_STATE_SCHEMA:
        raise _state_refused(path, f"has schema {state.get('schema')!r}, not {RUN_STATE_SCHEMA!r}")
    for field, kind in _STATE_FIELDS.items():
        value = state.get(field)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise _state_refused(path, f"has {field} = {type(value).__name__}, not {wanted}")
    progress = dict(state)
    for field in ("curve", "stopped_step", "step_seconds"):
        try:
            progress[field] = parse_json(state[field])
        except ValueError as err:
            raise _state_refused(
                path, f"has a {field} that is not JSON ({first_line(err)})"
            ) from None
    if state["spec"] != spec or state["seed"] != seed:
        raise _state_refused(
            path, f"holds {state['spec']!r} seed {state['seed']}, not {spec!r} seed {seed}"
        )
    check_progress(
        progress, fractions, lambda field, why: _state_refused(path, f"field {field} {why}")
    )
    return state


@attrs.define(eq=False)
class _Run:
    """One estimator's fine-tuning on one seed."""

    spec: str
    seed: int
    est: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: torch.Generator
    draws: torch.Generator
    lr: float | None = None  # set on the task's optimizer (a tuned race); None: the task's
    step: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    last_seconds: float = 0.0
    next_point: int = 0
    done: bool = False
    curve: list[dict[str, Any]] = attrs.Factory(list)
    stopped_step: dict[str, float] | None = None
    step_seconds: list[float] = attrs.Factory(list)  # each step's measured seconds

    def state(self, data_state: Tensor, draw_state: Tensor) -> dict[str, Any]:
        return {
            "schema": RUN_STATE_SCHEMA,
            "spec": self.spec,
            "seed": self.seed,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data": data_state,
            "draws": draw_state,
            "step": self.step,
            "flops": self.flops,
            "seconds": self.seconds,
            "last_seconds": self.last_seconds,
            "next_point": self.next_point,
            "done": self.done,
            "curve": json.dumps(self.curve),
            "stopped_step": json.dumps(self.stopped_step),
            "step_seconds": json.dumps(self.step_seconds),
        }

    def row(self) -> dict[str, Any]:
        """The run's record in a report: what it spent and its evaluated curve."""
        return {
            "seed": self.seed,
            "steps": self.step,
            "flops": self.flops,
            "seconds": self.seconds,
            "stopped_step": self.stopped_step,
            "step_seconds": self.step_seconds,
            "curve": self.curve,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.data.set_state(state["data"])
        self.draws.set_state(state["draws"])
        for key in ("step", "flops", "seconds", "last_seconds", "next_point", "done"):
            setattr(self, key, state[key])
        self.curve = json.loads(state["curve"])
        self.stopped_step = json.loads(state["stopped_step"])
        self.step_seconds = json.loads(state["step_seconds"])


@attrs.define(eq=False)
class _Race:
    task: RaceTask
    kind: str  # "flops" or "seconds"
    budget: float
    fractions: list[float]
    flops_per_unit: float
    # Where a run's resumable state lives (None: kept in memory only).
    state_path: Callable[[_Run], Path] | None
    bar: Any

    def new_run(
        self, spec: str, seed: int, pretrained: nn.Module, *, lr: float | None = None
    ) -> _Run:
        """A run of ``spec`` on ``seed`` from ``pretrained``, restored from its state file
        when there is one; ``lr`` overrides the task optimizer's learning rate (a tuned
        race's grid point), None keeps the task's."""
        model = copy.deepcopy(pretrained)
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = self.task.optimizer(parameters)
        if lr is not None:
            set_learning_rate(optimizer, lr)
        run = _Run(
            spec=spec,
            seed=seed,
            est=build_estimator(spec),
            model=model,
            optimizer=optimizer,
            data=torch.Generator().manual_seed(seed),
            draws=torch.Generator().manual_seed(seed + _DRAW_STREAM),
            lr=lr,
        )
        path = None if self.state_path is None else self.state_path(run)
        if path is not None and (path.exists() or path.is_symlink()):
            state = read_run_state(path, spec=spec, seed=seed, fractions=self.fractions)
            try:
                run.restore(state)
            except (RuntimeError, KeyError, ValueError, TypeError) as err:
                raise _state_refused(path, f"does not fit the run ({first_line(err)})") from None
        return run

    def finish(self, run: _Run, sampler: AffineSampler) -> None:
        """Advance ``run`` until its budget is spent (its last evaluation point taken)."""
        while not run.done:
            self.advance(run, sampler)

    def _evaluate(self, run: _Run) -> None:
        # Evaluated in eval mode, then back to the mode the run trains in (the task's: a
        # step's surrogate is recorded before this evaluation and backpropagated after it,
        # so the mode must come back as it was, or the surrogate is outdated).
        training = run.model.training
        run.model.eval()
        with torch.no_grad():
            metrics = {k: float(v) for k, v in self.task.evaluate(run.model).items()}
        run.model.train(training)
        run.curve.append(
            {
                "fraction": self.fractions[run.next_point],
                "flops": run.flops,
                "seconds": run.seconds,
                "steps": run.step,
                **metrics,
            }
        )
        run.next_point += 1
        self.bar.update(1)

    def _save(self, run: _Run, data_state: Tensor, draw_state: Tensor) -> None:
        if self.state_path is None:
            return
        path = self.state_path(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(run.state(data_state, draw_state), path)

    def advance(self, run: _Run, sampler: AffineSampler) -> None:
        """Take one step of ``run`` if it fits, evaluating the points it would pass first."""
        data_state, draw_state = run.data.get_state(), run.draws.get_state()
        started = time.perf_counter()
        problem = self.task.step_problem(run.model, sampler, run.data, run.step)
        sur = _surrogate(run.est, run.model, sampler, problem, run.draws)
        units = float(sur.cost.model_units() + problem.extra_cost.model_units())
        step_flops = units * self.flops_per_unit
        spent = run.flops if self.kind == "flops" else run.seconds
        step_size = step_flops if self.kind == "flops" else run.last_seconds
        evaluated = False
        # The step's own seconds stop while it evaluates (an evaluation is not training
        # compute, and it would weigh on whichever estimator reached a fraction first).
        before_evaluations = time.perf_counter() - started
        while run.next_point < len(self.fractions) and (
            spent + step_size > self.fractions[run.next_point] * self.budget
        ):
            self._evaluate(run)
            evaluated = True
        if run.next_point == len(self.fractions):
            run.done = True
            run.stopped_step = {"flops": step_flops, "model_units": units}
        if evaluated:
            # The state before this step: a resumed race recomputes it from here.
            self._save(run, data_state, draw_state)
        if run.done:
            return
        resumed = time.perf_counter()
        loss = sur.loss
        if problem.extra_loss is not None:
            loss = loss + problem.extra_loss(run.model)
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = getattr(self.task, "max_grad_norm", None)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for p in run.model.parameters() if p.requires_grad], clip
            )
        run.optimizer.step()
        elapsed = before_evaluations + (time.perf_counter() - resumed)
        run.step += 1
        run.flops += step_flops
        run.seconds += elapsed
        run.last_seconds = elapsed
        run.step_seconds.append(elapsed)


# -- the entry point ------------------------------------------------------------------------


def _settings(
    task: RaceTask,
    specs: list[str],
    seeds: list[int],
    given: str,
    value: float,
    fractions: list[float],
) -> dict[str, Any]:
    """What defines a race (a resumed race must have the same): the budget as given."""
    return {
        "task": task.name,
        "task_settings": task.settings(),
        "estimators": specs,
        "seeds": seeds,
        "budget_given": {"kind": given, "value": value},
        "fractions": fractions,
        "eval_samples": task.eval_samples,
    }


def _check_same_race(saved: Mapping[str, Any], settings: Mapping[str, Any], out: Path) -> None:
    differing = [k for k in settings if k != "task_settings" and saved.get(k) != settings[k]]
    details = [f"{k}: {saved.get(k)!r} there, {settings[k]!r} now" for k in differing]
    ours, theirs = settings["task_settings"], saved.get("task_settings") or {}
    for k in sorted(set(ours) | set(theirs)):
        if ours.get(k) != theirs.get(k):
            differing.append(f"task setting {k}")
            details.append(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} now")
    if differing:
        hint = (
            " (gradest race sets a task setting with --task-option KEY=VALUE)"
            if any(k.startswith("task setting") for k in differing)
            else ""
        )
        raise InvalidValue(
            f"--out {str(out)!r} holds a race with other settings ({', '.join(differing)}; "
            f"{'; '.join(details)}); rerun with its settings to continue it{hint}, "
            f"or pass a new --out"
        )


def race(
    task: RaceTask,
    specs: Sequence[str],
    *,
    seeds: int | Sequence[int],
    budget_flops: float | None = None,
    budget_seconds: float | None = None,
    budget_exact_steps: float | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    out: str | os.PathLike[str] | None = None,
    show_progress: bool = True,
    plots: bool = True,
) -> RaceReport:
    """Race ``specs`` on ``task`` under one compute budget; see the module docstring.

    Args:
        task: a :class:`RaceTask`.
        specs: estimator spec strings, ``"exact"`` among them (the reference).
        seeds: a count (seeds ``0 .. seeds - 1``) or the list of seeds.
        budget_flops: the budget in backward FLOPs, or
        budget_exact_steps: the budget in FLOPs of that many ``exact`` training steps, or
        budget_seconds: a wall-time budget (exactly one of the three).
        fractions: the budget fractions the model is evaluated at, increasing, ending at 1.
        out: a folder to keep the race's state in (resume) and write the report to
            (``report.md``, ``report.json`` and, with ``plots`` and matplotlib,
            ``reward_vs_compute.png``); None keeps everything in memory.
        show_progress: a tqdm bar over the evaluation points.

    Raises:
        InvalidValue / InvalidType: bad settings, an unknown or unsuitable estimator, a task
            with fewer than :data:`MIN_EVAL_SAMPLES` evaluation samples, or an ``out`` that
            holds a race with other settings; all before any work.
        OutputError: ``out`` cannot be written (before any work).
        FolderInUse: another process is running a race in ``out``.
    """
    _check_task(task)
    specs = _check_specs(specs, task)
    seed_list = _check_seeds(seeds)
    fraction_list = _check_fractions(fractions)
    kind, value = _check_budget(budget_flops, budget_seconds, budget_exact_steps)
    settings = _settings(task, specs, seed_list, kind, value, fraction_list)
    target = None
    if out is not None:
        target = check_output_dir(out, what="out", create=False)
        for name in ("report.md", "report.json", "state"):
            entry = target / name
            if entry.is_symlink() or (name != "state" and entry.is_dir()):
                raise OutputError(f"out {str(target)!r}: {name} there is not a plain file")
        if (target / RUN_RECORD).is_file():
            saved = read_run_record(
                target / RUN_RECORD, schemas={RACE_COMMAND: check_race_settings}
            )
            if saved.command == RACE_COMMAND:
                # The race's own message first: it names the settings as the command sets them.
                _check_same_race(saved.settings, settings, target)
    with contextlib.ExitStack() as stack:
        if target is not None:
            stack.enter_context(
                claim_run_folder(
                    target,
                    RunRecord(command=RACE_COMMAND, settings=settings),
                    schema=check_race_settings,
                )
            )
        return _run_race(
            task,
            specs,
            seed_list,
            fraction_list,
            kind,
            value,
            settings,
            target,
            show_progress=show_progress,
            plots=plots,
        )


def _state_path(folder: Path, specs: list[str], run: _Run) -> Path:
    """Where a plain race keeps ``run``'s state: no part of the way below the race folder
    may be a link (it could lead the state's writes out of the folder)."""
    state = folder / "state"
    path = state / f"seed{run.seed}" / f"{specs.index(run.spec):03d}.pt"
    refuse_symlinks([state, path.parent, path], what=f"race folder {str(folder)!r}")
    return path


def _run_race(
    task: RaceTask,
    specs: list[str],
    seed_list: list[int],
    fraction_list: list[float],
    kind: str,
    value: float,
    settings: dict[str, Any],
    target: Path | None,
    *,
    show_progress: bool,
    plots: bool,
) -> RaceReport:
    """The work of :func:`race`, in the folder it has claimed (``target``)."""
    from tqdm.auto import tqdm

    measured = measure_budget(task, kind, value)
    kind, budget = measured.kind, measured.budget
    settings = {**settings, **measured.settings()}
    pretrained = measured.pretrained

    initial = evaluate_pretrained(task, pretrained)
    total = len(seed_list) * len(specs) * len(fraction_list)
    with tqdm(total=total, desc=f"race {task.name}", unit="eval", disable=not show_progress) as bar:
        state = _Race(
            task=task,
            kind=kind,
            budget=budget,
            fractions=fraction_list,
            flops_per_unit=measured.flops_per_unit,
            state_path=None if target is None else functools.partial(_state_path, target, specs),
            bar=bar,
        )
        runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
        sampler = task.sampler()
        for seed in seed_list:
            seed_runs = [state.new_run(spec, seed, pretrained) for spec in specs]
            bar.update(sum(len(r.curve) for r in seed_runs))
            round_index = 0
            while not all(r.done for r in seed_runs):
                shift = (round_index + seed) % len(seed_runs)
                for run in [*seed_runs[shift:], *seed_runs[:shift]]:
                    if not run.done:
                        state.advance(run, sampler)
                round_index += 1
            for run in seed_runs:
                runs[run.spec].append(run.row())
    config = {**settings, "ceiling": task.ceiling, **measured.config()}
    report = RaceReport(config=config, initial=initial, runs=runs)
    if target is not None:
        report.write(target, plots=plots)
    return report


# -- the report -----------------------------------------------------------------------------


def _points(
    row: Mapping[str, Any], initial: Mapping[str, float], axis: str
) -> list[tuple[float, float]]:
    return [(0.0, initial["reward"])] + [(p[axis], p["reward"]) for p in row["curve"]]


def stalled_steps(step_seconds: Sequence[float]) -> list[tuple[int, float]]:
    """``(step index, seconds)`` of the steps that took more than :data:`STALL_FACTOR` times
    the run's median step: on a shared machine, time another process took, not the
    estimator's work (a run needs at least three steps to have a median to speak of)."""
    if len(step_seconds) < 3:
        return []
    median = statistics.median(step_seconds)
    return [(i, t) for i, t in enumerate(step_seconds) if t > STALL_FACTOR * median]


def compute_to_reach(points: Sequence[tuple[float, float]], target: float) -> float:
    """The compute at which a curve ``[(compute, reward), ...]`` first reaches ``target``,
    linearly interpolated between evaluation points; ``+inf`` when it never does."""
    previous = None
    for compute, reward in points:
        if reward >= target:
            if previous is None or previous[1] >= target:
                return compute
            (c0, r0) = previous
            return c0 + (target - r0) / (reward - r0) * (compute - c0)
        previous = (compute, reward)
    return math.inf


@attrs.frozen(eq=False)
class RaceReport:
    """A race's curves and their statistics.

    Attributes:
        config: the settings (task, estimators, seeds, budget, fractions, eval set size,
            the forward's FLOPs, the ceiling, torch).
        initial: the pretrained model's evaluation (every curve's point at compute 0).
        runs: per estimator, per seed: ``{"seed", "steps", "flops", "seconds",
            "stopped_step", "step_seconds" (each step's, from races run since they are
            kept), "curve": [{"fraction", "flops", "seconds", "steps", "reward",
            "drift", ...}, ...]}``.
    """

    config: dict[str, Any]
    initial: dict[str, float]
    runs: dict[str, list[dict[str, Any]]]

    @property
    def axis(self) -> str:
        """The compute the budget is in: ``"flops"`` or ``"seconds"``."""
        return str(self.config["budget_kind"])

    @property
    def unit(self) -> float:
        """What one unit of the reported compute is: an exact step's FLOPs, or a second."""
        return float(self.config["exact_step_flops"]) if self.axis == "flops" else 1.0

    @property
    def unit_name(self) -> str:
        return "exact steps" if self.axis == "flops" else "seconds"

    def at_fraction(self, spec: str, index: int, key: str = "reward") -> list[float]:
        return [row["curve"][index][key] for row in self.runs[spec]]

    def summary(self) -> dict[str, Any]:
        """Per estimator: reward and drift at every fraction (mean and CI), the paired
        difference to exact, and the compute to reach 50% / 90% of exact's final gain."""
        fractions = self.config["fractions"]
        initial = self.initial["reward"]
        exact_final = self.at_fraction(REFERENCE, len(fractions) - 1)
        ceiling = self.config.get("ceiling")
        out: dict[str, Any] = {}
        for spec, rows in self.runs.items():
            points = []
            for i, fraction in enumerate(fractions):
                reward = self.at_fraction(spec, i)
                points.append(
                    {
                        "fraction": fraction,
                        "compute": bootstrap_mean(
                            [v / self.unit for v in self.at_fraction(spec, i, self.axis)]
                        ).to_json(),
                        "reward": bootstrap_mean(reward).to_json(),
                        "reward_minus_exact": paired_bootstrap(
                            reward, self.at_fraction(REFERENCE, i)
                        ).to_json(),
                        "drift": bootstrap_mean(self.at_fraction(spec, i, "drift")).to_json(),
                    }
                )
            reach = {}
            exact_gain = sum(exact_final) / len(exact_final) - initial
            for level in REACH_LEVELS:
                if exact_gain <= 0:
                    # "p of exact's gain" is no target when exact lost reward on average:
                    # every curve would "reach" it at zero compute.
                    reach[f"{int(level * 100)}%"] = {
                        "per_seed": [],
                        "reached": 0,
                        "mean": None,
                        "low": None,
                        "high": None,
                        "undefined": "exact did not gain",
                    }
                    continue
                per_seed = [
                    compute_to_reach(
                        _points(row, self.initial, self.axis), initial + level * (e - initial)
                    )
                    / self.unit
                    for row, e in zip(rows, exact_final, strict=True)
                ]
                reach[f"{int(level * 100)}%"] = {
                    "per_seed": per_seed,
                    "reached": sum(math.isfinite(v) for v in per_seed),
                    **bootstrap_mean(per_seed).to_json(),
                }
            final = self.at_fraction(spec, len(fractions) - 1)
            gain = sum(final) / len(final) - initial
            out[spec] = {
                "points": points,
                "reach": reach,
                "steps": bootstrap_mean([row["steps"] for row in rows]).to_json(),
                "gain_fraction_of_exact": gain / exact_gain if exact_gain > 0 else None,
                "gain_fraction_of_ceiling": gain / (ceiling - initial)
                if ceiling is not None and ceiling != initial
                else None,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "config": self.config,
            "initial": self.initial,
            "summary": self.summary(),
            "runs": self.runs,
        }

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RaceReport:
        """The report a race wrote (``report.json``, or the folder holding it), rebuilt from
        its settings, the pretrained evaluation and the per-seed curves alone: every
        statistic (means, bootstrap intervals, paired differences, compute to reach) is
        recomputed from those, so ``load(p).to_json()`` equals the file where the stored
        statistics are the raw data's."""
        from gradest.harness import json_restored
        from gradest_lab.storage.file_schema import read_report_json

        data = read_report_json(
            path, kinds={SCHEMA: "race report"}, fields=("config", "initial", "runs")
        )
        return cls(
            config=data["config"],
            initial=json_restored(data["initial"]),
            runs=json_restored(data["runs"]),
        )

    def to_json(self) -> str:
        from gradest.harness import json_safe

        return json.dumps(json_safe(self.to_dict()), indent=2, allow_nan=False)

    def to_markdown(self) -> str:
        config, summary = self.config, self.summary()
        fractions = config["fractions"]
        seeds = config["seeds"]
        if self.axis == "flops":
            budget = (
                f"{config['budget_exact_steps']:.3g} exact steps = {config['budget']:.4g} "
                f"backward FLOPs (one forward {config['forward_flops'] / 1e6:.3g} MFLOP; an "
                f"exact step {config['exact_step_model_units']:.4g} forward-equivalents)"
            )
        else:
            budget = f"{config['budget']:.4g} s of measured wall time per estimator"
        ceiling = config.get("ceiling")
        lines = [
            f"# Race: {config['task']}",
            "",
            f"Budget {budget}; {len(seeds)} seeds ({_seed_text(seeds)}); every estimator "
            f"starts from the same pretrained model. Reward and drift on one fixed evaluation "
            f"set of {config['eval_samples']} samples shared by every estimator and seed "
            f"(the primary number; the training batches' rewards are not evaluations). "
            f"Pretrained: reward {self.initial['reward']:.4g}, drift "
            f"{self.initial['drift']:.4g}."
            + (
                f" Ceiling (attainable reward): {ceiling:.4g}."
                if ceiling is not None
                else " Ceiling: unknown."
            ),
            f"Means over seeds; [low, high] are 95% percentile bootstrap intervals "
            f"({config['bootstrap']['resamples']} resamples of the seeds, fixed seed), "
            f"differences to `exact` paired by seed. Compute in {self.unit_name}.",
            "",
            *_fraction_table_head(
                "Reward at each budget fraction (Δ: minus exact, paired)", fractions
            ),
        ]
        for spec, s in summary.items():
            cells = []
            for p in s["points"]:
                reward, diff = p["reward"], p["reward_minus_exact"]
                cell = f"{_num(reward['mean'])}"
                if spec != REFERENCE:
                    cell += f" (Δ {_ci(diff, '+.3g')})"
                cells.append(cell)
            lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
        lines += [
            "",
            *_fraction_table_head(
                "Drift from the pretrained model at each budget fraction", fractions
            ),
        ]
        for spec, s in summary.items():
            cells = [_ci(p["drift"]) for p in s["points"]]
            lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
        header = "| estimator | steps | final reward [CI] | share of exact's gain |"
        rule = "|---|---|---|---|"
        if ceiling is not None:
            header += " share of attainable gain |"
            rule += "---|"
        for level in REACH_LEVELS:
            header += f" compute to {int(level * 100)}% of exact's gain [CI] (seeds reached) |"
            rule += "---|"
        lines += [
            "",
            f"## Final reward, and compute to reach exact's gain ({self.unit_name})",
            "",
            header,
            rule,
        ]
        for spec, s in summary.items():
            final = s["points"][-1]["reward"]
            share = s["gain_fraction_of_exact"]
            row = (
                f"| `{spec}` | {_num(s['steps']['mean'])} | {_num(final['mean'])} "
                f"[{_num(final['low'])}, {_num(final['high'])}] "
                f"| {'-' if share is None else f'{100 * share:.1f}%'} |"
            )
            if ceiling is not None:
                c = s["gain_fraction_of_ceiling"]
                row += f" {'-' if c is None else f'{100 * c:.1f}%'} |"
            for level in REACH_LEVELS:
                r = s["reach"][f"{int(level * 100)}%"]
                n = len(r["per_seed"])
                if "undefined" in r:
                    row += f" - ({r['undefined']}) |"
                    continue
                if r["mean"] is not None and math.isfinite(r["mean"]):
                    text = f"{_num(r['mean'])} [{_num(r['low'])}, {_num(r['high'])}]"
                else:
                    text = "not reached"
                row += f" {text} ({r['reached']}/{n}) |"
            lines.append(row)
        lines += [
            "",
            "Compute to reach: per seed, the first crossing of `initial + p x (exact's final "
            "reward on that seed - initial)`, linearly interpolated between evaluation points; "
            'a seed that never reaches it counts as infinite ("not reached" when any seed '
            "does not).",
        ]
        if self.axis == "seconds":
            lines += self._stall_lines()
        return "\n".join(lines) + "\n"

    def stalls(self) -> dict[str, list[dict[str, Any]]]:
        """Per estimator, the seeds with a machine stall (:func:`stalled_steps`): ``{"seed",
        "steps": [(index, seconds), ...], "median": seconds}``. Empty for races run before
        step times were recorded."""
        found: dict[str, list[dict[str, Any]]] = {}
        for spec, rows in self.runs.items():
            for row in rows:
                times = row.get("step_seconds") or []
                slow = stalled_steps(times)
                if slow:
                    found.setdefault(spec, []).append(
                        {"seed": row["seed"], "steps": slow, "median": statistics.median(times)}
                    )
        return found

    def _stall_lines(self) -> list[str]:
        stalls = self.stalls()
        if not stalls:
            return []
        lines = [
            "",
            "## Machine stalls",
            "",
            f"Steps that took more than {STALL_FACTOR:g}x their run's median step. On a "
            "wall-time budget such a step spends budget on time the machine gave to something "
            "else, so these seeds' differences reflect load, not the estimator: rerun on a "
            "quiet machine, or read the FLOPs race.",
            "",
            "| estimator | seed | stalled steps (index: seconds) | median step (s) |",
            "|---|---|---|---|",
        ]
        for spec, entries in stalls.items():
            for entry in entries:
                steps = ", ".join(f"{i}: {t:.3g}" for i, t in entry["steps"])
                lines.append(f"| `{spec}` | {entry['seed']} | {steps} | {entry['median']:.3g} |")
        return lines

    def write(self, out: str | os.PathLike[str], *, plots: bool = True) -> Path:
        """Write ``report.md``, ``report.json`` and (with matplotlib) ``reward_vs_compute.png``
        into ``out``, each file atomically."""
        from gradest_lab.plots import plots_unavailable

        target = check_output_dir(out, what="out")
        missing = plots_unavailable() if plots else None
        if missing is not None:
            warnings.warn(f"gradest race: plots skipped: {missing}", stacklevel=2)
            plots = False
        atomic_write_text(target / "report.json", self.to_json())
        atomic_write_text(target / "report.md", self.to_markdown())
        if plots:
            from gradest_lab.plots import plot_race

            staging = Path(tempfile.mkdtemp(prefix=".race-plots-", dir=target))
            try:
                for item in plot_race(self, staging):
                    os.replace(item, target / item.name)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return target


def _fraction_table_head(title: str, fractions: Sequence[float]) -> list[str]:
    """The opening of a ``## title`` section: the heading, a blank line, and the header
    and rule of a table with one row per estimator and one column per budget fraction."""
    return [
        f"## {title}",
        "",
        "| estimator | " + " | ".join(f"{f:g} budget" for f in fractions) + " |",
        "|---|" + "---|" * len(fractions),
    ]


def _num(value: float | None, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def _ci(interval: Mapping[str, Any], spec: str = ".4g") -> str:
    """``mean [low, high]``."""
    low, high = _num(interval["low"], spec), _num(interval["high"], spec)
    return f"{_num(interval['mean'], spec)} [{low}, {high}]"


def _seed_text(seeds: Sequence[int]) -> str:
    """``0-15`` for a run of consecutive seeds (``16-31`` too), else the list."""
    values = list(seeds)
    if len(values) > 1 and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))
