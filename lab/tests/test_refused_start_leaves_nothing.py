"""A refused start leaves nothing behind (gradest_lab.storage.run_folder; docs/runs.md).

``gradest race`` and ``gradest race --tune`` check every argument before they create
``--out``: refused, the disk is as it was (no folder, none of its new parents; a parent
that was there stays). A check that can only run once the run holds its folder (the
recipes' ``fsdp``, which needs the launcher's process state) is refused inside the claim,
and the claim takes back everything it made: its ``run.json``, its lock, the folder and
the parents it created, also when the caller already took its ``run.json`` back; never a
folder that was there before, nor the record of a run it continued.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gradest_lab.race import plain_race as race_module
from gradest_lab.storage.run_folder import RUN_RECORD, RunRecord, claim_run_folder
from test_race import quadratic_task

from gradest.cli import main
from gradest.errors import InvalidValue

RECORD = RunRecord(command="gradest recipe sd3_reward", settings={"lr": 1e-4})


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


def test_a_start_refused_in_the_claim_removes_what_it_created(tmp_path: Path) -> None:
    """A setting refused once the run holds its folder, after the caller took back its own
    ``run.json`` (what the recipes did): the new folders go, the old parent stays."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    out = kept / "new" / "run"
    with pytest.raises(InvalidValue, match="fsdp"):
        with claim_run_folder(out, RECORD, what="--output_dir"):
            (out / RUN_RECORD).unlink()
            raise InvalidValue("setting fsdp=True is invalid in 1 process")
    assert snapshot(tmp_path) == before


def test_a_refused_continuation_leaves_its_folder_byte_identical(tmp_path: Path) -> None:
    """A run's own folder, continued and refused before writing: every byte stays (its
    ``run.json`` too), and the folder is not removed though it holds nothing else."""
    out = tmp_path / "run"
    with claim_run_folder(out, RECORD):
        (out / "log.jsonl").write_text('{"step": 1}\n')
    before = snapshot(tmp_path)
    with pytest.raises(InvalidValue, match="refused"):
        with claim_run_folder(out, RECORD, resume=True) as claimed:
            assert claimed.continued
            raise InvalidValue("refused")
    assert snapshot(tmp_path) == before
    (out / "log.jsonl").unlink()  # only its record left: still the run's, still kept
    before = snapshot(tmp_path)
    with pytest.raises(InvalidValue, match="refused"):
        with claim_run_folder(out, RECORD, resume=True):
            raise InvalidValue("refused")
    assert snapshot(tmp_path) == before


RACE = ["race", "--model", "quadratic", "--seeds", "1", "--budget", "1x", "--fractions", "1"]
TUNED = ["race", "--model", "quadratic", "--seeds", "2-3", "--budget", "1x", "--tune",
         "lr=0.01,0.02", "--tune-seeds", "0-1"]  # fmt: skip

#: Refused races: (the arguments, what the one error line says).
REFUSED_RACES = {
    "estimator spec": ([*RACE, "--estimators", "exact,jagg:window=0"], "window=0"),
    "task option": ([*RACE, "--task-option", "rate=1"], "no option 'rate'"),
    "repeated task option": (
        [*RACE, "--task-option", "lr=0.1", "--task-option", "lr=0.2"],
        "lr is given twice",
    ),
    "tuned estimator spec": ([*TUNED, "--estimators", "exact,jagg:window=0"], "window=0"),
    "tuned seeds": ([*TUNED[:-1], "3-4"], "must be disjoint"),
}


@pytest.mark.parametrize("case", list(REFUSED_RACES))
def test_a_refused_race_creates_no_folder(tmp_path: Path, monkeypatch, capsys, case) -> None:
    monkeypatch.setattr(race_module, "registered_tasks", lambda: {"quadratic": quadratic_task})
    kept = tmp_path / "kept"
    kept.mkdir()
    before = snapshot(tmp_path)
    argv, message = REFUSED_RACES[case]
    out = kept / "new" / "race"
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--no-plots", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert snapshot(tmp_path) == before
