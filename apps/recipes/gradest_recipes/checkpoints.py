"""Checkpoints of a recipe run: ``accelerator.save_state`` with LoRA-only model weights.

A checkpoint is the folder ``OUT/checkpoints/step_XXXXXX/``: accelerate's own state
(optimizer, gradient scaler, every process's RNG states, ``accelerator.step``) plus
``lora_0.safetensors`` (the adapter tensors only: the frozen base weights come from
``pretrained`` again, so a checkpoint of an SD3 LoRA run is megabytes, not gigabytes) and
``recipe_state.json`` (the step, the family, every setting and the run's lineage: the
checkpoints of other folders it continues from). It is written under a
temporary name and renamed when complete, so a run killed while saving leaves the
previous checkpoint as the newest one. Under accelerate's own FSDP (GPUs) accelerate saves
the (sharded) model itself and the LoRA-only hooks stand aside.

With the recipe's ``fsdp = true`` (torch's FSDP2 ``fully_shard``, applied by the recipe:
accelerate sets up FSDP on GPUs only) the parameters are sharded DTensors; the hooks
gather them, so ``lora_0.safetensors`` holds the full tensors, and
:class:`FullStateAdamW` makes accelerate's ``optimizer.bin`` the unsharded AdamW state: the
checkpoint has the same format as a DDP run's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradest.errors import InvalidValue
from gradest.files import atomic_write, atomic_write_text

__all__ = [
    "FullStateAdamW",
    "abandon_newer",
    "checkpoint_dirs",
    "checkpoint_lineage",
    "export_lora",
    "find_checkpoint",
    "holds_checkpoint",
    "register_lora_hooks",
    "save_checkpoint",
]

FORMAT = "gradest_recipes.checkpoint/1"
STATE_FILE = "recipe_state.json"
_NAME = re.compile(r"^step_(\d{6,})$")


def checkpoint_dirs(folder: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``folder``, newest first."""
    directory = Path(folder)
    if not directory.is_dir():
        return []
    found = []
    for item in directory.iterdir():
        match = _NAME.match(item.name)
        if match and (item / STATE_FILE).is_file():
            found.append((int(match.group(1)), item))
    return sorted(found, reverse=True)


def find_checkpoint(location: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint at ``location`` (a run folder or a checkpoint folder).

    Returns ``(folder, state)`` with ``state`` the parsed ``recipe_state.json``.
    """
    path = Path(location)
    if (path / STATE_FILE).is_file():
        candidates = [path]
    else:
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        candidates = [p for _, p in checkpoint_dirs(folder)]
    if not candidates:
        raise InvalidValue(
            f"setting resume={str(location)!r}: no checkpoint there (a run's out folder holds "
            f"checkpoints/step_XXXXXX/{STATE_FILE}); pass the out folder of a recipe run"
        )
    chosen = candidates[0]
    try:
        state = json.loads((chosen / STATE_FILE).read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidValue(
            f"setting resume={str(location)!r}: {chosen} is damaged ({err})"
        ) from None
    if state.get("format") != FORMAT:
        raise InvalidValue(
            f"setting resume={str(location)!r}: {chosen} is not a gradest recipe checkpoint "
            f"(format {state.get('format')!r}, expected {FORMAT!r})"
        )
    return chosen, state


def checkpoint_lineage(folder: Path, state: dict[str, Any]) -> tuple[str, ...]:
    """What the run that wrote the checkpoint ``folder`` continued from outside its own
    folder (``state["lineage"]``, resolved checkpoint paths in order; empty for a run
    started from scratch, and for a checkpoint written before the lineage was saved)."""
    lineage = state.get("lineage", [])
    if not isinstance(lineage, list) or not all(isinstance(item, str) for item in lineage):
        raise InvalidValue(
            f"checkpoint {str(folder)!r} is damaged: its {STATE_FILE} lineage is "
            f"{lineage!r}, not a list of checkpoint paths"
        )
    return tuple(lineage)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every process calls it)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) as a DTensor sharded as ``like``, when ``like`` is one.

    Every process holds the full tensor (read from the same file), so each keeps its own
    shard without communication (``src_data_rank=None``)."""
    mesh = getattr(like, "device_mesh", None)
    if mesh is None or getattr(value, "device_mesh", None) is not None:
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, mesh, like.placements, src_data_rank=None)  # type: ignore[attr-defined]


