"""Reward fine-tuning of a flow model with any gradest estimator: the user-facing loop.

Two objectives, one loop (``est.surrogate(...).loss.backward()`` then
``optimizer.step()``, as with any loss):

* ``mode="reward"``: the terminal objective ``L = -mean_b reward(z_N)``, differentiated
  through the deterministic Euler sampler (:class:`gradest.RectifiedFlow`) by the
  estimator (DRaFT / AlignProp / SDO-style direct reward backpropagation).
* ``mode="grpo"``: Flow-GRPO. Each step samples ``batch_size / group_size`` groups with
  the stochastic :class:`~gradest.workloads.sde.FlowSDE`, scores them, normalises the
  rewards within groups into advantages, and takes ``inner_epochs`` optimizer steps on
  the clipped surrogate (:func:`~gradest.workloads.grpo.grpo_objective`) of the recorded
  trajectories, each gradient from the estimator.

Every estimator differentiates the **same recorded path**: the loop samples without a
graph (``gradest.rollout``, timed as ``sample_seconds``) and hands the trajectory to
``est.surrogate(..., trajectory=...)``, whose loss it backpropagates
(``backward_seconds``). That separates the common sampling cost from the estimator's
own; the price is that ``exact`` recomputes the forwards instead of keeping the sampling
graph (``N`` extra forwards; call ``est.surrogate(model, flow, objective, noise=...)``
directly for its fused path).

The JSON log has one line per outer step: ``step``; ``reward_mean`` / ``reward_std`` of
that step's samples (before its update); ``loss`` (the estimator's ``info["loss"]``,
averaged over GRPO's inner epochs, whose per-epoch values are in ``losses``);
``grad_norm`` (before clipping; per epoch in ``grad_norms``); ``sample_seconds`` (the
rollout, the rewards and, for GRPO, advantages and old log-probabilities);
``backward_seconds`` (the estimator's ``surrogate`` calls and their ``loss.backward()``);
``optimizer_seconds``;
``cost`` (the estimators' :class:`~gradest.protocol.Cost` counts summed over the
step's backwards, their ``model_units``, and the rollout's ``sample_forwards``); and
``info`` (:func:`summarize_info` of the estimators' diagnostics, e.g. jagg's
``fallback_fraction``).

Randomness comes only from a ``torch.Generator`` seeded with ``seed``: evaluation
noise, training noise, SDE step noise and the estimators' random draws, in that order.
The same seed on the same machine gives the same run number for number (the JSON log
differs only in the ``*_seconds`` timings).

Under ``torchrun`` the loop is data-parallel: the model is wrapped in
``DistributedDataParallel``, each rank samples its share of the batch with its own
generator, DDP averages the surrogate losses' gradients, and only rank 0 writes (see
:func:`finetune`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

import gradest
from gradest.base import surrogate_from_estimate
from gradest.files import (
    JsonLog,
    atomic_write_text,
    check_output_dir,
    check_output_file,
    remove_stale_temporaries,
)
from gradest.flow import Trajectory, rollout
from gradest.integrations.distributed import (
    check_same_estimator,
    launched_world,
    process_group_from_env,
    rank_generator,
    replicas_in_sync,
)
from gradest.objectives import Objective, TerminalObjective
from gradest.protocol import Cost, Surrogate, is_estimator
from gradest.samplers import LOG_PROB_REDUCTIONS, FlowSDE, RectifiedFlow
from gradest.workloads.grpo import group_advantages, grpo_objective
from gradest.workloads.run_state import (
    check_same_run,
    earlier_run,
    newest_checkpoint,
    save_checkpoint,
)

MODES = ("reward", "grpo")
OPTIMIZERS = ("adamw", "sgd")
LOG_KEYS = (
    "step",
    "reward_mean",
    "reward_std",
    "loss",
    "grad_norm",
    "sample_seconds",
    "backward_seconds",
    "optimizer_seconds",
    "cost",
    "info",
)
# Lists longer than this (per-step cosines of a long chain, ...) are left out of the log.
_MAX_LOGGED_LIST = 64

Reward = Callable[[Tensor], Tensor]


# -- validation (all of it runs before any model call) -----------------------------------


def _check_int(name: str, value: Any, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}; {hint}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {hint}")
    return value


def _check_float(name: str, value: Any, *, positive: bool, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {value!r}; {hint}")
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(
            f"{name} must be a finite float {'> 0' if positive else '>= 0'}, got {value!r}; {hint}"
        )
    return float(value)


def resolve_estimator(estimator: Any) -> Any:
    """A spec string (``"jagg:window=4"``) or an estimator object -> the estimator.

    Spec errors (unknown name, unknown or invalid option) raise here, before any work.
    """
    if isinstance(estimator, str):
        return gradest.estimator(estimator)
    if is_estimator(estimator):
        return estimator
    raise TypeError(
        f"estimator must be a spec string such as 'exact' or 'jagg:window=4', or an "
        f"estimator object with estimate() (and surrogate()); got {type(estimator).__name__}"
    )


def surrogate_loss(est: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``est.surrogate(...)``, or for an estimator without one, the linear surrogate of its
    estimate (:func:`gradest.base.surrogate_from_estimate`) in the same record."""
    if callable(getattr(est, "surrogate", None)):
        return est.surrogate(model, *args, **kwargs)
    result = est.estimate(model, *args, **kwargs)
    return Surrogate(
        loss=surrogate_from_estimate(model, result),
        value=float(result.info.get("loss", float("nan"))),
        cost=result.cost,
        info=result.info,
    )


