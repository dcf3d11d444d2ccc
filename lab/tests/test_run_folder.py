"""The run-folder rule (gradest_lab.storage.run_folder) and the process lock under it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gradest_lab.storage.files import OutputError
from gradest_lab.storage.process_lock import read_holder, try_lock
from gradest_lab.storage.run_folder import (
    RUN_LOCK,
    RUN_RECORD,
    FolderInUse,
    RunRecord,
    claim_run_folder,
    read_run_record,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from gradest.errors import InvalidValue

RACE = RunRecord(command="gradest race", settings={"budget": "2x", "seeds": [0, 1]})


def test_a_new_folder_is_created_and_records_its_run(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "race"
    with claim_run_folder(out, RACE) as claimed:
        assert not claimed.continued
        assert (out / RUN_LOCK).is_file()
    assert read_run_record(out / RUN_RECORD) == RunRecord(
        command="gradest race", settings={"budget": "2x", "seeds": [0, 1]}
    )
    assert not (out / RUN_LOCK).exists()  # released and removed
    assert sorted(os.listdir(out)) == [RUN_RECORD]


def test_the_same_run_continues_and_another_is_refused_naming_the_difference(
    tmp_path: Path,
) -> None:
    with claim_run_folder(tmp_path, RACE):
        pass
    with claim_run_folder(tmp_path, RACE) as claimed:
        assert claimed.continued
    other = RunRecord(command="gradest race", settings={"budget": "3x", "seeds": [0, 1]})
    with pytest.raises(InvalidValue, match=r"budget: '2x' there, '3x' now.*new --out"):
        with claim_run_folder(tmp_path, other):
            pytest.fail("the body of a refused claim ran")
    with pytest.raises(InvalidValue, match=r"holds a 'gradest race' run, not a 'gradest compare'"):
        with claim_run_folder(tmp_path, RunRecord(command="gradest compare")):
            pass
    assert read_run_record(tmp_path / RUN_RECORD) == RACE


def test_resume_rules(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue, match="holds no gradest run to continue"):
        with claim_run_folder(tmp_path / "none", RACE, resume=True):
            pass
    assert not (tmp_path / "none").exists()  # nothing created for a refused resume
    with claim_run_folder(tmp_path / "run", RACE, resume=False):
        pass
    with pytest.raises(InvalidValue, match="continue it with gradest race --resume X"):
        with claim_run_folder(
            tmp_path / "run", RACE, resume=False, resume_hint="gradest race --resume X"
        ):
            pass
    with claim_run_folder(tmp_path / "run", RACE, resume=True) as claimed:
        assert claimed.continued


@settings(max_examples=25, deadline=None)
@given(
    names=st.lists(
        st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
        min_size=1,
        max_size=4,
        unique=True,
    )
)
def test_a_folder_of_other_files_is_refused_and_kept_byte_for_byte(
    tmp_path_factory: pytest.TempPathFactory, names: list[str]
) -> None:
    folder = tmp_path_factory.mktemp("foreign")
    names = [n for n in names if n not in (".DS_Store", RUN_LOCK)] or ["x"]
    for index, name in enumerate(names):
        (folder / name).write_bytes(bytes([index]) * 3)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(InvalidValue, match="not a gradest run's.*new --out"):
        with claim_run_folder(folder, RACE):
            pass
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize(
    "text, field",
    [
        ("[]", "the file"),
        ("null", "the file"),
        ('"x"', "the file"),
        ("{", "the text"),
        ("{}", "schema"),
        ('{"schema": "gradest.run/1"}', "command"),
        ('{"schema": "gradest.run/1", "command": "c", "settings": [], "lineage": []}', "settings"),
        ('{"schema": "gradest.run/1", "command": "c", "settings": {}, "lineage": [1]}', "lineage"),
    ],
)
def test_a_record_that_does_not_read_is_one_line_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    (tmp_path / RUN_RECORD).write_text(text)
    with pytest.raises(InvalidValue, match=f"{RUN_RECORD}': {field} ") as info:
        with claim_run_folder(tmp_path, RACE):
            pass
    assert "\n" not in str(info.value)
    assert (tmp_path / RUN_RECORD).read_text() == text


def test_links_are_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(RACE.to_json())
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / RUN_RECORD).symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symbolic link"):
        with claim_run_folder(folder, RACE):
            pass
    (folder / RUN_RECORD).unlink()
    (folder / RUN_LOCK).symlink_to(tmp_path / "lock-target")
    with pytest.raises(OutputError, match="symbolic link"):
        with claim_run_folder(folder, RACE):
            pass
    assert not (tmp_path / "lock-target").exists()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from gradest_lab.storage.run_folder import RunRecord, claim_run_folder
    with claim_run_folder(sys.argv[1], RunRecord(command="gradest race")):
        print("held", flush=True)
        time.sleep(60)
    """
)


