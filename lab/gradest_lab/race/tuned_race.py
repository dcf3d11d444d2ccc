"""The tuned race: every estimator at its own learning rate, compared at equal compute.

A plain race (:func:`gradest_lab.race.plain_race.race`) runs every estimator at the task's one
learning rate. With Adam the first updates are about ``lr * sign(g)``, so an estimator that
takes more (cheaper) steps for the same compute acts as if its lr were larger, and one
shared lr decides a good part of the answer. The tuned race removes that: it answers
"which estimator buys more reward per unit of compute?" the way optimizer benchmarks do::

    report = tuned_race(task, ["exact", "sdo", "drtune"], lrs=[4e-5, 1e-4, 2.5e-4, 6.3e-4,
                        1.6e-3], tune_seeds=range(0, 8), seeds=range(16, 32),
                        budget_exact_steps=8, out="runs/tuned")

1. **Tuning.** Every estimator runs at every lr of the grid on the *tuning seeds*, each run
   to the whole budget, evaluated at every budget fraction, so the best lr *for each
   budget* comes from the same runs. The rate chosen for the reward at budget fraction
   ``f`` is the one with the best mean reward at ``f`` over the tuning seeds; the rate
   chosen for time-to-target (below) is the one that reaches the primary level
   (:data:`PRIMARY_LEVEL` of the attainable gain) on every tuning seed with the least mean
   compute (when none does on every seed: the most seeds, then the best final reward).
   A chosen lr on the edge of the grid is flagged: the grid must be extended before such
   a result is quoted (and a grid of fewer than :data:`MIN_GRID_POINTS` points or spanning
   less than :data:`MIN_GRID_SPAN` x is flagged as too narrow to quote).
2. **The ceiling** (the attainable reward the targets are fractions of) is measured apart
   from the report: the (estimator, lr) with the best mean final reward on the tuning
   seeds runs on the first :data:`CEILING_SEEDS` tuning seeds for :data:`CEILING_FACTOR`
   times the budget, evaluated at :data:`CEILING_POINTS` points on the task's evaluation
   *apart* from the report's (``evaluate_apart``: other noise, other held-out draws; a task
   without one is evaluated on the report's set, and the report says so). The attainable
   gain is each run's settled end (the mean of its last :data:`SETTLED_SHARE` of
   evaluations) minus the pretrained model's reward on that set, averaged over the seeds
   with its 95% interval; the ceiling on the report's scale is the pretrained reward plus
   that gain. The task's own ceiling, if it states one, is reported beside it.
3. **Report.** Every estimator runs at its chosen rates on the *report seeds* (disjoint
   from the tuning seeds). Reported, with 95% bootstrap intervals over the report seeds:
   **time to target**, the compute each estimator needs to reach :data:`DEFAULT_LEVELS`
   of the attainable gain (per seed, linearly interpolated between evaluation points;
   "not reached" within the budget counts as infinite), with the paired bootstrap ratio to
   exact's and how many seeds reach it; the **reward at each budget fraction**, paired
   with exact's (each at its own lr for that budget); and a **decision table**: per budget,
   which estimators beat exact (the paired interval above 0), fall behind (below 0), or
   neither.

Every run is a shard (:mod:`gradest_lab.race.shards`): stored on its own, committed
and merged by copying files, resumed after a kill, claimed by one of several processes
running the same race. A race folder may grow (more estimators, lrs or seeds) while its
identity (task settings, budget, fractions, evaluation set) stays; anything else is refused.

Budgets are backward FLOPs (deterministic): a wall-time budget is not tuned here (its
numbers would move with the machine's load between tuning and report).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from gradest import InvalidType, InvalidValue
from gradest_lab.race.bootstrap import bootstrap_mean, paired_bootstrap, paired_ratio_bootstrap
from gradest_lab.race.file_schemas import check_tuned_settings
from gradest_lab.race.horizon import horizon
from gradest_lab.race.plain_race import (
    REFERENCE,
    RaceReport,
    RaceTask,
    _check_budget,
    _check_fractions,
    _check_specs,
    _check_task,
    _Race,
    compute_to_reach,
    evaluate_pretrained,
    measure_budget,
)
from gradest_lab.race.refinement import (
    BRACKET_RATIO,
    MAX_ROUNDS,
    check_bracket_ratio,
    merge_close,
    next_rates,
    residual_gap,
    verdict,
)
from gradest_lab.race.shards import ShardKey, ShardStore, lr_label, race_identity
from gradest_lab.storage.files import (
    atomic_write_text,
    check_output_dir,
    read_json,
    refuse_non_file,
)
from gradest_lab.storage.run_folder import RunRecord, claim_run_folder

# The command a tuned race folder's run.json names (a plain race's is "gradest race").
TUNED_RACE_COMMAND = "gradest race --tune"
TUNED_SCHEMA = "gradest.tuned-race/1"
DEFAULT_LEVELS = (0.5, 0.8, 0.9)
PRIMARY_LEVEL = 0.8
CEILING_FACTOR = 16.0
CEILING_POINTS = 32
# The ceiling runs on this many of the tuning seeds (the first ones)...
CEILING_SEEDS = 3
# ...and each one's settled end is the mean of this share of its last evaluations.
SETTLED_SHARE = 0.25
MIN_GRID_POINTS = 5
MIN_GRID_SPAN = 30.0
# The most rates a grid may have: each is a run per estimator and tuning seed, and a count
# past this is a typo, refused before the grid is built (lr=1e-4..1e-3:999999999).
MAX_GRID_POINTS = 100
# A tuned race evaluates at every eighth of the budget: time-to-target interpolates
# between evaluation points, so they must be dense enough to place a crossing.
DEFAULT_TUNED_FRACTIONS = tuple(i / 8 for i in range(1, 9))
# How often a process waiting for another's shard looks again (seconds).
_POLL_SECONDS = 2.0

__all__ = [
    "DEFAULT_LEVELS",
    "DEFAULT_TUNED_FRACTIONS",
    "MAX_GRID_POINTS",
    "PRIMARY_LEVEL",
    "TunedRaceReport",
    "check_lr_grid",
    "choose_lrs",
    "parse_lr_grid",
    "parse_seed_list",
    "replay_shard",
    "replot_race",
    "tuned_race",
]


# -- the command line's forms --------------------------------------------------------------


def parse_lr_grid(text: str) -> list[float]:
    """``lr=4e-5,1e-4,2.5e-4`` (the points) or ``lr=3e-5..1e-3:6`` (6 log-spaced points,
    rounded to 2 significant digits): the ``--tune`` grid, increasing, of at most
    :data:`MAX_GRID_POINTS` rates (a larger count is refused before any rate is built)."""
    if not isinstance(text, str):
        raise InvalidType(f"--tune must be text like lr=3e-5..1e-3:6, got {text!r}")
    key, sep, value = text.partition("=")
    if not sep or key.strip() != "lr":
        raise InvalidValue(
            f"--tune {text!r}: only the learning rate is tuned; give lr=3e-5..1e-3:6 (6 "
            f"log-spaced points) or lr=1e-4,3e-4,1e-3"
        )
    value = value.strip()
    ranged = re.fullmatch(r"([^.:,]+(?:\.[^.:,]+)?)\.\.([^:,]+):(\d+)", value)
    # The size first, from the text alone: nothing is built for a count past the bound (and
    # a count of thousands of digits is not even converted).
    asked = ranged[3] if ranged else str(value.count(",") + 1)
    if len(asked) > 6 or int(asked) > MAX_GRID_POINTS:
        shown = asked if len(asked) <= 12 else f"a count of {len(asked)} digits"
        raise InvalidValue(
            f"--tune {text if len(text) <= 60 else text[:57] + '...'!r}: a grid has at most "
            f"{MAX_GRID_POINTS} rates (each is a run per estimator and tuning seed), got "
            f"{shown}; e.g. lr=3e-5..1e-3:6"
        )
    try:
        if ranged:
            low, high, count = float(ranged[1]), float(ranged[2]), int(ranged[3])
            if count < 2 or not (0 < low < high) or not math.isfinite(high):
                raise ValueError
            ratio = (high / low) ** (1 / (count - 1))
            points = [float(f"{low * ratio**i:.2g}") for i in range(count)]
        else:
            points = [float(item) for item in value.split(",")]
    except ValueError:
        raise InvalidValue(
            f"--tune {text!r}: give lr=LOW..HIGH:COUNT (0 < LOW < HIGH, COUNT >= 2) or a comma "
            f"list of positive numbers, e.g. lr=3e-5..1e-3:6"
        ) from None
    distinct = len(set(points))
    if ranged and distinct < len(points):
        fix = "give" if distinct < 2 else f"ask for at most {distinct} points or give"
        raise InvalidValue(
            f"--tune {text!r}: its {len(points)} log-spaced rates, rounded to 2 significant "
            f"digits, are only {distinct} distinct {'rate' if distinct == 1 else 'rates'}; "
            f"{fix} a wider range"
        )
    return check_lr_grid(points, what=f"--tune {text!r}")


def check_lr_grid(points: Iterable[Any], *, what: str = "lrs") -> list[float]:
    """At least two (at most :data:`MAX_GRID_POINTS`) distinct, increasing, positive finite
    learning rates, each with a shard folder of its own (:func:`lr_label`)."""
    if isinstance(points, str | bytes):
        raise InvalidType(f"{what}: a list of learning rates, got {points!r}")
    # One past the bound is enough to refuse: a huge iterable is never listed whole.
    values = list(itertools.islice(points, MAX_GRID_POINTS + 1))
    if len(values) > MAX_GRID_POINTS:
        raise InvalidValue(
            f"{what}: a grid has at most {MAX_GRID_POINTS} learning rates (each is a run per "
            f"estimator and tuning seed); give fewer"
        )
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise InvalidType(f"{what}: learning rates are numbers, got {values!r}")
    floats = [float(v) for v in values]
    if len(floats) < 2 or any(not (math.isfinite(v) and v > 0) for v in floats):
        raise InvalidValue(f"{what}: at least two positive finite learning rates, got {values}")
    if floats != sorted(set(floats)):
        raise InvalidValue(
            f"{what}: the learning rates must be distinct and increasing, got {values}"
        )
    # Shards are stored by rate in folders named to 6 significant digits: two rates that
    # share one would read each other's runs back (and each refuse the other's).
    for before, now in itertools.pairwise(floats):
        if lr_label(before) == lr_label(now):
            raise InvalidValue(
                f"{what}: {before!r} and {now!r} share the shard folder {lr_label(now)} (rates "
                f"are told apart by 6 significant digits); drop one of them, or give rates "
                f"that differ within 6 digits"
            )
    return floats


# Seeds seed torch generators (64-bit) after offsets of a few million; a race of more
# seeds than this would not finish.
_MAX_SEED = 999_999_999
_MAX_SEEDS = 1_000_000


def parse_seed_list(text: str, *, what: str = "--seeds") -> list[int]:
    """``16`` (seeds 0..15), ``16-31`` (a range, both ends included), ``0,3,5`` or a mix
    (``0-3,8``): a seed list, each seed once."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidValue(f"{what}: give a count (16), a range (16-31) or a list (0,3,5)")
    items = [item.strip() for item in text.split(",")]
    if len(items) == 1 and re.fullmatch(r"\d+", items[0]):
        count = int(items[0])
        if not 1 <= count <= _MAX_SEEDS:
            raise InvalidValue(
                f"{what} {text!r}: a single number is a count of seeds (1 .. {_MAX_SEEDS}: "
                f"seeds 0 .. count-1); for one seed give a range such as 0-0"
            )
        return list(range(count))
    seeds: list[int] = []
    for item in items:
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise InvalidValue(
                f"{what} {text!r}: {item!r} is not a seed or a range; give e.g. 16-31 or 0,3,5"
            )
        low = int(match[1])
        high = low if match[2] is None else int(match[2])
        if high > _MAX_SEED:
            raise InvalidValue(f"{what} {text!r}: {item!r} goes past the largest seed, {_MAX_SEED}")
        if high < low:
            raise InvalidValue(f"{what} {text!r}: the range {item!r} runs backwards")
        if len(seeds) + high - low + 1 > _MAX_SEEDS:
            raise InvalidValue(f"{what} {text!r} lists more than {_MAX_SEEDS} seeds")
        seeds.extend(range(low, high + 1))
    if len(set(seeds)) != len(seeds):
        raise InvalidValue(f"{what} {text!r} lists a seed twice")
    return seeds


