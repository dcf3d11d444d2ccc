"""Nothing lost: interrupted fine-tuning runs resume bit for bit; used folders are not mixed.

* ``finetune(..., resume=DIR)`` after a crash continues from the newest checkpoint and ends
  with exactly (``torch.equal``) the parameters and log of an uninterrupted run, in both
  modes, with estimators that draw random steps and a stochastic sampler.
* A rerun into a folder holding a run is refused unless it resumes; resuming with other
  settings is refused naming them; a damaged newest checkpoint is skipped with a warning.
* ``gradest finetune`` is killed with SIGKILL at 20 random moments: afterwards every file
  under a final name is whole (every log line parses, every checkpoint loads,
  ``result.json`` parses) and ``gradest finetune --resume DIR`` finishes the run with the
  uninterrupted run's final parameters, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from digits_support import LinearClassifierReward, tiny_dit
from gradest_digits.finetune import finetune
from gradest_digits.run_state import checkpoints_in, load_checkpoint
from gradest_lab.storage.files import JsonLog

STEPS = 5


class Crash(Exception):
    """The interruption a test provokes."""


class CrashingReward(LinearClassifierReward):
    """The reward of ``test_finetune``, raising on its ``crash_at``-th call (1-based)."""

    def __init__(self, crash_at: int | None):
        super().__init__()
        self.crash_at = crash_at

    def forward(self, images):
        if self.crash_at is not None and self.calls + 1 == self.crash_at:
            raise Crash(f"interrupted at reward call {self.crash_at}")
        return super().forward(images)


def run(folder: Path, *, crash_at=None, resume=None, steps=STEPS, **overrides):
    settings = {
        "estimator": "sdo:samples=2",
        "mode": "reward",
        "batch_size": 4,
        "lr": 1e-2,
        "sampler_steps": 4,
        "seed": 3,
        "labels": 1,
        "progress": False,
    }
    settings.update(overrides)
    model = tiny_dit()
    result = finetune(
        model,
        CrashingReward(crash_at),
        steps=steps,
        log_path=folder / "log.jsonl",
        checkpoint_dir=folder / "checkpoints",
        checkpoint_every=1,
        resume=resume,
        **settings,
    )
    return model, result


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in records]


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


MODES = {
    "reward, sdo": {"estimator": "sdo:samples=2"},
    "grpo, random truncation": {
        "mode": "grpo",
        "estimator": "truncated:random=uniform",
        "group_size": 2,
        "inner_epochs": 2,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("crash_at", [4, 7])  # the n-th reward call (1: initial evaluation)
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, mode, crash_at):
    reference, result = run(tmp_path / "whole", **MODES[mode])
    with pytest.raises(Crash):
        run(tmp_path / "cut", crash_at=crash_at, **MODES[mode])
    # Some steps were finished and checkpointed before the crash.
    saved = [step for step, _ in checkpoints_in(tmp_path / "cut" / "checkpoints")]
    assert 1 <= saved[0] <= STEPS  # (grpo at call 7: the final evaluation crashed)
    resumed, resumed_result = run(tmp_path / "cut", resume=tmp_path / "cut", **MODES[mode])
    assert same_parameters(resumed, reference)
    whole_log = JsonLog(tmp_path / "whole" / "log.jsonl").records()
    cut_log = JsonLog(tmp_path / "cut" / "log.jsonl").records()
    assert [r["step"] for r in cut_log] == list(range(STEPS))
    assert without_timings(cut_log) == without_timings(whole_log)
    assert resumed_result["final_reward"] == result["final_reward"]
    assert resumed_result["initial_reward"] == result["initial_reward"]
    assert without_timings(resumed_result["history"]) == without_timings(result["history"])


def test_a_run_can_be_extended_by_resuming_with_more_steps(tmp_path):
    longer, _ = run(tmp_path / "long", steps=STEPS + 2)
    run(tmp_path / "short", steps=STEPS)
    extended, _ = run(tmp_path / "short", steps=STEPS + 2, resume=tmp_path / "short")
    assert same_parameters(extended, longer)


def test_a_used_folder_is_refused_without_resume(tmp_path):
    run(tmp_path, steps=2)
    before = (tmp_path / "log.jsonl").read_bytes()
    with pytest.raises(
        ValueError,
        match=r"an earlier run wrote to log_path / checkpoint_dir \(.*2 log records.*"
        r"2 checkpoint\(s\)\); continue it with resume=",
    ):
        run(tmp_path, steps=2)
    assert (tmp_path / "log.jsonl").read_bytes() == before


def test_resuming_with_other_settings_is_refused_naming_them(tmp_path):
    run(tmp_path, steps=2)
    with pytest.raises(
        ValueError,
        match=r"other settings \(lr: checkpoint 0\.01, now 0\.02; seed: checkpoint 3, now 4\)",
    ):
        run(tmp_path, steps=3, resume=tmp_path, lr=2e-2, seed=4)
    with pytest.raises(ValueError, match=r"checkpoint is at step 2, past steps=1"):
        run(tmp_path, steps=1, resume=tmp_path)


def test_a_damaged_newest_checkpoint_is_kept_and_refused(tmp_path):
    # Resuming from an older checkpoint would overwrite the damaged newest one: the folder
    # is append-only history, so the resume is refused naming the file, which is kept.
    with pytest.raises(Crash):
        run(tmp_path / "cut", crash_at=7)
    (_, newest), *older = checkpoints_in(tmp_path / "cut" / "checkpoints")
    assert older, "the test needs an older checkpoint it could have fallen back to"
    newest.write_bytes(newest.read_bytes()[:1000])  # e.g. copied in half
    before = {path: path.read_bytes() for path in (tmp_path / "cut").rglob("*") if path.is_file()}
    with pytest.raises(ValueError, match=rf"{newest.name}.* does not load .*--out NEW"):
        run(tmp_path / "cut", resume=tmp_path / "cut")
    after = {path: path.read_bytes() for path in (tmp_path / "cut").rglob("*") if path.is_file()}
    assert after == before


def test_resume_without_any_checkpoint_starts_over(tmp_path):
    reference, _ = run(tmp_path / "whole")
    with pytest.raises(Crash):
        run(tmp_path / "cut", crash_at=2)  # dies in step 0: no checkpoint, no log record
    with pytest.warns(RuntimeWarning, match="starting it over from step 0"):
        resumed, _ = run(tmp_path / "cut", resume=tmp_path / "cut")
    assert same_parameters(resumed, reference)
    with pytest.raises(ValueError, match="nothing to resume at .*no such file or folder"):
        run(tmp_path / "other", resume=tmp_path / "missing")


# -- SIGKILL at random moments, through the command line ----------------------------------

ARGV = [
    "finetune",
    "--estimator",
    "sdo",
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--sampler-steps",
    "2",
    "--checkpoint-every",
    "1",
    "--quiet",
]
TRIALS = 20


def cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gradest.cli", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def final_model(folder: Path) -> dict:
    (step, path), *_ = checkpoints_in(folder / "checkpoints")
    return load_checkpoint(path)["model"]


def assert_every_final_file_is_whole(folder: Path) -> None:
    log = folder / "log.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            json.loads(line)  # raises on a torn line
    for _, path in checkpoints_in(folder / "checkpoints"):
        load_checkpoint(path)  # raises on a truncated zip
    if (folder / "result.json").exists():
        json.loads((folder / "result.json").read_text())


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_whole_files_and_a_resumable_run(tmp_path):
    assets = pytest.importorskip("gradest_digits.assets")
    if not assets.asset_path(assets.DIT_CHECKPOINT).is_file():
        pytest.skip("shipped DiT checkpoint missing")
    reference_dir = tmp_path / "reference"
    started = time.monotonic()
    reference = cli(*ARGV, "--out", str(reference_dir))
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()
    duration = time.monotonic() - started
    want = final_model(reference_dir)

    chooser = random.Random(0)
    for trial in range(TRIALS):
        folder = tmp_path / f"trial{trial}"
        process = cli(*ARGV, "--out", str(folder))
        time.sleep(chooser.uniform(0.2, 1.1) * duration)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        assert_every_final_file_is_whole(folder)
        # Killed before it recorded its run (run.json), the folder holds no run to resume
        # (an error): it is started again. Once run.json is there, the folder is the run's
        # (also if it was killed before settings.json): only --resume continues it.
        started_run = (folder / "run.json").is_file()
        resumed = cli(*ARGV, *(("--resume",) if started_run else ("--out",)), str(folder))
        code = resumed.wait(timeout=300)
        assert code == 0, (trial, resumed.stderr.read().decode())
        assert_every_final_file_is_whole(folder)
        got = final_model(folder)
        assert all(torch.equal(got[k], want[k]) for k in want), trial
        records = JsonLog(folder / "log.jsonl").records()
        assert [r["step"] for r in records] == list(range(6)), trial


SLOW_WRITE = """
import os, sys, time
real_fsync = os.fsync

