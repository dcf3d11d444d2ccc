"""Plumbing shared by the recipe tests (tests/test_recipe*.py).

* accelerate keeps one global state per process (its settings cannot change once set):
  tests that build an ``Accelerator`` in-process import :func:`fresh_accelerate_state`,
  which resets it before and after each test.
* :func:`launch` runs a launcher command line (torchrun, ``accelerate launch``) the way CI
  does; :data:`ACCELERATE_TWO_CPU_PROCESSES` are the ``accelerate launch`` flags
  docs/recipes.md gives for 2 CPU processes.
* :data:`RECIPE_WARNINGS`: diffusers' warnings about tiny models, silenced (``pytestmark``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

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


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts without accelerate state (runs with other mixed precision reset
    it in between). Import it into a test module to apply it there."""
    reset_accelerate()
    yield
    reset_accelerate()


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
