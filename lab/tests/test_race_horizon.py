"""A task's horizon (gradest_lab.race.horizon): long only when exact, at its own lrs, is
short of the target at half a budget of at least 32 exact steps, both ways the report
measures it; and each committed tuned race's report states its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gradest_lab.race.horizon import MIN_BUDGET, horizon, horizon_sentence
from gradest_lab.race.tuned_race import TunedRaceReport

REPO = Path(__file__).resolve().parents[2]


def _race(budget: float, shares: list[float], times: list[float]) -> dict:
    fractions = [(i + 1) / len(shares) for i in range(len(shares))]
    config = {"budget_exact_steps": budget, "primary_level": 0.8, "fractions": fractions}
    decision = [
        {"fraction": f, "budget_exact_steps": f * budget, "exact_share_of_attainable": s}
        for f, s in zip(fractions, shares, strict=True)
    ]
    finite = [t for t in times if math.isfinite(t)]
    mean = sum(times) / len(times) if len(finite) == len(times) else math.inf
    to_target = {
        "lr": 1e-3,
        "levels": {
            "0.8": {
                "per_seed": times,
                "reached": len(finite),
                "compute": {"mean": mean, "low": mean - 1, "high": mean + 1, "n": len(times)},
            }
        },
    }
    return horizon(config, decision, to_target)


SLOW = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.85]


def test_a_task_short_of_the_target_at_half_a_long_budget_is_long() -> None:
    found = _race(32, SLOW, [25.0, 27.0])
    assert found["long"]
    assert found["share_at_half"] == 0.5
    assert found["share_first"] == {"budget": 4.0, "share": 0.2}
    assert "long-horizon" in horizon_sentence("t", found)
    assert "not long-horizon" not in horizon_sentence("t", found)


@pytest.mark.parametrize(
    ("budget", "shares", "times", "why"),
    [
        (8, SLOW, [7.0, 7.5], "a budget under 32 exact steps"),
        (31.9, SLOW, [25.0, 27.0], "a budget just under 32"),
        (32, [0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.9, 0.9], [15.0, 17.0], "80% at half the budget"),
        (32, SLOW, [10.0, 12.0], "the median seed at the target before half the budget"),
        (32, SLOW, [10.0, 12.0, math.inf], "one seed never there, the median early"),
        (32, [0.2, 0.4, 0.6], [25.0, 27.0], "no evaluation at half the budget"),
    ],
)
def test_anything_less_is_not_long(budget, shares, times, why) -> None:
    found = _race(budget, shares, times)
    assert not found["long"], why
    assert "not long-horizon" in horizon_sentence("t", found)


def test_a_seed_that_never_reaches_the_target_counts_as_late() -> None:
    found = _race(MIN_BUDGET, SLOW, [20.0, math.inf])
    assert found["long"]
    assert "does not reach 80% within the budget (1 of 2 seeds do)" in horizon_sentence("t", found)


def test_the_sentence_says_what_the_numbers_are() -> None:
    text = horizon_sentence("digits-relabel", _race(32, SLOW, [25.0, 27.0]))
    assert "20.0% of the attainable gain after 4 exact steps and 50.0% at half the budget" in text
    assert "its median seed reaches 80% after 26 exact steps (the earliest after 25" in text


def test_the_committed_short_horizon_headline_is_not_long() -> None:
    report = TunedRaceReport.load(REPO / "docs" / "results" / "race_digits_tuned")
    found = report.summary()["horizon"]
    assert found["budget_exact_steps"] == 8
    assert not found["long"]
    assert "## Horizon" in report.to_markdown()


LONG_HORIZON_TASKS = {"digits-relabel", "digits-blend", "mnist-relabel"}


def _committed_long_horizon_races() -> list[Path]:
    """Every committed race folder whose race.json names a long-horizon task."""
    folders = sorted(p.parent for p in (REPO / "docs" / "results").glob("race_*/race.json"))
    return [
        folder
        for folder in folders
        if json.loads((folder / "race.json").read_text())["task"] in LONG_HORIZON_TASKS
    ]


def test_every_committed_long_horizon_race_ready_to_quote_shows_its_horizon() -> None:
    """A race on a task built to be long-horizon shows the property in its own report once
    it is ready to quote (until then its pages carry its warnings); the headline is one."""
    ready = []
    for folder in _committed_long_horizon_races():
        if not (folder / "report.json").exists():
            continue  # racing: no report yet
        report = TunedRaceReport.load(folder)
        if report.grid_warnings():
            continue
        found = report.summary()["horizon"]
        assert found["long"], (folder.name, found)
        ready.append(folder.name)
    assert "race_relabel_tuned" in ready