def announce_and_stall(fd):
    # Stall inside the write of checkpoint 2, after its bytes went to the temporary file.
    path = os.readlink(f"/proc/self/fd/{fd}")
    if "step_000002.pt" in path:
        print("WRITING " + path, flush=True)
        time.sleep(60)
    real_fsync(fd)

os.fsync = announce_and_stall
from gradest.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_final_names_whole(tmp_path):
    """Deterministic: the process is killed while checkpoint 2 is being written."""
    assets = pytest.importorskip("gradest_digits.assets")
    if not assets.asset_path(assets.DIT_CHECKPOINT).is_file():
        pytest.skip("shipped DiT checkpoint missing")
    folder = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, *ARGV, "--out", str(folder)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("WRITING "), line + process.stderr.read()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    temporary = Path(line.split()[1])
    assert temporary.name.startswith(".step_000002.pt.") and temporary.exists()
    assert not (folder / "checkpoints" / "step_000002.pt").exists()
    assert_every_final_file_is_whole(folder)
    resumed = cli(*ARGV, "--resume", str(folder))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    assert not temporary.exists()  # the stale temporary was cleared
    assert [r["step"] for r in JsonLog(folder / "log.jsonl").records()] == list(range(6))


def test_a_checkpoint_from_before_prior_weight_resumes_with_the_default():
    from gradest_digits.run_state import check_same_run

    current = {"mode": "reward", "steps": 4, "prior_weight": 0.0}
    check_same_run({"mode": "reward", "steps": 2}, current)  # the setting did not exist
    with pytest.raises(ValueError, match="prior_weight: checkpoint 0.0, now 1.0"):
        check_same_run({"mode": "reward", "steps": 2}, {**current, "prior_weight": 1.0})
