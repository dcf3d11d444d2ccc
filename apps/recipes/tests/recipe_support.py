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

import ast
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

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
FAMILIES = ["sd3", "flux", "sd_unet", "sdxl"]
SCRIPT_OF = {"sd3": "sd3_reward", "flux": "flux_reward", "sd_unet": "sd_unet_reward",
             "sdxl": "sdxl_reward"}  # fmt: skip
#: The families whose denoiser is a UNet (LoRA prefix and subfolder ``unet``).
UNET_FAMILIES = ("sd_unet", "sdxl")


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


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of scalar ``tag`` in the TensorBoard event files of ``folder``,
    read with tensorboard's ``EventAccumulator`` (purged steps left out, as TensorBoard
    shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def wandb_offline_history(out: Path) -> tuple[list[dict], dict]:
    """The history rows and the summary of the offline wandb run under ``out/wandb``.

    wandb 0.2x+ has no Python reader of its run file any more (its service is in Go): the
    ``run-<id>.wandb`` file is a LevelDB-style log (a 7-byte header ``:W&B``, magic
    0xBEE1, version 0; then 32 KiB blocks of records, each a 7-byte header (crc32, length
    uint16 LE, type: 1 full, 2 first, 3 middle, 4 last) and its bytes) of ``Record``
    protobufs (``wandb.proto.wandb_internal_pb2``), read here directly."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    block, position, pending, payloads = 32768, 7, b"", []
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # the block's tail is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:  # zero padding
            position += room
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    history, summary = [], {}
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }  # fmt: skip
            )
        elif which == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, summary


def lora_export(folder: Path) -> dict[str, torch.Tensor]:
    """The diffusers-format LoRA file of a checkpoint (or ``lora/``) folder."""
    from safetensors.torch import load_file

    return load_file(str(folder / "pytorch_lora_weights.safetensors"))


def rl_script(family: str, objective: str):
    """``examples/recipes/{family}_{objective}.py`` (the RL recipes) as a module."""
    name = f"{family}_{objective}"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# docs/recipes.md's call that loads a recipe's LoRA export with diffusers.
DOCUMENTED_LORA_LOAD = re.compile(r"`(load_lora_adapter\(folder,[^`]*\))`")


def documented_lora_load(family: str = "sd3") -> dict[str, Any]:
    """The keyword arguments of the ``load_lora_adapter(folder, ...)`` call that
    docs/recipes.md gives for a recipe's LoRA files, read from the page, so that the tests
    run the documented call and not one of their own (a call that differs from what
    diffusers needs fails there, as it would for a reader). The page writes SD3's
    ``prefix="transformer"``; for the UNet families (sd_unet, sdxl) the prefix is
    ``"unet"``, as the page says."""
    text = (ROOT / "docs" / "recipes.md").read_text("utf-8")
    found = DOCUMENTED_LORA_LOAD.search(text)
    assert found is not None, "docs/recipes.md no longer shows load_lora_adapter(folder, ...)"
    call = ast.parse(" ".join(found.group(1).split()), mode="eval").body
    assert isinstance(call, ast.Call) and [ast.unparse(a) for a in call.args] == ["folder"]
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    assert keywords.get("prefix") == "transformer", keywords
    if family in UNET_FAMILIES:
        keywords["prefix"] = "unet"
    return keywords


def lora_scale(run: Path) -> float:
    """``alpha / rank`` of the run in ``run`` (its ``config.toml``; alpha unset: 1)."""
    import tomllib

    settings = tomllib.loads((run / "config.toml").read_text())
    settings = settings.get("recipe", settings)
    alpha = settings.get("lora_alpha")
    return 1.0 if alpha is None else float(alpha) / int(settings["lora_rank"])


def assert_lora_loads_into_fresh_denoiser(
    family: str, folder: Path, trained: dict[str, torch.Tensor], scale: float = 1.0
) -> None:
    """diffusers' ``load_lora_adapter`` reads ``folder/pytorch_lora_weights.safetensors``
    into a fresh tiny denoiser: every key matched, every weight the trained one (the
    recipe's own names, ``.default.``, with or without the wrappers' path, as
    ``lora_0.safetensors`` holds them). The export folds the run's ``scale = alpha / rank``
    into ``lora_B`` (the loader's default is alpha = rank), so ``lora_B`` loads as the
    trained one times ``scale``, exactly when the scale is a power of two."""
    from gradest_recipes.families import tiny_denoiser

    wrapper = re.compile(r"^(model\.)?transformer\.")  # CFG's .model, DiffusersVelocity's
    trained = {wrapper.sub("", key): value for key, value in trained.items()}
    fresh = tiny_denoiser(family)
    # The documented call (docs/recipes.md), its prefix the family's, the adapter named.
    fresh.load_lora_adapter(str(folder), **documented_lora_load(family), adapter_name="loaded")
    loaded = {k.replace(".loaded.", ".default."): v for k, v in fresh.state_dict().items()
              if "lora_" in k}  # fmt: skip
    assert set(loaded) == set(trained)  # no key unmatched, none missing
    for key, value in trained.items():
        want = value * scale if "lora_B" in key else value
        torch.testing.assert_close(loaded[key], want, rtol=0, atol=0)
