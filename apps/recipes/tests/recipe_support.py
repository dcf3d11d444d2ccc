"""Plumbing shared by the recipe tests (apps/recipes/tests/test_recipe*.py); the autouse
fixture that resets accelerate's global state is in conftest.py.

* :func:`script` loads an example recipe (``examples/recipes/*_reward.py``) as a module;
  :func:`records`, :func:`comparable`, :func:`lora_file` and :func:`assert_run_outputs`
  read back what a run wrote.
* :func:`launch` runs a launcher command line (torchrun, ``accelerate launch``) the way CI
  does; :data:`ACCELERATE_TWO_CPU_PROCESSES` are the ``accelerate launch`` flags
  docs/recipes.md gives for 2 CPU processes.
* :data:`RECIPE_WARNINGS`: diffusers' warnings about tiny models, silenced (``pytestmark``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# ``--multi_gpu`` selects accelerate's torch.distributed launcher (``--cpu`` starts one
# process, for mpirun); with no CUDA device the recipe asks accelerate for CPUs, so the
# processes join a gloo group. Every setting is a flag: no config file is needed.
ACCELERATE_TWO_CPU_PROCESSES = [
    "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
]  # fmt: skip
RECIPE_WARNINGS = [
    pytest.mark.filterwarnings("ignore:There are modules in .* that should be kept in float32"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def launch(command: list[str], tmp_path: Path) -> None:
    """Run a launcher command line as CI does: none of the calling shell's launcher or
    accelerate variables, no hub, one thread per process, CPUs only (also on a machine
    with GPUs), and an empty HF_HOME, so no saved ``accelerate config`` file is read."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_ENV and not k.startswith("ACCELERATE_")
    }
    env.update(
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        HF_HOME=str(tmp_path / "hf_home"),
    )
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


# The repository root (apps/recipes/tests/ -> the root) and the example recipe scripts.
ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "examples" / "recipes"
FAMILIES = ["sd3", "flux", "sd_unet"]
SCRIPT_OF = {"sd3": "sd3_reward", "flux": "flux_reward", "sd_unet": "sd_unet_reward"}


def script(family: str):
    """The example script as a module (``main(argv)`` called in-process)."""
    name = SCRIPT_OF[family]
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(out: Path) -> list[dict]:
    """The records of a run's log.jsonl."""
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    """Log records without their timings (equal across equal runs)."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def lora_file(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors an accelerate checkpoint folder holds."""
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "lora_0.safetensors"))


def assert_run_outputs(out: Path, steps: int) -> None:
    """Everything a finished ``steps``-step recipe run writes under ``out``."""
    from PIL import Image

    rows = records(out)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(row["reward"])) for row in rows)
    assert all(row["grad_norm"] > 0 for row in rows)
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    grid = out / "samples" / f"step_{steps:06d}.png"
    with Image.open(grid) as image:
        assert image.format == "PNG" and image.size[0] > 16
    checkpoint = out / "checkpoints" / f"step_{steps:06d}"
    state = json.loads((checkpoint / "recipe_state.json").read_text())
    assert state["step"] == steps
    assert (checkpoint / "optimizer.bin").is_file()
    assert (checkpoint / "random_states_0.pkl").is_file()
    assert lora_file(checkpoint)  # LoRA tensors only: no full model weights
    assert not list(checkpoint.glob("model*.safetensors"))
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "config.toml").is_file()