def _sample_shape(model: torch.nn.Module, sample_shape: Any) -> tuple[int, ...]:
    if sample_shape is not None:
        shape = tuple(sample_shape)
        if not shape or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise ValueError(
                f"sample_shape must be a tuple of positive ints (one sample, no batch "
                f"dimension), e.g. (1, 8, 8); got {sample_shape!r}"
            )
        return shape
    config = getattr(model, "config", None)
    size, channels = getattr(config, "input_size", None), getattr(config, "in_channels", None)
    if isinstance(size, int) and isinstance(channels, int):
        return (channels, size, size)
    raise ValueError(
        f"cannot infer the sample shape of {type(model).__name__}; pass sample_shape=(C, H, W) "
        f"(one sample, without the batch dimension)"
    )


def _cond(labels: Any, batch: int, device: torch.device, key: str) -> dict[str, Tensor] | None:
    """The model's conditioning: ``{key: [B] labels}``, or None for an unconditional call."""
    if labels is None:
        return None
    if isinstance(labels, bool):
        raise TypeError(f"labels must be None, an int class or a [batch] tensor, got {labels!r}")
    if isinstance(labels, int):
        return {key: torch.full((batch,), labels, dtype=torch.long, device=device)}
    if isinstance(labels, Tensor) and labels.shape == (batch,) and not labels.is_floating_point():
        return {key: labels.to(device=device, dtype=torch.long)}
    shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
    raise ValueError(
        f"labels must be None, an int class, or an integer tensor of shape [batch_size] = "
        f"[{batch}], got {shape}"
    )


def _reward_values(reward: Reward, images: Tensor) -> Tensor:
    """``reward(images)`` checked to be a ``[B]`` tensor (finite or not)."""
    values = reward(images)
    if not isinstance(values, Tensor) or values.shape != images.shape[:1]:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(
            f"reward(images) must return one reward per sample, shape [{images.shape[0]}], got "
            f"{shape}; do not reduce over the batch"
        )
    return values


def _require_finite_rewards(values: Tensor) -> Tensor:
    if not bool(torch.isfinite(values).all()):
        raise FloatingPointError(
            "reward(images) returned NaN or Inf; the samples may have diverged (lower lr)"
        )
    return values


def _rewards(reward: Reward, images: Tensor) -> Tensor:
    """``reward(images)`` checked to be a finite ``[B]`` tensor."""
    return _require_finite_rewards(_reward_values(reward, images))


def _check_world(mode: str, batch_size: int, group_size: int, world: int) -> int:
    """The per-rank batch ``batch_size / world``, checked to split evenly (and, for GRPO,
    into whole groups: advantages are normalised within a group, so a group must not
    straddle two ranks)."""
    if batch_size % world:
        raise ValueError(
            f"batch_size={batch_size} is the global batch and must be divisible by the world "
            f"size {world} (each rank samples batch_size / world_size); e.g. "
            f"batch_size={world * max(1, batch_size // world)}"
        )
    local = batch_size // world
    if mode == "grpo" and local % group_size:
        suggestion = world * group_size * max(1, local // group_size)
        raise ValueError(
            f"in mode='grpo' the per-rank batch batch_size / world_size = {batch_size} / {world} "
            f"= {local} must be a multiple of group_size={group_size}, so that no group "
            f"straddles two ranks; e.g. batch_size={suggestion}"
        )
    return local


def _gather(values: Tensor, world: int) -> Tensor:
    """Every rank's ``[b]`` tensor, concatenated in rank order (the global batch)."""
    parts = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts)


