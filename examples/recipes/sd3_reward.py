"""Stable Diffusion 3 reward fine-tuning: SD3Transformer2DModel + FlowMatchEulerDiscreteScheduler,
LoRA on the attention projections, classifier-free guidance, any gradest estimator.

    python examples/recipes/sd3_reward.py --tiny --out runs/sd3_tiny        # CPU, seconds
    accelerate launch examples/recipes/sd3_reward.py \\
        --pretrained /models/stable-diffusion-3-medium-diffusers \\
        --embeddings prompts_sd3.pt --estimator jagg:window=4 --mixed-precision bf16

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
    return run_recipe(argv, family="sd3")


if __name__ == "__main__":
    sys.exit(script_main("sd3"))  # a bad setting: one line on stderr, exit status 2
