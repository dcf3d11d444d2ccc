"""Stable Diffusion 3 Flow-GRPO with a KL penalty: SD3Transformer2DModel rolled out with
sampler_from_scheduler(..., sde_noise_level=0.7), groups of group_size images per prompt,
the clipped surrogate plus the KL to the same transformer with its LoRA adapters off,
any gradest estimator for stepwise objectives.

    python examples/recipes/sd3_grpo.py --tiny --out runs/sd3_grpo_tiny     # CPU, seconds
    accelerate launch examples/recipes/sd3_grpo.py \\
        --pretrained /models/stable-diffusion-3-medium-diffusers \\
        --embeddings prompts_sd3.pt --estimator sdo --mixed-precision bf16

Settings: docs/recipes.md (RL recipes), or --help.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

try:
    from gradest_recipes.train import main as run_recipe
    from gradest_recipes.train import script_main
except ModuleNotFoundError as err:  # one line naming the fix, not a traceback
    missing = (err.name or "a package").partition(".")[0]
    sys.exit(
        f"{__file__.rsplit('/', 1)[-1]}: error: {missing} is not installed; the recipes need "
        f"it: pip install . ./apps/recipes (from the gradest repository root)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_recipe(argv, family="sd3", objective="grpo")


if __name__ == "__main__":
    sys.exit(script_main("sd3", objective="grpo"))  # a bad setting: one line, exit 2