def lora_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s LoRA tensors, whole (FSDP shards are gathered: call on every process)."""
    return {
        name: _full(tensor).detach().cpu().contiguous()
        for name, tensor in model.state_dict().items()
        if "lora_" in name
    }


class FullStateAdamW(torch.optim.AdamW):
    """AdamW over FSDP2-sharded (DTensor) parameters whose ``state_dict`` is unsharded.

    ``state_dict()`` gathers every sharded state tensor (a collective: accelerate's
    ``save_state`` calls it on every process and writes rank 0's, which is then the whole
    state, as a DDP run saves it); ``load_state_dict()`` takes the whole tensors and keeps
    this process's shard of each. With plain parameters it is AdamW.
    """

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["state"] = {
            index: {key: _full(value) for key, value in values.items()}
            for index, values in state["state"].items()
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        state = {
            index: {
                key: _shard_like(value, params[int(index)])
                if isinstance(value, torch.Tensor) and value.shape == params[int(index)].shape
                else value
                for key, value in values.items()
            }
            for index, values in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": state})


def register_lora_hooks(accelerator: Any, models: list[nn.Module] | None = None) -> None:
    """Make ``save_state`` / ``load_state`` write and read the LoRA tensors only.

    ``models``: the models to save, when accelerate did not prepare them (a model the
    recipe sharded with ``fully_shard`` itself); by default the ones accelerate prepared.
    Under accelerate's own FSDP the hooks stand aside (accelerate saves the model).
    """
    from accelerate.utils import DistributedType
    from safetensors.torch import load_file, save_file

    if accelerator.distributed_type == DistributedType.FSDP:
        return

    def save_hook(prepared: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        for index, model in enumerate(prepared if models is None else models):
            tensors = lora_tensors(accelerator.unwrap_model(model))  # every process: gathers
            if accelerator.is_main_process:
                save_file(tensors, os.path.join(output_dir, f"lora_{index}.safetensors"))
        weights.clear()  # accelerate then saves no full model weights

    def load_hook(prepared: list[nn.Module], input_dir: str) -> None:
        for index, model in enumerate(prepared if models is None else models):
            file = os.path.join(input_dir, f"lora_{index}.safetensors")
            if not os.path.isfile(file):
                raise InvalidValue(f"checkpoint {input_dir!r} lacks {os.path.basename(file)}")
            module = accelerator.unwrap_model(model)
            current = {k: v for k, v in module.state_dict().items() if "lora_" in k}
            state = load_file(file, device=str(next(module.parameters()).device))
            if set(state) != set(current):
                raise InvalidValue(
                    f"checkpoint {input_dir!r} holds other LoRA tensors than this model "
                    f"({len(set(state) - set(current))} unexpected, "
                    f"{len(set(current) - set(state))} missing): was it written with other "
                    f"lora_rank / lora_targets?"
                )
            state = {k: _shard_like(v, current[k]) for k, v in state.items()}
            module.load_state_dict(state, strict=False)
        prepared.clear()  # loaded here; accelerate loads no model weights

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(accelerator: Any, out: Path, step: int, state: dict[str, Any],
                    keep: int, export: Callable[[Path], None] | None = None) -> Path:  # fmt: skip
    """``accelerator.save_state`` into ``out/checkpoints/step_XXXXXX`` (all processes).

    ``export(folder)`` (called on every process) adds files to the checkpoint before it is
    renamed complete: the recipe writes diffusers' ``pytorch_lora_weights.safetensors``.
    ``keep`` (0: all): the newest checkpoints kept, counting this one and the older ones
    only; a checkpoint newer than this one is never deleted here."""
    folder = out / "checkpoints"
    final = folder / f"step_{step:06d}"
    partial = folder / f".step_{step:06d}.partial"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        for stopped in folder.glob(".step_*.deleting"):  # a deletion that was interrupted
            shutil.rmtree(stopped, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    if export is not None:
        export(partial)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {"format": FORMAT, "step": step, **state}
        atomic_write_text(partial / STATE_FILE, json.dumps(record, indent=1) + "\n")
        if final.exists():
            _remove_checkpoint(final)
        os.replace(partial, final)
        if keep:
            older = [path for number, path in checkpoint_dirs(folder) if number <= step]
            for old in older[keep:]:
                _remove_checkpoint(old)
    accelerator.wait_for_everyone()
    return final


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder, renamed out of the checkpoint names first: a run
    stopped (Ctrl-C, a kill) in the middle of the deletion leaves a hidden
    ``.step_XXXXXX.deleting`` folder that ``latest`` never takes, not a torn checkpoint
    that still holds its ``recipe_state.json``; the next checkpoint's save removes it."""
    doomed = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def holds_checkpoint(out: str | Path, checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` is one of the run folder ``out``'s own: it lies under
    ``out/checkpoints/`` (``abandoned/`` included). Both paths resolved: links and ``..``
    followed, so two spellings of one folder are one."""
    return (Path(out) / "checkpoints").resolve() in Path(checkpoint).resolve().parents


def abandon_newer(out: Path, step: int, *, resumed_from: Path) -> list[Path]:
    """Move the checkpoints of ``out`` newer than ``step`` (a run resumed from an older
    checkpoint abandons them) to ``out/checkpoints/abandoned/``, where neither ``latest``
    nor ``keep_checkpoints`` sees them; nothing is deleted. Returns the new locations.

    Only a run continued in its own folder abandons anything: ``resumed_from`` (the
    checkpoint it resumes) must be one of ``out``'s own (:func:`holds_checkpoint`); a
    checkpoint of another folder is refused, so another run's checkpoints never move."""
    if not holds_checkpoint(out, resumed_from):
        raise InvalidValue(
            f"checkpoint {str(resumed_from)!r} is not in {str(out)!r}: a run resumed from "
            f"another folder's checkpoint abandons nothing there"
        )
    folder = out / "checkpoints"
    moved = []
    for number, path in checkpoint_dirs(folder):
        if number <= step:
            continue
        target = folder / "abandoned" / path.name
        suffix = 1
        while target.exists():
            target = folder / "abandoned" / f"{path.name}.{suffix}"
            suffix += 1
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        moved.append(target)
    return moved


_ADAPTER = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


def export_lora(tensors: dict[str, torch.Tensor], prefix: str, path: Path, rank: int,
                alpha: float | None) -> Path:  # fmt: skip
    """Write the denoiser's adapter ``tensors`` (its own parameter names) in diffusers'
    LoRA format, loadable with ``pipe.load_lora_weights``.

    Keys are ``{prefix}.{module}.lora_A.weight`` / ``lora_B.weight`` (peft's adapter name
    dropped, as ``save_lora_weights`` writes them); the scale ``alpha / rank`` is folded
    into ``lora_B``, so the file means the same under the loader's default ``alpha = rank``.
    """
    from safetensors.torch import save

    scale = 1.0 if alpha is None else float(alpha) / rank
    out = {}
    for name, tensor in tensors.items():
        key = _ADAPTER.sub(r".lora_\1.weight", name)
        value = tensor.detach().float().cpu().contiguous()
        if key.endswith("lora_B.weight"):
            value = value * scale
        out[f"{prefix}.{key}"] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    # Serialized in memory, then gradest's atomic writer: never half-written, never onto a
    # device, pipe or folder at the path (gradest.files.refuse_non_file).
    data = save(out)
    atomic_write(path, lambda file: file.write(data))
    return path
