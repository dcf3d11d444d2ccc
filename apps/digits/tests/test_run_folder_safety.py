"""A run folder is append-only history, and nothing outside it is touched (issue 24).

Each test reproduces an attack that used to destroy, mix or follow something:

* a folder of another tool passed as ``--out`` (a log with a torn last line, no
  ``run.json``) keeps every byte although the command is refused; a ``log.jsonl`` or
  ``checkpoints`` that is a symbolic link out of the folder is refused by name and its
  target is unchanged; a non-JSON line in the middle of the log is one line naming the
  file and the line;
* a newest checkpoint of another format (or unreadable) is kept and the resume refused,
  naming the file, its format and ``--out NEW``; resuming an older checkpoint in place (a
  branch) is refused and keeps the newer steps, and branching into a new folder works;
* ``auto``'s schedule is in the checkpoint: a killed and resumed ``--estimator auto`` run
  ends bitwise as the uninterrupted one, with the same log;
* ``result.json`` names every checkpoint of the run, also after a resume;
* sizes that cannot fit in memory, a TOML setting given under both spellings and a
  ``--lora-rank`` that cannot apply are one line, before ``--out`` exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from digits_support import (
    LinearClassifierReward,
    finetune_cli,
    one_line,
    run_finetune,
    snapshot,
    tiny_dit,
    without_timings,
)
from gradest_digits.run_state import FORMAT, checkpoints_in, load_checkpoint

RUN = (
    "--estimator sdo --batch-size 2 --sampler-steps 2 --target 1 --lr 0.01 "
    "--checkpoint-every 1 --quiet --no-tensorboard"
).split()


def records(folder: Path) -> list[dict]:
    lines = (folder / "log.jsonl").read_text().splitlines()
    return [without_timings(json.loads(line)) for line in lines]


def final_model(folder: Path) -> dict:
    (_, path), *_ = checkpoints_in(folder / "checkpoints")
    return load_checkpoint(path)["model"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def two_steps(tmp_path, capsys, tiny_digits_assets) -> Path:
    folder = tmp_path / "run"
    code, err = finetune_cli(capsys, *RUN, "--steps", "2", "--out", str(folder))
    assert code == 0, err
    return folder


# -- nothing outside the run is touched ----------------------------------------------------


@pytest.mark.parametrize("content", [b'{"tool": "other", "n": 1}\n{"torn": "xx', b'{"torn": "x'])
def test_a_foreign_log_with_a_torn_last_line_keeps_its_bytes(
    tmp_path, capsys, tiny_digits_assets, content
):
    folder = tmp_path / "other_tool"
    folder.mkdir()
    (folder / "log.jsonl").write_bytes(content)
    (folder / ".notes.txt.abc.tmp").write_bytes(b"the other tool's temporary")
    before = snapshot(folder)
    code, err = finetune_cli(capsys, *RUN, "--steps", "1", "--out", str(folder))
    assert code == 2
    # No run.json: not a gradest run's (not an earlier run to --resume), named file by file.
    line = one_line(err)
    assert "holds files that are not a gradest run's (.notes.txt.abc.tmp, log.jsonl" in line
    assert "no run.json" in line and "pass a new --out" in line and "--resume" not in line
    assert snapshot(folder) == before


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlinked_log_out_of_the_folder_is_refused_and_its_target_kept(
    tmp_path, capsys, two_steps, resume
):
    victim = tmp_path / "victim.jsonl"
    victim.write_bytes(b'{"precious": 1}\n{"precious": 2}\n{"torn')
    folder = two_steps if resume else tmp_path / "new"
    folder.mkdir(exist_ok=True)
    log = folder / "log.jsonl"
    log.unlink(missing_ok=True)
    log.symlink_to(victim)
    before = victim.read_bytes()
    argv = ("--resume", str(folder), "--steps", "3") if resume else (*RUN, "--out", str(folder))
    code, err = finetune_cli(capsys, *argv)
    assert code == 2
    line = one_line(err)
    assert f"{str(log)!r} is a symbolic link" in line, line
    assert victim.read_bytes() == before


def test_a_symlinked_checkpoints_folder_is_refused(tmp_path, capsys, two_steps):
    elsewhere = tmp_path / "elsewhere"
    (two_steps / "checkpoints").rename(elsewhere)
    (two_steps / "checkpoints").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "3")
    assert code == 2 and "checkpoints' is a symbolic link" in one_line(err)
    assert snapshot(elsewhere) == before


def test_a_corrupt_line_in_the_middle_of_the_log_is_one_line(tmp_path, capsys, two_steps):
    log = two_steps / "log.jsonl"
    first, second = log.read_text().splitlines()
    log.write_text(f"{first}\nnot json at all\n{second}\n")
    before = snapshot(two_steps)
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "3")
    assert code == 2
    assert f"{str(log)!r} line 2 is not a JSON record" in one_line(err)
    assert snapshot(two_steps) == before


# -- resume never destroys or mixes ---------------------------------------------------------


@pytest.mark.parametrize("damage", ["foreign_format", "unreadable"])
def test_a_foreign_or_unreadable_newest_checkpoint_is_kept_and_the_resume_refused(
    capsys, two_steps, damage
):
    (_, newest), *_ = checkpoints_in(two_steps / "checkpoints")
    if damage == "foreign_format":
        state = load_checkpoint(newest)
        torch.save({**state, "format": "gradest.finetune/1"}, newest)
        expected = rf"{newest.name}' has format 'gradest.finetune/1', not '{FORMAT}'"
    else:
        newest.write_bytes(b"not a zip file at all")
        expected = rf"{newest.name}' does not load \(format unreadable"
    before = snapshot(two_steps)
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "4")
    assert code == 2
    line = one_line(err)
    assert re.search(expected, line), line
    assert "start over, run again into a new folder with --out NEW" in line
    assert snapshot(two_steps) == before  # the log, every step_*.pt, the settings


def test_branching_from_an_older_checkpoint_never_overwrites_the_newer_steps(tmp_path):
    folder = tmp_path / "run"
    kwargs = {"checkpoint_every": 1, "seed": 3, "estimator": "sdo"}
    _, whole = run_finetune(
        steps=4, log_path=folder / "log.jsonl", checkpoint_dir=folder / "checkpoints", **kwargs
    )
    older = dict((step, path) for step, path in checkpoints_in(folder / "checkpoints"))[2]
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"holds newer checkpoints \(step_000003.pt, step_0000"):
        run_finetune(
            steps=4,
            log_path=folder / "log.jsonl",
            checkpoint_dir=folder / "checkpoints",
            resume=older,
            **kwargs,
        )
    assert snapshot(folder) == before
    # A branch goes into a new folder: it continues from step 2 as the run did.
    branch = tmp_path / "branch"
    model, result = run_finetune(
        steps=4,
        log_path=branch / "log.jsonl",
        checkpoint_dir=branch / "checkpoints",
        resume=older,
        **kwargs,
    )
    assert same(final_model(branch), final_model(folder))
    assert snapshot(folder) == before
    # Its history and result name the run's checkpoints up to the branch point too.
    assert [without_timings(r) for r in result["history"]] == [
        without_timings(r) for r in whole["history"]
    ]
    assert [Path(p).name for p in result["checkpoints"]] == [
        f"step_{s:06d}.pt" for s in (1, 2, 3, 4)
    ]


def test_a_log_of_another_run_is_not_cut_by_a_resume(tmp_path):
    folder = tmp_path / "run"
    paths = {"log_path": folder / "log.jsonl", "checkpoint_dir": folder / "checkpoints"}
    run_finetune(steps=2, checkpoint_every=1, **paths)
    log = folder / "log.jsonl"
    lines = log.read_text().splitlines()
    other = json.loads(lines[0]) | {"reward_mean": 123.0}  # not this run's step 0
    log.write_text(json.dumps(other) + "\n" + lines[1] + "\n")
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"records before step 2 that are not the checkpoint's"):
        run_finetune(steps=3, checkpoint_every=1, resume=folder, **paths)
    assert snapshot(folder) == before


AUTO = "auto:candidates=(sdo,truncated:k=1),recheck_every=3,draws=2"


def test_a_killed_and_resumed_auto_run_ends_bitwise_as_the_uninterrupted_one(
    tmp_path, capsys, tiny_digits_assets
):
    # Each command builds its own estimator: the resumed one starts with no schedule and
    # has only the checkpoint's.
    argv = [*RUN, "--estimator", AUTO]
    code, err = finetune_cli(capsys, *argv, "--steps", "5", "--out", str(tmp_path / "whole"))
    assert code == 0, err
    code, err = finetune_cli(capsys, *argv, "--steps", "2", "--out", str(tmp_path / "cut"))
    assert code == 0, err
    code, err = finetune_cli(capsys, "--resume", str(tmp_path / "cut"), "--steps", "5")
    assert code == 0, err
    whole, cut = records(tmp_path / "whole"), records(tmp_path / "cut")
    # The probes (calls 1 and 4) happened at the same steps, and the run is the same.
    probing = [r["info"]["auto_probing"] for r in whole]
    assert probing[0] and not probing[1] and not probing[2] and probing[3], probing
    assert cut == whole
    assert same(final_model(tmp_path / "cut"), final_model(tmp_path / "whole"))
    # result.json describes the whole run: every checkpoint, not only the resumed ones.
    result = json.loads((tmp_path / "cut" / "result.json").read_text())
    assert [Path(p).name for p in result["checkpoints"]] == [
        f"step_{s:06d}.pt" for s in range(1, 6)
    ]


def test_auto_exports_and_imports_one_models_schedule():
    from gradest_lab.auto import Auto

    import gradest

    auto = gradest.estimator(AUTO)
    assert isinstance(auto, Auto)
    model, other = tiny_dit(), tiny_dit()
    flow = gradest.RectifiedFlow(steps=2)
    objective = gradest.TerminalObjective(lambda z: -LinearClassifierReward()(z).mean())
    noise = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    auto.estimate(model, flow, objective, noise=noise)
    state = auto.state_dict(model)
    assert state["schedules"] and state["schedules"][0]["calls"] == 1
    auto.load_state_dict(other, state)
    copied = auto.state_dict(other)
    grads = [s.pop("exact_grads") for s in (*state["schedules"], *copied["schedules"])]
    assert copied == state
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    # The next call on the other model continues the schedule (no new probe), as on the first.
    a = auto.estimate(model, flow, objective, noise=noise)
    b = auto.estimate(other, flow, objective, noise=noise)
    assert not a.info["auto_probing"] and not b.info["auto_probing"]
    assert a.info["auto_choice"] == b.info["auto_choice"]
    assert auto.state_dict(other)["schedules"][0]["calls"] == 2
    with pytest.raises(ValueError, match="saved schedule"):
        auto.load_state_dict(other, {"format": "something else"})


# -- one-line errors before --out exists ---------------------------------------------------


def test_an_absurd_batch_size_in_a_config_file_is_one_line_before_out_exists(
    tmp_path, capsys, tiny_digits_assets
):
    config = tmp_path / "run.toml"
    config.write_text("batch_size = 9223372036854775807\n")
    out = tmp_path / "out"
    code, err = finetune_cli(capsys, "--config", str(config), "--out", str(out), "--quiet")
    assert code == 2
    line = one_line(err)
    assert "--batch-size 9223372036854775807 is too large" in line and "use at most" in line
    assert not out.exists()
    code, err = finetune_cli(capsys, "--sampler-steps", str(2**62), "--out", str(out), "--quiet")
    assert code == 2 and "--sampler-steps" in one_line(err) and not out.exists()


def test_one_setting_under_both_spellings_in_a_config_file_is_refused(
    tmp_path, capsys, tiny_digits_assets
):
    config = tmp_path / "run.toml"
    config.write_text("batch_size = 2\nbatch-size = 4\n")
    out = tmp_path / "out"
    code, err = finetune_cli(capsys, "--config", str(config), "--out", str(out), "--quiet")
    assert code == 2
    assert "'batch_size' and 'batch-size' are the same setting" in one_line(err)
    assert not out.exists()


def test_lora_rank_that_cannot_apply_is_one_line(tmp_path, capsys, two_steps):
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "3", "--lora-rank", "4")
    assert code == 2 and "--lora-rank 0 (given 4)" in one_line(err)
    huge = str(2**40)
    code, err = finetune_cli(capsys, *RUN, "--lora-rank", huge, "--out", str(tmp_path / "lora"))
    assert code == 2 and "is larger than the DiT's layers" in one_line(err)


# -- no code from data ----------------------------------------------------------------------


def test_a_resume_never_imports_code_named_by_the_run_folder(tmp_path, capsys, two_steps):
    """The digits command has no setting that names code (its reward is the shipped
    classifier's, ``--target`` a digit); the estimator spec is looked up among installed
    estimators only. A settings.json edited to name a file of the folder runs nothing."""
    marker = tmp_path / "ran"
    (two_steps / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef fn(x): x\n")
    path = two_steps / "settings.json"
    data = json.loads(path.read_text())
    data["settings"]["estimator"] = f"{two_steps / 'evil.py'}:fn"
    path.write_text(json.dumps(data))
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "3")
    assert code == 2 and "estimator" in one_line(err)
    assert not marker.exists()
