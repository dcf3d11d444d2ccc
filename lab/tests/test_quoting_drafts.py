"""A page that quotes a tuned race not ready to quote must say so next to it."""

from __future__ import annotations

import warnings

from gradest_lab.race.quoting import page_problems, update_page
from gradest_lab.race.tuned_race import tuned_race
from test_race import QuadraticTask
from test_tuned_race import SETTINGS, SPECS


def test_a_provisional_race_is_quoted_only_beside_its_warnings(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradest race --tune")
        tuned_race(QuadraticTask(), SPECS, out=tmp_path / "race", **SETTINGS, bracket_ratio=None)
    table = "<!-- race-quote tuned-decision race -->\n<!-- /race-quote -->\n"
    page = update_page(tmp_path, "# Results\n\n" + table)
    problems = page_problems(tmp_path, page)
    assert any("which is not ready to quote" in p and "tuned-warnings race" in p for p in problems)
    flagged = update_page(
        tmp_path,
        "# Results\n\n<!-- race-quote tuned-warnings race -->\n<!-- /race-quote -->\n\n" + table,
    )
    assert "**Not ready to quote**" in flagged and "not bracketed at 1.26x" in flagged
    assert not any("not ready to quote" in p for p in page_problems(tmp_path, flagged))