def _start_holder(folder: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_ones_lock_is_taken_over(
    tmp_path: Path,
) -> None:
    child = _start_holder(tmp_path)
    try:
        with pytest.raises(FolderInUse, match=rf"in use by pid {child.pid} on .*gradest race"):
            with claim_run_folder(tmp_path, RunRecord(command="gradest race")):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (tmp_path / RUN_LOCK).exists()  # the killed process could not clean up
    with claim_run_folder(tmp_path, RunRecord(command="gradest race")) as claimed:
        assert claimed.continued
        assert json.loads((tmp_path / RUN_LOCK).read_text())["pid"] == os.getpid()


def test_two_writers_racing_for_a_free_lock_cannot_both_hold_it(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    first = try_lock(lock, command="a")
    assert first is not None
    assert try_lock(lock, command="b") is None
    assert read_holder(lock) is not None and read_holder(lock)["command"] == "a"
    first.release()
    assert read_holder(lock) is None
    second = try_lock(lock, command="b")
    assert second is not None
    second.release()


def test_a_shared_run_takes_no_folder_lock(tmp_path: Path) -> None:
    with claim_run_folder(tmp_path, RACE, shared=True) as one:
        with claim_run_folder(tmp_path, RACE, shared=True) as two:
            assert not one.continued and two.continued
            assert not (tmp_path / RUN_LOCK).exists()


def test_an_unwritable_parent_is_one_line_before_anything(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="is a file|part of the path is a file"):
        with claim_run_folder(blocker / "run", RACE):
            pytest.fail("the body of a refused claim ran")


def test_a_run_that_fails_before_writing_anything_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="bad model"):
        with claim_run_folder(out, RACE):
            raise RuntimeError("bad model")
    assert list(tmp_path.iterdir()) == []
    # one that wrote something keeps it (and its record), to resume
    with pytest.raises(RuntimeError, match="killed"):
        with claim_run_folder(out, RACE):
            (out / "state").mkdir()
            raise RuntimeError("killed")
    assert sorted(os.listdir(out)) == [RUN_RECORD, "state"]
    with claim_run_folder(out, RACE) as claimed:
        assert claimed.continued


def test_gradest_compare_keeps_one_compare_per_folder(tmp_path: Path, capsys) -> None:
    from gradest.cli import main

    out = tmp_path / "cmp"
    argv = ["compare", "--steps", "4", "--seeds", "1", "--draws", "1", "--repeats", "1"]
    argv += ["--no-sweeps", "--no-plots", "--quiet", "--out", str(out)]
    assert main([*argv, "--estimators", "exact,sdo"]) == 0
    report = (out / "report.json").read_bytes()
    capsys.readouterr()
    assert main([*argv, "--estimators", "exact,jagg:window=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds another 'gradest compare' run (estimators: ['exact', 'sdo'] there" in err
    assert "new --out" in err and len(err.splitlines()) == 1
    assert (out / "report.json").read_bytes() == report
    assert main([*argv, "--estimators", "exact,sdo"]) == 0  # the same compare: rewritten


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_that_is_not_a_regular_file_is_one_line(tmp_path: Path, kind: str) -> None:
    lock = tmp_path / RUN_LOCK
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    with pytest.raises(OutputError, match="lock file .* (not a regular file|Is a directory)"):
        with claim_run_folder(tmp_path, RACE):
            pytest.fail("the body of a refused claim ran")
    assert lock.is_fifo() if kind == "fifo" else lock.is_dir()