def _check_seed_list(seeds: Iterable[Any], what: str) -> list[int]:
    if isinstance(seeds, str | bytes):
        raise InvalidType(f"{what} must be a list of ints, got {seeds!r}")
    # One past the bound is enough to refuse: a huge range is never listed whole.
    values = list(itertools.islice(seeds, _MAX_SEEDS + 1))
    if len(values) > _MAX_SEEDS:
        raise InvalidValue(f"{what} lists more than {_MAX_SEEDS} seeds")
    if not values or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in values):
        raise InvalidValue(f"{what} must be a non-empty list of ints >= 0, got {values!r}")
    if len(set(values)) != len(values):
        raise InvalidValue(f"{what} lists a seed twice: {values}")
    return values


def _check_levels(levels: Sequence[float], primary: float) -> list[float]:
    values = [float(v) for v in levels]
    if not values or values != sorted(set(values)) or any(not 0 < v <= 1 for v in values):
        raise InvalidValue(f"levels must be increasing, distinct, in (0, 1], got {list(levels)}")
    if primary not in values:
        raise InvalidValue(f"the primary level {primary} must be one of the levels {values}")
    return values


# -- the statistics of the runs ------------------------------------------------------------


def _reward_at(rows: Sequence[Mapping[str, Any]], index: int, key: str = "reward") -> list[float]:
    return [float(row["curve"][index][key]) for row in rows]


