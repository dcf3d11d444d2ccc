"""Flux Flow-GRPO with a KL penalty: FluxTransformer2DModel (packed latents, guidance
embedding) rolled out with sampler_from_scheduler(..., sde_noise_level=0.7) on
FluxPipeline's sigmas and mu, groups of group_size images per prompt, the clipped surrogate plus the
KL to the same transformer with its LoRA adapters off, any stepwise gradest estimator.

    python examples/recipes/flux_grpo.py --tiny --out runs/flux_grpo_tiny     # CPU, seconds
    accelerate launch examples/recipes/flux_grpo.py \\
        --pretrained /models/FLUX.1-dev \\
        --embeddings prompts_flux.pt --estimator sdo --mixed-precision bf16

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
    return run_recipe(argv, family="flux", objective="grpo")


if __name__ == "__main__":
    sys.exit(script_main("flux", objective="grpo"))  # a bad setting: one line, exit 2
