"""``gradest finetune --resume DIR`` alone continues the run with the run's own settings.

* Every setting comes from the run (``DIR/settings.json``): a bare resume with only
  ``--steps`` ends bitwise as an uninterrupted run, honouring non-default settings
  (``--batch-size 3``, the estimator, the target) that it was never told again.
* Only flags given explicitly (command line or ``--config`` file) are compared: a
  differing one is refused in one line naming it with both values, an equal one is
  accepted; ``--steps``, ``--checkpoint-every`` and ``--device`` may change.
* ``--resume`` of a folder that does not exist or holds no run is one line, exit status 2,
  and creates nothing; a folder without ``run.json`` (an older gradest's run) is not a
  gradest run's and is kept as it is; a run stopped before it wrote ``settings.json``
  resumes with the settings of its ``run.json`` and asks for ``--steps``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from digits_support import finetune_cli, parse_finetune_args, snapshot
from gradest_digits.run_state import checkpoints_in, load_checkpoint
from gradest_lab.storage.config_file import explicit_settings

# Non-default settings throughout, so that a bare resume taking the defaults would show.
RUN = (
    "--estimator sdo:samples=2 --batch-size 3 --sampler-steps 4 --target 2 --lr 0.01 "
    "--seed 3 --checkpoint-every 1 --quiet --no-tensorboard"
).split()


def ok(capsys, *argv: str) -> None:
    code, err = finetune_cli(capsys, *argv)
    assert code == 0, err


def final_model(folder: Path) -> dict:
    (_, path), *_ = checkpoints_in(folder / "checkpoints")
    return load_checkpoint(path)["model"]


def records(folder: Path) -> list[dict]:
    lines = (folder / "log.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith("_seconds")} for line in lines
    ]


def settings(folder: Path) -> dict:
    return json.loads((folder / "settings.json").read_text())["settings"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def two_steps(tmp_path, capsys, tiny_digits_assets) -> Path:
    """A 2-step run of the tiny model with non-default settings, checkpointed every step."""
    folder = tmp_path / "run"
    ok(capsys, *RUN, "--steps", "2", "--out", str(folder))
    return folder


def test_explicit_settings_are_the_given_flags_only(tmp_path):
    args = parse_finetune_args(["--lr", "1e-4", "--quiet", "--resume", "x"])
    # --lr equals its default and still counts; --resume is not a setting.
    assert explicit_settings(args) == {"lr", "quiet"}
    assert explicit_settings(parse_finetune_args([])) == frozenset()


def test_a_bare_resume_continues_bitwise_with_the_runs_settings(tmp_path, capsys, two_steps):
    recorded = settings(two_steps)
    assert (recorded["batch_size"], recorded["target"], recorded["estimator"]) == (
        3, 2, "sdo:samples=2"
    )  # fmt: skip
    ok(capsys, "--resume", str(two_steps), "--steps", "4")
    whole = tmp_path / "whole"
    ok(capsys, *RUN, "--steps", "4", "--out", str(whole))
    assert same(final_model(two_steps), final_model(whole))
    assert records(two_steps) == records(whole)
    assert [r["step"] for r in records(two_steps)] == [0, 1, 2, 3]
    assert settings(two_steps) == {**recorded, "steps": 4} == settings(whole)
    # A further bare resume continues to the recorded 4 steps: nothing left to do.
    ok(capsys, "--resume", str(two_steps))
    assert same(final_model(two_steps), final_model(whole))


def test_explicit_differing_flags_are_refused_naming_each(tmp_path, capsys, two_steps):
    before = {p.name: p.read_bytes() for p in two_steps.iterdir() if p.is_file()}
    code, err = finetune_cli(
        capsys,
        *("--resume", str(two_steps), "--steps", "4", "--lr", "0.02", "--target", "1"),
        *("--estimator", "exact", "--labels", "target"),
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the run was started with other settings" in err
    for named in (
        "--estimator 'sdo:samples=2' (given 'exact')",
        "--lr 0.01 (given 0.02)",
        "--target 2 (given 1)",
        "--labels 'null' (given 'target')",
    ):
        assert named in err, err
    assert "--steps" not in err.split("settings:")[1].split("; drop")[0]
    after = {p.name: p.read_bytes() for p in two_steps.iterdir() if p.is_file()}
    assert after == before
    # A --config file's settings are given ones too.
    config = tmp_path / "run.toml"
    config.write_text("batch_size = 4\n")
    code, err = finetune_cli(capsys, "--config", str(config), "--resume", str(two_steps))
    assert code == 2 and "--batch-size 3 (given 4)" in err, err


def test_explicit_equal_flags_are_accepted(tmp_path, capsys, two_steps):
    config = tmp_path / "run.toml"
    config.write_text('target = 2\nestimator = "sdo:samples=2,scale=unbiased"\n')
    ok(
        capsys,
        *RUN,  # every original flag again (the only way before)
        *("--config", str(config), "--steps", "3", "--checkpoint-every", "2"),
        *("--resume", str(two_steps)),
    )
    assert [r["step"] for r in records(two_steps)] == [0, 1, 2]
    assert settings(two_steps)["checkpoint_every"] == 2  # it may change


@pytest.mark.usefixtures("tiny_digits_assets")
@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_resume_of_a_folder_without_a_run_is_one_line_and_creates_nothing(tmp_path, capsys, kind):
    folder = tmp_path / "typo_dir"
    if kind == "empty":
        folder.mkdir()
    elif kind == "file":
        folder.write_text("x")
    listing = sorted(tmp_path.rglob("*"))
    code, err = finetune_cli(capsys, "--resume", str(folder), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"gradest finetune: error: --resume {str(folder)!r}: ")
    expected = {
        "missing": "the folder does not exist",
        "empty": "holds no run",
        "file": "is a file",
    }
    assert expected[kind] in err
    assert sorted(tmp_path.rglob("*")) == listing


def test_a_run_killed_before_its_first_checkpoint_restarts_with_its_settings(
    tmp_path, capsys, two_steps
):
    want = final_model(two_steps)
    for _, path in checkpoints_in(two_steps / "checkpoints"):
        path.unlink()
    with pytest.warns(RuntimeWarning, match="starting it over from step 0"):
        ok(capsys, "--resume", str(two_steps))
    assert same(final_model(two_steps), want)


@pytest.mark.parametrize("kept", [(), ("settings.json",)])
def test_an_older_folder_without_run_json_is_not_a_gradest_runs(tmp_path, capsys, two_steps, kept):
    # Written by a gradest before run.json existed (with or without settings.json): it is
    # not a gradest run's folder now, for --resume as for --out, and keeps every byte.
    (two_steps / "run.json").unlink()
    for name in {"settings.json"} - set(kept):
        (two_steps / name).unlink()
    before = snapshot(two_steps)
    code, err = finetune_cli(capsys, "--resume", str(two_steps), "--steps", "3")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds files that are not a gradest run's (checkpoints, log.jsonl" in err, err
    assert "no run.json" in err and "--out NEW" in err, err
    code, err = finetune_cli(capsys, *RUN, "--steps", "3", "--out", str(two_steps))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds files that are not a gradest run's" in err and "new --out" in err, err
    assert snapshot(two_steps) == before


def test_a_run_stopped_before_its_settings_resumes_with_its_run_record(tmp_path, capsys, two_steps):
    # Stopped between run.json and settings.json (or settings.json lost): run.json records
    # every setting a resume may not change; how far the run goes is asked for.
    recorded = settings(two_steps)
    (two_steps / "settings.json").unlink()
    code, err = finetune_cli(capsys, "--resume", str(two_steps))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the run does not record --steps" in err
    assert "--batch-size" not in err and "--lr" not in err  # run.json records those
    assert "--estimator" not in err and "--target" not in err
    # Given explicitly, the estimator is still compared with the run's (its run.json).
    code, err = finetune_cli(
        capsys, "--resume", str(two_steps), "--steps", "3", "--estimator", "exact", "--target", "2"
    )
    assert code == 2 and "--estimator 'sdo:samples=2' (given 'exact')" in err, err
    assert not (two_steps / "settings.json").exists()  # written only once a resume ran
    ok(capsys, "--resume", str(two_steps), "--steps", "3", "--target", "2")
    assert [r["step"] for r in records(two_steps)] == [0, 1, 2]
    assert settings(two_steps)["batch_size"] == 3  # taken from run.json
    now = settings(two_steps)
    assert now["checkpoint_every"] == 0  # not recorded in run.json: its default
    assert {**now, "checkpoint_every": 1} == {**recorded, "steps": 3}


def test_the_run_record_proves_every_setting_but_those_that_may_change(tmp_path):
    from gradest_digits.finetune_cli import (
        MAY_CHANGE,
        RUN_SETTINGS,
        recorded_settings,
        run_record,
        run_settings,
    )

    args = parse_finetune_args(["--estimator", "exact", "--labels", "target", "--target", "5"])
    (tmp_path / "run.json").write_text(run_record(run_settings(args)).to_json())
    proven = recorded_settings(tmp_path)
    assert (proven["estimator"], proven["labels"], proven["target"]) == ("exact", "target", 5)
    assert proven["lora_rank"] == 0 and proven["prior_weight"] == 0.0
    assert set(proven) == set(RUN_SETTINGS) - MAY_CHANGE  # --steps is asked for
    # Another command's record is not a finetune run's.
    (tmp_path / "run.json").write_text(
        run_record(run_settings(args)).to_json().replace("gradest finetune", "gradest race")
    )
    with pytest.raises(ValueError, match="is not the record of a 'gradest finetune' run"):
        recorded_settings(tmp_path)
