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

Reading one back: ``recipe_state.json`` is read by
:func:`gradest_recipes.records.read_recipe_state`; before ``accelerator.load_state``,
:func:`check_checkpoint_files` reads and checks accelerate's files against the run's own
objects, and the load hook reads ``lora_N.safetensors`` with :func:`read_lora_file`. A
damaged or foreign file is one line naming it and the field, and is left as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from gradest_lab.storage.files import atomic_write, atomic_write_text
from torch import nn

from gradest import GradestError, InvalidValue
from gradest_recipes.file_schema import (
    Refuse,
    conform,
    describe,
    file_bytes,
    first_line,
    is_int,
    load_torch_bytes,
)

__all__ = [
    "FullStateAdamW",
    "abandon_newer",
    "check_checkpoint_files",
    "checkpoint_dirs",
    "checkpoint_number",
    "export_lora",
    "holds_checkpoint",
    "load_checkpoint",
    "read_lora_file",
    "register_lora_hooks",
    "save_checkpoint",
]

FORMAT = "gradest_recipes.checkpoint/1"
STATE_FILE = "recipe_state.json"
_NAME = re.compile(r"^step_(\d{6,})$")


def checkpoint_number(folder: Path) -> int | None:
    """The step in a checkpoint folder's name (``step_000042``: 42), or None."""
    match = _NAME.match(folder.name)
    return int(match.group(1)) if match else None


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
    from safetensors.torch import save_file

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
            file = Path(input_dir) / f"lora_{index}.safetensors"
            module = accelerator.unwrap_model(model)
            current = {k: v for k, v in module.state_dict().items() if "lora_" in k}
            state = read_lora_file(file, current)
            device = next(module.parameters()).device
            state = {k: _shard_like(v.to(device), current[k]) for k, v in state.items()}
            module.load_state_dict(state, strict=False)
        prepared.clear()  # loaded here; accelerate loads no model weights

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _refuser(path: Path) -> Refuse:
    """The ``refuse(field, why)`` of a checkpoint's file ``path``."""

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"checkpoint file {str(path)!r}: {field} {why}; the file is damaged or is not this "
            f"run's (it is left as it is): resume another checkpoint, or start a new run in "
            f"another --output_dir"
        )

    return refuse