def _times_to(
    rows: Sequence[Mapping[str, Any]], initial: float, target: float, unit: float
) -> list[float]:
    """Per row, the compute (in ``unit``) at which its curve first reaches ``target``."""
    return [
        compute_to_reach(
            [(0.0, initial)] + [(p["flops"] / unit, p["reward"]) for p in row["curve"]], target
        )
        for row in rows
    ]


def choose_lrs(
    rows_by_lr: Mapping[str, Sequence[Mapping[str, Any]]],
    lrs: Sequence[float],
    *,
    fractions: Sequence[float],
    initial: float,
    target: float | None,
    unit: float,
    ratio: float = BRACKET_RATIO,
) -> dict[str, Any]:
    """An estimator's chosen rates from its tuning runs (module docstring, item 1), with
    how finely each is bracketed (:mod:`gradest_lab.race.refinement`).

    Args:
        rows_by_lr: the tuning rows per lr label (:func:`lr_label`), one list per tried rate.
        lrs: the tried rates, increasing.
        ratio: the bracket a choice needs (its tried neighbours at most this far).

    Returns ``{"by_fraction": [lr per fraction], "primary": lr or None (no target yet),
    "gap_by_fraction": [residual tuning gap in reward per fraction], "primary_gap": the
    time (in ``unit``) a finer rate could still save for time-to-target (None when not
    measurable), "edge": [names of the choices on the tried rates' edge], "unbracketed":
    [names of the choices whose neighbours are farther than ``ratio``], "wanted": [the rates
    to try next, increasing]}``.
    """

    def mean_at(lr: float, index: int) -> float:
        rows = rows_by_lr[lr_label(lr)]
        value = sum(_reward_at(rows, index)) / len(rows)
        # A diverged run's NaN would make the choice depend on the rates' order.
        return value if math.isfinite(value) else -math.inf

    means = {lr: [mean_at(lr, i) for i in range(len(fractions))] for lr in lrs}

    def best_at(index: int) -> float:
        """The best mean reward at budget fraction ``index``; a tie goes to the smaller lr."""
        return max(lrs, key=lambda lr: (means[lr][index], -lr))

    by_fraction = [best_at(i) for i in range(len(fractions))]
    profiles = [
        (f"{fractions[i]:g} of the budget", {x: means[x][i] for x in lrs}, lr)
        for i, lr in enumerate(by_fraction)
    ]
    primary = None
    speed: dict[float, float] = {}
    if target is not None:

        def score(lr: float) -> tuple[float, ...]:
            times = _times_to(rows_by_lr[lr_label(lr)], initial, target, unit)
            reached = sum(math.isfinite(t) for t in times)
            if reached == len(times):
                return (0.0, sum(times) / len(times), lr)
            return (1.0, -reached, -means[lr][-1], lr)

        scores = {lr: score(lr) for lr in lrs}
        primary = min(lrs, key=scores.__getitem__)
        # Faster is better: the negated mean time where every tuning seed reached the target.
        speed = {lr: -scores[lr][1] if scores[lr][0] == 0 else -math.inf for lr in lrs}
        if math.isfinite(speed[primary]):
            profiles.append(("time to target", speed, primary))

    # A choice on the tried rates' edge says the best rate may lie beyond it, unless the
    # edge only ties its neighbour (an estimator that takes no step ties at every rate).
    def beyond_edge(lr: float, values: Mapping[float, float]) -> bool:
        if lr not in (lrs[0], lrs[-1]) or len(lrs) < 2:
            return False
        neighbour = lrs[1] if lr == lrs[0] else lrs[-2]
        return values[lr] > values[neighbour]

    edge = [name for name, values, lr in profiles if beyond_edge(lr, values)]
    asked: list[tuple[float, float]] = []
    unbracketed = []
    for name, values, lr in profiles:
        more = next_rates(lrs, values, lr, ratio=ratio)
        if more:
            unbracketed.append(name)
            asked += [(rate, lr) for rate in more]
    gaps = [residual_gap(lrs, values, lr) for _, values, lr in profiles[: len(fractions)]]
    primary_gap = (
        residual_gap(lrs, speed, primary)
        if primary is not None and math.isfinite(speed[primary])
        else None
    )
    return {
        "by_fraction": by_fraction,
        "primary": primary,
        "gap_by_fraction": gaps,
        "primary_gap": primary_gap,
        "edge": edge,
        "unbracketed": unbracketed,
        "wanted": [lr for lr in merge_close(asked, ratio=ratio) if lr not in lrs],
    }


