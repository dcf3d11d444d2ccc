"""A warm start from an existing LoRA (``lora_path``), as Flow-GRPO's ``train.lora_path``.

Flow-GRPO continues from a LoRA with ``PeftModel.from_pretrained(transformer, lora_path)``:
a peft adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``, what its
``save_ckpt`` writes with ``save_pretrained``). The recipes write diffusers' format
(``pytorch_lora_weights.safetensors``, their ``lora/`` export and each checkpoint's, what
``pipe.load_lora_weights`` reads). :func:`load_lora_start` reads either into the adapters
:func:`gradest.integrations.peft.add_lora` injected, so that the run's first step starts
from that LoRA's update ``(alpha / rank) B A``:

* diffusers' format: keys ``{prefix}.{module}.lora_A.weight`` / ``lora_B.weight`` with the
  scale folded into ``lora_B`` (``alpha = rank``, as the recipes' export writes it);
* a peft folder: keys ``base_model.model.{module}.lora_A.weight`` with the scale
  ``lora_alpha / r`` of its ``adapter_config.json``.

``lora_B`` is divided by the run's own scale ``lora_alpha / lora_rank``, so the update is
the file's whatever the run's alpha. The run's rank and targets must be the file's: every
adapter tensor of the model must be in the file with its shape, and nothing else. Anything
else is one line naming the file and the tensor, before any step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from gradest_recipes.errors import RecipeConfigError
from gradest_recipes.file_schema import file_bytes, first_line

__all__ = ["PEFT_CONFIG", "PEFT_WEIGHTS", "load_lora_start"]

#: A peft adapter folder's files (``save_pretrained``).
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: The diffusers LoRA file in a folder (the recipes' export, ``save_lora_weights``).
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
# A model's adapter tensor name: ``{module}.lora_A.{adapter}.weight``.
_MODEL_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$")
# A file's: ``{module}.lora_A.weight``.
_FILE_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PEFT_PREFIX = "base_model.model."


def _fail(path: Path, why: str) -> RecipeConfigError:
    return RecipeConfigError(
        f"setting lora_path={str(path)!r} is invalid: {why}; pass a LoRA in diffusers' format "
        f"(a recipe's lora/ folder, {DIFFUSERS_WEIGHTS}) or a peft adapter folder "
        f"({PEFT_CONFIG} and {PEFT_WEIGHTS}) written for this model with this run's "
        f"lora_rank and lora_targets"
    )


def _safetensors(path: Path, where: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    def refuse(field: str, why: str) -> RecipeConfigError:
        return _fail(where, f"{field} {str(path)!r} {why}")

    data = file_bytes(path, refuse)
    try:
        return load(data)
    except Exception as err:  # safetensors raises its own error, others for a bad header
        raise _fail(where, f"{str(path)!r} is not a safetensors file ({first_line(err)})") from None


def _peft_scale(path: Path, where: Path) -> float:
    """``lora_alpha / r`` of a peft folder's ``adapter_config.json``."""
    try:
        config = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise _fail(
            where, f"{str(path)!r} is not a JSON adapter config ({first_line(err)})"
        ) from None
    if not isinstance(config, dict):
        raise _fail(where, f"{str(path)!r} holds no JSON object")
    numbers = []
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise _fail(where, f"{str(path)!r} needs {name} > 0, got {name}={value!r}")
        numbers.append(float(value))
    rank, alpha = numbers
    return alpha / rank


def read_lora_start(path: Path, prefix: str) -> tuple[dict[str, torch.Tensor], float]:
    """``({module.lora_A.weight: tensor, ...}, scale)``: the file's adapter tensors by module,
    and the scale its ``lora_B`` carries beside what is folded in (1 for diffusers' format,
    ``lora_alpha / r`` for peft's)."""
    if path.is_dir() and (path / PEFT_CONFIG).exists():
        tensors, scale, strip = (
            _safetensors(path / PEFT_WEIGHTS, path),
            _peft_scale(path / PEFT_CONFIG, path),
            _PEFT_PREFIX,
        )
    else:
        file = path / DIFFUSERS_WEIGHTS if path.is_dir() else path
        tensors, scale, strip = _safetensors(file, path), 1.0, f"{prefix}."
    out = {}
    for key, value in tensors.items():
        name = key[len(strip) :] if key.startswith(strip) else key
        if _FILE_KEY.match(name) is None:
            raise _fail(path, f"tensor {key!r} is not a LoRA tensor (module.lora_A.weight)")
        out[name] = value
    return out, scale


def load_lora_start(
    model: nn.Module, path: str | Path, *, prefix: str, rank: int, alpha: float | None
) -> None:
    """Copy the LoRA at ``path`` into ``model``'s adapters (see the module docstring).

    Args:
        model: the denoiser after :func:`gradest.integrations.peft.add_lora`.
        path: a diffusers LoRA file or folder, or a peft adapter folder.
        prefix: the pipeline's name for the denoiser in diffusers' keys (``"transformer"``).
        rank, alpha: the run's ``lora_rank`` and ``lora_alpha`` (None: the rank).

    Raises:
        RecipeConfigError: no such file, not a LoRA file, or tensors that are not exactly
            the model's adapters with their shapes.
    """
    where = Path(path).expanduser()
    if not where.exists():
        raise _fail(where, "nothing is there")
    found, file_scale = read_lora_start(where, prefix)
    own: Mapping[str, torch.Tensor] = {
        name: tensor for name, tensor in model.state_dict().items() if _MODEL_KEY.match(name)
    }
    by_file_key = {}
    for name in own:
        match = _MODEL_KEY.match(name)
        assert match is not None
        by_file_key[f"{match['module']}.lora_{match['ab']}.weight"] = name
    missing = sorted(set(by_file_key) - set(found))
    extra = sorted(set(found) - set(by_file_key))
    if missing or extra:
        first = (missing or extra)[0]
        why = "is missing (the model has it)" if missing else "is not an adapter of this model"
        raise _fail(
            where,
            f"tensor {first!r} {why} ({len(missing)} missing, {len(extra)} unexpected: another "
            f"lora_rank / lora_targets, or another model?)",
        )
    scale = file_scale / ((alpha if alpha is not None else rank) / rank)
    state = {}
    for key, tensor in found.items():
        name = by_file_key[key]
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise _fail(
                where,
                f"tensor {key!r} has shape {tuple(tensor.shape)}, the model's "
                f"{tuple(own[name].shape)} (another lora_rank?)",
            )
        value = tensor * scale if key.endswith("lora_B.weight") else tensor
        state[name] = value.to(dtype=own[name].dtype, device=own[name].device)
    model.load_state_dict(state, strict=False)
