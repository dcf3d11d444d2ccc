"""Reward fine-tuning recipes for diffusers models: LoRA, accelerate, any gradest estimator.

One concern per module:

* :mod:`~gradest_recipes.config`: every setting (a frozen attrs class), TOML files and
  command-line overrides, validation with the setting's name and the fix.
* :mod:`~gradest_recipes.families`: SD3, Flux, SD 1.x/2.x and SDXL UNets: denoiser, VAE,
  scheduler, gradest sampler, conditioning (tiny random ones with ``tiny = true``);
  guidance is the library's (:mod:`gradest.integrations.guidance`).
* :mod:`~gradest_recipes.rewards`: rewards on VAE-decoded images; ``module:function`` hooks;
  :mod:`~gradest_recipes.reward_sums`: a weighted sum of them (Flow-GRPO's ``multi_score``);
  :mod:`~gradest_recipes.reward_folder`: a learned reward's folder built from local files
  (``python -m gradest_recipes.reward_folder``).
* :mod:`~gradest_recipes.embeddings` / :mod:`~gradest_recipes.prompts`: the precomputed
  prompt embeddings file, and writing it with the real text encoders.
* :mod:`~gradest_recipes.checkpoints`: ``accelerator.save_state`` with LoRA-only weights.
* :mod:`~gradest_recipes.rl_objectives`: the RL recipes' rollouts and objectives
  (Flow-GRPO with a KL to the adapters-off model, adjoint matching);
  :mod:`~gradest_recipes.grpo_epoch`: a grpo step as one epoch of Flow-GRPO's script.
* :mod:`~gradest_recipes.ema`: the EMA of the LoRA weights on Flow-GRPO's schedule.
* :mod:`~gradest_recipes.lora_start`: a warm start from an existing LoRA (``lora_path``).
* :mod:`~gradest_recipes.evaluation`: held-out prompts sampled deterministically, scored
  with the EMA weights (Flow-GRPO's evaluation loop).
* :mod:`~gradest_recipes.train`: the loop; ``examples/recipes/*_reward.py``,
  ``*_grpo.py`` and ``*_adjoint_matching.py`` call its ``main``.

Needs diffusers, peft and accelerate (``pip install 'gradest[integrations,recipes]'``);
docs/recipes.md describes the recipes, their settings and what was tested.
"""

from gradest_recipes.config import RecipeConfig, load_config
from gradest_recipes.errors import RecipeConfigError

__all__ = ["RecipeConfig", "RecipeConfigError", "load_config"]