@attrs.frozen(eq=False)
class TunedRaceReport:
    """A tuned race's runs and their statistics (module docstring).

    Attributes:
        config: the race's settings and measured constants (task, estimators, grid, seeds,
            budget, fractions, levels, the forward's FLOPs, torch).
        initial: the pretrained model's evaluation (every curve's point at compute 0).
        ceiling_run: the ceiling measurement (:attr:`attainable_gain`): ``{"spec", "lr",
            "seeds", "budget_exact_steps", "evaluation", "initial", "rows"}``: the runs'
            rows, ``evaluation`` ``"apart"`` (on the task's evaluation apart from the
            report's, ``initial`` the pretrained model's there) or ``"report"`` (the task
            has none; ``initial`` is the report's). A race folder of before the ceiling was
            measured apart holds ``"seed"`` and ``"row"`` instead: read as one seed on the
            report's evaluation, and flagged.
        tuning: per estimator, per lr label (``lr-0.0001``): the tuning seeds' rows.
        runs: per estimator, per chosen lr label: the report seeds' rows.

    Rows are :meth:`gradest_lab.race.plain_race._Run.row` records (``seed``, ``steps``,
    ``flops``, ``seconds``, ``stopped_step``, ``step_seconds``, ``curve``).
    """

    config: dict[str, Any]
    initial: dict[str, float]
    ceiling_run: dict[str, Any]
    tuning: dict[str, dict[str, list[dict[str, Any]]]]
    runs: dict[str, dict[str, list[dict[str, Any]]]]

    @property
    def unit(self) -> float:
        """One exact training step's FLOPs: the unit of every compute the report shows."""
        return float(self.config["exact_step_flops"])

    @property
    def ceiling_rows(self) -> list[dict[str, Any]]:
        """The ceiling runs' rows (one per seed)."""
        run = self.ceiling_run
        return list(run["rows"]) if "rows" in run else [run["row"]]

    @property
    def ceiling_evaluation(self) -> str:
        """``"apart"`` (measured on evaluation noise disjoint from the report's) or
        ``"report"``."""
        return str(self.ceiling_run.get("evaluation", "report"))

    def _settled(self) -> tuple[list[float], list[float], int]:
        """Per ceiling run: its settled end's gain over the pretrained model, how much it
        still rose over that stretch; and how many evaluations the stretch holds."""
        initial = float(self.ceiling_run.get("initial", self.initial)["reward"])
        gains, rises = [], []
        count = 1
        for row in self.ceiling_rows:
            rewards = [float(p["reward"]) for p in row["curve"]]
            count = max(1, round(len(rewards) * SETTLED_SHARE))
            end = sum(rewards[-count:]) / count
            before = rewards[-2 * count : -count] or rewards[:1]
            gains.append(end - initial)
            rises.append(end - sum(before) / len(before))
        return gains, rises, count

    def attainable_gain(self) -> dict[str, Any]:
        """The attainable gain over the pretrained model, measured apart from the report:
        per ceiling run (seed), the mean reward of its settled end (its last
        :data:`SETTLED_SHARE` of evaluations) minus the pretrained model's on the same
        evaluation set; its mean over the seeds with a 95% bootstrap interval, and how much
        the runs still rose over that last stretch (against the stretch before it)."""
        gains, rises, count = self._settled()
        return {
            "gain": bootstrap_mean(gains).to_json(),
            "per_seed": gains,
            "settled_points": count,
            "rise": sum(rises) / len(rises),
        }

    @property
    def ceiling(self) -> float:
        """The attainable reward on the report's evaluation set: its pretrained reward plus
        the attainable gain measured apart (:meth:`attainable_gain`)."""
        gains = self._settled()[0]
        return self.initial["reward"] + sum(gains) / len(gains)

    def target(self, level: float) -> float:
        initial = self.initial["reward"]
        return initial + level * (self.ceiling - initial)

    @property
    def bracket_ratio(self) -> float:
        """How finely every choice must be bracketed to be quoted (``refinement``)."""
        return float(self.config.get("bracket_ratio") or BRACKET_RATIO)

    def tried_lrs(self, spec: str) -> list[float]:
        """The rates ``spec`` was tuned at: the grid and the refinement's, increasing."""
        tried = self.config.get("tried_lrs", {}).get(spec)
        return list(self.config["lrs"]) if tried is None else list(tried)

    def choices(self) -> dict[str, dict[str, Any]]:
        """Per estimator, its chosen rates (:func:`choose_lrs`) from the tuning runs."""
        return {
            spec: choose_lrs(
                self.tuning[spec],
                self.tried_lrs(spec),
                fractions=self.config["fractions"],
                initial=self.initial["reward"],
                target=self.target(self.config["primary_level"]),
                unit=self.unit,
                ratio=self.bracket_ratio,
            )
            for spec in self.config["estimators"]
        }

    def grid_warnings(self) -> list[str]:
        """Why the race's result cannot be quoted yet (a narrow grid, choices on its edge)."""
        lrs = self.config["lrs"]
        notes = []
        if len(lrs) < MIN_GRID_POINTS or lrs[-1] / lrs[0] < MIN_GRID_SPAN:
            notes.append(
                f"the grid has {len(lrs)} points spanning {lrs[-1] / lrs[0]:.3g}x; a result to "
                f"quote needs at least {MIN_GRID_POINTS} spanning at least {MIN_GRID_SPAN:g}x"
            )
        seeds = len(self.ceiling_rows)
        if self.ceiling_evaluation != "apart" or seeds < CEILING_SEEDS:
            if self.ceiling_run.get("evaluation") is None:
                fix = "rerun the race (python -m gradest_lab.race.rerun FOLDER)"
            elif self.ceiling_evaluation != "apart":
                fix = "give the task an evaluate_apart method, then rerun the race"
            else:
                fix = f"give at least {CEILING_SEEDS} tuning seeds, then rerun the race"
            notes.append(
                f"the ceiling was measured on {seeds} seed(s) and "
                + (
                    "evaluation noise apart from the report's"
                    if self.ceiling_evaluation == "apart"
                    else "the report's own evaluation set"
                )
                + f"; a ceiling to quote is measured apart, on at least {CEILING_SEEDS} seeds: "
                f"{fix}"
            )
        for spec, choice in self.choices().items():
            if choice["edge"]:
                notes.append(
                    f"`{spec}`: the lr chosen for {', '.join(choice['edge'])} is on the grid's "
                    f"edge; extend the grid past it before quoting"
                )
            if choice["unbracketed"]:
                names = choice["unbracketed"]
                budgets = [name for name in names if name != "time to target"]
                if len(budgets) == len(self.config["fractions"]) > 1:
                    names = ["every budget"] + [n for n in names if n == "time to target"]
                plural = len(names) > 1 or names == ["every budget"]
                notes.append(
                    f"`{spec}`: the lr chosen for {' and '.join(names)} "
                    f"{'are' if plural else 'is'} not bracketed at {self.bracket_ratio:g}x "
                    f"(tried rates next to it farther away); rerun the race to refine before "
                    f"quoting"
                )
        return notes

    def _rows(self, spec: str, lr: float) -> list[dict[str, Any]]:
        return sorted(self.runs[spec][lr_label(lr)], key=lambda row: row["seed"])

    def summary(self) -> dict[str, Any]:
        """Every statistic of the report, recomputed from the runs (no stored numbers)."""
        config, initial = self.config, self.initial["reward"]
        fractions, levels = config["fractions"], config["levels"]
        choices = self.choices()
        steps = config["budget_exact_steps"]
        tuning: dict[str, Any] = {}
        for spec, by_lr in self.tuning.items():
            target = self.target(config["primary_level"])
            tuning[spec] = {
                "chosen": choices[spec],
                "per_lr": {
                    label: {
                        "final_reward": bootstrap_mean(
                            _reward_at(rows, len(fractions) - 1)
                        ).to_json(),
                        "reward_by_fraction": [
                            sum(_reward_at(rows, i)) / len(rows) for i in range(len(fractions))
                        ],
                        "time_to_primary": bootstrap_mean(
                            _times_to(rows, initial, target, self.unit)
                        ).to_json(),
                    }
                    # increasing lr (the refinement's rates were added after the grid's)
                    for label, rows in sorted(by_lr.items(), key=lambda item: float(item[0][3:]))
                },
            }
        final: dict[str, list[dict[str, Any]]] = {}
        exact_choice = choices[REFERENCE]
        for spec in config["estimators"]:
            points = []
            for i, fraction in enumerate(fractions):
                lr = choices[spec]["by_fraction"][i]
                rows = self._rows(spec, lr)
                reward = _reward_at(rows, i)
                baseline = _reward_at(self._rows(REFERENCE, exact_choice["by_fraction"][i]), i)
                diffs = [a - b for a, b in zip(reward, baseline, strict=True)]
                gap = choices[spec]["gap_by_fraction"][i]
                exact_gap = exact_choice["gap_by_fraction"][i]
                points.append(
                    {
                        "fraction": fraction,
                        "budget_exact_steps": fraction * steps,
                        "lr": lr,
                        "residual_gap": gap,
                        # What the difference to exact must clear to be called ahead or
                        # behind: both estimators' residual gaps (a gap not measurable
                        # counts 0: that takes fewer than three tried rates around the
                        # choice, a grid the warnings already call too small).
                        "margin": (gap or 0.0) + (exact_gap or 0.0),
                        "reward": bootstrap_mean(reward).to_json(),
                        "reward_minus_exact": paired_bootstrap(reward, baseline).to_json(),
                        "seeds_above_exact": sum(d > 0 for d in diffs),
                        "drift": bootstrap_mean(_reward_at(rows, i, "drift")).to_json(),
                        "steps": bootstrap_mean(
                            [p["steps"] for p in (r["curve"][i] for r in rows)]
                        ).to_json(),
                    }
                )
            final[spec] = points
        to_target: dict[str, Any] = {}
        for spec in config["estimators"]:
            lr = choices[spec]["primary"]
            exact_lr = exact_choice["primary"]
            per_level = {}
            for level in levels:
                times = _times_to(self._rows(spec, lr), initial, self.target(level), self.unit)
                exact_times = _times_to(
                    self._rows(REFERENCE, exact_lr), initial, self.target(level), self.unit
                )
                both = all(map(math.isfinite, times)) and all(map(math.isfinite, exact_times))
                per_level[f"{level:g}"] = {
                    "per_seed": times,
                    "reached": sum(math.isfinite(t) for t in times),
                    "compute": bootstrap_mean(times).to_json(),
                    "ratio_to_exact": paired_ratio_bootstrap(times, exact_times).to_json()
                    if both and min(exact_times) > 0
                    else None,
                }
            to_target[spec] = {
                "lr": lr,
                "residual_gap": choices[spec]["primary_gap"],
                "levels": per_level,
            }
        decision = []
        for i, fraction in enumerate(fractions):
            beats: list[dict[str, Any]] = []
            behind: list[dict[str, Any]] = []
            neither: list[dict[str, Any]] = []
            for spec in config["estimators"]:
                if spec == REFERENCE:
                    continue
                point = final[spec][i]
                diff = point["reward_minus_exact"]
                entry = {
                    "spec": spec,
                    "lr": point["lr"],
                    "minus_exact": diff,
                    "margin": point["margin"],
                }
                word = verdict(diff["low"], diff["high"], point["margin"])
                {"ahead": beats, "behind": behind, "level": neither}[word].append(entry)
            beats.sort(key=lambda e: -e["minus_exact"]["mean"])
            decision.append(
                {
                    "fraction": fraction,
                    "budget_exact_steps": fraction * steps,
                    "exact_lr": exact_choice["by_fraction"][i],
                    "exact_residual_gap": exact_choice["gap_by_fraction"][i],
                    "exact_share_of_attainable": (final[REFERENCE][i]["reward"]["mean"] - initial)
                    / (self.ceiling - initial)
                    if self.ceiling > initial
                    else None,
                    "beats_exact": beats,
                    "behind_exact": behind,
                    "no_clear_difference": neither,
                }
            )
        return {
            "ceiling": {
                "value": self.ceiling,
                "attainable_gain": self.attainable_gain(),
                "evaluation": self.ceiling_evaluation,
                "task_ceiling": config.get("task_ceiling"),
                "spec": self.ceiling_run["spec"],
                "lr": self.ceiling_run["lr"],
                "seeds": [row["seed"] for row in self.ceiling_rows],
                "budget_exact_steps": self.ceiling_run["budget_exact_steps"],
            },
            "targets": {f"{level:g}": self.target(level) for level in levels},
            "tuning": tuning,
            "final": final,
            "time_to_target": to_target,
            "decision": decision,
            "horizon": horizon(config, decision, to_target[REFERENCE]),
            "warnings": self.grid_warnings(),
        }

    # -- files ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": TUNED_SCHEMA,
            "config": self.config,
            "initial": self.initial,
            "summary": self.summary(),
            "ceiling_run": self.ceiling_run,
            "tuning": self.tuning,
            "runs": self.runs,
        }

    def to_json(self) -> str:
        from gradest.harness import json_safe

        return json.dumps(json_safe(self.to_dict()), indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunedRaceReport:
        """The report a tuned race wrote (``report.json`` or its folder), rebuilt from its
        settings and raw runs alone: every statistic is recomputed."""
        from gradest.harness import json_restored
        from gradest_lab.storage.file_schema import read_report_json

        data = read_report_json(
            path,
            kinds={TUNED_SCHEMA: "tuned race report"},
            fields=("config", "initial", "ceiling_run", "tuning", "runs"),
        )
        return cls(
            config=data["config"],
            initial=json_restored(data["initial"]),
            ceiling_run=json_restored(data["ceiling_run"]),
            tuning=json_restored(data["tuning"]),
            runs=json_restored(data["runs"]),
        )

    def write(self, out: str | os.PathLike[str], *, plots: bool = True) -> Path:
        """``report.json``, ``report.md`` and (with matplotlib) ``reward_vs_compute.png``,
        ``tuning_curves.png`` and ``decision.png`` into ``out``, each atomically."""
        from gradest_lab.plots import plots_unavailable

        target = check_output_dir(out, what="out")
        missing = plots_unavailable() if plots else None
        if missing is not None:
            warnings.warn(f"gradest race: plots skipped: {missing}", stacklevel=2)
            plots = False
        atomic_write_text(target / "report.json", self.to_json() + "\n")
        atomic_write_text(target / "report.md", self.to_markdown())
        if plots:
            from gradest_lab.plots import plot_tuned_race

            plot_tuned_race(self, target)
        return target

    # -- the page ---------------------------------------------------------------------------

    def to_markdown(self) -> str:
        from gradest_lab.race.tuned_page import tuned_race_markdown

        return tuned_race_markdown(self)


# -- running it ----------------------------------------------------------------------------


class _EvaluatedApart:
    """The task with its evaluation swapped for its ``evaluate_apart`` (the ceiling's)."""

    def __init__(self, task: RaceTask) -> None:
        self._task = task

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def evaluate(self, model: torch.nn.Module) -> Any:
        # optional (not in RaceTask): the tuned race calls it only where the task has it
        return getattr(self._task, "evaluate_apart")(model)  # noqa: B009


class _NoBar:
    """The per-evaluation progress of a run is not shown: the bar counts shards."""

    def update(self, count: int) -> None:
        del count


def _identity_settings(
    task: RaceTask, budget: Mapping[str, Any], fractions: list[float]
) -> dict[str, Any]:
    settings = dict(task.settings())
    settings.pop("lr", None)  # every shard sets its own
    return {
        "task": task.name,
        "task_settings": settings,
        "budget_given": dict(budget),
        "fractions": fractions,
        "eval_samples": task.eval_samples,
    }


@attrs.define(eq=False)
class _ShardRunner:
    """Runs the shards of one budget and fraction list, each once, with a progress bar."""

    race: _Race
    store: ShardStore
    pretrained: torch.nn.Module
    sampler: Any
    bar: Any

    def results(self, keys: Sequence[ShardKey]) -> dict[ShardKey, dict[str, Any]]:
        """The finished row of every key, running those not run yet (waiting for those
        another process runs)."""
        done: dict[ShardKey, dict[str, Any]] = {}
        waiting: list[ShardKey] = []
        for key in keys:
            row = self.store.result(key)
            if row is None:
                row = self._run(key)
            if row is None:
                waiting.append(key)
            else:
                done[key] = row
                self.bar.update(1)
        while waiting:
            time.sleep(_POLL_SECONDS)
            still = []
            for key in waiting:
                row = self.store.result(key) or self._run(key)
                if row is None:
                    still.append(key)
                else:
                    done[key] = row
                    self.bar.update(1)
            waiting = still
        return {key: done[key] for key in keys}

    def _run(self, key: ShardKey) -> dict[str, Any] | None:
        with self.store.claim(key) as mine:
            if not mine:
                return None
            row = self.store.result(key)  # finished by another process meanwhile
            if row is not None:
                return row
            self.bar.set_postfix_str(key.describe(), refresh=True)
            run = self.race.new_run(key.spec, key.seed, self.pretrained, lr=key.lr)
            self.race.finish(run, self.sampler)
            row = run.row()
            environment = {"torch": torch.__version__, "threads": torch.get_num_threads()}
            self.store.save(key, row, environment)
            return json.loads(json.dumps(row))  # as a later read gives it back


def tuned_race(
    task: RaceTask,
    specs: Sequence[str],
    *,
    lrs: Sequence[float],
    tune_seeds: Iterable[int],
    seeds: Iterable[int],
    budget_exact_steps: float,
    fractions: Sequence[float] = DEFAULT_TUNED_FRACTIONS,
    levels: Sequence[float] = DEFAULT_LEVELS,
    primary_level: float = PRIMARY_LEVEL,
    ceiling_factor: float = CEILING_FACTOR,
    bracket_ratio: float | None = BRACKET_RATIO,
    out: str | os.PathLike[str] | None = None,
    show_progress: bool = True,
    plots: bool = True,
) -> TunedRaceReport:
    """Tune every estimator's lr on ``tune_seeds``, then race them at equal compute on
    ``seeds`` (module docstring).

    Args:
        task: a :class:`~gradest_lab.race.plain_race.RaceTask` whose optimizer's param groups take
            an ``lr`` (each run sets it).
        specs: estimator spec strings, ``"exact"`` among them.
        lrs: the grid, increasing (``parse_lr_grid`` reads the command line's form).
        tune_seeds: the tuning seeds (the lrs are chosen on them).
        seeds: the report seeds, disjoint from the tuning seeds.
        budget_exact_steps: the budget in FLOPs of that many exact training steps.
        fractions: the budget fractions every run is evaluated at (ending at 1).
        levels: the time-to-target levels, fractions of the attainable gain.
        primary_level: the level whose time-to-target chooses that statistic's lr.
        ceiling_factor: the ceiling run's budget in race budgets.
        bracket_ratio: refine every choice on the tuning seeds until the tried rates next
            to it are at most this far (:mod:`gradest_lab.race.refinement`); None keeps
            the grid's choices (the report then flags them as not bracketed).
        out: the race folder (shards, resume, report); None keeps everything in memory.

    Raises:
        InvalidValue / InvalidType / OutputError: before any work.
    """
    _check_task(task)
    specs = _check_specs(specs, task)
    grid = check_lr_grid(lrs)
    tune_list = _check_seed_list(tune_seeds, "tune_seeds")
    seed_list = _check_seed_list(seeds, "seeds")
    shared = sorted(set(tune_list) & set(seed_list))
    if shared:
        raise InvalidValue(
            f"the tuning seeds and the report seeds must be disjoint (a rate chosen on a seed "
            f"is not evidence on it); both have {shared}"
        )
    fraction_list = _check_fractions(fractions)
    kind, value = _check_budget(None, None, budget_exact_steps)
    level_list = _check_levels(levels, float(primary_level))
    if isinstance(ceiling_factor, bool) or not (
        isinstance(ceiling_factor, int | float)
        and math.isfinite(ceiling_factor)
        and ceiling_factor >= 1
    ):
        raise InvalidValue(f"ceiling_factor must be a number >= 1, got {ceiling_factor!r}")
    bracket_ratio = check_bracket_ratio(bracket_ratio)
    budget_given = {"kind": kind, "value": value}
    identity_settings = _identity_settings(task, budget_given, fraction_list)
    identity = race_identity(identity_settings)
    settings = {
        "kind": "tuned",
        "identity": identity,
        "identity_settings": identity_settings,
        "task": task.name,
        "task_settings": identity_settings["task_settings"],
        "estimators": specs,
        "lrs": grid,
        "tune_seeds": tune_list,
        "seeds": seed_list,
        "budget_given": budget_given,
        "fractions": fraction_list,
        "eval_samples": task.eval_samples,
        "levels": level_list,
        "primary_level": float(primary_level),
        "ceiling_factor": float(ceiling_factor),
        "bracket_ratio": bracket_ratio,
    }
    target = None
    with contextlib.ExitStack() as stack:
        if out is not None:
            # Several processes may run one tuned race (each claims its shards): the folder
            # is shared, and its record is the race's identity, which the race's growth
            # (more lrs, estimators or seeds) leaves unchanged.
            target = check_output_dir(out, what="out", create=False)
            refuse_non_file(target / "race.json", what=f"out {str(target)!r}: race.json")
            record = RunRecord(
                command=TUNED_RACE_COMMAND, settings={"identity": identity, **identity_settings}
            )
            stack.enter_context(
                claim_run_folder(target, record, shared=True, schema=check_tuned_settings)
            )
        # -- the work starts here --
        measured = measure_budget(task, kind, value)
        if target is not None:
            # This call's settings (the grid, line-up and seeds it asked for), for the reader.
            atomic_write_text(target / "race.json", json.dumps(settings, indent=2) + "\n")
        # Without out, the shards live in a temporary folder for the call's duration.
        root = (
            target
            if target is not None
            else Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="gradest-tuned-race-"))
            )
        )
        report = _run_tuned_race(
            task,
            specs,
            grid,
            tune_list,
            seed_list,
            fraction_list,
            value,
            float(ceiling_factor),
            settings,
            identity_settings,
            identity,
            measured,
            root,
            show_progress,
        )
    if target is not None:
        report.write(target, plots=plots)
    for note in report.grid_warnings():
        warnings.warn(f"gradest race --tune: {note}", stacklevel=2)
    return report


