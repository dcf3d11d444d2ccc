"""A refused start leaves nothing behind (docs/runs.md, "A failed start leaves nothing").

A recipe refused at its start (a bad estimator spec, a reward option out of range, reward
weights that are not there, a setting the launcher contradicts) ends with one error line
and exit status 2, and the disk is as it was: no ``--output_dir`` folder and none of the
parents it would have created, while a folder that was there before stays. Refused after
the folder was claimed (``fsdp`` needs accelerate's process state, so it is checked once
the run holds its folder), the claim takes back what it made. A refused resume of a run in
its own folder leaves every byte of it as it was. Tiny sd3 runs on CPU, in-process through
``script_main`` (the script's exit status and stderr).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_recipes.train import script_main  # noqa: E402
from recipe_support import RECIPE_WARNINGS  # noqa: E402

pytestmark = RECIPE_WARNINGS

TINY = ["--tiny", "--report_to", "none"]

#: Refusals of a new run: (the flags, what the error line says).
REFUSED = {
    "estimator": (["--estimator", "jagg:window=0"], "setting estimator='jagg:window=0'"),
    "reward option": (["--reward", "hpsv2:version=3"], "setting reward='hpsv2:version=3'"),
    "reward weights": (["--reward", "aesthetic:head={missing}"], "no MLP head at"),
    # Checked with accelerate's process state, after the folder is claimed.
    "fsdp in one process": (["--fsdp"], "setting fsdp=True is invalid in 1 process"),
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """``sd3_reward.py ARGV`` in-process: its exit status and its stderr lines."""
    capsys.readouterr()
    status = script_main("sd3", list(argv))
    return status, capsys.readouterr().err.splitlines()


def the_error(err: list[str]) -> str:
    """The one line a refused run ends with (``sd3_reward.py: error: ...``)."""
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_new_run_creates_no_folder(tmp_path, capsys, case):
    """``--output_dir kept/new/run`` with ``kept`` already there: refused, ``kept`` stays
    (with what it held) and neither ``new`` nor ``run`` exists."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    flags, message = REFUSED[case]
    flags = [flag.format(missing=tmp_path / "no-such-head.pth") for flag in flags]
    out = kept / "new" / "run"

    status, err = run(capsys, *TINY, *flags, "--output_dir", str(out))

    assert status == 2
    assert message in the_error(err)
    assert snapshot(tmp_path) == before  # no new folder anywhere, kept as it was


@pytest.fixture
def finished_run(tmp_path, capsys) -> Path:
    """A finished two-step tiny run, checkpointed every step."""
    out = tmp_path / "run"
    status, err = run(capsys, *TINY, "--output_dir", str(out), "--max_train_steps", "2",
                      "--checkpointing_steps", "1")  # fmt: skip
    assert status == 0, err
    return out


def test_a_refused_resume_leaves_its_run_folder_byte_identical(finished_run, capsys, monkeypatch):
    """Resuming the run in its own folder, refused before the claim (a bad estimator) and
    after it (accelerate asked for FSDP it cannot set up on CPUs): every byte stays, and
    the run still resumes afterwards."""
    before = snapshot(finished_run)
    resume = ["--resume_from_checkpoint", "latest", "--output_dir", str(finished_run),
              "--max_train_steps", "3"]  # fmt: skip

    status, err = run(capsys, *resume, "--estimator", "jagg:window=0")
    assert status == 2 and "setting estimator='jagg:window=0'" in the_error(err)
    assert snapshot(finished_run) == before

    with monkeypatch.context() as env:
        env.setenv("ACCELERATE_USE_FSDP", "true")
        status, err = run(capsys, *resume)
    assert status == 2 and "accelerate was asked for FSDP" in the_error(err)
    assert snapshot(finished_run) == before

    status, err = run(capsys, *resume)  # nothing of the refusals is in the way
    assert status == 0, err


def test_a_refused_resume_into_a_new_folder_creates_no_folder(
    finished_run, tmp_path, capsys, monkeypatch
):
    """Resuming another folder's checkpoint into ``kept/new/run``, refused after the claim:
    neither the new folders nor anything in the resumed run's folder is left changed."""
    kept = tmp_path / "kept"
    kept.mkdir()
    before = snapshot(tmp_path)
    checkpoint = finished_run / "checkpoints" / "step_000001"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")

    status, err = run(capsys, "--resume_from_checkpoint", str(checkpoint),
                      "--output_dir", str(kept / "new" / "run"))  # fmt: skip

    assert status == 2 and "accelerate was asked for FSDP" in the_error(err)
    assert snapshot(tmp_path) == before
