"""Flux adjoint matching: FluxTransformer2DModel rolled out with the memoryless sampler
(gradest.rl.memoryless_flow on the scheduler's grid with FluxPipeline's sigmas and mu),
the lean adjoint of -reward_multiplier * reward with the LoRA adapters off (the base
model), the regression loss on every step's velocity, any stepwise gradest estimator.

    python examples/recipes/flux_adjoint_matching.py --tiny --out runs/flux_am_tiny   # CPU
    accelerate launch examples/recipes/flux_adjoint_matching.py \\
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
    return run_recipe(argv, family="flux", objective="adjoint_matching")


if __name__ == "__main__":
    sys.exit(script_main("flux", objective="adjoint_matching"))  # a bad setting: one line, exit 2
