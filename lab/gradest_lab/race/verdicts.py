"""Who beat exact: the reference every race compares to, and a decision row's verdicts.

One place for the words the race's pages quote (:mod:`gradest_lab.race.quoting`) and its
decision picture draws (:func:`gradest_lab.plots.plot_decision`), so the two cannot
disagree. A leaf module: the plots read it without importing the race's reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REFERENCE", "VERDICT_KEYS", "decision_grid", "row_verdicts"]

#: The estimator every race measures the others against.
REFERENCE = "exact"
#: Each verdict's list in a decision row of a tuned race's summary.
VERDICT_KEYS = {"ahead": "beats_exact", "level": "no_clear_difference", "behind": "behind_exact"}


def row_verdicts(row: Mapping[str, Any]) -> dict[str, str]:
    """A decision row's verdict per estimator: ``ahead``, ``level`` or ``behind``."""
    return {entry["spec"]: word for word, key in VERDICT_KEYS.items() for entry in row[key]}


def row_mean_leads(row: Mapping[str, Any]) -> dict[str, float]:
    """A decision row's mean reward difference to exact per estimator (the point estimate
    its verdict's interval is around)."""
    return {
        entry["spec"]: entry["minus_exact"]["mean"]
        for key in VERDICT_KEYS.values()
        for entry in row[key]
    }


def decision_grid(
    report: Any, decision: Sequence[Mapping[str, Any]] | None = None
) -> tuple[list[str], list[float], list[list[str]]]:
    """``(specs, budgets, verdicts)`` of a tuned race: the estimators but exact (rows), the
    budgets in exact steps (columns) and ``verdicts[row][column]``, each ``ahead``,
    ``level`` or ``behind`` (:func:`row_verdicts`); ``decision``: the report's decision
    table, if the caller has it already."""
    if decision is None:
        decision = report.summary()["decision"]
    specs = [spec for spec in report.config["estimators"] if spec != REFERENCE]
    words = [row_verdicts(row) for row in decision]
    return (
        specs,
        [row["budget_exact_steps"] for row in decision],
        [[column[spec] for column in words] for spec in specs],
    )
