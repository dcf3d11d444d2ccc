"""Stable Diffusion 1.x/2.x reward fine-tuning: UNet2DConditionModel + DDIMScheduler (through
gradest.integrations.sampler_from_scheduler, with --eta), encoder_hidden_states,
classifier-free guidance, LoRA on the attention projections, any gradest estimator.

    python examples/recipes/sd_unet_reward.py --tiny --out runs/sd_tiny     # CPU, seconds
    accelerate launch examples/recipes/sd_unet_reward.py \\
        --pretrained /models/stable-diffusion-v1-5 --embeddings prompts_sd.pt \\
        --estimator truncated:k=1 --eta 0.0 --mixed-precision fp16

Settings: docs/recipes.md (or --help).
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
    return run_recipe(argv, family="sd_unet")


if __name__ == "__main__":
    sys.exit(script_main("sd_unet"))  # a bad setting: one line on stderr, exit status 2
