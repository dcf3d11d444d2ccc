"""The lab's race commands (``python -m gradest_lab.race.rerun`` and
``python -m gradest_lab.race.race_contraction``) refuse a folder in one line on stderr and
exit 2, like every gradest command: no traceback, the folder untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradest_lab.race import race_contraction, rerun


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("race_json", "message"),
    [
        (None, "race.json': no such file"),
        ({"kind": "plain"}, "race.json is not a tuned race's"),
    ],
)
def test_rerun_refuses_a_folder_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], race_json: dict | None, message: str
) -> None:
    if race_json is not None:
        (tmp_path / "race.json").write_text(json.dumps(race_json))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert rerun.main([str(tmp_path), "--quiet"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rerun: error: ") and message in line and str(tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_race_contraction_refuses_a_folder_without_a_report_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert race_contraction.main([str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("race_contraction: error: ") and "report.json" in line
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_rerun_says_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(folder: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(rerun, "rerun_tuned_race", interrupted)
    assert rerun.main([str(tmp_path), "--quiet"]) == 130
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rerun: interrupted;") and "run it again to resume" in line
