"""Learning rates tuned to their optimum: a choice bracketed finely, and what is left to gain.

A tuned race chooses each estimator's lr from a coarse grid (2.5x apart): the reward lost to
that spacing can be as large as the differences the race reports. So after the coarse grid
the race *refines* every choice on the tuning seeds until it is **bracketed**: the tried
rates next to it, below and above, are each at most :data:`BRACKET_RATIO` (1.26x) away.
Each round adds, beside every choice not bracketed yet, one rate on the side that is too
far (at a power of a step a notch under the bracket, 1.25x for 1.26x, from the choice:
about half the gap in log lr, so a 2.5x gap closes in two rounds); a choice on the tried
rates' edge that beats its neighbour gets a rate beyond it. Every earlier run is kept (a
shard per rate and seed).

Even bracketed, a choice can sit off the optimum between its neighbours. Its **residual
tuning gap** is what a finer choice could still add, from the tuning means: a quadratic in
log lr fitted to the choice and up to two tried rates on each side, its highest value over
the bracket minus its value at the choice (0 when the fit is highest at the choice). A
race calls a difference ahead or behind only when its interval clears zero by more than the
two estimators' gaps (:func:`verdict`).

Pure functions of the tuning means: the race (:mod:`gradest_lab.race.tuned_race`) runs the
rates they ask for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from gradest import InvalidValue

__all__ = [
    "BRACKET_RATIO",
    "MAX_ROUNDS",
    "bracket",
    "check_bracket_ratio",
    "parse_bracket_ratio",
    "merge_close",
    "next_rates",
    "residual_gap",
    "round_rate",
    "verdict",
]

#: A choice is bracketed when its tried neighbours are at most this far (a ratio) from it.
BRACKET_RATIO = 1.26
# Refined rates lie at powers of the bracket over this from the choice: a notch under the
# bracket, so that rounding a rate to 3 significant digits (at most 0.5%) keeps it inside.
_ROUNDING_ROOM = 1.008
#: Rounds of refinement at most; a choice still not bracketed after them is flagged.
MAX_ROUNDS = 8
# Rates the fit uses on each side of the choice.
_FIT_SIDE = 2
# Ratios are compared with this relative slack (a rate rounded to 3 digits that lands on
# the bracket exactly is inside it), and a fitted gain below this share of the values'
# scale is the fit's rounding, not a gain.
_SLACK = 1e-9
_FIT_NOISE = 1e-12
# The bracket ratios a race accepts: finer than this costs many rounds for little, coarser
# than this is no refinement.
BRACKET_BOUNDS = (1.1, 4.0)


def check_bracket_ratio(value: object, *, what: str = "bracket_ratio") -> float | None:
    """``value`` as a bracket ratio: None (no refinement) or a number in
    :data:`BRACKET_BOUNDS`."""
    low, high = BRACKET_BOUNDS
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise InvalidValue(
            f"{what} must be none (no refinement) or a ratio in [{low:g}, {high:g}] (a "
            f"choice's tried neighbours at most this far; finer costs more runs), got "
            f"{value!r}; e.g. 1.26"
        )
    return float(value)


def round_rate(lr: float) -> float:
    """A refined rate as stored: 3 significant digits (its shard folder has 6)."""
    return float(f"{lr:.3g}")


def parse_bracket_ratio(text: str | None, *, what: str = "--bracket-ratio") -> float | None:
    """The command line's form: a ratio (``1.26``), ``none`` (no refinement), or None (the
    default, :data:`BRACKET_RATIO`), checked by :func:`check_bracket_ratio`."""
    if text is None:
        return BRACKET_RATIO
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidValue(
            f"{what} {text!r}: give a ratio such as 1.26, or none (no refinement)"
        ) from None
    return check_bracket_ratio(value, what=what)


def bracket(lrs: Sequence[float], chosen: float) -> tuple[float | None, float | None]:
    """The tried rates next to ``chosen`` (below, above): None past the tried rates' edge."""
    below = [lr for lr in lrs if lr < chosen]
    above = [lr for lr in lrs if lr > chosen]
    return (max(below) if below else None, min(above) if above else None)


def _step_towards(chosen: float, neighbour: float, ratio: float) -> float:
    """A rate between ``chosen`` and ``neighbour`` at a power of the step (``ratio`` less
    the rounding's room) from the choice, about half the gap in log lr (one step at least)."""
    step = ratio / _ROUNDING_ROOM
    gap = max(chosen, neighbour) / min(chosen, neighbour)
    powers = max(1, math.floor(math.log(math.sqrt(gap)) / math.log(step)))
    factor = step**powers
    return round_rate(chosen * factor if neighbour > chosen else chosen / factor)


