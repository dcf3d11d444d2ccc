"""``gradest finetune`` logs to TensorBoard beside ``log.jsonl`` (``OUT/tensorboard``).

Tiny runs (the micro DiT and a linear reward injected as the shipped assets, 4 sampler
steps, batch 4) through the command line, read back with TensorBoard's own
``EventAccumulator``: every number of every log record is a scalar at its step with the
log's value; ``--no-tensorboard`` writes no folder; a resumed run's redone steps are
purged, not doubled; toggling TensorBoard does not block a resume; and without
tensorboard installed ``--tensorboard`` is a one-line error, the default quietly off.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from digits_support import LinearClassifierReward, tiny_dit
from gradest_digits import finetune_tensorboard
from gradest_digits.finetune import finetune
from gradest_digits.finetune_tensorboard import TensorBoardLog, scalars
from gradest_lab.errors import Diverged

from gradest.cli import main
from gradest.errors import MissingDependency

TINY = "--steps 3 --batch-size 4 --sampler-steps 4 --target 2 --quiet".split()


def finetune_cli(capsys, *argv: str) -> None:
    code = main(["finetune", *TINY, *argv])
    assert code == 0, capsys.readouterr().err


def log_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def board(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard shows the folder (purges applied)."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The log's numbers per tag, as TensorBoard stores them (float32)."""
    tags: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for tag, value in scalars(record):
            tags.setdefault(tag, []).append((record["step"], float(np.float32(value))))
    return tags


