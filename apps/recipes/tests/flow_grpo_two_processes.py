"""One grpo step of the recipe and Flow-GRPO's update written by hand, on two processes.

Run by ``apps/recipes/tests/test_flow_grpo_inner_epochs.py`` as
``torchrun --nproc_per_node 2 flow_grpo_two_processes.py OUT [setting=value ...]`` (gloo,
CPUs). Each process:

1. runs :func:`test_flow_grpo_inner_epochs.hand_grpo_step` on a fresh tiny family (the
   same LoRA init) with this process's share of the recipe's draws, the rewards and
   prompts gathered with ``torch.distributed.all_gather`` for the per-prompt statistics,
   and the gradients averaged with ``all_reduce`` before clipping: Flow-GRPO's
   ``train_sd3.py`` on two GPUs, with its CFG (``noise_pred_uncond.detach()``);
2. runs the recipe (``gradest_recipes.train.train``, tiny SD3 with CFG, ``exact``) for one
   step in ``OUT/run``: accelerate's DDP over the two processes, on the same group;
3. writes ``OUT/rank_R.json``: the largest change of a LoRA weight in the hand loop
   (``moved``) and the largest difference between the two loops' weights (``gap``).

Settings given as ``key=value`` (values read as Python literals) override the recipe's,
e.g. ``detach_unconditional=False``: the hand loop keeps Flow-GRPO's detached guidance.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_flow_grpo_inner_epochs import (  # noqa: E402
    SETTINGS,
    Processes,
    hand_on_fresh_family,
    tiny,
    trainable,
)

# The hand loop always follows Flow-GRPO: only the recipe takes these overrides.
RECIPE_ONLY = frozenset({"detach_unconditional"})


def main(out: Path, overrides: dict[str, object]) -> None:
    from gradest_recipes.config import load_config
    from gradest_recipes.rewards import resolve_reward
    from gradest_recipes.rl_objectives import per_sample_reward
    from gradest_recipes.train import train

    shared = {
        **SETTINGS,
        "lr": 3e-4,
        **{k: v for k, v in overrides.items() if k not in RECIPE_ONLY},
    }
    settings = {"tiny": True, "objective": "grpo", "estimator": "exact", "steps": 1,
                "out": str(out / "run"), "report_to": "none", **shared,
                **{k: v for k, v in overrides.items() if k in RECIPE_ONLY}}  # fmt: skip
    # The hand loop first, on the process group torchrun's environment describes; the
    # recipe's accelerate then runs on the same group and ends it (end_training).
    torch.distributed.init_process_group("gloo")
    processes = Processes(torch.distributed.get_rank(), torch.distributed.get_world_size())
    config, embeddings, family = tiny(torch.float32, **shared)
    reward = resolve_reward(config.reward)

    def reward_of(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        prompts = [embeddings.prompts[int(i)] for i in rows]
        return per_sample_reward(reward, family.vae, family.to_vae_latents, prompts)(z)

    start = [p.detach().clone() for p in trainable(family.velocity)]  # the LoRA init
    hand = hand_on_fresh_family(shared, torch.float32, reward_of=reward_of, processes=processes)
    theirs = [p.detach() for p in trainable(hand.velocity)]
    run = train("sd3", load_config("sd3", overrides=settings))
    mine = [p.detach() for p in trainable(run.family.velocity)]
    moved = max(float((b - a).abs().max()) for a, b in zip(start, theirs, strict=True))
    gap = max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True))
    result = {"moved": moved, "gap": gap, "parameters": len(mine)}
    (out / f"rank_{processes.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    given = dict(arg.split("=", 1) for arg in sys.argv[2:])
    main(folder, {key: ast.literal_eval(value) for key, value in given.items()})
