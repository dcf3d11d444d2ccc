"""Whether a tuned race's task has a training horizon: exact's own pace toward the target.

A race whose task exact settles in its first steps measures how each estimator's first
updates size, not what it buys over a run. A task has a **long horizon** here when, over a
budget of at least :data:`MIN_BUDGET` exact steps, ``exact`` at its own tuned learning
rates has not reached the primary target (80% of the attainable gain) by half the budget,
measured both ways the report has it:

* its share of the attainable gain at half the budget, at the lr tuned for that budget, is
  below the target level; and
* at the lr tuned for time to target, its median report seed reaches the target no
  earlier than half the budget (a seed that never reaches it counts as latest).

Both are the report's own numbers (:meth:`TunedRaceReport.summary`); this module states
them and the verdict, so that a report, its page and the quoting blocks say the same.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MIN_BUDGET", "horizon", "horizon_sentence"]

#: The smallest budget (exact steps) a long-horizon task is raced at.
MIN_BUDGET = 32.0
# The share of the budget by which exact must not yet have reached the target.
_HALF = 0.5


def horizon(
    config: Mapping[str, Any],
    decision: Sequence[Mapping[str, Any]],
    exact_to_target: Mapping[str, Any],
) -> dict[str, Any]:
    """Exact's pace on a tuned race's task, and whether the task has a long horizon.

    Args:
        config: the report's config (its budget, fractions and primary level).
        decision: the summary's decision rows (exact's share of the gain per budget).
        exact_to_target: the summary's time-to-target entry for exact.

    Returns:
        ``budget_exact_steps``; ``share_at_half`` (exact's share of the attainable gain at
        half the budget, None when the race was not evaluated there); ``share_first`` (at
        the first evaluated budget); ``time_to_target`` (the bootstrap interval of exact's
        compute to the primary target, its ``median`` seed's (``inf``: not reached),
        ``earliest``, ``reached`` and ``seeds``); ``lr`` (its lr for time to target);
        ``long`` (the verdict).
    """
    budget = float(config["budget_exact_steps"])
    level = float(config["primary_level"])
    share = next(
        (
            row["exact_share_of_attainable"]
            for row in decision
            if math.isclose(row["fraction"], _HALF)
        ),
        None,
    )
    first = decision[0]
    entry = exact_to_target["levels"][f"{level:g}"]
    times = sorted(entry["per_seed"])  # inf (never reached) sorts last
    reached, seeds = entry["reached"], len(times)
    median = statistics.median(times)
    return {
        "budget_exact_steps": budget,
        "level": level,
        "share_at_half": share,
        "share_first": {
            "budget": first["budget_exact_steps"],
            "share": first["exact_share_of_attainable"],
        },
        "lr": exact_to_target["lr"],
        "time_to_target": {
            **entry["compute"],
            "median": median,
            "earliest": times[0],
            "reached": reached,
            "seeds": seeds,
        },
        "long": bool(
            budget >= MIN_BUDGET
            and share is not None
            and share < level
            and median >= _HALF * budget
        ),
    }


def horizon_sentence(task: str, found: Mapping[str, Any]) -> str:
    """Two sentences: the task's horizon, and the numbers it rests on."""
    level = 100 * found["level"]
    budget = found["budget_exact_steps"]
    first = found["share_first"]
    half = found["share_at_half"]
    figures = []  # (share, when)
    if first["share"] is not None:
        unit = "exact step" if first["budget"] == 1 else "exact steps"
        figures.append((first["share"], f"after {first['budget']:.3g} {unit}"))
    if half is not None:
        figures.append((half, "at half the budget"))
    shares = (
        " and ".join(
            f"{100 * share:.1f}%" + (" of the attainable gain" if i == 0 else "") + f" {when}"
            for i, (share, when) in enumerate(figures)
        )
        or "no attainable gain to share"
    )
    time = found["time_to_target"]
    if math.isinf(time["median"]):
        time_text = (
            f"its median seed does not reach {level:g}% within the budget ({time['reached']} "
            f"of {time['seeds']} seeds do)"
        )
    else:
        time_text = (
            f"its median seed reaches {level:g}% after {time['median']:.3g} exact steps (the "
            f"earliest after {time['earliest']:.3g}; {time['reached']} of {time['seeds']} "
            "seeds within the budget)"
        )
    verdict = "long-horizon" if found["long"] else "not long-horizon"
    return (
        f"`{task}` over {budget:.3g} exact steps: {verdict} (a long horizon: a budget of at "
        f"least {MIN_BUDGET:g} exact steps, exact short of {level:g}% of the attainable gain "
        f"at half of it, its median seed reaching it no earlier). Exact at its own lrs has "
        f"{shares}; at its lr for time to target ({found['lr']:.3g}) {time_text}."
    )
