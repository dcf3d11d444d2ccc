"""The race pictures: written from a committed report, every line told apart."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from gradest_lab.plots import _line_styles, plot_race, plot_tuned_race
from gradest_lab.race.plain_race import RaceReport
from gradest_lab.race.tuned_race import TunedRaceReport

pytest.importorskip("matplotlib")
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def test_forty_lines_have_forty_styles() -> None:
    styles = [tuple(sorted(s.items())) for s in itertools.islice(_line_styles(), 40)]
    assert len(set(styles)) == 40


def test_a_tuned_race_draws_its_two_pictures(tmp_path: Path) -> None:
    report = TunedRaceReport.load(RESULTS / "race_digits_tuned")
    assert len(report.config["estimators"]) > 10  # more lines than one colour cycle
    paths = plot_tuned_race(report, tmp_path)
    assert [p.name for p in paths] == ["reward_vs_compute.png", "tuning_curves.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_a_plain_race_draws_its_picture(tmp_path: Path) -> None:
    (path,) = plot_race(RaceReport.load(RESULTS / "race_digits"), tmp_path)
    assert path.read_bytes().startswith(PNG)
