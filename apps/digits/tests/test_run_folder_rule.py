"""A run folder belongs to one run (:mod:`gradest_lab.storage.run_folder`): ``gradest finetune`` and
``gradest pretrain`` under the rule.

* ``gradest finetune``: a second writer while a run holds the folder (a live ``gradest
  finetune`` subprocess, paused after its first checkpoint; or this process holding the
  claim) is refused in one line naming the holder's pid, exit status 2, and nothing of
  the folder changes; once the first is killed, ``--resume`` takes its stale lock over
  and finishes the run; ``--out`` (and ``--resume``) of a folder holding another
  command's ``run.json`` or another tool's files is refused and the folder kept byte for
  byte.
* ``gradest pretrain``: a second pretrain to the same file while the first holds its lock
  is refused naming the pid; an existing file that is not a pretrained checkpoint of the
  same kind (a finetune checkpoint, the other kind, any file) is refused naming it and
  kept; a checkpoint of the same kind is replaced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from digits_support import one_line, parse_finetune_args, run_cli, snapshot
from gradest_digits.finetune_cli import run_record, run_settings
from gradest_digits.run_state import checkpoints_in
from gradest_lab.storage.files import JsonLog
from gradest_lab.storage.process_lock import read_holder, try_lock
from gradest_lab.storage.run_folder import RUN_LOCK, RUN_RECORD, RunRecord, claim_run_folder

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock and signals: POSIX")

RUN = (
    "--estimator sdo --batch-size 2 --sampler-steps 2 --target 1 --lr 0.01 --seed 3 "
    "--checkpoint-every 1 --quiet --no-tensorboard"
).split()

# `gradest finetune` in a subprocess on the tiny model and reward of conftest's
# tiny_digits_assets (steps of a few milliseconds).
CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from digits_support import LinearClassifierReward, tiny_dit
    from gradest_digits import assets, rewards
    assets.load_pretrained_dit = lambda device="cpu": tiny_dit().to(device)
    assets.load_digit_classifier = lambda device="cpu": "classifier"
    rewards.ClassifierReward = lambda classifier, target: LinearClassifierReward(target)
    from gradest.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


def _start_finetune(out: Path, stderr: Path) -> subprocess.Popen[bytes]:
    """A long ``gradest finetune --out OUT`` (checkpoint every step), once it has written
    its first checkpoint. Its output goes to a file (a pipe nobody reads could block it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["finetune", *RUN, "--steps", "100000", "--out", str(out)]
    with stderr.open("wb") as errors:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(Path(__file__).parent), *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "step_000001.pt").is_file():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            child.wait(timeout=60)
            pytest.fail(f"no first checkpoint: {stderr.read_text()[-3000:]}")
        time.sleep(0.02)
    return child