def next_second() -> None:
    """Event files are named by the second they were opened, and TensorBoard reads a
    folder's files in name order: a resumed run in the same process must open its file
    in a later second to be read after the earlier one (separate processes always are)."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)


@pytest.mark.usefixtures("tiny_digits_assets")
def test_every_logged_number_is_a_scalar_at_its_step(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "ft"
    # GRPO with jagg: lists (losses, grad_norms), nested cost and estimator info.
    finetune_cli(
        capsys, "--mode", "grpo", "--estimator", "jagg:window=2", "--group-size", "2",
        "--out", str(out),
    )  # fmt: skip
    records = log_records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    shown = board(out / "tensorboard")
    assert shown == expected(records)
    # Every number is there, flattened; the lists and the step itself are not.
    assert {"train/reward_mean", "train/loss", "train/grad_norm", "train/sample_seconds"} <= set(
        shown
    )
    assert {"train/cost/model_units", "train/info/fallback_fraction"} <= set(shown)
    assert not {"train/step", "train/losses", "train/grad_norms"} & set(shown)
    assert all(steps == [0, 1, 2] for steps in ([s for s, _ in v] for v in shown.values()))


def test_scalars_flattens_numbers_and_skips_the_rest():
    record = {
        "step": 4,
        "loss": None,
        "reward_mean": -1.5,
        "grad_norms": [1.0, 2.0],
        "cost": {"param_vjps": 3, "model_units": 2.5},
        "info": {"step": 7, "auto_choice": "sdo", "fallback": True, "nested": {"x": 1}},
    }
    assert dict(scalars(record)) == {
        "train/reward_mean": -1.5,
        "train/cost/param_vjps": 3.0,
        "train/cost/model_units": 2.5,
        "train/info/step": 7.0,  # an estimator's own "step" is a number like any other
        "train/info/nested/x": 1.0,
    }


@pytest.mark.usefixtures("tiny_digits_assets")
def test_no_tensorboard_writes_no_folder(tmp_path, capsys):
    out = tmp_path / "ft"
    finetune_cli(capsys, "--no-tensorboard", "--out", str(out))
    assert len(log_records(out)) == 3
    assert not (out / "tensorboard").exists()
    # The same from a config file; the command line still wins over it.
    config = tmp_path / "run.toml"
    config.write_text("tensorboard = false\n")
    finetune_cli(capsys, "--config", str(config), "--out", str(tmp_path / "off"))
    assert not (tmp_path / "off" / "tensorboard").exists()
    if finetune_tensorboard.tensorboard_available():
        finetune_cli(
            capsys, "--config", str(config), "--tensorboard", "--out", str(tmp_path / "on")
        )
        assert (tmp_path / "on" / "tensorboard").is_dir()


def test_a_config_file_tensorboard_must_be_a_boolean(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('tensorboard = "no"\n')
    code = main(["finetune", "--config", str(config), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "tensorboard = 'no' in " in err and "expected true or false" in err


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_resumed_run_purges_its_redone_steps(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "ft"
    finetune_cli(capsys, "--checkpoint-every", "2", "--out", str(out))
    # Killed after logging step 2 but before its checkpoint: resume redoes step 2.
    (out / "checkpoints" / "step_000003.pt").unlink()
    first = log_records(out)
    next_second()
    finetune_cli(capsys, "--checkpoint-every", "2", "--resume", str(out), "--steps", "4")
    records = log_records(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[:2] == first[:2]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    shown = board(out / "tensorboard")
    # Each step once, with the value the log holds now (the redone step 2's timings
    # differ from the first attempt's: those are hidden).
    assert shown == expected(records)
    assert records[2]["sample_seconds"] != first[2]["sample_seconds"]


@pytest.mark.usefixtures("tiny_digits_assets")
def test_tensorboard_on_or_off_does_not_block_a_resume(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "ft"
    finetune_cli(capsys, "--no-tensorboard", "--steps", "2", "--out", str(out))
    finetune_cli(capsys, "--tensorboard", "--resume", str(out))
    records = log_records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    # Only the steps this part ran are in TensorBoard.
    assert board(out / "tensorboard") == expected(records[2:])


@pytest.fixture
def without_tensorboard(monkeypatch):
    """``from torch.utils.tensorboard import SummaryWriter`` fails as if not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_tensorboard_flag_without_tensorboard_is_a_one_line_error(
    tmp_path, capsys, without_tensorboard
):
    out = tmp_path / "ft"
    code = main(["finetune", *TINY, "--tensorboard", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "gradest finetune: error: --tensorboard needs tensorboard" in err
    assert "pip install tensorboard" in err and "apps/digits[tensorboard]" in err
    assert not out.exists()  # refused before any work


@pytest.mark.usefixtures("tiny_digits_assets")
def test_by_default_a_missing_tensorboard_is_simply_off(tmp_path, capsys, without_tensorboard):
    out = tmp_path / "ft"
    finetune_cli(capsys, "--out", str(out))
    assert len(log_records(out)) == 3 and not (out / "tensorboard").exists()


def test_python_tensorboard_dir_without_tensorboard_is_refused(tmp_path, without_tensorboard):
    with pytest.raises(MissingDependency, match="tensorboard_dir needs tensorboard.*pip install"):
        finetune(
            tiny_dit(), LinearClassifierReward(), steps=1, batch_size=4, sampler_steps=4,
            progress=False, tensorboard_dir=tmp_path / "tb",
        )  # fmt: skip
    assert not (tmp_path / "tb").exists()


def test_the_writer_is_closed_when_the_run_fails(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    closed = []
    close = TensorBoardLog.close
    monkeypatch.setattr(TensorBoardLog, "close", lambda self: (closed.append(1), close(self)))
    log = tmp_path / "log.jsonl"
    linear = LinearClassifierReward()

    def reward(images):
        # NaN once step 0 is logged: step 1 diverges.
        values = linear(images)
        return values * float("nan") if log.exists() and log.read_text() else values

    with pytest.raises(Diverged):
        finetune(
            tiny_dit(), reward, steps=3, batch_size=4, sampler_steps=4, labels=1,
            progress=False, log_path=log, tensorboard_dir=tmp_path / "tb",
        )  # fmt: skip
    assert closed == [1]
    assert board(tmp_path / "tb") == expected(log_records(tmp_path))