def read_lora_file(path: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a checkpoint's ``lora_N.safetensors`` (on the CPU), checked
    against ``like``, the model's own LoRA tensors by name: the same names, each tensor of
    the same shape and dtype (a sharded parameter's whole shape). Anything else (no file,
    not a safetensors file, a tensor missing, extra, of another shape or dtype) is one line
    naming the file and the tensor; the file is left as it is."""
    from safetensors.torch import load

    refuse = _refuser(path)
    data = file_bytes(path, refuse)
    try:
        state = load(data)
    except Exception as err:  # safetensors raises its own error, and others for a bad header
        raise refuse("the file", f"is not a safetensors file ({first_line(err)})") from None
    missing = sorted(set(like) - set(state))
    extra = sorted(set(state) - set(like))
    if missing or extra:
        why = "is missing (this model has it)" if missing else "is not a LoRA tensor of this model"
        raise refuse(
            f"tensor {(missing or extra)[0]!r}",
            f"{why} ({len(extra)} unexpected, {len(missing)} missing: was it written with other "
            f"lora_rank / lora_targets?)",
        )
    for name, tensor in state.items():
        conform(tensor, like[name], refuse, f"tensor {name!r}")
    return state


#: What AdamW keeps per parameter (``max_exp_avg_sq`` too with ``amsgrad``).
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def _scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


def _check_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """accelerate's ``optimizer.bin``: the AdamW state of this run's parameters."""
    refuse = _refuser(path)
    saved = load_torch_bytes(file_bytes(path, refuse), refuse)
    inner: torch.optim.Optimizer = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(saved, Mapping):
        raise refuse("the file", f"holds {describe(saved)}, not an optimizer's state")
    for key in ("state", "param_groups"):
        if key not in saved:
            raise refuse(key, "is missing")
    groups, live_groups = saved["param_groups"], inner.param_groups
    if not isinstance(groups, list | tuple) or len(groups) != len(live_groups):
        raise refuse(
            "param_groups", f"is {describe(groups)}, not a list of {len(live_groups)} groups"
        )
    numbers: list[Any] = []
    owners: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for index, (group, live) in enumerate(zip(groups, live_groups, strict=True)):
        field = f"param_groups[{index}]"
        if not isinstance(group, Mapping):
            raise refuse(field, f"is {describe(group)}, not a dict")
        if "params" not in group:
            raise refuse(f"{field}.params", "is missing")
        params, count = group["params"], len(live["params"])
        if not isinstance(params, list | tuple) or len(params) != count:
            raise refuse(f"{field}.params", f"is {describe(params)}, not {count} parameters")
        rest = {key: value for key, value in group.items() if key != "params"}
        conform(rest, {key: v for key, v in live.items() if key != "params"}, refuse, field)
        numbers.extend(params)
        owners.extend((param, live) for param in live["params"])
    if numbers != list(range(len(numbers))):
        raise refuse(
            "param_groups[...].params", "are not the parameter numbers 0, 1, ... torch writes"
        )
    state = saved["state"]
    if not isinstance(state, Mapping):
        raise refuse("state", f"is {describe(state)}, not a dict")
    for key, entry in state.items():
        field = f"state[{key!r}]"
        if not is_int(key) or not 0 <= key < len(owners):
            raise refuse(field, f"is there, but this optimizer has {len(owners)} parameters")
        if not isinstance(entry, Mapping):
            raise refuse(field, f"is {describe(entry)}, not a dict")
        param, live = owners[key]
        names = (*_ADAM_STATE, "max_exp_avg_sq") if live.get("amsgrad") else _ADAM_STATE
        for name in names:
            if name not in entry:
                raise refuse(f"{field}.{name}", "is missing")
        for name, value in entry.items():
            if name not in names:
                raise refuse(f"{field}.{name}", "is there, but AdamW keeps no such state")
            if name != "step":
                conform(value, param, refuse, f"{field}.{name}")
            elif not _scalar_tensor(value):
                raise refuse(f"{field}.step", f"is {describe(value)}, not a step count")


def _check_random_states(path: Path) -> None:
    """accelerate's ``random_states_N.pkl``: the step and the Python, numpy and torch RNG
    states, each one that the generator takes (tried on a new generator: nothing global
    changes). accelerate itself skips such a file silently when it does not load."""
    import random

    import numpy as np
    from accelerate.utils import other

    refuse = _refuser(path)
    safe = getattr(other, "TORCH_SAFE_GLOBALS", ())  # the numpy types of the states
    states = load_torch_bytes(file_bytes(path, refuse), refuse, safe_globals=safe)
    if not isinstance(states, Mapping):
        raise refuse("the file", f"holds {describe(states)}, not a dict of RNG states")
    for key in ("step", "random_state", "numpy_random_seed", "torch_manual_seed"):
        if key not in states:
            raise refuse(key, "is missing")
    if not is_int(states["step"]) or states["step"] < 0:
        raise refuse("step", f"is {describe(states['step'])}, not a step count")
    conform(states["numpy_random_seed"], np.random.get_state(), refuse, "numpy_random_seed")
    conform(states["torch_manual_seed"], torch.get_rng_state(), refuse, "torch_manual_seed")
    python = states["random_state"]
    if not (
        isinstance(python, tuple)
        and len(python) == 3
        and is_int(python[0])
        and isinstance(python[1], tuple)
        and all(is_int(word) for word in python[1])
        and (python[2] is None or isinstance(python[2], float))
    ):
        raise refuse("random_state", f"is {describe(python)}, not a state of Python's random")
    trials: list[tuple[str, Callable[[Any], Any]]] = [
        ("random_state", random.Random().setstate),
        ("numpy_random_seed", np.random.RandomState().set_state),
        ("torch_manual_seed", torch.Generator().set_state),
    ]
    for key, take in trials:
        try:
            take(states[key])
        except Exception as err:  # each generator raises its own kinds
            raise refuse(key, f"is not a state its generator takes ({first_line(err)})") from None
    cuda = states.get("torch_cuda_manual_seed")
    if cuda is not None and not (
        isinstance(cuda, list | tuple)
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)
    ):
        raise refuse("torch_cuda_manual_seed", f"is {describe(cuda)}, not a list of CUDA states")


def check_checkpoint_files(
    folder: Path,
    *,
    optimizer: torch.optim.Optimizer,
    custom: Sequence[tuple[Any, bool]],
    process_index: int,
    scaler: Any = None,
) -> None:
    """Read and check every file ``accelerator.load_state(folder)`` reads, before it does.

    Each is read by :func:`~gradest_recipes.file_schema.load_torch_bytes` (weights only:
    accelerate loads ``custom_checkpoint_N.pkl`` with ``weights_only=False``, so a file that
    would run code is refused here, before accelerate sees it) and checked against this
    run's own objects: ``optimizer.bin`` holds AdamW's state of this optimizer's parameters
    (shapes and dtypes); ``custom_checkpoint_N.pkl`` the state of ``custom[N]``; and
    ``random_states_{process_index}.pkl`` states each generator takes; ``scaler.pt`` (with
    ``scaler``, fp16) the gradient scaler's. The LoRA file is read by the load hook
    (:func:`read_lora_file`).

    Args:
        custom: the objects registered with ``register_for_checkpointing``, in order, each
            with whether it checks its own state. False: the saved state must have the
            structure of the object's ``state_dict()`` now (:func:`conform`: keys, kinds,
            lengths, tensor shapes and dtypes); True (an estimator's state, whose length
            varies): its ``load_state_dict`` is called here with the loaded state, and
            whatever it raises is one line naming the file.

    Raises:
        InvalidValue: one line naming the file and the field; every file is left as it is.
    """
    _check_optimizer(folder / "optimizer.bin", optimizer)
    for index, (obj, checks_itself) in enumerate(custom):
        path = folder / f"custom_checkpoint_{index}.pkl"
        refuse = _refuser(path)
        state = load_torch_bytes(file_bytes(path, refuse), refuse)
        if not checks_itself:
            conform(state, obj.state_dict(), refuse, "")
            continue
        if not isinstance(state, Mapping):
            raise refuse("the file", f"holds {describe(state)}, not a state dict")
        try:
            obj.load_state_dict(state)
        except KeyError as err:
            raise refuse("the state", f"lacks the entry {first_line(err)}") from None
        except (GradestError, IndexError, TypeError, ValueError, AttributeError) as err:
            raise refuse("the state", f"does not load ({first_line(err)})") from None
    _check_random_states(folder / f"random_states_{process_index}.pkl")
    if scaler is not None:
        path = folder / "scaler.pt"
        refuse = _refuser(path)
        conform(load_torch_bytes(file_bytes(path, refuse), refuse), scaler.state_dict(), refuse, "")


# What accelerate and torch raise for a state that does not fit (all but gradest's own).
_LOAD_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError)


def load_checkpoint(accelerator: Any, folder: Path) -> None:
    """``accelerator.load_state(folder)``, after :func:`check_checkpoint_files`: what the
    checks cannot see (a value out of its range) is one line naming the folder, not a
    traceback from deep inside accelerate."""
    try:
        accelerator.load_state(str(folder))
    except GradestError:
        raise
    except _LOAD_ERRORS as err:
        raise InvalidValue(
            f"checkpoint {str(folder)!r} does not load ({type(err).__name__}: "
            f"{first_line(err)}); it is damaged or is not this run's (it is left as it is): "
            f"resume another checkpoint, or start a new run in another --output_dir"
        ) from None


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
    # device, pipe or folder at the path (gradest_lab.storage.files.refuse_non_file).
    data = save(out)
    atomic_write(path, lambda file: file.write(data))
    return path