def _run_tuned_race(
    task: RaceTask,
    specs: list[str],
    grid: list[float],
    tune_list: list[int],
    seed_list: list[int],
    fraction_list: list[float],
    value: float,
    ceiling_factor: float,
    settings: dict[str, Any],
    identity_settings: dict[str, Any],
    identity: str,
    measured: Any,
    root: Path,
    show_progress: bool,
) -> TunedRaceReport:
    """The runs of :func:`tuned_race`, its shards under ``root``."""
    from tqdm.auto import tqdm

    initial = evaluate_pretrained(task, measured.pretrained)
    sampler = task.sampler()

    def runner(
        store: ShardStore, budget: float, points: list[float], bar: Any, judged: Any = task
    ) -> _ShardRunner:
        race = _Race(
            task=judged,
            kind="flops",
            budget=budget,
            fractions=points,
            flops_per_unit=measured.flops_per_unit,
            state_path=lambda run: store.state_path(ShardKey(run.spec, run.lr, run.seed)),
            bar=_NoBar(),
        )
        return _ShardRunner(race, store, measured.pretrained, sampler, bar)

    # Seed-major: every estimator's first run comes first, so an estimator that fails on
    # this task (an option the model cannot meet) fails in the first minutes, not hours in.
    tuning_keys = [ShardKey(s, lr, seed) for seed in tune_list for lr in grid for s in specs]
    with tqdm(
        total=len(tuning_keys),
        desc=f"tuned race {task.name}",
        unit="run",
        disable=not show_progress,
    ) as bar:
        main = runner(
            ShardStore(root, identity, fractions=fraction_list),
            measured.budget,
            fraction_list,
            bar,
        )
        tuned = main.results(tuning_keys)
        tuning = {
            spec: {
                lr_label(lr): [tuned[ShardKey(spec, lr, seed)] for seed in tune_list] for lr in grid
            }
            for spec in specs
        }
        # The ceiling: the best (estimator, lr) by mean final reward, run much longer.
        best = max(
            ((spec, lr) for spec in specs for lr in grid),
            key=lambda pair: sum(_reward_at(tuning[pair[0]][lr_label(pair[1])], -1)),
        )
        # Measured apart from the report: on tuning seeds, and (where the task has one) on
        # its evaluation apart from the report's, so that the report's own noise does not
        # set the bar its shares are measured against.
        apart = callable(getattr(task, "evaluate_apart", None))
        judged = _EvaluatedApart(task) if apart else task
        ceiling_points = [i / CEILING_POINTS for i in range(1, CEILING_POINTS + 1)]
        ceiling_identity = race_identity(
            {
                **identity_settings,
                "ceiling_factor": float(ceiling_factor),
                "points": ceiling_points,
                "evaluation": "apart" if apart else "report",
            }
        )
        ceiling_seeds = tune_list[:CEILING_SEEDS]
        bar.total += len(ceiling_seeds)
        ceiling_store = ShardStore(
            root, ceiling_identity, name="ceiling-apart", fractions=ceiling_points
        )
        ceiling_keys = [ShardKey(best[0], best[1], seed) for seed in ceiling_seeds]
        ceiling_rows = runner(
            ceiling_store, measured.budget * ceiling_factor, ceiling_points, bar, judged
        ).results(ceiling_keys)
        ceiling_run = {
            "spec": best[0],
            "lr": best[1],
            "seeds": ceiling_seeds,
            "budget_exact_steps": value * ceiling_factor,
            "evaluation": "apart" if apart else "report",
            "initial": evaluate_pretrained(judged, measured.pretrained) if apart else initial,
            "rows": [ceiling_rows[key] for key in ceiling_keys],
        }
        config = {
            **settings,
            **measured.settings(),
            "task_ceiling": task.ceiling,
            **measured.config(),
        }
        tried = {spec: list(grid) for spec in specs}
        # Refinement (gradest_lab.race.refinement): rounds of new rates beside every choice
        # not bracketed yet, on the tuning seeds, until none asks for more.
        rounds = MAX_ROUNDS if settings["bracket_ratio"] is not None else 0
        for _ in range(rounds):
            partial = TunedRaceReport(
                {**config, "tried_lrs": tried}, initial, ceiling_run, tuning, runs={}
            )
            wanted = {spec: choice["wanted"] for spec, choice in partial.choices().items()}
            refine_keys = [
                ShardKey(spec, lr, seed)
                for seed in tune_list
                for spec in specs
                for lr in wanted[spec]
            ]
            if not refine_keys:
                break
            bar.total += len(refine_keys)
            refined = main.results(refine_keys)
            for spec in specs:
                for lr in wanted[spec]:
                    tuning[spec][lr_label(lr)] = [
                        refined[ShardKey(spec, lr, seed)] for seed in tune_list
                    ]
                tried[spec] = sorted({*tried[spec], *wanted[spec]})
        config["tried_lrs"] = tried
        partial = TunedRaceReport(config, initial, ceiling_run, tuning, runs={})
        chosen = partial.choices()
        report_keys = [
            ShardKey(spec, lr, seed)
            for spec in specs
            for lr in sorted({*chosen[spec]["by_fraction"], chosen[spec]["primary"]})
            for seed in seed_list
        ]
        bar.total += len(report_keys)
        reported = main.results(report_keys)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {spec: {} for spec in specs}
    for key in report_keys:
        runs[key.spec].setdefault(lr_label(key.lr), []).append(reported[key])
    return TunedRaceReport(config, initial, ceiling_run, tuning, runs)