def _mean_across_ranks(
    values: Sequence[float | None], world: int, device: torch.device
) -> list[float | None]:
    """Each value averaged over the ranks (None, i.e. not reported, stays None)."""
    local = torch.tensor(
        [math.nan if v is None else v for v in values], dtype=torch.float64, device=device
    )
    dist.all_reduce(local)
    return [None if math.isnan(v) else v / world for v in local.tolist()]


# -- the loop ----------------------------------------------------------------------------


def summarize_info(infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON-friendly part of the estimators' ``result.info`` over one step's backwards.

    Numbers are averaged over the backwards (e.g. jagg's ``fallback_fraction`` over
    GRPO's inner epochs); strings, booleans and short flat lists are kept from the last
    one (sdo's ``sampled_steps``, jagg's ``gate_cosines``); nested lists are dropped.
    """
    summary: dict[str, Any] = {}
    if not infos:
        return summary
    for key, last in infos[-1].items():
        if isinstance(last, bool | str):
            summary[key] = last
        elif isinstance(last, int | float):
            values = [float(info[key]) for info in infos if isinstance(info.get(key), int | float)]
            # Equal values (truncated's fixed k) keep their type; others are averaged.
            summary[key] = last if len(set(values)) == 1 else sum(values) / len(values)
        elif isinstance(last, list | tuple) and len(last) <= _MAX_LOGGED_LIST:
            if all(isinstance(x, int | float) and not isinstance(x, bool) for x in last):
                summary[key] = list(last)
    return summary


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if len(present) == len(values) else None


def _cost_record(cost: Cost, sample_forwards: int) -> dict[str, Any]:
    return {
        "forwards_with_graph": cost.forwards_with_graph,
        "forwards_without_graph": cost.forwards_without_graph,
        "param_vjps": cost.param_vjps,
        "state_vjps": cost.state_vjps,
        "model_units": cost.model_units(),
        "sample_forwards": sample_forwards,
    }


def _grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _rng_states(
    generator: torch.Generator, distributed: bool, world: int
) -> tuple[list[Tensor], list[Tensor]]:
    """Every rank's training generator and global torch RNG state, in rank order."""
    mine = (generator.get_state(), torch.get_rng_state())
    if not distributed:
        return [mine[0]], [mine[1]]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return [g for g, _ in gathered], [r for _, r in gathered]


def finetune(
    model: torch.nn.Module,
    reward: Reward,
    *,
    estimator: Any = "exact",
    mode: str = "reward",
    steps: int = 10,
    batch_size: int = 8,
    lr: float = 1e-4,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    max_grad_norm: float | None = None,
    seed: int = 0,
    sampler_steps: int = 10,
    labels: int | Tensor | None = None,
    cond_key: str = "y",
    sample_shape: tuple[int, ...] | None = None,
    group_size: int = 4,
    inner_epochs: int = 2,
    clip: float = 0.2,
    noise_level: float = 0.7,
    log_prob_reduction: str = "sum",
    log_path: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    progress: bool = True,
    resume: str | Path | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` (in place) to raise ``reward`` of its samples.

    Args:
        model: velocity model called as ``model(z, t, **cond)``; its trainable
            parameters are updated.
        reward: ``reward(images [B, ...]) -> [B]``, higher is better; differentiable in
            the images for ``mode="reward"`` (e.g. ``ClassifierReward(classifier, 3)``).
        estimator: a spec string (``"exact"``, ``"jagg:window=4"``, ``"sdo:samples=2"``,
            ``"truncated:k=2"``) or an estimator object.
        mode: ``"reward"`` (terminal ``-reward`` through the ODE sampler) or ``"grpo"``
            (Flow-GRPO clipped surrogate on FlowSDE rollouts); see the module docstring.
        steps: outer steps (``reward``: one optimizer step each; ``grpo``: one batch of
            rollouts, then ``inner_epochs`` optimizer steps).
        batch_size: samples per step, over all ranks (``grpo``: a multiple of
            ``group_size``; with several ranks, divisible by the world size, and the
            per-rank share a multiple of ``group_size``).
        lr, optimizer, weight_decay: ``torch.optim.AdamW`` or plain ``SGD``.
        max_grad_norm: clip the total gradient norm to this (None: no clipping).
        seed: seeds the run's only ``torch.Generator`` (several ranks: the evaluation
            generator, and each rank's training generator via ``rank_generator(seed)``).
        sampler_steps: ``N``, steps of the sampler.
        labels: the model's class condition, passed as ``cond={cond_key: labels}``:
            None (unconditional call), an int for every sample, or a ``[batch_size]``
            integer tensor (several ranks: rank ``r`` trains on its consecutive slice).
        sample_shape: one sample's shape; inferred from a DiT's config when None.
        group_size, inner_epochs, clip, noise_level, log_prob_reduction: GRPO's group
            size, optimizer steps per batch, PPO clip range, FlowSDE ``noise_level``,
            and the reduction of :meth:`FlowSDE.step_log_prob`.
        log_path: append one JSON line per step (keys :data:`LOG_KEYS` plus mode
            extras); every line is written whole (:class:`gradest.files.JsonLog`).
        checkpoint_dir: write ``step_XXXXXX.pt`` every ``checkpoint_every`` steps (0:
            only at the end), atomically: the model and optimizer state, every rank's
            generator and torch RNG state, the step, the config, the history and the
            initial reward (:mod:`gradest.workloads.run_state`; loadable with
            ``torch.load(weights_only=True)``).
        progress: show a tqdm progress bar.
        resume: a checkpoint file, or a folder of them (or a ``gradest finetune --out``
            folder): continue from the newest checkpoint that loads. The settings must be
            the checkpoint's (``steps`` may be larger); the continued run ends with
            bitwise the parameters of an uninterrupted one, and its log is cut back to
            the checkpoint's step before it goes on. Without ``resume``, a ``log_path``
            that already holds records or a ``checkpoint_dir`` that holds checkpoints is
            refused (two runs never mix in one place).

    Returns:
        ``{"initial_reward", "final_reward", "final_reward_std", "history", "checkpoints",
        "log_path", "config", "rank", "world_size", "ranks_in_sync"}``: the rewards are
        means on a fixed evaluation batch (drawn first from the seeded generator, sampled
        with the ODE) before and after training; ``history`` holds the logged records;
        ``ranks_in_sync`` is None for one process, else whether all replicas ended bit
        for bit equal (False also warns).

    Raises:
        ValueError / TypeError: invalid arguments or estimator spec, an output path that
            cannot be written (:class:`gradest.files.OutputError`), or a run that cannot be
            resumed, all before any model call.

    Data parallelism (``torchrun --nproc_per_node=R ...``): when ``WORLD_SIZE > 1`` and
    no default process group exists, one is initialized from the environment (``gloo``,
    or ``nccl`` for a CUDA model; each rank needs its own GPU) and destroyed on return;
    a group the caller initialized is used and left as is. Every rank starts from rank
    0's weights (the model is wrapped in ``DistributedDataParallel``), samples
    ``batch_size / R`` of the batch with its own generator (``rank_generator(seed)``),
    backpropagates its surrogate loss (DDP averages the gradients) and takes the same
    optimizer step, so the replicas stay equal. The estimators' random draws and gates are
    rank 0's (:mod:`gradest.ranks`), so every rank makes the same model calls. The
    evaluation batch is the global one on every rank. Only rank 0 writes the log and
    checkpoints and shows the progress bar (other ranks return ``log_path=None`` and no
    checkpoints). Logged rewards and
    losses are over the global batch; ``cost`` and ``info`` are rank 0's own.
    """
    # -- everything is validated before the first model call --
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(reward):
        raise TypeError(
            f"reward must be a callable images [B, ...] -> rewards [B], got {type(reward).__name__}"
        )
    _check_int("steps", steps, 1, "e.g. steps=50")
    _check_int("batch_size", batch_size, 1, "e.g. batch_size=16")
    _check_int("sampler_steps", sampler_steps, 1, "e.g. sampler_steps=10")
    _check_int("checkpoint_every", checkpoint_every, 0, "0 saves only the final checkpoint")
    _check_int("seed", seed, 0, "any non-negative int")
    lr = _check_float("lr", lr, positive=True, hint="e.g. lr=1e-4")
    weight_decay = _check_float("weight_decay", weight_decay, positive=False, hint="e.g. 0.0")
    if max_grad_norm is not None:
        max_grad_norm = _check_float("max_grad_norm", max_grad_norm, positive=True, hint="or None")
    if checkpoint_every and checkpoint_dir is None:
        raise ValueError(
            f"checkpoint_every={checkpoint_every} needs checkpoint_dir= (a folder to write to)"
        )
    if mode == "grpo":
        _check_int("group_size", group_size, 2, "advantages compare samples within a group")
        _check_int("inner_epochs", inner_epochs, 1, "Flow-GRPO uses 1-2")
        if batch_size % group_size:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of group_size={group_size} in "
                f"mode='grpo'; e.g. batch_size={group_size * max(1, batch_size // group_size)}"
            )
        if not (isinstance(clip, int | float) and not isinstance(clip, bool) and 0 < clip < 1):
            raise ValueError(f"clip must be in (0, 1), got {clip!r}; Flow-GRPO uses 0.2")
        noise_level = _check_float(
            "noise_level", noise_level, positive=True, hint="Flow-GRPO uses 0.7"
        )
        if log_prob_reduction not in LOG_PROB_REDUCTIONS:
            raise ValueError(
                f"log_prob_reduction must be one of {', '.join(LOG_PROB_REDUCTIONS)}, "
                f"got {log_prob_reduction!r}"
            )
    if log_path is not None:
        log_path = check_output_file(log_path, what="log_path")
    if checkpoint_dir is not None:
        checkpoint_dir = check_output_dir(checkpoint_dir, what="checkpoint_dir")
    resumed = None
    if resume is not None:
        resumed = newest_checkpoint(resume)
        if resumed is None:
            warnings.warn(
                f"resume={str(resume)!r}: no checkpoint was written before the run stopped; "
                f"starting it over from step 0",
                RuntimeWarning,
                stacklevel=2,
            )
    else:
        found = earlier_run(log_path, checkpoint_dir)
        if found is not None:
            # Two runs never mix in one place.
            raise ValueError(
                f"an earlier run wrote to log_path / checkpoint_dir ({found}); continue it "
                f"with resume=<its folder>, or pass new paths"
            )
    est = resolve_estimator(estimator)
    check_steps = getattr(est, "check_steps", None)
    if callable(check_steps):
        check_steps(sampler_steps)  # options that need more steps than N, before any work
    # Under torchrun the world size is known from the environment before any group
    # exists, so a batch that does not split evenly fails here, on every rank alike.
    _, world = launched_world()
    local_batch = _check_world(mode, batch_size, group_size, world)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # The loop wraps the bare module itself once the process group exists.
        model = model.module
    shape = _sample_shape(model, sample_shape)
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError(
            f"model {type(model).__name__} has no parameters with requires_grad=True; "
            f"unfreeze the ones to fine-tune"
        )
    device = parameters[0].device
    eval_cond = _cond(labels, batch_size, device, cond_key)

    config: dict[str, Any] = {
        "estimator": repr(est),
        "mode": mode,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "optimizer": optimizer,
        "weight_decay": weight_decay,
        "max_grad_norm": max_grad_norm,
        "seed": seed,
        "sampler_steps": sampler_steps,
        "labels": labels if labels is None or isinstance(labels, int) else labels.tolist(),
        "sample_shape": list(shape),
        "world_size": world,
    }
    if mode == "grpo":
        config.update(
            group_size=group_size,
            inner_epochs=inner_epochs,
            clip=float(clip),
            noise_level=noise_level,
            log_prob_reduction=log_prob_reduction,
        )

    if resumed is not None:
        check_same_run(resumed["config"], config)
        if resumed["step"] > steps:
            raise ValueError(
                f"the checkpoint is at step {resumed['step']}, past steps={steps}; pass "
                f"steps >= {resumed['step']} to continue the run"
            )

    with process_group_from_env(device) as (rank, world):
        return _train(
            model,
            reward,
            est,
            config,
            rank=rank,
            world=world,
            local_batch=local_batch,
            parameters=parameters,
            shape=shape,
            eval_cond=eval_cond,
            log_path=log_path,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            progress=progress,
            resumed=resumed,
        )


def _train(
    model: torch.nn.Module,
    reward: Reward,
    est: Any,
    config: dict[str, Any],
    *,
    rank: int,
    world: int,
    local_batch: int,
    parameters: list[torch.nn.Parameter],
    shape: tuple[int, ...],
    eval_cond: dict[str, Tensor] | None,
    log_path: str | Path | None,
    checkpoint_dir: str | Path | None,
    checkpoint_every: int,
    progress: bool,
    resumed: dict[str, Any] | None,
) -> dict[str, Any]:
    """The loop of :func:`finetune`, on validated arguments, inside the process group."""
    mode, steps, batch_size = config["mode"], config["steps"], config["batch_size"]
    sampler_steps, max_grad_norm = config["sampler_steps"], config["max_grad_norm"]
    lr, weight_decay = config["lr"], config["weight_decay"]
    group_size, inner_epochs = config.get("group_size", 0), config.get("inner_epochs", 1)
    dtype, device = parameters[0].dtype, parameters[0].device
    distributed, main = world > 1, rank == 0
    # The evaluation batch is the global one, identical on every rank (same seed), so
    # every rank computes the same initial and final rewards.
    eval_generator = torch.Generator().manual_seed(config["seed"])
    # One process: one stream (evaluation noise, then training noise, SDE noise and the
    # estimators' draws). Several ranks: each draws its share of the batch from its own
    # stream, derived from (seed, rank).
    generator = rank_generator(config["seed"], rank=rank) if distributed else eval_generator
    # The rank's consecutive share of the global batch's labels.
    cond = (
        None
        if eval_cond is None
        else {k: v[rank * local_batch : (rank + 1) * local_batch] for k, v in eval_cond.items()}
    )

    ode = RectifiedFlow(steps=sampler_steps)
    train_flow: RectifiedFlow | FlowSDE = (
        ode if mode == "reward" else FlowSDE(sampler_steps, noise_level=config["noise_level"])
    )
    if config["optimizer"] == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(parameters, lr=lr, weight_decay=weight_decay)
    terminal = TerminalObjective(lambda images: -_rewards(reward, images).mean())

    if resumed is not None:
        # Before DDP's constructor, which broadcasts rank 0's weights: every rank loads.
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["optimizer"])
    # DDP's constructor starts every replica from rank 0's weights and buffers; its
    # backward hooks average the surrogate losses' gradients.
    trained: torch.nn.Module = (
        torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
        if distributed
        else model
    )
    if distributed:
        check_same_estimator(est, trained)

    # Fixed evaluation noise, drawn first: every estimator run with this seed is scored
    # on the same samples.
    eval_noise = torch.randn((batch_size, *shape), generator=eval_generator, dtype=dtype).to(device)

    def evaluate() -> Tensor:
        with torch.no_grad():
            final = rollout(model, ode, eval_noise, eval_cond).states[-1]
            return _rewards(reward, final).detach()

    # The evaluation noise came first from a fresh generator; a resumed run drew it again
    # above and now continues every stream where the checkpoint left it.
    initial = evaluate() if resumed is None else torch.tensor(resumed["initial_reward"])
    start = 0 if resumed is None else int(resumed["step"])
    if resumed is not None:
        generator.set_state(resumed["generators"][rank])
        torch.set_rng_state(resumed["torch_rng"][rank])

    # Only rank 0 writes; the other ranks' replicas are identical to its own.
    log = JsonLog(log_path) if log_path is not None and main else None
    if log is not None:
        # A resumed run redoes the steps after its checkpoint; a new one starts empty.
        log.keep(lambda record: record["step"] < start)
    if checkpoint_dir is not None and main:
        remove_stale_temporaries(checkpoint_dir)

    history: list[dict[str, Any]] = [] if resumed is None else list(resumed["history"])
    checkpoints: list[str] = []
    bar = tqdm(
        range(start, steps),
        desc=f"finetune {mode}",
        unit="step",
        initial=start,
        total=steps,
        disable=not (progress and main),
    )
    try:
        for step in bar:
            started = time.perf_counter()
            noise = torch.randn((local_batch, *shape), generator=generator, dtype=dtype).to(device)
            trajectory: Trajectory = rollout(model, train_flow, noise, cond, generator=generator)
            with torch.no_grad():
                rewards = _reward_values(reward, trajectory.states[-1]).detach()
                # Gathered before the finiteness check, so a NaN on one rank raises on
                # every rank instead of leaving the others waiting in a collective.
                all_rewards = _gather(rewards, world) if distributed else rewards
                _require_finite_rewards(all_rewards)
            objectives: list[Objective]
            if mode == "reward":
                objectives = [terminal]
            else:
                assert isinstance(train_flow, FlowSDE)
                # Groups lie within one rank's share (checked), so these are exactly the
                # advantages of the global batch.
                advantages = group_advantages(rewards.to(torch.float64), group_size)
                old_log_probs = train_flow.trajectory_log_probs(
                    trajectory, reduction=config["log_prob_reduction"]
                )
                surrogate = grpo_objective(
                    train_flow,
                    trajectory,
                    old_log_probs,
                    advantages.to(dtype),
                    config["clip"],
                    reduction=config["log_prob_reduction"],
                )
                objectives = [surrogate] * inner_epochs
            sample_seconds = time.perf_counter() - started

            backward_seconds = optimizer_seconds = 0.0
            losses: list[float | None] = []
            norms: list[float] = []
            infos: list[dict[str, Any]] = []
            cost = Cost()
            for objective in objectives:
                opt.zero_grad(set_to_none=True)
                started = time.perf_counter()
                # The objectives are means over the rank's samples, so DDP's average over
                # equal shares is the global batch's gradient.
                result = surrogate_loss(
                    est,
                    trained,
                    train_flow,
                    objective,
                    trajectory=trajectory,
                    cond=cond,
                    generator=generator,
                )
                result.loss.backward()
                backward_seconds += time.perf_counter() - started
                # The averaged gradient is the same on every rank: so are the norm, the
                # clipping and the optimizer step, and the replicas stay equal.
                norm = _grad_norm(parameters)
                if not math.isfinite(norm):
                    raise FloatingPointError(
                        f"step {step}: the gradient norm is {norm}; lower lr or set max_grad_norm"
                    )
                started = time.perf_counter()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
                opt.step()
                optimizer_seconds += time.perf_counter() - started
                info = dict(result.info)
                loss = info.pop("loss", None)
                if loss is None and mode == "reward":
                    # A plugin that records no loss: the terminal loss is -mean reward.
                    loss = -float(rewards.mean())
                losses.append(None if loss is None else float(loss))
                norms.append(norm)
                infos.append(info)
                cost = cost + result.cost
            if distributed:
                # Each rank's loss is the mean over its share: their mean is the global one.
                losses = _mean_across_ranks(losses, world, device)

            record: dict[str, Any] = {
                "step": step,
                "reward_mean": float(all_rewards.mean()),
                "reward_std": float(all_rewards.std(unbiased=False)),
                "loss": _mean_or_none(losses),
                "grad_norm": sum(norms) / len(norms),
                "sample_seconds": sample_seconds,
                "backward_seconds": backward_seconds,
                "optimizer_seconds": optimizer_seconds,
                "cost": _cost_record(cost, sample_forwards=sampler_steps),
                "info": summarize_info(infos),
            }
            if mode == "grpo":
                record["losses"] = losses
                record["grad_norms"] = norms
            history.append(record)
            if log is not None:
                log.append(record)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
            done = step + 1
            if checkpoint_dir is not None and (
                (checkpoint_every and done % checkpoint_every == 0) or done == steps
            ):
                # Every rank's streams, gathered on every rank (a collective), saved by rank 0.
                generators, torch_rng = _rng_states(generator, distributed, world)
                if main:
                    state = {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "generators": generators,
                        "torch_rng": torch_rng,
                        "config": config,
                        "history": history,
                        "initial_reward": initial.tolist(),
                    }
                    checkpoints.append(save_checkpoint(Path(checkpoint_dir), done, state))
    finally:
        bar.close()

    final = evaluate()
    in_sync = replicas_in_sync(model) if distributed else None
    if in_sync is False and main:
        warnings.warn(
            f"the {world} replicas ended with different weights although every rank stepped "
            f"with the same averaged gradient; the ranks' arithmetic differs (mixed hardware "
            f"or nondeterministic kernels): checkpoints hold rank 0's weights",
            RuntimeWarning,
            stacklevel=3,
        )
    return {
        "initial_reward": float(initial.mean()),
        "final_reward": float(final.mean()),
        "final_reward_std": float(final.std(unbiased=False)),
        "history": history,
        "checkpoints": checkpoints,
        "log_path": None if log_path is None or not main else str(log_path),
        "config": config,
        "rank": rank,
        "world_size": world,
        "ranks_in_sync": in_sync,
    }


# -- command-line helpers (wired into gradest/cli.py as `gradest finetune`) -------------


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gradest finetune`` options to ``parser``."""
    parser.add_argument(
        "--estimator",
        default="exact",
        help="estimator spec, e.g. exact, jagg:window=4, sdo:samples=2, truncated:k=2",
    )
    parser.add_argument(
        "--mode",
        default="reward",
        choices=MODES,
        help="reward: backprop -reward through the ODE sampler; "
        "grpo: Flow-GRPO on FlowSDE rollouts (default reward)",
    )
    parser.add_argument("--steps", type=int, default=50, help="outer training steps (default 50)")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on the attention layers instead of all "
        "weights (needs peft; default 0: full fine-tuning)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (default 16)")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    parser.add_argument(
        "--optimizer", default="adamw", choices=OPTIMIZERS, help="adamw or sgd (default adamw)"
    )
    parser.add_argument("--weight-decay", type=float, default=0.0, help="default 0")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip the gradient norm (default: no clipping)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole run (default 0)")
    parser.add_argument(
        "--sampler-steps", type=int, default=10, help="sampler steps N (default 10)"
    )
    parser.add_argument(
        "--target",
        type=int,
        default=3,
        help="the digit whose classifier log-probability is the reward (default 3)",
    )
    parser.add_argument(
        "--labels",
        default="null",
        choices=("null", "target"),
        help="condition the DiT on the null label (unconditional samples steered to the "
        "target by the reward; the default) or on the target digit itself (the pretrained "
        "model already draws it, so the reward has little room to improve)",
    )
    parser.add_argument("--group-size", type=int, default=4, help="GRPO group size (default 4)")
    parser.add_argument(
        "--inner-epochs", type=int, default=2, help="GRPO optimizer steps per batch (default 2)"
    )
    parser.add_argument("--clip", type=float, default=0.2, help="GRPO clip range (default 0.2)")
    parser.add_argument(
        "--noise-level", type=float, default=0.7, help="FlowSDE noise level a (default 0.7)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder: log.jsonl, result.json, checkpoints/ (default runs/finetune; "
        "a folder that holds an earlier run is refused: --resume it or pass a new one)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR (an earlier --out) from its newest valid checkpoint, "
        "with the same settings (--steps may be larger); it ends bitwise as an "
        "uninterrupted run would",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save a checkpoint every this many steps (0: only the final one)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_finetune_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``gradest finetune`` on the shipped digits DiT and classifier reward.

    Writes ``log.jsonl``, ``result.json`` (the result without the history) and
    ``checkpoints/`` under ``--out`` (or continues the run in ``--resume DIR``) and returns
    the result dict; every output path is checked before any work. Under ``torchrun``
    (``python -m torch.distributed.run --nproc_per_node=2 -m gradest.cli finetune ...``)
    the ranks train data-parallel (see :func:`finetune`; ``--batch-size`` is the global
    batch) and only rank 0 writes.
    """
    # Validate the cheap things before loading checkpoints.
    resolve_estimator(args.estimator)
    if not 0 <= args.target <= 9:
        raise ValueError(f"--target must be a digit 0..9, got {args.target}")
    if args.resume is not None and args.out is not None and Path(args.out) != Path(args.resume):
        raise ValueError(
            f"--resume {args.resume!r} continues the run in that folder; drop --out "
            f"{args.out!r} or pass the same folder"
        )
    out = check_output_dir(args.resume or args.out or "runs/finetune", what="--out")
    # finetune() checks the log and checkpoint folder; result.json is written here.
    check_output_file(out / "result.json", what="--out")
    if args.resume is None:
        found = earlier_run(out / "log.jsonl", out / "checkpoints")
        if found is not None:
            raise ValueError(
                f"--out {str(out)!r} holds an earlier run ({found}); continue it with "
                f"--resume {str(out)}, or pass a new --out"
            )
    remove_stale_temporaries(out)
    # Loaded lazily so that this module imports without the shipped checkpoints.
    from gradest.workloads.assets import load_digit_classifier, load_pretrained_dit
    from gradest.workloads.rewards import ClassifierReward

    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {args.lora_rank}")
    model: torch.nn.Module = load_pretrained_dit()
    if args.lora_rank:
        # After loading: peft renames the targeted weights to *.base_layer.weight.
        from gradest.integrations.peft import add_lora

        model = add_lora(model, args.lora_rank)
    reward = ClassifierReward(load_digit_classifier(), args.target)
    result = finetune(
        model,
        reward,
        estimator=args.estimator,
        mode=args.mode,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        sampler_steps=args.sampler_steps,
        labels=args.target if args.labels == "target" else None,
        group_size=args.group_size,
        inner_epochs=args.inner_epochs,
        clip=args.clip,
        noise_level=args.noise_level,
        log_path=out / "log.jsonl",
        checkpoint_dir=out / "checkpoints",
        checkpoint_every=args.checkpoint_every,
        progress=not args.quiet,
        resume=out if args.resume is not None else None,
    )
    if result["rank"] == 0:
        summary = {key: value for key, value in result.items() if key not in ("history", "rank")}
        summary["target"] = args.target
        atomic_write_text(out / "result.json", json.dumps(summary, indent=2) + "\n")
    return result
