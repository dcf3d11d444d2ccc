"""The decision rule for a task not raced, and its score (gradest_lab.race.decision_rule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gradest_lab.race.decision_rule import (
    RULE,
    DecisionRule,
    rival_leads,
    rule_tally,
    score_rule,
)
from gradest_lab.race.quoting import render
from gradest_lab.race.tuned_page import rule_section

from gradest import InvalidValue

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"ahead": "beats_exact", "level": "no_clear_difference", "behind": "behind_exact"}


class _Report:
    """The part of a tuned race report the rule reads: its line-up and decision rows."""

    def __init__(
        self,
        verdicts: dict[str, list[str]],
        *,
        identity: str = "0123456789abcdef",
        warnings: tuple[str, ...] = (),
        means: dict[str, list[float]] | None = None,
    ) -> None:
        self.config = {"task": "fake", "estimators": ["exact", *verdicts], "identity": identity}
        self.warnings = list(warnings)
        budgets = len(next(iter(verdicts.values())))
        self.rows = []
        for i in range(budgets):
            row: dict[str, Any] = {"fraction": (i + 1) / budgets, "budget_exact_steps": i + 1}
            row.update({key: [] for key in KEYS.values()})
            for spec, words in verdicts.items():
                entry: dict[str, Any] = {"spec": spec}
                if means is not None:
                    entry["minus_exact"] = {"mean": means[spec][i]}
                row[KEYS[words[i]]].append(entry)
            self.rows.append(row)

    def summary(self) -> dict[str, Any]:
        return {"decision": self.rows, "warnings": self.warnings}


def test_each_budget_scores_the_estimator_the_rule_prefers_there() -> None:
    rule = DecisionRule("sdo", "alignprop", 0.5, "2026-12-05", (), frozenset(), "text")
    report = _Report(
        {
            "sdo": ["ahead", "behind", "ahead", "ahead"],
            "alignprop": ["behind", "ahead", "level", "behind"],
        }
    )
    cells = score_rule(report, rule)
    # fractions 0.25, 0.5, 0.75, 1: sdo below half, alignprop from half on
    assert [c.prefers for c in cells] == ["sdo", "alignprop", "alignprop", "alignprop"]
    assert [c.verdict for c in cells] == ["ahead", "ahead", "level", "behind"]
    assert [c.outcome for c in cells] == ["confirmed", "confirmed", "not confirmed", "refuted"]
    assert rule_tally(cells) == {"confirmed": 2, "not confirmed": 1, "refuted": 1}


def test_a_rival_is_compared_where_the_rule_prefers_another_estimator() -> None:
    rule = DecisionRule("sdo", "alignprop", 0.5, "2026-12-05", (), frozenset(), "text")
    words = ["level"] * 4
    report = _Report(
        {"sdo": words, "alignprop": words, "refl": words},
        means={
            "sdo": [0.1, 0.9, 0.2, 0.5],
            "alignprop": [0.3, 0.4, 0.6, 0.1],
            "refl": [0.5, 0.3, 0.7, 0.0],
        },
    )
    # fractions 0.25, 0.5, 0.75, 1: sdo preferred below half, alignprop from half on
    assert rival_leads(report, "sdo", rule) == [True, False, True]
    assert rival_leads(report, "refl", rule) == [True, False, True, False]
    assert rival_leads(report, "refl", rule, prefers="alignprop") == [False, True, False]
    assert rival_leads(report, "refl", rule, prefers="sdo") == [True]
    assert rival_leads(report, "drtune", rule) == []  # not raced there


def test_the_pages_rival_phrase_counts_the_cells() -> None:
    """``rule-rival`` over the long-horizon races is the count of rival_leads."""
    from gradest_lab.race.tuned_race import TunedRaceReport

    folders = ["race_relabel_tuned", "race_blend_tuned", "race_relabel_tuned_n8"]
    paths = ",".join(f"docs/results/{f}" for f in folders)
    leads = [
        rival_leads(
            TunedRaceReport.load(ROOT / "docs" / "results" / f), "refl", prefers="alignprop"
        )
        for f in folders
    ]
    ran = sum(bool(found) for found in leads)
    assert 0 < ran < len(folders)
    flat = [lead for found in leads for lead in found]
    phrase = render(ROOT, f"rule-rival {paths} estimator=refl prefers=alignprop").strip()
    assert phrase == (
        f"{sum(flat)} of the {len(flat)} (task, budget) cells of the {ran} races that ran it"
    )
    with pytest.raises(InvalidValue, match="no race given ran 'adjoint'"):
        render(ROOT, f"rule-rival {paths} estimator=adjoint")
    with pytest.raises(InvalidValue, match="prefers=refl; give one of sdo, alignprop"):
        render(ROOT, f"rule-rival {paths} estimator=sdo prefers=refl")


def test_a_race_without_the_preferred_estimator_cannot_score_it() -> None:
    with pytest.raises(ValueError, match="did not run 'alignprop'"):
        score_rule(_Report({"sdo": ["ahead"]}))


def test_the_rule_is_fixed_and_never_scored_on_the_races_it_came_from() -> None:
    # written before the tasks that score it: the races it was drawn from are committed
    for folder in RULE.drawn_from:
        assert (ROOT / folder / "report.json").is_file()
    assert RULE.early in RULE.text and RULE.late in RULE.text
    # ...nor on any race committed before it, however its path is written
    import json

    for folder in (*RULE.drawn_from, "docs/results/race_digits_grpo_tuned"):
        identity = json.loads((ROOT / folder / "race.json").read_text())["identity"]
        assert identity in RULE.raced_before
    for kind in ("rule-score", "rule-tally"):
        for path in (
            RULE.drawn_from[0],
            f"./{RULE.drawn_from[0]}/",
            "docs/results/race_digits_grpo_tuned",
        ):
            with pytest.raises(InvalidValue, match="was raced before the rule was written"):
                render(ROOT, f"{kind} {path}")


def _section(report: _Report) -> list[str]:
    return rule_section(report, report.summary())


_RACED_AFTER = {
    "sdo": ["ahead", "level", "ahead", "ahead"],
    "alignprop": ["behind", "ahead", "level", "behind"],
}


def test_a_race_raced_after_the_rule_scores_it_on_its_page() -> None:
    """What a user sees in report.md (and the command's output) after racing a new task:
    the rule scored budget by budget (fractions 0.25-1: all `alignprop`'s, RULE prefers it
    from a quarter on)."""
    lines = _section(_Report(_RACED_AFTER))
    assert f"> {RULE.text}" in lines
    assert (
        "On this race: confirmed at 1, not confirmed at 1 and refuted at 2 of the 4 budgets."
        in lines
    )
    rows = [line for line in lines if line.startswith("| ") and "`" in line]
    assert rows == [
        "| 1 | `alignprop` | behind | refuted |",
        "| 2 | `alignprop` | ahead | confirmed |",
        "| 3 | `alignprop` | level | not confirmed |",
        "| 4 | `alignprop` | behind | refuted |",
    ]
    provisional = _section(_Report(_RACED_AFTER, warnings=("ceiling on 1 seed",)))
    assert any("(provisional: the race is not ready to quote" in line for line in provisional)


def test_a_race_that_cannot_score_the_rule_says_why_on_its_page() -> None:
    before = _section(_Report(_RACED_AFTER, identity=next(iter(RULE.raced_before))))
    assert any("does not score it" in line for line in before)
    assert not any(line.startswith("| ") for line in before)
    without = _section(_Report({"sdo": ["ahead", "ahead"], "drtune": ["level", "ahead"]}))
    assert any("did not run `alignprop`" in line for line in without)
    assert not any(line.startswith("| ") for line in without)


def test_the_committed_pages_score_the_rule_as_the_pages_tally_does() -> None:
    """The report.md of a race raced after the rule carries the same score the docs quote
    (rule-tally over that one race)."""
    for folder in ("race_relabel_tuned", "race_blend_tuned", "race_relabel_tuned_n8"):
        page = (ROOT / "docs" / "results" / folder / "report.md").read_text()
        tally = render(ROOT, f"rule-tally docs/results/{folder}").strip()
        counts = tally.replace(" (task, budget) cells", " budgets")
        assert f"On this race: {counts}." in page, folder


# Per long-horizon race: the budgets (exact steps), from a quarter of the budget on, at
# which the pages say `sdo`'s mean lead over exact was NOT larger than `alignprop`'s, and
# whether `refl` ran there (its lead then larger at every one).
_CONFIRMED_NOT_BEST = {
    "race_relabel_tuned": ([], True),
    "race_blend_tuned": ([], False),
    "race_relabel_tuned_n8": ([8.0], True),
}


@pytest.mark.parametrize("race", sorted(_CONFIRMED_NOT_BEST))
def test_the_pages_confirmed_is_not_best_holds_on_the_scoring_races(race: str) -> None:
    """README.md and docs/results.md say the rule is confirmed but not best on the
    long-horizon races: where it prefers `alignprop`, `sdo`'s mean difference to exact is
    larger than `alignprop`'s but at the budgets listed, `refl`'s at every one (a claim
    about means, checked here against the committed reports)."""
    from gradest_lab.race.tuned_race import TunedRaceReport

    exceptions, with_refl = _CONFIRMED_NOT_BEST[race]
    final = TunedRaceReport.load(ROOT / "docs" / "results" / race).summary()["final"]
    assert ("refl" in final) == with_refl
    not_larger = []
    for i, alignprop in enumerate(final["alignprop"]):
        if alignprop["fraction"] < RULE.from_fraction:
            continue
        lead = alignprop["reward_minus_exact"]["mean"]
        if final["sdo"][i]["reward_minus_exact"]["mean"] <= lead:
            not_larger.append(alignprop["budget_exact_steps"])
        if with_refl:
            assert final["refl"][i]["reward_minus_exact"]["mean"] > lead
    assert not_larger == exceptions
