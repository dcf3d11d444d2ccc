"""The committed race results (docs/results/race_*) are what their raw data say.

Each ``report.json`` holds the race's settings, the pretrained evaluation and every
seed's curve; :meth:`RaceReport.load` rebuilds the report from those alone and recomputes
every statistic. These tests check that the stored statistics and ``report.md`` are that
recomputation, and that each paired difference to ``exact`` that docs/results.md quotes
for a race's final budget is the recomputed one (as rounded there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradest.errors import InvalidValue
from gradest.harness.race import REFERENCE, RaceReport

REPO = Path(__file__).resolve().parents[1]
RACES = sorted(p.parent for p in (REPO / "docs" / "results").glob("race_*/report.json"))


def test_there_are_committed_races() -> None:
    assert len(RACES) >= 4, RACES


@pytest.mark.parametrize("folder", RACES, ids=lambda p: p.name)
def test_stored_statistics_are_recomputed_from_the_raw_curves(folder: Path) -> None:
    report = RaceReport.load(folder)
    assert report.to_json() == (folder / "report.json").read_text()
    assert report.to_markdown() == (folder / "report.md").read_text()


def _signed(value: float, decimals: int) -> str:
    text = f"{value:+.{decimals}f}"
    return text.replace("-", "\N{MINUS SIGN}")


def _mention(folder: Path, text: str) -> int | None:
    """Where docs/results.md first names the race's folder (not a longer name)."""
    found = re.search(rf"docs/results/{re.escape(folder.name)}(?![\w-])", text)
    return None if found is None else found.start()


def _section_of(folder: Path, text: str) -> str:
    """The part of docs/results.md about one race: from the heading above its command (or
    the first mention of its folder) to the next heading of that level."""
    mention = _mention(folder, text)
    assert mention is not None
    start = text.rfind("\n## ", 0, mention)
    end = text.find("\n## ", mention)
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.parametrize("folder", RACES, ids=lambda p: p.name)
def test_docs_quote_the_recomputed_differences(folder: Path) -> None:
    """Every estimator's final paired difference to exact, if docs/results.md shows it,
    is the recomputed mean and interval at the precision shown (1 to 4 decimals)."""
    text = (REPO / "docs" / "results.md").read_text()
    if _mention(folder, text) is None:
        pytest.skip(f"docs/results.md does not present {folder.name}")
    section = _section_of(folder, text)
    summary = RaceReport.load(folder).summary()
    quoted = 0
    for spec, row in summary.items():
        if spec == REFERENCE or f"`{spec}`" not in section:
            continue
        diff = row["points"][-1]["reward_minus_exact"]
        forms = [
            f"{_signed(diff['mean'], d)} [{_signed(diff['low'], d)}, {_signed(diff['high'], d)}]"
            for d in range(1, 5)
        ]
        table_rows = [line for line in section.splitlines() if line.startswith(f"| `{spec}`")]
        for line in table_rows:
            assert any(form in line for form in forms), (spec, forms[1], line)
            quoted += 1
    assert quoted or "\n| " not in section, f"no table row of {folder.name} was checked"


def test_load_refuses_what_is_not_a_race_report(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text('{"schema": "gradest.compare/1"}')
    with pytest.raises(InvalidValue, match="not a race report"):
        RaceReport.load(tmp_path)
    (tmp_path / "report.json").write_text("{")
    with pytest.raises(InvalidValue, match="not a readable race report.json"):
        RaceReport.load(tmp_path / "report.json")
    with pytest.raises(InvalidValue, match="not a readable"):
        RaceReport.load(tmp_path / "missing.json")
