"""A recipe killed after its last checkpoint but before its final LoRA export finishes the
export when resumed at its last step, without training longer."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

import torch  # noqa: E402
from recipe_support import lora_export, records, script  # noqa: E402


def test_a_run_stopped_before_its_export_finishes_it_on_resume(tmp_path):
    main = script("sd3").main
    out = tmp_path / "run"
    assert main(["--tiny", "--output_dir", str(out), "--max_train_steps", "2"]) == 0
    exported = lora_export(out / "lora")
    steps_logged = len(records(out))
    # What a kill between the last checkpoint and the export leaves behind.
    shutil.rmtree(out / "lora")
    (out / "done.json").unlink()
    assert main(["--resume_from_checkpoint", "latest", "--output_dir", str(out)]) == 0
    again = lora_export(out / "lora")
    assert set(again) == set(exported)
    assert all(torch.equal(again[key], exported[key]) for key in exported)
    assert (out / "done.json").exists()
    assert len(records(out)) == steps_logged  # no step was trained again


def test_a_finished_run_is_not_resumed_past_its_steps(tmp_path):
    main = script("sd3").main
    out = tmp_path / "run"
    assert main(["--tiny", "--output_dir", str(out), "--max_train_steps", "2"]) == 0
    with pytest.raises(Exception, match="already at step 2"):
        main(["--resume_from_checkpoint", "latest", "--output_dir", str(out)])


def test_auto_resumes_its_schedule(tmp_path):
    """``auto``'s picks and probes are in the checkpoint: a run stopped and resumed makes
    the same probes at the same steps as an uninterrupted one."""
    from recipe_support import comparable

    main = script("sd3").main
    flags = ["--tiny", "--estimator", "auto:recheck_every=2", "--checkpointing_steps", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*flags, "--output_dir", str(straight), "--max_train_steps", "4"]) == 0
    assert main([*flags, "--output_dir", str(split), "--max_train_steps", "3"]) == 0
    assert main(["--resume_from_checkpoint", "latest", "--output_dir", str(split),
                 "--max_train_steps", "4"]) == 0  # fmt: skip
    assert comparable(records(split)) == comparable(records(straight))
    a, b = lora_export(split / "lora"), lora_export(straight / "lora")
    assert all(torch.equal(a[key], b[key]) for key in b)
