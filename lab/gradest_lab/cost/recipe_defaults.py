"""What the recipes run by default, as ``gradest cost`` settings (``--recipe-defaults``).

The recipes (``apps/recipes``, ``gradest_recipes.config.RecipeConfig`` and its
``FAMILY_DEFAULTS``) train with LoRA rank 8 on the attention projections, no gradient
checkpointing of the transformer, the VAE's gradient checkpointing for the reward's
decode, one sample per step in float32 (``mixed_precision = "no"``), the ``sdo``
estimator on the ``brightness`` reward (a pixel reward: the decode, no reward model) and
each family's sampling: SD3 28 steps at 1024 px with CFG 7.0, Flux 28 steps at 1024 px
with the guidance embedding at 3.5 (no true CFG), SDXL 50 steps at 1024 px with CFG 5.0,
SD 1.x/2.x 50 steps at 512 px with CFG 7.5.

The grpo recipes (``--recipe-defaults grpo``; SD3 and Flux) run as Flow-GRPO trains:
the stepwise objective on the sampled paths, ``exact`` one timestep's backward at a time
(``--per-timestep``), LoRA rank 32 on the 8 attention projections of both streams, four
samples per batch, the same family sampling (the training step decodes nothing: the
rewards are scored without a graph, so it is priced with ``--reward latent``).

The values are written here in the recipes' own names (:data:`RECIPE_DEFAULTS`,
:data:`FAMILY_RECIPE_DEFAULTS`): the lab does not import the recipes, and
``apps/recipes/tests/test_cost_recipe_defaults.py`` checks them against ``RecipeConfig``
so that the two cannot drift apart. :func:`cost_options` turns them into the command's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradest import InvalidValue

__all__ = [
    "FAMILY_RECIPE_DEFAULTS",
    "GRPO_FAMILIES",
    "GRPO_RECIPE_DEFAULTS",
    "RECIPE_DEFAULTS",
    "RECIPE_OBJECTIVES",
    "cost_options",
    "recipe_family",
]

#: The reward recipes' defaults that decide a step's cost, every family alike (the
#: names and values of ``RecipeConfig``'s fields).
RECIPE_DEFAULTS: dict[str, Any] = {
    "objective": "reward",
    "estimator": "sdo",
    "reward": "brightness",
    "lora_rank": 8,
    "lora_targets": ("to_q", "to_k", "to_v", "to_out.0"),
    "gradient_checkpointing": False,
    "decoder_checkpointing": True,
    "detach_unconditional": False,
    "mixed_precision": "no",
    "batch_size": 1,
}
#: The grpo recipes' (``OBJECTIVE_DEFAULTS["grpo"]`` over :data:`RECIPE_DEFAULTS`).
GRPO_RECIPE_DEFAULTS: dict[str, Any] = {
    "objective": "grpo",
    "estimator": "exact",
    "lora_rank": 32,
    "lora_targets": (
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    ),
    "detach_unconditional": True,
    "batch_size": 4,
}  # fmt: skip
#: The families with a grpo recipe (``examples/recipes/{sd3,flux}_grpo.py``).
GRPO_FAMILIES = ("sd3", "flux")
#: ``--recipe-defaults``'s values: the recipes' ``objective``s it prices.
RECIPE_OBJECTIVES = ("reward", "grpo")
#: Each family's (``FAMILY_DEFAULTS``, and the Flux recipe's ``true_cfg_scale``).
FAMILY_RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"num_inference_steps": 28, "guidance_scale": 7.0, "resolution": 1024},
    "flux": {
        "num_inference_steps": 28,
        "guidance_scale": 3.5,
        "resolution": 1024,
        "true_cfg_scale": 1.0,
    },
    "sd_unet": {"num_inference_steps": 50, "guidance_scale": 7.5, "resolution": 512},
    "sdxl": {"num_inference_steps": 50, "guidance_scale": 5.0, "resolution": 1024},
}
#: ``mixed_precision`` -> ``--dtype``: with ``no`` every weight and activation is float32.
DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
#: The recipes' built-in pixel rewards, priced as ``--reward pixels`` (the decode alone).
PIXEL_REWARDS = ("brightness", "contrast", "color")


def recipe_family(config: Mapping[str, Any]) -> str:
    """The recipe family that trains the model of a diffusers ``config``: ``sd3`` (SD3,
    SD3.5), ``flux``, ``sdxl`` (a UNet with SDXL's ``text_time`` embedding) or
    ``sd_unet``."""
    name = config.get("_class_name")
    if name == "SD3Transformer2DModel":
        return "sd3"
    if name == "FluxTransformer2DModel":
        return "flux"
    if config.get("addition_embed_type") == "text_time":
        return "sdxl"
    return "sd_unet"


def cost_options(family: str, objective: str = "reward") -> dict[str, Any]:
    """The ``gradest cost`` options (argparse names) of the defaults of the ``family``
    recipe of ``objective`` (``reward`` or ``grpo``)."""
    if family not in FAMILY_RECIPE_DEFAULTS:
        raise InvalidValue(
            f"no recipe family {family!r}; one of {', '.join(FAMILY_RECIPE_DEFAULTS)}"
        )
    if objective not in RECIPE_OBJECTIVES:
        raise InvalidValue(
            f"--recipe-defaults {objective!r}: the recipes it prices are "
            f"{', '.join(RECIPE_OBJECTIVES)}"
        )
    if objective == "grpo" and family not in GRPO_FAMILIES:
        raise InvalidValue(
            f"--recipe-defaults grpo: the {family} family has no grpo recipe (those of "
            f"{', '.join(GRPO_FAMILIES)} do); drop grpo to price its reward recipe"
        )
    extra = GRPO_RECIPE_DEFAULTS if objective == "grpo" else {}
    recipe = RECIPE_DEFAULTS | FAMILY_RECIPE_DEFAULTS[family] | extra
    reward = str(recipe["reward"]).split(":", 1)[0]
    options: dict[str, Any] = {
        "objective": {"reward": "terminal", "grpo": "stepwise"}[recipe["objective"]],
        "estimators": recipe["estimator"],
        # GRPO scores its samples without a graph: its training step decodes nothing.
        "reward": "latent"
        if objective == "grpo"
        else "pixels"
        if reward in PIXEL_REWARDS
        else reward,
        "lora_rank": recipe["lora_rank"],
        "lora_targets": ",".join(recipe["lora_targets"]),
        "gradient_checkpointing": recipe["gradient_checkpointing"],
        "decoder_checkpointing": recipe["decoder_checkpointing"],
        "dtype": DTYPES[recipe["mixed_precision"]],
        "batch": recipe["batch_size"],
        "steps": recipe["num_inference_steps"],
        "height": recipe["resolution"],
        "width": recipe["resolution"],
        # The pipeline's guidance_scale: CFG, or Flux's guidance embedding's value.
        "cfg": recipe["guidance_scale"],
        "true_cfg": None if recipe.get("true_cfg_scale", 1.0) == 1.0 else recipe["true_cfg_scale"],
    }
    if objective == "grpo":
        del options["decoder_checkpointing"]  # nothing decoded with a graph
        options["per_timestep"] = True  # exact, as the recipe trains it
    return options
