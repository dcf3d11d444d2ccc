"""The recipes' EMA of the LoRA weights: diffusers' ``EMAModel`` on Flow-GRPO's schedule.

Flow-GRPO's ``scripts/train_sd3.py`` keeps an EMA of the trainable parameters with its
``EMAModuleWrapper(decay=0.9, update_step_interval=8)``: after optimizer step ``s`` (the
steps taken so far, its ``global_step``) it updates only when ``(s + 1) % 8 == 0``, by

    ema <- ema + (1 - d_s) (param - ema),    d_s = min((1 + s) / (10 + s), decay)

so early updates follow the weights closely and the decay reaches 0.9 from ``s = 80``.
diffusers' ``EMAModel`` (what diffusers' training scripts use, and what the recipes
checkpoint: ``shadow_params``, ``optimization_step``, ``decay``) updates at every call with
``d = min(s / (9 + s), decay)``, one step behind. :class:`IntervalEMA` is ``EMAModel`` with
Flow-GRPO's decay and interval, so a recipe's EMA is Flow-GRPO's and its checkpoints keep
diffusers' format. With ``every = 1`` it updates after every optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from diffusers.training_utils import EMAModel

__all__ = ["IntervalEMA", "ema_decay_at"]


def ema_decay_at(step: int, decay: float) -> float:
    """Flow-GRPO's decay after ``step`` optimizer steps: ``min((1 + s) / (10 + s), decay)``."""
    return min((1 + step) / (10 + step), decay)


class IntervalEMA(EMAModel):  # type: ignore[misc]  # diffusers is untyped
    """diffusers' ``EMAModel`` updated every ``every``-th optimizer step with Flow-GRPO's
    decay (see the module docstring). Call :meth:`step` after every optimizer step;
    ``optimization_step`` counts them all, updated or not, and is checkpointed.

    Args:
        parameters: the trainable parameters (the EMA starts as their copy).
        decay: the largest decay (Flow-GRPO's 0.9).
        every: the update interval in optimizer steps (Flow-GRPO's 8).
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], decay: float, every: int):
        super().__init__(parameters, decay=decay)
        self.every = every

    def get_decay(self, optimization_step: int) -> float:
        return ema_decay_at(optimization_step, self.decay)

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        # The steps taken once this call counts: Flow-GRPO's global_step at its ema.step.
        steps = self.optimization_step + 1
        if (steps + 1) % self.every:
            self.optimization_step = steps  # counted, not applied
            return
        super().step(parameters)  # counts to ``steps``, then updates with get_decay(steps)