def next_rates(
    lrs: Sequence[float],
    values: Mapping[float, float],
    chosen: float,
    *,
    ratio: float = BRACKET_RATIO,
) -> list[float]:
    """The rates to try next so that ``chosen`` becomes bracketed at ``ratio``.

    Args:
        lrs: the tried rates, increasing.
        values: the statistic the choice maximises at every tried rate (a mean reward, or a
            negated mean time; ``-inf`` where it is undefined).
        chosen: the rate chosen, one of ``lrs``.

    A side is bracketed when its neighbour is within ``ratio`` or ties the choice exactly
    (the statistic is flat there: an estimator that never steps, nothing to gain). Past
    the tried rates' edge, a rate beyond is asked for only when the choice beats its inner
    neighbour (the optimum may lie outside); it lies as far out as that neighbour lies in.
    """
    below, above = bracket(lrs, chosen)
    wanted: list[float] = []
    for inner, outer in ((below, above), (above, below)):
        if inner is not None:
            if max(inner, chosen) / min(inner, chosen) <= ratio * (1 + _SLACK):
                continue
            if values[inner] == values[chosen]:
                continue
            candidate = _step_towards(chosen, inner, ratio)
        else:
            # The choice is on the edge of the tried rates (on this side).
            if outer is None or not values[chosen] > values[outer]:
                continue
            candidate = round_rate(chosen * chosen / outer)
        if candidate not in lrs and candidate != chosen:
            wanted.append(candidate)
    return sorted(set(wanted))


def merge_close(
    asked: Sequence[tuple[float, float]], *, ratio: float = BRACKET_RATIO
) -> list[float]:
    """The rates to run for ``asked``, ``(rate, the choice that asked for it)`` pairs of one
    estimator. Two choices a grid step apart each ask for a rate towards the other, and one
    run between them (their geometric mean, when they are closer than the square root of
    ``ratio``) serves both, unless a rate asked for as a choice's last step (within one
    refinement step of it) would move out of that step: then both run."""
    step = ratio / _ROUNDING_ROOM

    def apart(a: float, b: float) -> float:
        return max(a, b) / min(a, b)

    groups: list[tuple[float, list[tuple[float, float]]]] = []
    for lr, chosen in sorted(set(asked)):
        if groups and lr / groups[-1][0] < math.sqrt(ratio):
            merged = round_rate(math.sqrt(lr * groups[-1][0]))
            members = [*groups[-1][1], (lr, chosen)]
            if all(
                apart(merged, c) <= step or apart(r, c) > step * (1 + _SLACK) for r, c in members
            ):
                groups[-1] = (merged, members)
                continue
        groups.append((lr, [(lr, chosen)]))
    return sorted({lr for lr, _ in groups})


def residual_gap(
    lrs: Sequence[float], values: Mapping[float, float], chosen: float
) -> float | None:
    """What a finer choice within ``chosen``'s bracket could still add to ``values`` (the
    module docstring): None when fewer than three finite values lie around it."""
    index = list(lrs).index(chosen)
    window = [
        lr
        for lr in lrs[max(0, index - _FIT_SIDE) : index + _FIT_SIDE + 1]
        if math.isfinite(values[lr])
    ]
    if chosen not in window or len(window) < 3:
        return None
    x = np.log(np.asarray(window, dtype=np.float64))
    y = np.asarray([values[lr] for lr in window], dtype=np.float64)
    # Centred for conditioning; three points are fitted exactly.
    centre = math.log(chosen)
    a, b, c = np.polyfit(x - centre, y, 2)
    below, above = bracket(lrs, chosen)
    low = math.log(below) - centre if below is not None else 0.0
    high = math.log(above) - centre if above is not None else 0.0
    candidates = [low, high]
    if a < 0:
        vertex = -b / (2 * a)
        if low < vertex < high:
            candidates.append(vertex)
    best = max(a * u * u + b * u + c for u in candidates)
    gain = float(best - c)
    # A flat profile fits to its rounding: no gain.
    return gain if gain > _FIT_NOISE * max(1.0, abs(float(c))) else 0.0


def verdict(low: float | None, high: float | None, margin: float) -> str:
    """``ahead`` when a difference's interval ``[low, high]`` lies above ``margin`` (the two
    estimators' residual gaps added), ``behind`` below ``-margin``, else ``level``."""
    if low is not None and low > margin:
        return "ahead"
    if high is not None and high < -margin:
        return "behind"
    return "level"