# -- gradest finetune ------------------------------------------------------------------------


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_second_writer_is_refused_naming_the_first_and_a_killed_runs_lock_is_taken_over(
    tmp_path, capsys
):
    out = tmp_path / "run"
    child = _start_finetune(out, tmp_path / "child.err")
    try:
        child.send_signal(signal.SIGSTOP)  # paused: its files stay as they are
        before = snapshot(out)
        assert json.loads((out / RUN_LOCK).read_text())["pid"] == child.pid
        # A second `gradest finetune --resume DIR`: refused under the lock, before it reads
        # the run's files.
        code, err = run_cli(capsys, "finetune", "--resume", str(out), "--quiet")
        line = one_line(err)
        assert code == 2, line
        assert f"--out {str(out)!r} is in use by pid {child.pid} on " in line, line
        assert "(gradest finetune, since " in line and "wait for it to finish" in line, line
        # A second `--out DIR` too (it names the run there and --resume).
        code, err = run_cli(capsys, "finetune", *RUN, "--steps", "3", "--out", str(out))
        assert code == 2 and "holds an earlier run" in one_line(err), err
        assert snapshot(out) == before  # nothing written, moved or removed
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    # Killed, it left its lock file; the lock itself died with it.
    assert (out / RUN_LOCK).is_file() and read_holder(out / RUN_LOCK) is None
    record = (out / RUN_RECORD).read_bytes()
    (newest, _), *_ = checkpoints_in(out / "checkpoints")
    code, err = run_cli(capsys, "finetune", "--resume", str(out), "--steps", str(newest + 1))
    assert code == 0, err
    assert [r["step"] for r in JsonLog(out / "log.jsonl").records()] == list(range(newest + 1))
    assert checkpoints_in(out / "checkpoints")[0][0] == newest + 1
    assert (out / RUN_RECORD).read_bytes() == record  # the run's record, never rewritten
    assert not (out / RUN_LOCK).exists()  # released at the end of the run


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_folder_held_by_another_process_is_refused_for_out_and_resume(tmp_path, capsys):
    # This process holds the claim (the lock is flock's: a second open file is a second
    # writer, in the same process too); the command run against it is refused by pid.
    out = tmp_path / "run"
    args = parse_finetune_args([*RUN, "--steps", "2"])
    with claim_run_folder(out, run_record(run_settings(args)), resume=False):
        before = snapshot(out)
        for argv in (
            ("--out", str(out), *RUN, "--steps", "2"),
            ("--resume", str(out), "--steps", "2"),
        ):
            code, err = run_cli(capsys, "finetune", *argv)
            line = one_line(err)
            assert code == 2 and f"is in use by pid {os.getpid()} on " in line, line
            assert snapshot(out) == before
    # Released: the run recorded there (nothing else yet) is continued by --resume only.
    code, err = run_cli(capsys, "finetune", *RUN, "--steps", "2", "--out", str(out))
    assert code == 2
    assert f"continue it with gradest finetune --resume {out}" in one_line(err), err
    with pytest.warns(RuntimeWarning, match="starting it over from step 0"):
        code, err = run_cli(capsys, "finetune", "--resume", str(out), "--steps", "2")
    assert code == 0, err
    assert [r["step"] for r in JsonLog(out / "log.jsonl").records()] == [0, 1]


@pytest.mark.usefixtures("tiny_digits_assets")
def test_out_of_a_folder_holding_another_commands_run_is_refused(tmp_path, capsys):
    out = tmp_path / "race"
    race = RunRecord(command="gradest race", settings={"budget": "2x", "seeds": [0, 1]})
    with claim_run_folder(out, race):
        (out / "shards").mkdir()
        (out / "shards" / "seed-0.json").write_text('{"loss": 1.0}\n')
        (out / "log.jsonl").write_text('{"step": 0}\n')  # a file of the same name as ours
    before = snapshot(out)
    code, err = run_cli(capsys, "finetune", *RUN, "--steps", "1", "--out", str(out))
    line = one_line(err)
    assert code == 2
    assert "holds a 'gradest race' run, not a 'gradest finetune' run" in line, line
    assert "new --out" in line
    code, err = run_cli(capsys, "finetune", "--resume", str(out), "--steps", "1")
    line = one_line(err)
    assert code == 2 and "holds a 'gradest race' run, not a 'gradest finetune' run" in line
    assert snapshot(out) == before