def replay_shard(
    task: RaceTask, config: Mapping[str, Any], key: ShardKey, *, points: int
) -> list[dict[str, Any]]:
    """Rerun the shard ``key`` of a tuned race (``config``: its report's) up to its first
    ``points`` evaluation points, and return that part of its curve: what a committed
    curve must equal when the code still computes what it computed (the golden rerun)."""
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise InvalidValue(f"points must be an int >= 1, got {points!r}")
    measured = measure_budget(task, "exact_steps", float(config["budget_given"]["value"]))
    race = _Race(
        task=task,
        kind="flops",
        budget=measured.budget,
        fractions=list(config["fractions"]),
        flops_per_unit=measured.flops_per_unit,
        state_path=None,
        bar=_NoBar(),
    )
    run = race.new_run(key.spec, key.seed, measured.pretrained, lr=key.lr)
    sampler = task.sampler()
    while not run.done and len(run.curve) < points:
        race.advance(run, sampler)
    return run.curve[:points]


def replot_race(folder: str | os.PathLike[str]) -> list[Path]:
    """Redraw a race folder's pictures from its ``report.json`` alone (no run repeated): a
    tuned race's three (:func:`gradest_lab.plots.plot_tuned_race`), a plain race's one
    (:func:`gradest_lab.plots.plot_race`); returns the paths written."""
    from gradest_lab.plots import plot_race, plot_tuned_race

    folder = Path(folder)
    schema = read_json(folder / "report.json", what="a race report").get("schema", "")
    if str(schema).startswith("gradest.tuned-race"):
        return plot_tuned_race(TunedRaceReport.load(folder), folder)
    return plot_race(RaceReport.load(folder), folder)
