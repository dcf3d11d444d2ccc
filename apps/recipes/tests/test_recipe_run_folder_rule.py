"""A run folder belongs to one run (gradest_lab.storage.run_folder, in the recipes).

Every recipe run claims its ``--output_dir`` before it writes there: ``run.json`` records
the run (command, settings a resume may not change, lineage), another run's folder or a
folder of other files is refused in one line naming it and ``--out``, with every byte
kept; the lock ``.gradest-run.lock`` refuses a second writer naming its pid, and a killed
holder's lock is taken over. Resuming another folder's checkpoint starts a run in a new or
empty folder, which records the checkpoint as its lineage. Tiny sd3 runs on CPU, in-process
through ``script_main`` (its exit status and its one stderr line); the holders of a lock
are small subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_lab.storage.run_folder import RUN_LOCK, RUN_RECORD, read_run_record  # noqa: E402
from gradest_recipes.config import load_config  # noqa: E402
from gradest_recipes.train import run_record, script_main  # noqa: E402
from recipe_support import (  # noqa: E402
    LAUNCHER_ENV,
    RECIPE_WARNINGS,
    SCRIPTS,
    comparable,
    records,
)

pytestmark = RECIPE_WARNINGS

TINY = ["--tiny", "--report_to", "none"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """``sd3_reward.py ARGV`` in-process: its exit status and its stderr lines."""
    capsys.readouterr()
    status = script_main("sd3", list(argv))
    return status, capsys.readouterr().err.splitlines()


def finished(capsys: pytest.CaptureFixture[str], out: Path, steps: int = 2) -> None:
    """A finished tiny run in ``out``, checkpointed every step."""
    status, err = run(capsys, *TINY, "--output_dir", str(out), "--max_train_steps", str(steps),
                      "--checkpointing_steps", "1")  # fmt: skip
    assert status == 0, err


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


def the_error(err: list[str]) -> str:
    """The one line a refused run ends with (``sd3_reward.py: error: ...``)."""
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


def test_resuming_another_runs_checkpoint_into_a_finished_run_is_refused_and_keeps_it(
    tmp_path, capsys
):
    """The issue's example: ``--resume A/checkpoints/step_000001 --out B`` with B another
    finished run exited 0, moved B's newer checkpoints to ``abandoned/``, appended A's
    step 2 to B's log and overwrote B's ``lora/``, ``done.json`` and ``config.toml``. Now
    it exits non-zero with one line naming B's run and ``--out``, and B and A keep every
    byte; into a new folder C the same resume runs, C records A's checkpoint as its
    lineage, and C's own ``latest`` continues it."""
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    finished(capsys, a)
    finished(capsys, b)
    before_a, before_b = snapshot(a), snapshot(b)
    checkpoint = a / "checkpoints" / "step_000001"

    status, err = run(capsys, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(b))
    assert status != 0
    line = the_error(err)
    assert f"--output_dir {str(b)!r} holds another 'gradest recipe sd3_reward' run" in line
    assert "step_000001" in line and "new --out" in line
    assert snapshot(b) == before_b
    assert snapshot(a) == before_a
    assert not (b / "checkpoints" / "abandoned").exists()

    # The same resume into a new folder: nothing of A is copied or changed.
    status, err = run(capsys, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(c))
    assert status == 0, err
    assert snapshot(a) == before_a
    assert read_run_record(c / RUN_RECORD).lineage == (str(checkpoint.resolve()),)
    assert [r["step"] for r in records(c)] == [2]  # A's step 1 is A's, not copied
    assert comparable(records(c)) == comparable(records(a))[1:]  # the same step 2 as A's
    state = json.loads((c / "checkpoints" / "step_000002" / "recipe_state.json").read_text())
    assert state["lineage"] == [str(checkpoint.resolve())]
    # C continues its own run; starting it again, or from A's checkpoint again, is refused.
    status, err = run(capsys, "--resume_from_checkpoint", "latest", "--output_dir", str(c),
                      "--max_train_steps", "3")  # fmt: skip
    assert status == 0, err
    assert [r["step"] for r in records(c)] == [2, 3]
    kept = snapshot(c)
    status, err = run(capsys, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(c))
    assert status != 0
    assert "holds an earlier run; continue it with --resume_from_checkpoint latest" in (
        the_error(err)
    )
    status, err = run(capsys, *TINY, "--output_dir", str(c))
    assert status != 0 and "new --out" in the_error(err)
    assert snapshot(c) == kept
    assert snapshot(a) == before_a


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from gradest_lab.storage.run_folder import RUN_RECORD, claim_run_folder, read_run_record
    from pathlib import Path
    out = Path(sys.argv[1])
    record = read_run_record(out / RUN_RECORD)
    with claim_run_folder(out, record, what="--output_dir", resume=True):
        print("held", flush=True)
        time.sleep(120)
    """
)


def hold(out: Path) -> subprocess.Popen[str]:
    """A process that holds ``out``'s lock as the run would, until it is killed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_writer_is_refused_naming_the_holders_pid(tmp_path, capsys):
    out = tmp_path / "run"
    finished(capsys, out)
    before = snapshot(out)
    holder = hold(out)
    try:
        for argv in (
            ["--resume_from_checkpoint", "latest", "--output_dir", str(out),
             "--max_train_steps", "3"],
            [*TINY, "--output_dir", str(out)],
        ):  # fmt: skip
            status, err = run(capsys, *argv)
            assert status != 0
            line = the_error(err)
            assert f"--output_dir {str(out)!r} is in use by pid {holder.pid} " in line
            assert "gradest recipe sd3_reward" in line and "new --out" in line
        lock = json.loads((out / RUN_LOCK).read_text())
        assert lock["pid"] == holder.pid  # the holder's lock, not taken over
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Nothing written by the refused runs (the lock file is the killed holder's).
    assert {k: v for k, v in snapshot(out).items() if k != RUN_LOCK} == before


def test_a_killed_runs_stale_lock_does_not_stop_resume_latest(tmp_path, capsys):
    out = tmp_path / "run"
    finished(capsys, out)
    holder = hold(out)
    holder.send_signal(signal.SIGKILL)  # killed: no cleanup; the kernel freed its flock
    holder.wait()
    assert json.loads((out / RUN_LOCK).read_text())["pid"] == holder.pid
    status, err = run(capsys, "--resume_from_checkpoint", "latest", "--output_dir", str(out),
                      "--max_train_steps", "3")  # fmt: skip
    assert status == 0, err
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    assert not (out / RUN_LOCK).exists()  # taken over, then released


def test_a_foreign_folder_and_an_older_run_are_refused_and_kept_byte_for_byte(tmp_path, capsys):
    """A non-empty folder without ``run.json`` (another tool's files, here with a
    ``log.jsonl`` of its own) is refused for a new run and for a resume into it; a run
    folder of an older gradest (no ``run.json``) is not continued in place, the message
    names the way on: its checkpoint into a new folder, which works."""
    foreign = tmp_path / "foreign"
    (foreign / "data").mkdir(parents=True)
    (foreign / "notes.txt").write_bytes(b"mine\n")
    (foreign / "log.jsonl").write_bytes(b'{"step": 1}\n')
    (foreign / "data" / "x.bin").write_bytes(bytes(range(7)))
    before = snapshot(foreign)
    status, err = run(capsys, *TINY, "--output_dir", str(foreign))
    assert status != 0
    line = the_error(err)
    assert f"--output_dir {str(foreign)!r} holds files that are not a gradest run's" in line
    assert "notes.txt" in line and "new --out" in line
    assert snapshot(foreign) == before

    older = tmp_path / "older"
    finished(capsys, older)
    (older / RUN_RECORD).unlink()  # what a run of an older gradest leaves
    kept = snapshot(older)
    checkpoint = older / "checkpoints" / "step_000001"
    status, err = run(capsys, "--resume_from_checkpoint", str(checkpoint), "--output_dir",
                      str(foreign))  # fmt: skip
    assert status != 0 and "not a gradest run's" in the_error(err)
    assert snapshot(foreign) == before
    status, err = run(capsys, "--resume_from_checkpoint", "latest", "--output_dir", str(older),
                      "--max_train_steps", "3")  # fmt: skip
    assert status != 0
    line = the_error(err)
    assert f"{str(older)!r} holds no {RUN_RECORD}" in line
    assert "--output_dir NEW" in line
    assert snapshot(older) == kept
    new = tmp_path / "new"
    newest = older / "checkpoints" / "step_000002"
    status, err = run(capsys, "--resume_from_checkpoint", str(newest), "--output_dir", str(new),
                      "--max_train_steps", "3")  # fmt: skip
    assert status == 0, err
    assert [r["step"] for r in records(new)] == [3]
    assert snapshot(older) == kept


def test_a_start_refused_after_the_claim_leaves_the_folder_as_it_was(tmp_path, capsys):
    """A setting refused once the folder is claimed (a reward file that does not exist)
    removes the new ``run.json`` again: the corrected command starts in the same folder."""
    out = tmp_path / "run"
    status, err = run(capsys, *TINY, "--output_dir", str(out),
                      "--reward", f"{tmp_path / 'missing.py'}:reward")  # fmt: skip
    assert status != 0 and "missing.py" in the_error(err)
    assert not out.exists() or list(out.iterdir()) == []
    status, err = run(capsys, *TINY, "--output_dir", str(out), "--max_train_steps", "1")
    assert status == 0, err
    assert read_run_record(out / RUN_RECORD).settings["reward"] == "brightness"
    assert read_run_record(out / RUN_RECORD) == run_record(
        "sd3", load_config("sd3", overrides={"tiny": True, "out": str(out)})
    )


def test_abandon_newer_never_moves_another_folders_checkpoints(tmp_path):
    """Only a run continued in its own folder moves that folder's newer checkpoints aside:
    given a checkpoint of another folder, ``abandon_newer`` refuses and moves nothing."""
    from gradest_recipes.checkpoints import STATE_FILE, abandon_newer, holds_checkpoint

    from gradest.errors import InvalidValue

    for name in ("A/checkpoints/step_000001", "B/checkpoints/step_000002"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / STATE_FILE).write_text("{}")
    a, b = tmp_path / "A", tmp_path / "B"
    before = snapshot(b)
    assert holds_checkpoint(b, b / "checkpoints" / "step_000002")
    assert holds_checkpoint(b, b / "checkpoints" / "abandoned" / "step_000003")
    assert not holds_checkpoint(b, a / "checkpoints" / "step_000001")
    assert not holds_checkpoint(tmp_path, a / "checkpoints" / "step_000001")  # not out's own
    with pytest.raises(InvalidValue, match="abandons nothing there"):
        abandon_newer(b, 1, resumed_from=a / "checkpoints" / "step_000001")
    assert snapshot(b) == before
    moved = abandon_newer(b, 1, resumed_from=b / ".." / "B" / "checkpoints" / "step_000001")
    assert moved == [b / "checkpoints" / "abandoned" / "step_000002"]


GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


@pytest.mark.slow
@GLOO
def test_two_processes_are_refused_before_either_writes(tmp_path):
    """Under torchrun with 2 processes the main one claims the folder and the other waits
    for the outcome: a foreign folder is refused (the launch fails, it does not hang) and
    keeps every byte."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_bytes(b"mine\n")
    before = snapshot(foreign)
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_ENV and not k.startswith("ACCELERATE_")}  # fmt: skip
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               HF_HOME=str(tmp_path / "hf_home"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "sd3_reward.py"), *TINY, "--output_dir", str(foreign)],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if ": error: " in line]
    # Each process refuses with the main one's line (torchrun may stop the second
    # before its line is out, so one or two).
    assert 1 <= len(refusals) <= 2, done.stderr[-3000:]
    assert all("holds files that are not a gradest run's" in line for line in refusals)
    assert snapshot(foreign) == before


# A bad setting of each kind a recipe checks: the value itself (lr), a name it resolves
# (estimator, reward), a file it reads (embeddings) and a model folder (pretrained).
BAD_SETTINGS = {
    "lr": ["--tiny", "--lr", "-1"],
    "estimator": ["--tiny", "--estimator", "nope"],
    "reward": ["--tiny", "--reward", "sparkle"],
    "embeddings": ["--pretrained", ".", "--embeddings", "none.pt"],
    "pretrained": ["--pretrained", "no/such/model", "--embeddings", "prompts.pt"],
}


@pytest.mark.parametrize("setting", sorted(BAD_SETTINGS))
def test_a_bad_setting_is_refused_as_itself_beside_another_run(setting, capsys):
    """Settings are checked before the run folder is looked at: the default --output_dir
    (runs/recipe) holding another recipe's run changes nothing in the error, and nothing
    there is touched."""
    from gradest_recipes.embeddings import tiny_embeddings

    tiny_embeddings("sd3").to_file(Path("prompts.pt"))
    argv = [*BAD_SETTINGS[setting], *TINY[1:]]
    status, err = run(capsys, *argv)
    assert status == 2
    alone = the_error(err)
    assert f"setting {setting}=" in alone, alone
    assert not Path("runs").exists()
    other = Path("runs/recipe")
    other.mkdir(parents=True)
    (other / RUN_RECORD).write_text(
        run_record("flux", load_config("flux", overrides={"tiny": True})).to_json()
    )
    before = snapshot(other)
    status, err = run(capsys, *argv)
    assert status == 2
    assert the_error(err) == alone
    assert snapshot(other) == before
