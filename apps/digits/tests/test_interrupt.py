"""Ctrl-C in ``gradest finetune``: one line naming the last complete checkpoint and the
resume command (``gradest finetune --resume OUT``), exit status 130; the resume continues
the run. A SIGINT delivered to the command running as a subprocess, as a terminal sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from gradest_lab.storage.files import JsonLog

from gradest.testing.processes import start_with_sigint_at_default

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child: POSIX")

ARGV = [
    "finetune", "--estimator", "sdo", "--steps", "100000", "--batch-size", "4",
    "--sampler-steps", "2", "--checkpoint-every", "1", "--quiet",
]  # fmt: skip


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path):
    assets = pytest.importorskip("gradest_digits.assets")
    if not assets.asset_path(assets.DIT_CHECKPOINT).is_file():
        pytest.skip("shipped DiT checkpoint missing")
    from gradest_digits.run_state import checkpoints_in

    from gradest.cli import main

    out = tmp_path / "run"
    # Files, not pipes: nothing reads a pipe while the test waits for the first checkpoint,
    # and a child that fills one blocks before it gets there.
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_file.open("w") as stdout_sink, err_file.open("w") as stderr_sink:
        process = start_with_sigint_at_default(
            [sys.executable, "-m", "gradest.cli", *ARGV, "--out", str(out)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=stdout_sink,
            stderr=stderr_sink, text=True,
        )  # fmt: skip
        first = out / "checkpoints" / "step_000001.pt"
        deadline = time.monotonic() + 180
        while not first.is_file():
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
            process.wait()
            pytest.fail(
                f"still running 120 s after SIGINT; its stderr: {err_file.read_text()[-3000:]}"
            )
    stderr = err_file.read_text()
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "nothing was written" not in stderr, stderr[-3000:]
    (step, path), *_ = checkpoints_in(out / "checkpoints")
    assert stderr.strip().splitlines()[-1] == (
        f"gradest finetune: interrupted; the last complete checkpoint is step {step} ({path}); "
        f"continue with: gradest finetune --resume {out}"
    )
    # The command it names continues the run (one step further than the checkpoint).
    assert main(["finetune", "--resume", str(out), "--steps", str(step + 1), "--quiet"]) == 0
    assert [r["step"] for r in JsonLog(out / "log.jsonl").records()] == list(range(step + 1))
    assert checkpoints_in(out / "checkpoints")[0][0] == step + 1
