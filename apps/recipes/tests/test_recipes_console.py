"""What a recipe says on the console: Ctrl-C ends with one line naming the resume command
(exit status 130) and the run continues from its last complete checkpoint; ``--estimator
auto`` says what its probe will cost before the probe runs.

Both run the script as a subprocess, as a user does: the console (stderr) is what is
checked, and a SIGINT is delivered to a real process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from recipe_support import LAUNCHER_ENV, RECIPE_WARNINGS, SCRIPTS, records, script  # noqa: E402

from gradest.testing.processes import start_with_sigint_at_default  # noqa: E402

pytestmark = [
    *RECIPE_WARNINGS,
    pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process: POSIX"),
]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_ctrl_c_ends_with_the_resume_command_and_the_run_continues(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, str(SCRIPTS / "sd3_reward.py"), "--tiny", "--output_dir", str(out),
        "--max_train_steps", "100000", "--checkpointing_steps", "1",
    ]  # fmt: skip
    # Files, not pipes: nothing reads a pipe while the run waits for its checkpoint, and a
    # child that fills one (a progress bar) blocks before it gets there.
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_file.open("w") as stdout_sink, err_file.open("w") as stderr_sink:
        process = start_with_sigint_at_default(
            command, env=_environment(), stdout=stdout_sink, stderr=stderr_sink, text=True
        )
        # Any complete checkpoint, not step 1's: the run keeps its 2 newest, so step 1's is
        # deleted two steps (~0.2 s on the tiny model) after it is written, and a poll on a
        # busy machine can miss it and then wait for a file that will never come back.
        complete = out / "checkpoints"
        deadline = time.monotonic() + 300
        while not any(complete.glob("step_*/recipe_state.json")):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                pytest.fail(f"no first checkpoint: {err_file.read_text()[-3000:]}")
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    stdout, stderr = out_file.read_text(), err_file.read_text()
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    checkpoints = (out / "checkpoints").glob("step_*")
    newest = max(folder for folder in checkpoints if (folder / "recipe_state.json").is_file())
    step = json.loads((newest / "recipe_state.json").read_text())["step"]
    assert last == (
        f"sd3_reward.py: interrupted; the last complete checkpoint is step {step} ({newest}); "
        f"continue with: python {SCRIPTS / 'sd3_reward.py'} --resume_from_checkpoint latest "
        f"--output_dir {out}"
    )
    assert "steps done" not in stdout  # it did not pass for a finished run
    # The resume command continues the run: one more step after the checkpoint.
    main = script("sd3").main
    argv = ["--resume_from_checkpoint", "latest", "--output_dir", str(out)]
    assert main([*argv, "--max_train_steps", str(step + 1)]) == 0
    assert [row["step"] for row in records(out)] == list(range(1, step + 2))
    assert (out / "checkpoints" / f"step_{step + 1:06d}" / "recipe_state.json").is_file()
    assert json.loads((out / "done.json").read_text())["step"] == step + 1


def test_auto_says_what_its_probe_costs_before_it_runs(tmp_path):
    out = tmp_path / "auto"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "sd3_reward.py"), "--tiny", "--output_dir", str(out),
         "--max_train_steps", "1", "--estimator", "auto:candidates=(exact,sdo),draws=2"],
        env=_environment(), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("auto: ")]
    expected, plan, spent = lines
    # tiny: 3 inference steps, 3N = 9 model units per exact call; from the noise and on
    # the path: 2 x (1 reference + 1 candidate x 2 draws) = 6 exact calls.
    assert expected.startswith("auto: probe 1 of 1 on this call, before it trains: about 6 ")
    assert "54 model units at 3N = 9 per exact call" in expected
    assert plan.startswith("auto: probing 1 candidate(s) x 2 draws")
    assert spent.startswith("auto: the probe spent") and "picked" in spent
    assert records(out)[0]["step"] == 1
