"""The decision across tuned races (quoting's ``tuned-matrix`` and ``tuned-tally`` blocks):
labels name what varied, every verdict of every race is counted once, and a block that
names a race that is not tuned is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gradest_lab.race import quoting
from gradest_lab.race.tuned_page import matrix_table, tally_table, task_labels

from gradest.errors import InvalidValue

ROOT = Path(__file__).resolve().parents[2]


def _entry(spec: str, mean: float) -> dict[str, Any]:
    return {"spec": spec, "minus_exact": {"mean": mean, "low": mean - 0.1, "high": mean + 0.1}}


class _Report:
    """What the matrix reads from a TunedRaceReport."""

    def __init__(
        self, settings: dict[str, Any], rows: list[dict[str, Any]], warnings: tuple[str, ...] = ()
    ) -> None:
        self.config = {"task": "digits", "task_settings": {"device": "cpu", **settings}}
        self._rows = rows
        self._warnings = list(warnings)

    def summary(self) -> dict[str, Any]:
        return {"decision": self._rows}

    def grid_warnings(self) -> list[str]:
        return self._warnings


def _row(fraction: float, beats: list[str], level: list[str], behind: list[str]) -> dict:
    return {
        "fraction": fraction,
        "budget_exact_steps": 8 * fraction,
        "exact_lr": 2.5e-4,
        "exact_share_of_attainable": 0.8,
        "beats_exact": [_entry(s, 0.3) for s in beats],
        "no_clear_difference": [_entry(s, 0.0) for s in level],
        "behind_exact": [_entry(s, -0.3) for s in behind],
    }


def _two_tasks() -> list[_Report]:
    return [
        _Report(
            {"target": 3, "batch": 16},
            [_row(0.5, ["sdo"], ["drtune"], []), _row(1.0, ["sdo", "drtune"], [], [])],
        ),
        _Report(
            {"target": 8, "batch": 16},
            [_row(0.5, [], ["sdo"], ["drtune"]), _row(1.0, [], [], ["sdo", "drtune"])],
        ),
    ]


def test_labels_name_only_the_settings_that_vary_between_races_of_a_task() -> None:
    configs = [r.config for r in _two_tasks()]
    assert task_labels(configs) == ["digits target=3", "digits target=8"]
    # A task raced once needs no settings to tell it apart.
    assert task_labels(configs[:1]) == ["digits"]


def test_the_matrix_has_a_row_per_task_and_budget_and_says_none_where_nobody_beats_exact() -> None:
    lines = matrix_table(_two_tasks(), [0.5, 1.0])
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| `digits target=3` | 4 | 80.0% | `sdo` +0.3 [+0.2, +0.4] |")
    assert lines[4] == "| `digits target=8` | 4 | 80.0% | none | `drtune` |"
    # A fraction not asked for is left out.
    assert len(matrix_table(_two_tasks(), [1.0])) == 2 + 2


def test_a_race_not_ready_to_quote_has_every_row_marked_provisional() -> None:
    ready, draft = _two_tasks()
    draft._warnings = ["the ceiling was measured on 1 seed(s)"]
    lines = matrix_table([ready, draft], [0.5, 1.0])
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| `digits target=3`",
        "| `digits target=3`",
        "| `digits target=8` (provisional)",
        "| `digits target=8` (provisional)",
    ]


def test_the_tally_counts_each_race_verdict_once() -> None:
    lines = tally_table(_two_tasks(), [0.5, 1.0])
    rows = {line.split(" | ")[0]: line for line in lines[2:]}
    assert rows["| `sdo`"].endswith("| 1 / 1 / 0 of 2 | 1 / 0 / 1 of 2 |")
    assert rows["| `drtune`"].endswith("| 0 / 1 / 1 of 2 | 1 / 0 / 1 of 2 |")


def test_a_matrix_block_refuses_a_race_that_is_not_tuned() -> None:
    with pytest.raises(InvalidValue, match="race_digits is not a tuned race"):
        quoting.render(ROOT, "tuned-tally docs/results/race_digits fractions=1")


class _HorizonReport:
    """What ``horizon-shares`` reads from a TunedRaceReport: exact's first share."""

    def __init__(self, share: float | None, budget: float = 1.0) -> None:
        self._first = {"budget": budget, "share": share}

    def summary(self) -> dict[str, Any]:
        return {"horizon": {"share_first": self._first}}


def test_horizon_shares_is_the_range_of_exacts_first_share() -> None:
    shares = quoting._MATRIX_RENDERERS["horizon-shares"]
    reports = [_HorizonReport(0.658), _HorizonReport(0.322), _HorizonReport(0.5)]
    assert shares(reports, {}) == "32.2% to 65.8% of the attainable gain after 1 exact step"
    assert shares([_HorizonReport(0.4, budget=2)], {}) == (
        "40.0% of the attainable gain after 2 exact steps"
    )
    mixed = [_HorizonReport(0.4, budget=2), _HorizonReport(0.6)]
    assert shares(mixed, {}) == "40.0% to 60.0% of the attainable gain after its first evaluation"
    with pytest.raises(InvalidValue, match="race 2 of those given has no attainable gain"):
        shares([_HorizonReport(0.6), _HorizonReport(None)], {})


def test_horizon_shares_over_the_committed_races_is_their_horizons_range() -> None:
    from gradest_lab.race.tuned_race import TunedRaceReport

    folders = ["docs/results/race_digits_tuned", "docs/results/race_mnist_tuned_target3"]
    firsts = [
        TunedRaceReport.load(ROOT / folder).summary()["horizon"]["share_first"]["share"]
        for folder in folders
    ]
    phrase = quoting.render(ROOT, f"horizon-shares {','.join(folders)}").strip()
    assert phrase.startswith(f"{100 * min(firsts):.1f}% to {100 * max(firsts):.1f}%")
