"""The recipes' evaluation on held-out prompts, as Flow-GRPO evaluates during training.

Flow-GRPO's ``scripts/train_sd3.py`` (``yifan123/flow_grpo``) evaluates at every epoch
divisible by ``eval_freq`` (epoch 0, the base model, included): it samples each prompt of
a test set once with ``sample.eval_num_steps`` (40) deterministic steps (its SDE with
``noise_level=0``, which is the flow ODE's Euler step) at the training's CFG scale, with
the EMA weights when it keeps an EMA (``ema.copy_ema_to(..., store_temp=True)``, then
``copy_temp_to`` back), scores the images with the reward, gathers the scores of every
process and logs their mean as ``eval_reward_<name>``.

The recipes do the same with these differences, each so that the number is a fixed test
of the model that cannot disturb the training:

* **Held-out prompts.** ``eval_prompts = n`` holds the embeddings' last ``n`` prompts out
  of training (:func:`hold_out`): the run trains on the others only, and a held-out
  prompt whose text is also a training prompt is refused. A run with ``eval_every = 0``
  keeps the same split and trains exactly as one that evaluates.
* **Fixed noise.** The initial noise of held-out row ``r`` of the embeddings comes from a
  generator seeded by ``(EVAL_SEED, EVAL, r)`` (:data:`EVAL`), independent of ``seed``,
  the processes and the batching: every evaluation of every run scores the same
  (prompt, noise) pairs, so evaluations compare across steps and runs. Flow-GRPO draws it
  from the global generator, which moves the training's random streams; here no global
  generator is drawn from (and the evaluation runs under ``torch.random.fork_rng``).
* **A deterministic sampler.** :func:`eval_sampler`: Euler steps of the flow ODE on the
  family's flow-matching grid with ``eval_num_inference_steps`` steps (sd_unet, sdxl:
  DDIM with ``eta = 0`` on their grid), the model in eval mode.
* **No padding in the mean.** Flow-GRPO's distributed sampler repeats test prompts to fill
  the last batch of every process, and the repeats enter the mean; here each process
  scores its share (rows ``rank, rank + world, ...``), only real rows are scored, and the
  mean is the gathered sum over the gathered count (:func:`eval_batches`). Every process
  still runs the same number of sampling calls (a process with fewer rows samples a
  one-row stand-in batch it does not score), as FSDP's collectives need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradest_recipes.config import RecipeConfig
from gradest_recipes.embeddings import PromptEmbeddings
from gradest_recipes.errors import RecipeConfigError
from gradest_recipes.families import UNET_FAMILIES, Family, flux_sigmas

__all__ = [
    "EVAL",
    "EVAL_SEED",
    "PER_PROMPT",
    "EvalBatch",
    "ema_weights",
    "eval_batches",
    "eval_mode",
    "eval_sampler",
    "evaluates_at",
    "hold_out",
    "random_state_kept",
]

#: The evaluation's generator stream (train.py has 0 to 3, grpo_epoch.py 4 and 5).
EVAL = 6
#: The seed of the evaluation's noise: fixed, not the run's ``seed``, so that runs of
#: different seeds are scored on the same noise.
EVAL_SEED = 0
#: The embeddings' tensors with one row per prompt (the others are shared by every prompt:
#: the negative prompt's, Flux's ``text_ids``).
PER_PROMPT = ("prompt_embeds", "pooled_prompt_embeds")


def _rows(embeddings: PromptEmbeddings, rows: slice) -> PromptEmbeddings:
    """The prompts ``rows`` of ``embeddings`` (their per-prompt tensors' rows, the shared
    tensors as they are)."""
    tensors = {k: v[rows] if k in PER_PROMPT else v for k, v in embeddings.tensors.items()}
    return PromptEmbeddings(
        family=embeddings.family, prompts=embeddings.prompts[rows], tensors=tensors
    )


def hold_out(
    embeddings: PromptEmbeddings, count: int
) -> tuple[PromptEmbeddings, PromptEmbeddings | None]:
    """``(training, held_out)``: the first ``P - count`` prompts of ``embeddings`` and its
    last ``count`` (``count = 0``: all of them and None).

    Raises:
        RecipeConfigError: ``count`` leaves no prompt to train on, or a held-out prompt's
            text is also a training prompt (it would be trained on): one line naming the
            setting, the prompt and its rows.
    """
    if count == 0:
        return embeddings, None
    total = embeddings.count
    if count >= total:
        raise RecipeConfigError(
            f"setting eval_prompts={count} is invalid: the embeddings hold {total} prompt"
            f"{'s' if total != 1 else ''} and at least one must be left to train on; hold "
            f"out fewer (the last eval_prompts prompts are held out)"
        )
    kept = total - count
    training, held_out = _rows(embeddings, slice(0, kept)), _rows(embeddings, slice(kept, None))
    trained = {prompt: row for row, prompt in enumerate(training.prompts)}
    for offset, prompt in enumerate(held_out.prompts):
        if prompt in trained:
            raise RecipeConfigError(
                f"setting eval_prompts={count} is invalid: the held-out prompt {prompt!r} "
                f"(row {kept + offset}) is also training prompt row {trained[prompt]}, so it "
                f"would be trained on; remove the repeat from the embeddings' prompts"
            )
    return training, held_out


def evaluates_at(config: RecipeConfig, step: int, *, last: bool) -> bool:
    """Whether the run evaluates after ``step`` steps (``step = 0``: before training):
    with ``eval_every > 0`` at step 0, every ``eval_every`` steps and at the last step."""
    return config.eval_every > 0 and (step % config.eval_every == 0 or last)


def eval_sampler(family: Family, config: RecipeConfig) -> Any:
    """The evaluation's deterministic sampler with ``eval_num_inference_steps`` steps on
    the family's grid: ``gradest.RectifiedFlow`` (Euler steps of the flow ODE) on the
    scheduler's sigmas for sd3 and flux (also when the scheduler samples stochastically),
    DDIM with ``eta = 0`` for sd_unet and sdxl."""
    from gradest import RectifiedFlow
    from gradest.integrations.diffusers import sampler_from_scheduler

    steps = config.eval_num_inference_steps
    if family.name in UNET_FAMILIES:
        return sampler_from_scheduler(family.scheduler, steps, eta=0.0)
    options = dict(family.schedule_options)
    if "sigmas" in options:  # Flux: FluxPipeline's default sigmas, for this many steps
        options["sigmas"] = flux_sigmas(steps)
    grid = sampler_from_scheduler(family.scheduler, steps, **options)
    return RectifiedFlow(times=grid.times)


class EvalBatch:
    """One sampling call of an evaluation on one process.

    Attributes:
        rows: ``[B]`` rows of the held-out embeddings to sample.
        scored: how many of them (the first) are scored; 0 for a stand-in batch that only
            keeps the processes' sampling calls in step.
    """

    __slots__ = ("rows", "scored")

    def __init__(self, rows: Tensor, scored: int):
        self.rows, self.scored = rows, scored


def eval_batches(count: int, rank: int, world: int, batch_size: int) -> list[EvalBatch]:
    """Process ``rank``'s batches of the ``count`` held-out rows: its share ``rank, rank +
    world, ...`` in batches of ``batch_size``, then stand-in batches (row ``0``, not
    scored) up to the number of batches the largest share takes, so that every process
    makes the same number of sampling calls."""
    mine = torch.arange(count)[rank::world]  # empty when there are fewer rows than processes
    most = -(-count // world)  # the largest share
    calls = -(-most // batch_size)
    batches = [
        EvalBatch(part, int(part.numel())) for part in torch.split(mine, batch_size) if part.numel()
    ]
    batches += [EvalBatch(torch.zeros(1, dtype=torch.long), 0)] * (calls - len(batches))
    return batches


@contextlib.contextmanager
def ema_weights(ema: Any, parameters: Sequence[nn.Parameter]) -> Iterator[None]:
    """Inside, ``parameters`` hold ``ema``'s weights (``ema.copy_to``; ``ema`` None: the
    trained weights, unchanged); afterwards the trained weights again, bit for bit (a
    copy of them is written back, as Flow-GRPO's ``store_temp`` / ``copy_temp_to``)."""
    if ema is None:
        yield
        return
    trained = [p.detach().clone() for p in parameters]
    ema.copy_to(parameters)
    try:
        yield
    finally:
        with torch.no_grad():
            for parameter, saved in zip(parameters, trained, strict=True):
                parameter.copy_(saved)


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside (no dropout, as Flow-GRPO samples), and every
    submodule back in its own mode afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def random_state_kept(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The global torch generators (the CPU's and ``device``'s, when a CUDA device) as
    they were before, afterwards: whatever the body draws, the training's random streams
    continue as if it had not run."""
    devices: list[int] = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    return torch.random.fork_rng(devices=devices)
