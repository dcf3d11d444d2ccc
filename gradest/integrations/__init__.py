"""Bridges from gradest to the rest of the PyTorch ecosystem.

Each submodule is imported on its own, so that gradest never imports an optional
dependency it does not need:

* :mod:`gradest.integrations.distributed`: helpers around DDP / FSDP2 data parallelism
  (``rank_generator``, ``check_same_estimator``, ``process_group_from_env``).
* :mod:`gradest.integrations.peft`: LoRA adapters through ``peft`` (``add_lora``,
  ``adapters_disabled``: the base model as a frozen reference without a copy).
* :mod:`gradest.integrations.diffusers`: ``diffusers`` flow-matching and DDIM / DDPM
  schedulers, transformers and UNets (``sampler_from_scheduler``, ``DiffusersVelocity``).
* :mod:`gradest.integrations.guidance`: classifier-free guidance and Flux's guidance
  embedding as velocity models (``ClassifierFreeGuidance``, ``EmbeddedGuidance``).
* :mod:`gradest.integrations.pipelines`: a diffusers pipeline (SD3, Flux, SDXL, SD) and
  prompts as velocity, sampler and cond (``from_pipeline``).
* :mod:`gradest.integrations.diffusers_schedulers`: a diffusers scheduler's grid, read
  for ``sampler_from_scheduler``.

Served from here too, imported on first use: ``DiffusersVelocity``,
``sampler_from_scheduler``, ``adapters_disabled``, ``ClassifierFreeGuidance``,
``EmbeddedGuidance`` and ``from_pipeline``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names served below, for type checkers and the API reference
    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler
    from gradest.integrations.guidance import ClassifierFreeGuidance, EmbeddedGuidance
    from gradest.integrations.peft import adapters_disabled
    from gradest.integrations.pipelines import from_pipeline

__all__ = [
    "ClassifierFreeGuidance",
    "DiffusersVelocity",
    "EmbeddedGuidance",
    "adapters_disabled",
    "from_pipeline",
    "sampler_from_scheduler",
]

_HOMES = {
    "DiffusersVelocity": "gradest.integrations.diffusers",
    "sampler_from_scheduler": "gradest.integrations.diffusers",
    "adapters_disabled": "gradest.integrations.peft",
    "ClassifierFreeGuidance": "gradest.integrations.guidance",
    "EmbeddedGuidance": "gradest.integrations.guidance",
    "from_pipeline": "gradest.integrations.pipelines",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
