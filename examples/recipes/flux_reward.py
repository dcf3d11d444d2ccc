"""Flux reward fine-tuning: FluxTransformer2DModel on packed latents (img_ids / txt_ids),
pooled projections and, for guidance-distilled FLUX.1-dev, the guidance embedding instead
of classifier-free guidance; LoRA on the attention projections, any gradest estimator.

    python examples/recipes/flux_reward.py --tiny --out runs/flux_tiny      # CPU, seconds
    accelerate launch examples/recipes/flux_reward.py \\
        --pretrained /models/FLUX.1-dev --embeddings prompts_flux.pt \\
        --estimator sdo --mixed-precision bf16 --gradient-checkpointing

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
    return run_recipe(argv, family="flux")


if __name__ == "__main__":
    sys.exit(script_main("flux"))  # a bad setting: one line on stderr, exit status 2
