"""Stable Diffusion XL reward fine-tuning: SDXL's UNet2DConditionModel (text_time
conditioning: encoder_hidden_states + the nested added_cond_kwargs text_embeds / time_ids)
+ DDIMScheduler from the model's scheduler config (through
gradest.integrations.sampler_from_scheduler, with --eta), classifier-free guidance, LoRA on
the attention projections, any gradest estimator.

    python examples/recipes/sdxl_reward.py --tiny --out runs/sdxl_tiny     # CPU, seconds
    accelerate launch examples/recipes/sdxl_reward.py \\
        --pretrained /models/stable-diffusion-xl-base-1.0 --embeddings prompts_sdxl.pt \\
        --estimator truncated:k=1 --mixed-precision fp16 --gradient-checkpointing

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
    return run_recipe(argv, family="sdxl")


if __name__ == "__main__":
    sys.exit(script_main("sdxl"))  # a bad setting: one line on stderr, exit status 2
