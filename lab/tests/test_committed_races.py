"""The committed race results (docs/results/race_*) are what their raw data say.

Each ``report.json`` holds the race's settings, the pretrained evaluation and every
seed's curve; :meth:`RaceReport.load` (:meth:`TunedRaceReport.load` for a tuned race)
rebuilds the report from those alone and recomputes every statistic. These tests check
that the stored statistics and ``report.md`` are that recomputation, and that a tuned
race's report holds exactly its shard files. What the pages quote of them is checked by
lab/tests/test_quoted_numbers.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from gradest_lab.race.plain_race import RaceReport
from gradest_lab.race.shards import ShardKey, ShardStore, lr_label
from gradest_lab.race.tuned_race import TUNED_SCHEMA, TunedRaceReport

from gradest.errors import InvalidValue

REPO = Path(__file__).resolve().parents[2]
_FOLDERS = sorted(p.parent for p in (REPO / "docs" / "results").glob("race_*/report.json"))
TUNED = [p for p in _FOLDERS if f'"schema": "{TUNED_SCHEMA}"' in (p / "report.json").read_text()]
RACES = [p for p in _FOLDERS if p not in TUNED]


# Recomputed statistics may differ from the stored ones in their last bits on another CPU:
# the residual tuning gap is a least-squares fit (numpy's LAPACK, whose kernels differ
# between instruction sets). A difference beyond round-off is a different result.
_ROUND_OFF = 1e-9


def assert_same_report(stored: Any, recomputed: Any, where: str = "report.json") -> None:
    """``stored`` and ``recomputed`` (parsed JSON) are equal, floats to round-off."""
    if isinstance(stored, float) or isinstance(recomputed, float):
        assert isinstance(stored, (int, float)) and isinstance(recomputed, (int, float)), where
        assert math.isclose(stored, recomputed, rel_tol=_ROUND_OFF, abs_tol=1e-12), (
            where,
            stored,
            recomputed,
        )
    elif isinstance(stored, dict):
        assert isinstance(recomputed, dict) and stored.keys() == recomputed.keys(), where
        for key, value in stored.items():
            assert_same_report(value, recomputed[key], f"{where}/{key}")
    elif isinstance(stored, list):
        assert isinstance(recomputed, list) and len(stored) == len(recomputed), where
        for i, (a, b) in enumerate(zip(stored, recomputed, strict=True)):
            assert_same_report(a, b, f"{where}[{i}]")
    else:
        assert stored == recomputed, (where, stored, recomputed)


def test_round_off_is_all_that_is_forgiven() -> None:
    stored = {"a": [1.0, {"b": 0.0334}], "c": "NaN", "n": 3}
    assert_same_report(
        stored, {"a": [1.0 + 1e-13, {"b": 0.0334 * (1 + 1e-12)}], "c": "NaN", "n": 3}
    )
    for changed in (
        {"a": [1.0, {"b": 0.0335}], "c": "NaN", "n": 3},
        {"a": [1.0, {"b": 0.0334}], "c": "NaN", "n": 4},
        {"a": [1.0, {"b": 0.0334}, 2.0], "c": "NaN", "n": 3},
        {"a": [1.0, {"b": 0.0334}], "c": "Infinity", "n": 3},
        {"a": [1.0, {"b": 0.0334, "d": 1}], "c": "NaN", "n": 3},
    ):
        with pytest.raises(AssertionError):
            assert_same_report(stored, changed)


def test_there_are_committed_races() -> None:
    assert len(RACES) >= 4, RACES
    assert TUNED, "no committed tuned race"


@pytest.mark.parametrize("folder", RACES, ids=lambda p: p.name)
def test_stored_statistics_are_recomputed_from_the_raw_curves(folder: Path) -> None:
    report = RaceReport.load(folder)
    stored = json.loads((folder / "report.json").read_text())
    assert_same_report(stored, json.loads(report.to_json()))
    assert report.to_markdown() == (folder / "report.md").read_text()


@pytest.mark.parametrize("folder", TUNED, ids=lambda p: p.name)
def test_a_tuned_race_is_its_shards(folder: Path) -> None:
    """A tuned race's report holds exactly its shards' rows (the raw data, one file per
    run), and every statistic and the page are recomputed from them."""
    report = TunedRaceReport.load(folder)
    stored = json.loads((folder / "report.json").read_text())
    assert_same_report(stored, json.loads(report.to_json()))
    assert report.to_markdown() == (folder / "report.md").read_text()
    # Read as the race reads them: each curve checked against the race's fractions.
    store = ShardStore(folder, report.config["identity"], fractions=report.config["fractions"])
    lrs = {
        lr_label(lr): lr for spec in report.config["estimators"] for lr in report.tried_lrs(spec)
    }
    for runs in (report.tuning, report.runs):
        for spec, by_lr in runs.items():
            for label, rows in by_lr.items():
                for row in rows:
                    shard = store.result(ShardKey(spec, lrs[label], row["seed"]))
                    assert shard == row, (spec, label, row["seed"])
    assert set(report.config["tune_seeds"]).isdisjoint(report.config["seeds"])
    # Ready to quote, or waiting for its refinement or ceiling (python -m
    # gradest_lab.race.rerun); then every page that quotes it shows why (quoting's check,
    # test_quoted_numbers). Never a narrow grid or a choice on its edge.
    for note in report.grid_warnings():
        assert "not bracketed at" in note or note.startswith("the ceiling was measured"), note


def test_load_refuses_what_is_not_a_race_report(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text('{"schema": "gradest.compare/1"}')
    with pytest.raises(InvalidValue, match="not a race report"):
        RaceReport.load(tmp_path)
    (tmp_path / "report.json").write_text("{")
    with pytest.raises(InvalidValue, match="not a readable race report.json"):
        RaceReport.load(tmp_path / "report.json")
    with pytest.raises(InvalidValue, match="not a readable"):
        RaceReport.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "not a race report"),
        ("null", "not a race report"),
        ('"report"', "not a race report"),
        ('{"schema": "gradest.race/1"}', "field 'config' is missing"),
        ('{"schema": "gradest.race/1", "config": {}, "initial": [], "runs": {}}', "'initial'"),
    ],
)
def test_one_reader_refuses_every_malformed_report_in_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    from gradest_lab.race.quoting import _load
    from gradest_lab.race.tuned_race import TunedRaceReport

    (tmp_path / "report.json").write_text(text)
    for load in (RaceReport.load, lambda p: _load(p, ".")):
        with pytest.raises(InvalidValue, match=message) as info:
            load(tmp_path)
        assert "\n" not in str(info.value)
    with pytest.raises(InvalidValue, match="not a tuned race report|field"):
        TunedRaceReport.load(tmp_path)
    (tmp_path / "report.json").write_bytes(b"\xff\xfe")
    with pytest.raises(InvalidValue, match="not a readable race report.json.*UTF-8"):
        RaceReport.load(tmp_path)
    assert (tmp_path / "report.json").read_bytes() == b"\xff\xfe"
