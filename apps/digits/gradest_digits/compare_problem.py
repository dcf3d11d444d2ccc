"""``gradest compare --model digits``: the shipped digits DiT with its classifier reward.

Registered under the ``gradest.problems`` entry-point group. The DiT pretrained on real
8x8 digits is sampled unconditionally; the terminal objective is the frozen digit
classifier's ``-log p(3 | x)`` (the reward fine-tuning objective), the stepwise one a
per-step loss on the velocities.
"""

from __future__ import annotations

import torch
from gradest_lab.compare.problems import Problem, seeded_noise

from gradest import RectifiedFlow, TerminalObjective
from gradest.plugin import Objective
from gradest.testing import random_stepwise_objective
from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
from gradest_digits.datasets import DIGITS
from gradest_digits.rewards import ClassifierReward

TARGET_DIGIT = 3


def digits_problem(
    *,
    steps: int,
    objective: str,
    batch: int = 8,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Problem:
    """The digits DiT and a terminal (classifier reward) or stepwise objective."""
    del seed  # the model is the shipped one; seeds pick the noise only
    model = load_pretrained_dit(device=device, dtype=dtype)
    if objective == "terminal":
        reward = ClassifierReward(load_digit_classifier(device=device, dtype=dtype), TARGET_DIGIT)
        objective_value: Objective = TerminalObjective(lambda z: -reward(z).mean())
    else:
        objective_value = random_stepwise_objective(steps, (batch, *DIGITS.image_shape), seed=2)

    noise_fn = seeded_noise((batch, *DIGITS.image_shape), dtype=dtype, device=device)
    return Problem(model, RectifiedFlow(steps=steps), objective_value, noise_fn, lambda s: {})
