"""The sd3 recipe under FSDP2 (``--fsdp``: torch's ``fully_shard``) with 2 CPU processes.

accelerate (1.15) sets up FSDP only on GPUs and other accelerators: on CPUs its state is
``MULTI_CPU`` and ``--use_fsdp`` is ignored (accelerate/state.py switches to
``DistributedType.FSDP`` only inside ``elif self.distributed_type in [MULTI_GPU, ...]``).
So the recipe shards the denoiser itself when ``fsdp = true`` and leaves the optimizer,
accumulation, clipping and checkpoints to accelerate. Checked here: a 2-process
``accelerate launch --multi_gpu ... --fsdp`` run trains, writes whole (gathered) LoRA
tensors, resumes, and equals the same run under DDP: the same batches on the same
processes give the same averaged gradient, so the LoRA weights agree to float32
round-off; and settings that cannot work fail with one line naming the setting.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from gradest_recipes import RecipeConfigError  # noqa: E402
from recipe_support import (  # noqa: E402
    ACCELERATE_TWO_CPU_PROCESSES,
    RECIPE_WARNINGS,
    launch,
    records,
)

pytestmark = RECIPE_WARNINGS

ROOT = Path(__file__).resolve().parents[3]  # the repository root (apps/recipes/tests/..)
SD3 = ROOT / "examples" / "recipes" / "sd3_reward.py"
GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)
# A learning rate that moves the adapters, clipping that acts (step 1's gradient norm is
# about 1e-5, later ones 1e-3), two micro-steps per step.
SETTINGS = ["--tiny", "--lr", "1e-2", "--max-grad-norm", "1e-4", "--gradient-accumulation", "2"]


def sd3_main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("recipe_sd3_reward_fsdp", SD3)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def launch_sd3(args: list[str], tmp_path: Path) -> None:
    """The sd3 recipe under ``accelerate launch`` with 2 CPU processes (docs/recipes.md)."""
    command = [sys.executable, "-m", "accelerate.commands.launch",
               *ACCELERATE_TWO_CPU_PROCESSES, str(SD3), *args]  # fmt: skip
    launch(command, tmp_path)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_close_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)


EXPORT = Path("lora") / "pytorch_lora_weights.safetensors"


@pytest.mark.slow
@GLOO
def test_fsdp_with_two_processes_equals_ddp_saves_whole_lora_and_resumes(tmp_path):
    fsdp, ddp, one = tmp_path / "fsdp", tmp_path / "ddp", tmp_path / "one"
    launch_sd3([*SETTINGS, "--fsdp", "--out", str(fsdp), "--steps", "2"], tmp_path)
    launch_sd3(["--resume", str(fsdp), "--steps", "3"], tmp_path)  # FSDP again (saved setting)
    launch_sd3([*SETTINGS, "--out", str(ddp), "--steps", "3", "--save-every", "2"], tmp_path)

    done = json.loads((fsdp / "done.json").read_text())
    assert (done["parallel"], done["processes"]) == ("fsdp2", 2)  # really sharded
    assert json.loads((ddp / "done.json").read_text())["parallel"] == "ddp"
    assert "fsdp = true" in (fsdp / "config.toml").read_text()

    rows = records(fsdp)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward"]) and r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["grad_norm"] > 1e-4  # the clipping acted
    for got, want in zip(rows, records(ddp), strict=True):
        for key in ("reward", "loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)

    # The real check: after 2 steps (checkpoint) and after 3 (resumed, export) the LoRA
    # weights under FSDP equal DDP's; the AdamW state in the checkpoint too.
    step2 = Path("checkpoints") / "step_000002"
    assert_close_tensors(tensors(fsdp / step2 / "lora_0.safetensors"),
                         tensors(ddp / step2 / "lora_0.safetensors"))  # fmt: skip
    assert_close_tensors(tensors(fsdp / EXPORT), tensors(ddp / EXPORT))
    optimizer = [torch.load(out / step2 / "optimizer.bin", weights_only=True)
                 for out in (fsdp, ddp)]  # fmt: skip
    for index, state in optimizer[1]["state"].items():
        assert_close_tensors(optimizer[0]["state"][index], state)

    # Whole tensors, not shards: the shapes of a 1-process run's export.
    assert sd3_main([*SETTINGS, "--out", str(one), "--steps", "1"]) == 0
    shapes = {k: v.shape for k, v in tensors(one / EXPORT).items()}
    assert {k: v.shape for k, v in tensors(fsdp / EXPORT).items()} == shapes
    lora_b = [v for k, v in tensors(fsdp / EXPORT).items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)  # trained


def test_fsdp_in_one_process_is_refused(tmp_path):
    with pytest.raises(RecipeConfigError, match=r"setting fsdp=True is invalid in 1 process"):
        sd3_main(["--tiny", "--fsdp", "--out", str(tmp_path / "out")])


def test_accelerate_fsdp_that_accelerate_does_not_set_up_is_refused(tmp_path, monkeypatch):
    """``accelerate launch --use_fsdp`` on CPUs sets ACCELERATE_USE_FSDP, but accelerate
    runs without FSDP there: the recipe says so instead of silently not sharding."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeConfigError, match=r"asked for FSDP .* pass --fsdp to the recipe"):
        sd3_main(["--tiny", "--out", str(tmp_path / "out")])
