"""``gradest cost --recipe-defaults`` prices what the recipes run by default.

The lab does not import the recipes: it writes their defaults down
(``gradest_lab.cost.recipe_defaults``). These tests tie them to ``RecipeConfig`` and
``FAMILY_DEFAULTS`` (every field that decides a step's cost, every family), and tie the
guidance the command prices (CFG rows or not) to what the recipe's family builds, so the
two cannot drift apart.
"""

from __future__ import annotations

import argparse
import os

import attrs
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")

from gradest_lab.cost.command import add_arguments, resolve_options  # noqa: E402
from gradest_lab.cost.diffusers_presets import (  # noqa: E402
    LORA_TARGETS,
    PRESETS,
    guidance_plan,
)
from gradest_lab.cost.recipe_defaults import (  # noqa: E402
    FAMILY_RECIPE_DEFAULTS,
    RECIPE_DEFAULTS,
    recipe_family,
)
from gradest_recipes.config import FAMILIES, RecipeConfig, load_config  # noqa: E402
from gradest_recipes.families import guided  # noqa: E402

#: The recipe settings that decide what a step costs (the rest: where it writes, how
#: often it logs, the optimizer's constants, ...).
COST_FIELDS = {
    "objective", "estimator", "reward", "lora_rank", "lora_targets", "gradient_checkpointing",
    "decoder_checkpointing", "detach_unconditional", "mixed_precision", "batch_size",
    "num_inference_steps", "guidance_scale", "resolution", "true_cfg_scale",
}  # fmt: skip


def recipe(family: str) -> RecipeConfig:
    """The family's reward recipe as its script runs it with no setting given."""
    return load_config(family, overrides={"pretrained": "/models/x", "embeddings": "x.pt"})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cost_commands_recipe_defaults_are_the_recipes(family):
    config = recipe(family)
    written = RECIPE_DEFAULTS | FAMILY_RECIPE_DEFAULTS[family]
    assert set(written) >= COST_FIELDS - {"true_cfg_scale"} and set(FAMILY_RECIPE_DEFAULTS) == set(
        FAMILIES
    )
    for key, value in written.items():
        assert getattr(config, key) == value, key
    assert config.true_cfg_scale == FAMILY_RECIPE_DEFAULTS[family].get("true_cfg_scale", 1.0)
    assert tuple(config.lora_targets) == LORA_TARGETS  # what gradest cost adapts


def test_every_cost_field_is_a_setting():
    names = {field.name for field in attrs.fields(RecipeConfig)}
    assert COST_FIELDS <= names


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_priced_guidance_is_the_recipes(preset):
    """``--recipe-defaults`` on each preset: the family's sampling (steps, resolution) and
    guidance, CFG rows exactly where the recipe's family runs ClassifierFreeGuidance."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = resolve_options(parser.parse_args(["--model", preset, "--recipe-defaults"]))
    family = recipe_family(PRESETS[preset].config)
    assert args.recipe_defaults == family
    config = recipe(family)
    assert (args.steps, args.height, args.width) == (
        config.num_inference_steps,
        config.resolution,
        config.resolution,
    )
    assert (args.steps, args.height) == (PRESETS[preset].steps, PRESETS[preset].height)
    _, cfg_rows = guidance_plan(
        PRESETS[preset].config["_class_name"], family,
        bool(PRESETS[preset].config.get("guidance_embeds")), args.cfg, args.true_cfg,
    )  # fmt: skip
    assert (cfg_rows is not None) == guided(family, config)
    # The Flux recipe with true CFG on: the command prices it with --true-cfg.
    if family == "flux":
        true_cfg = load_config(
            "flux",
            overrides={"pretrained": "/models/x", "embeddings": "x.pt", "true_cfg_scale": 4.0},
        )
        _, rows = guidance_plan("FluxTransformer2DModel", "flux", True, 3.5, 4.0)
        assert guided("flux", true_cfg) and rows == 4.0


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_the_cost_commands_grpo_defaults_are_the_grpo_recipes(family):
    """``--recipe-defaults grpo`` against the grpo recipe as its script runs it: every cost
    field, and the per-timestep loop exactly when the recipe trains one timestep at a time."""
    from gradest_lab.cost.recipe_defaults import GRPO_FAMILIES, GRPO_RECIPE_DEFAULTS, cost_options
    from gradest_recipes.grpo_epoch import backward_per_timestep

    import gradest

    config = load_config(
        family, overrides={"pretrained": "/models/x", "embeddings": "x.pt", "objective": "grpo"}
    )
    written = RECIPE_DEFAULTS | FAMILY_RECIPE_DEFAULTS[family] | GRPO_RECIPE_DEFAULTS
    for key, value in written.items():
        assert getattr(config, key) == value, key
    options = cost_options(family, "grpo")
    assert options["per_timestep"] == backward_per_timestep(gradest.estimator(config.estimator))
    assert options["lora_targets"].split(",") == list(config.lora_targets)
    assert options["batch"] == config.batch_size and options["objective"] == "stepwise"
    assert set(GRPO_FAMILIES) == {"sd3", "flux"}  # the examples/recipes/*_grpo.py scripts
