"""The rule we give a user for a task nobody raced, fixed before the tasks that score it.

The tuned races answer "who beats exact at equal compute" per task and budget. A user with
a new task needs one sentence instead, and a sentence is only worth giving if the data can
prove it wrong. :data:`RULE` is that sentence, as data: written down on the date it says,
from the short-horizon races committed then, *before* any long-horizon task was raced; each
race raced after it scores it (:func:`score_rule`), budget fraction by budget fraction,
from the verdicts of the race's decision table (:mod:`gradest_lab.race.verdicts`: ahead /
level / behind exact, a difference counted only past both estimators' residual tuning
gaps). The rule is not edited after the fact: a miss is reported as a miss.

A leaf module (it reads reports through their ``summary()``): the pages quote it through
:mod:`gradest_lab.race.quoting`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from gradest_lab.race.verdicts import row_mean_leads, row_verdicts

__all__ = [
    "RULE",
    "DecisionRule",
    "RuleCell",
    "missing_estimators",
    "rival_leads",
    "rule_tally",
    "score_rule",
    "tally_sentence",
]


@attrs.frozen
class DecisionRule:
    """ "On a new task, prefer ``early`` below ``from_fraction`` of the budget and ``late``
    from it on."

    Scored per budget fraction of a race (:func:`score_rule`): the rule is **confirmed**
    where the estimator it prefers at that fraction is ahead of exact, **not confirmed**
    where it is level (nothing lost, nothing shown gained), **refuted** where it is behind.

    Attributes:
        early: the estimator the rule prefers on small budgets.
        late: the estimator it prefers once the budget reaches ``from_fraction``.
        from_fraction: the share of the budget from which it prefers ``late``.
        written: the date the rule was fixed (ISO).
        drawn_from: the races it was drawn from (their folders).
        raced_before: the identities of every tuned race committed when it was written
            (those it was drawn from among them), none of which can score it.
        text: the sentence a user reads.
    """

    early: str
    late: str
    from_fraction: float
    written: str
    drawn_from: tuple[str, ...]
    raced_before: frozenset[str]
    text: str

    def prefers(self, fraction: float) -> str:
        """The estimator the rule prefers at ``fraction`` of the budget."""
        return self.late if fraction >= self.from_fraction else self.early


#: The rule, fixed on the date it states from the short-horizon races it names (their
#: tally then: from a quarter of the budget on, `alignprop` was never behind exact on the
#: seven tasks and ahead at the full budget on six; at an eighth, `sdo` was ahead on four).
RULE = DecisionRule(
    early="sdo",
    late="alignprop",
    from_fraction=0.25,
    written="2026-12-05",
    drawn_from=(
        "docs/results/race_digits_tuned",
        "docs/results/race_digits_tuned_target5",
        "docs/results/race_digits_tuned_target8",
        "docs/results/race_digits_tuned_n8",
        "docs/results/race_digits_tuned_n50",
        "docs/results/race_mnist_tuned_target3",
        "docs/results/race_mnist_tuned_target7",
    ),
    # The eight tuned races committed on that date (their race.json identities): the seven
    # above and the tuned Flow-GRPO race.
    raced_before=frozenset(
        {
            "a21645331adf3a14",
            "5a27c518185d4529",
            "727f548faf098951",
            "19d54975dc7366ba",
            "c5cd7941ea37fe20",
            "4c0df7c58c8c5f80",
            "387d9ce9ab06875a",
            "e67abd59847bc3e1",
        }
    ),
    text=(
        "On a task not raced, each estimator at its own tuned lr: prefer `alignprop` "
        "(AlignProp's random truncation) from a quarter of the training budget on, and `sdo` "
        "(one-step cotangents) below it."
    ),
)


@attrs.frozen
class RuleCell:
    """The rule against one race at one budget fraction."""

    fraction: float
    budget_exact_steps: float
    prefers: str  # the estimator the rule prefers there
    verdict: str  # its verdict against exact: ahead, level or behind
    outcome: str  # "confirmed", "not confirmed" or "refuted"


_OUTCOMES = {"ahead": "confirmed", "level": "not confirmed", "behind": "refuted"}


def missing_estimators(report: Any, rule: DecisionRule = RULE) -> list[str]:
    """The estimators the rule prefers that the race did not run (it cannot score the rule
    without them)."""
    return [spec for spec in (rule.early, rule.late) if spec not in report.config["estimators"]]


def _require_preferred(report: Any, rule: DecisionRule) -> None:
    """Refuse a race that did not run an estimator the rule prefers (it cannot score it)."""
    for spec in missing_estimators(report, rule)[:1]:
        raise ValueError(
            f"the {report.config.get('task')!r} race did not run {spec!r}, an estimator "
            f"the rule prefers: race it to score the rule"
        )


def score_rule(
    report: Any, rule: DecisionRule = RULE, *, summary: Mapping[str, Any] | None = None
) -> list[RuleCell]:
    """The rule scored on a tuned race's decision, one cell per budget fraction.

    ``summary``: the report's ``summary()`` when the caller has it already (it is recomputed
    from the runs on every call).

    Raises:
        ValueError: the race did not run an estimator the rule prefers.
    """
    _require_preferred(report, rule)
    cells = []
    for row in (report.summary() if summary is None else summary)["decision"]:
        verdicts: Mapping[str, str] = row_verdicts(row)
        spec = rule.prefers(row["fraction"])
        word = verdicts[spec]
        cells.append(
            RuleCell(row["fraction"], row["budget_exact_steps"], spec, word, _OUTCOMES[word])
        )
    return cells


def rival_leads(
    report: Any,
    rival: str,
    rule: DecisionRule = RULE,
    *,
    prefers: str | None = None,
    summary: Mapping[str, Any] | None = None,
) -> list[bool]:
    """Confirmed is not best: at each budget fraction where the rule prefers an estimator
    other than ``rival`` (``prefers``, if given, only where it prefers that one), whether
    ``rival``'s mean lead over exact was the larger (a comparison of the two point
    estimates, not a paired verdict between them). Empty when the race did not run
    ``rival``.

    Raises:
        ValueError: the race did not run an estimator the rule prefers.
    """
    _require_preferred(report, rule)
    if rival not in report.config["estimators"]:
        return []
    leads = []
    for row in (report.summary() if summary is None else summary)["decision"]:
        preferred = rule.prefers(row["fraction"])
        if preferred != rival and prefers in (None, preferred):
            means = row_mean_leads(row)
            leads.append(means[rival] > means[preferred])
    return leads


def rule_tally(cells: Sequence[RuleCell]) -> dict[str, int]:
    """How many cells each outcome has."""
    outcomes = ("confirmed", "not confirmed", "refuted")
    return {word: sum(cell.outcome == word for cell in cells) for word in outcomes}


def tally_sentence(cells: Sequence[RuleCell], unit: str) -> str:
    """``confirmed at 7, not confirmed at 1 and refuted at 0 of the 8 {unit}``: the words
    the pages and a race's report.md give the score in."""
    tally = rule_tally(cells)
    return (
        f"confirmed at {tally['confirmed']}, not confirmed at {tally['not confirmed']} and "
        f"refuted at {tally['refuted']} of the {len(cells)} {unit}"
    )
