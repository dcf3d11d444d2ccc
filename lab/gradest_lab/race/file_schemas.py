"""What a race's files must hold when they are read back: a run's row and evaluated curve
(a shard, a run's saved state) and the settings a race folder's ``run.json`` records.

A race reads back files it wrote, but also files copied from another machine, committed,
edited or damaged; each is checked here by the same principles before any number of it is
used: every field of its type (a bool is not a number, a string not an object), every list
of its length (one curve point per budget fraction, one step time per step), every number
finite and within its bounds (no negative step count), and every sequence in its order
(budget fractions increasing, steps, FLOPs and seconds never going down along a curve).
The first field that breaks one is one line from the reader's ``refuse(field, why)``
(:mod:`gradest_lab.storage.file_schema`), which names the file; the file is left as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gradest_lab.storage.file_schema import (
    Refuse,
    describe,
    is_int,
    is_number,
    require,
    require_finite,
    require_increasing,
    require_int,
    require_list,
    require_object,
)

__all__ = [
    "BUDGET_KINDS",
    "check_curve",
    "check_fractions",
    "check_progress",
    "check_race_settings",
    "check_row",
    "check_tuned_settings",
]

#: The kinds of budget a race's settings record (``budget_given.kind``).
BUDGET_KINDS = ("flops", "seconds", "exact_steps")
# The fields every curve point holds besides the task's own metrics (each a number too).
_POINT_COUNTERS = ("steps", "flops", "seconds")
_POINT_METRICS = ("reward", "drift")


def _require_non_negative(value: Any, refuse: Refuse, field: str) -> float:
    """A finite number >= 0 (a count of FLOPs or seconds)."""
    ok = is_number(value) and math.isfinite(value) and value >= 0
    require(ok, refuse, field, value, "a finite number >= 0")
    return float(value)


def _check_step_times(record: Mapping[str, Any], steps: int, refuse: Refuse, prefix: str) -> None:
    """A run's ``step_seconds`` (one time >= 0 per step) and ``stopped_step`` (None, or the
    step that did not fit: its FLOPs and model units, each >= 0)."""
    times = require_list(
        record["step_seconds"], refuse, f"{prefix}step_seconds", length=steps, why="one per step"
    )
    for index, value in enumerate(times):
        _require_non_negative(value, refuse, f"{prefix}step_seconds[{index}]")
    stopped = record["stopped_step"]
    if stopped is not None:
        for key, value in require_object(stopped, refuse, f"{prefix}stopped_step").items():
            _require_non_negative(value, refuse, f"{prefix}stopped_step.{key}")


def check_fractions(values: Any, refuse: Refuse, field: str = "fractions") -> list[float]:
    """Budget fractions: a non-empty list of numbers in (0, 1], increasing, ending at 1."""
    items = require_list(values, refuse, field)
    require(bool(items), refuse, field, values, "a non-empty list of budget fractions")
    for index, value in enumerate(items):
        ok = is_number(value) and 0 < value <= 1
        require(ok, refuse, f"{field}[{index}]", value, "a budget fraction in (0, 1]")
    require_increasing(items, refuse, field, strict=True)
    require(items[-1] == 1, refuse, f"{field}[{len(items) - 1}]", items[-1], "1 (the whole budget)")
    return [float(v) for v in items]


def check_curve(
    curve: Any,
    fractions: Sequence[float] | None,
    refuse: Refuse,
    field: str = "curve",
    *,
    why: str = "one point per budget fraction of the race",
) -> list[dict[str, Any]]:
    """A run's evaluated curve: one point per budget fraction of ``fractions`` (the race's,
    or those a run in progress has passed; ``why`` says which), each at its fraction; with
    ``fractions`` None (the race's are not known), a finished run's: at least one point,
    each fraction in (0, 1], the last at 1.

    Every point is an object of finite numbers: ``fraction``, the counters ``steps`` (an
    integer >= 0), ``flops`` and ``seconds`` (>= 0), none of them going down along the
    curve, and the metrics ``reward`` and ``drift`` (the task's other metrics, if any, are
    finite numbers too).
    """
    points = require_list(curve, refuse, field)
    for index, point in enumerate(points):
        where = f"{field}[{index}]"
        require_object(point, refuse, where)
        for key in ("fraction", *_POINT_COUNTERS, *_POINT_METRICS):
            if key not in point:
                raise refuse(f"{where}.{key}", "is missing")
        for key, value in point.items():
            require_finite(value, refuse, f"{where}.{key}")
        require_int(point["steps"], refuse, f"{where}.steps", low=0)
        for key in ("flops", "seconds"):
            _require_non_negative(point[key], refuse, f"{where}.{key}")
        fraction = point["fraction"]
        if fractions is None:
            require(0 < fraction <= 1, refuse, f"{where}.fraction", fraction, "in (0, 1]")
        elif index < len(fractions) and fraction != fractions[index]:
            raise refuse(
                f"{where}.fraction",
                f"is {describe(fraction)}, not {fractions[index]!r} (the race's budget "
                f"fraction {index})",
            )
    if fractions is not None:
        # After the points, so that a damaged point is named as itself, not as a count.
        require_list(curve, refuse, field, length=len(fractions), why=why)
    else:
        # A finished run's last point is at the whole budget.
        require(bool(points), refuse, field, curve, "a non-empty list (a finished run's)")
        last = points[-1]["fraction"]
        require(
            last == 1, refuse, f"{field}[{len(points) - 1}].fraction", last, "1 (the whole budget)"
        )
    require_increasing(points, refuse, field, strict=True, key="fraction")
    for key in _POINT_COUNTERS:
        require_increasing(points, refuse, field, strict=False, key=key)
    return points


def check_row(
    row: Any, refuse: Refuse, *, seed: int, fractions: Sequence[float] | None, field: str = "row"
) -> dict[str, Any]:
    """A finished run's record (a shard's ``row``): its ``seed``, what it spent (``steps``,
    ``flops``, ``seconds``: no less than its curve's last point), one time per step in
    ``step_seconds``, the step it stopped at (``stopped_step``: None or finite numbers) and
    its curve (:func:`check_curve`)."""
    record = require_object(row, refuse, field)
    for key in ("seed", *_POINT_COUNTERS, "stopped_step", "step_seconds", "curve"):
        if key not in record:
            raise refuse(f"{field}.{key}", "is missing")
    if require_int(record["seed"], refuse, f"{field}.seed", low=0) != seed:
        raise refuse(f"{field}.seed", f"is {record['seed']}, not {seed} (the shard's seed)")
    steps = require_int(record["steps"], refuse, f"{field}.steps", low=0)
    flops = _require_non_negative(record["flops"], refuse, f"{field}.flops")
    seconds = _require_non_negative(record["seconds"], refuse, f"{field}.seconds")
    _check_step_times(record, steps, refuse, f"{field}.")
    curve = check_curve(record["curve"], fractions, refuse, f"{field}.curve")
    last = curve[-1] if curve else None
    for key, total in (("steps", steps), ("flops", flops), ("seconds", seconds)):
        if last is not None and last[key] > total:
            raise refuse(
                f"{field}.{key}",
                f"is {describe(record[key])}, less than its curve's last point's "
                f"({describe(last[key])})",
            )
    return record


def _check_common_settings(settings: Mapping[str, Any], refuse: Refuse) -> None:
    """What a plain and a tuned race both record: the task, its settings, the budget as
    given, the budget fractions and the evaluation set's size."""
    for key in ("task", "task_settings", "budget_given", "fractions", "eval_samples"):
        if key not in settings:
            raise refuse(key, "is missing")
    task = settings["task"]
    require(isinstance(task, str) and bool(task), refuse, "task", task, "a task name")
    require_object(settings["task_settings"], refuse, "task_settings")
    budget = require_object(settings["budget_given"], refuse, "budget_given")
    kind = budget.get("kind")
    require(kind in BUDGET_KINDS, refuse, "budget_given.kind", kind, f"one of {BUDGET_KINDS}")
    value: Any = budget.get("value")
    ok = is_number(value) and math.isfinite(value) and value > 0
    require(ok, refuse, "budget_given.value", value, "a positive finite number")
    check_fractions(settings["fractions"], refuse)
    require_int(settings["eval_samples"], refuse, "eval_samples", low=1)


def check_race_settings(settings: Mapping[str, Any], refuse: Refuse) -> None:
    """The settings of a plain race's ``run.json`` (``gradest race``): besides the common
    ones, its ``estimators`` (distinct spec strings) and ``seeds`` (distinct ints >= 0)."""
    _check_common_settings(settings, refuse)
    for key in ("estimators", "seeds"):
        if key not in settings:
            raise refuse(key, "is missing")
    specs = require_list(settings["estimators"], refuse, "estimators")
    for index, spec in enumerate(specs):
        require(
            isinstance(spec, str) and bool(spec),
            refuse,
            f"estimators[{index}]",
            spec,
            "an estimator spec",
        )
    seeds = require_list(settings["seeds"], refuse, "seeds")
    for index, seed in enumerate(seeds):
        require_int(seed, refuse, f"seeds[{index}]", low=0)
    for key, values in (("estimators", specs), ("seeds", seeds)):
        require(
            bool(values) and len(set(values)) == len(values),
            refuse,
            key,
            values,
            "a non-empty list without repeats",
        )


def check_tuned_settings(settings: Mapping[str, Any], refuse: Refuse) -> None:
    """The settings of a tuned race's ``run.json`` (``gradest race --tune``): besides the
    common ones, the race's ``identity`` (the hash its shards carry)."""
    _check_common_settings(settings, refuse)
    identity: Any = settings.get("identity")
    ok = isinstance(identity, str) and len(identity) == 16
    require(
        ok and all(c in "0123456789abcdef" for c in identity),
        refuse,
        "identity",
        identity,
        "a race identity (16 hex digits)",
    )


def check_progress(state: Mapping[str, Any], fractions: Sequence[float], refuse: Refuse) -> None:
    """What a run in progress has done, from its saved state (its tensors and types are the
    state reader's): ``step`` (>= 0) steps, timed one each in ``step_seconds``; ``flops``,
    ``seconds`` and ``last_seconds`` (>= 0); ``next_point``, the budget fractions it has
    passed, each with its point on ``curve`` (:func:`check_curve`); ``done`` only once it has
    passed all of ``fractions``; ``stopped_step`` None or finite numbers."""
    steps = require_int(state["step"], refuse, "step", low=0)
    for key in ("flops", "seconds", "last_seconds"):
        _require_non_negative(state[key], refuse, key)
    passed = state["next_point"]
    ok = is_int(passed) and 0 <= passed <= len(fractions)
    require(ok, refuse, "next_point", passed, f"an integer in [0, {len(fractions)}]")
    if state["done"] and passed != len(fractions):
        raise refuse("done", f"is true with {passed} of the race's {len(fractions)} points taken")
    _check_step_times(state, steps, refuse, "")
    check_curve(
        state["curve"],
        fractions[:passed],
        refuse,
        why="one per budget fraction passed, as next_point says",
    )