@pytest.mark.usefixtures("tiny_digits_assets")
@pytest.mark.parametrize(
    "files",
    [
        {"notes.txt": b"mine"},
        {"data/images.bin": bytes(range(256)), ".hidden": b""},
        # What an older gradest finetune left (no run.json): not a gradest run's now.
        {"log.jsonl": b'{"step": 0}\n', "settings.json": b"{}", "checkpoints/step_000001.pt": b"x"},
        {"result.json": b"{}", "run.json.bak": b"{}"},
    ],
)
def test_a_foreign_non_empty_folder_is_refused_and_kept_byte_for_byte(tmp_path, capsys, files):
    out = tmp_path / "theirs"
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    before = snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, err = run_cli(capsys, "finetune", *RUN, "--steps", "1", "--out", str(out))
    line = one_line(err)
    assert code == 2
    assert "holds files that are not a gradest run's" in line and "no run.json" in line, line
    assert "new --out" in line
    code, err = run_cli(capsys, "finetune", "--resume", str(out), "--steps", "1")
    line = one_line(err)
    assert code == 2 and "not a gradest run's" in line and "--out NEW" in line, line
    assert snapshot(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes
    assert not (out / RUN_LOCK).exists()


# -- gradest pretrain ------------------------------------------------------------------------

PRETRAIN = ["pretrain", "--what", "dit", "--steps", "1", "--batch-size", "2", "--no-evaluate"]


def test_a_second_pretrain_to_the_same_file_is_refused_naming_the_first(tmp_path, capsys):
    out = tmp_path / "assets" / "digits_dit.pt"
    out.parent.mkdir()
    held = try_lock(out.parent / ".digits_dit.pt.lock", command="gradest pretrain --what dit")
    assert held is not None
    try:
        code, err = run_cli(capsys, *PRETRAIN, "--out", str(out), "--quiet")
        line = one_line(err)
        assert code == 2
        assert line.startswith("gradest pretrain: error: "), line
        assert f"{str(out)!r} is being written by pid {os.getpid()} on " in line, line
        assert "wait for it to finish, or pass another --out" in line
        assert not out.exists()
    finally:
        held.release()
    # Free again: it writes (and releases its own lock).
    code, err = run_cli(capsys, *PRETRAIN, "--out", str(out), "--quiet")
    assert code == 0, err
    assert torch.load(out, weights_only=True)["kind"] == "digits_dit"
    assert sorted(p.name for p in out.parent.iterdir()) == ["digits_dit.pt"]


def _finetune_checkpoint(path: Path) -> None:
    from gradest_digits.run_state import save_checkpoint

    save_checkpoint(path.parent, 1, {"model": {"w": torch.zeros(1)}})
    (path.parent / "step_000001.pt").rename(path)


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("text", "a file that does not load as a torch checkpoint"),
        ("empty", "a file that does not load as a torch checkpoint"),
        ("finetune", "a gradest finetune checkpoint"),
        ("classifier", "a 'digit_classifier' checkpoint"),
        ("tensor", "a torch file of another tool (Tensor)"),
    ],
)
def test_pretrain_never_replaces_a_file_that_is_not_its_kind_of_checkpoint(
    tmp_path, capsys, kind, named
):
    out = tmp_path / "model.pt"
    if kind == "text":
        out.write_text("my notes\n")
    elif kind == "empty":
        out.write_bytes(b"")
    elif kind == "finetune":
        _finetune_checkpoint(out)
    elif kind == "classifier":
        torch.save({"kind": "digit_classifier", "state_dict": {}}, out)
    else:
        torch.save(torch.ones(3), out)
    before = out.read_bytes()
    code, err = run_cli(capsys, *PRETRAIN, "--out", str(out), "--quiet")
    line = one_line(err)
    assert code == 2
    assert f"out {str(out)!r} holds {named}, not a 'digits_dit' checkpoint" in line, line
    assert "it is not replaced; pass another --out, or remove the file first" in line, line
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no lock left


def test_pretrain_replaces_a_checkpoint_of_its_own_kind(tmp_path, capsys):
    out = tmp_path / "digits_dit.pt"
    code, err = run_cli(capsys, *PRETRAIN, "--seed", "1", "--out", str(out), "--quiet")
    assert code == 0, err
    first = out.read_bytes()
    code, err = run_cli(capsys, *PRETRAIN, "--seed", "2", "--out", str(out), "--quiet")
    assert code == 0, err
    assert out.read_bytes() != first
    assert torch.load(out, weights_only=True)["info"]["seed"] == 2


def test_a_file_that_appears_while_pretrain_trains_is_not_replaced(tmp_path, monkeypatch):
    from gradest_digits import pretrain as module

    out = tmp_path / "digits_dit.pt"
    real = module.pretrain_dit

    def training_while_someone_writes_the_file(**kwargs):
        result = real(**kwargs)
        out.write_text("written meanwhile by another tool\n")
        return result

    monkeypatch.setattr(module, "pretrain_dit", training_while_someone_writes_the_file)
    with pytest.raises(ValueError, match="holds a file that does not load as a torch checkpoint"):
        module.pretrain("dit", out, steps=1, batch_size=2, evaluate=False, progress=False)
    assert out.read_text() == "written meanwhile by another tool\n"
    assert not (tmp_path / ".digits_dit.pt.lock").exists()


def test_mnist_pretrain_holds_both_files_before_training_either(tmp_path):
    from gradest_digits.mnist_pretrain import mnist_pretrain

    (tmp_path / "mnist_dit.pt").write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"mnist_dit.pt' holds a file that does not load"):
        mnist_pretrain(tmp_path, what="all", progress=False)
    # Refused before the classifier was trained or written; no lock left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist_dit.pt"]
    assert (tmp_path / "mnist_dit.pt").read_text() == "not a checkpoint\n"
