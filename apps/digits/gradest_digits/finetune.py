"""Reward fine-tuning of a flow model with any gradest estimator: the user-facing loop.

Three objectives, one loop (``est.surrogate(...).loss.backward()`` then
``optimizer.step()``, as with any loss):

* ``mode="reward"``: the terminal objective ``L = -mean_b reward(z_N)``, differentiated
  through the deterministic Euler sampler (:class:`gradest.RectifiedFlow`) by the
  estimator (DRaFT / AlignProp / SDO-style direct reward backpropagation).
* ``mode="grpo"``: Flow-GRPO. Each step samples ``batch_size / group_size`` groups with
  the stochastic :class:`~gradest.FlowSDE`, scores them, normalises the
  rewards within groups into advantages, and takes ``inner_epochs`` optimizer steps on
  the clipped surrogate (:func:`~gradest.rl.flow_grpo.grpo_objective`) of the recorded
  trajectories, each gradient from the estimator (``kl_weight > 0`` adds the KL to a
  frozen copy of the initial model).
* ``mode="adjoint_matching"``: adjoint matching (:mod:`gradest.rl.adjoint_matching`). Each
  step samples the batch with the memoryless :class:`~gradest.FlowSDE`
  (``noise_level=sqrt(2)``), computes the lean adjoint of ``-reward`` with a frozen copy of
  the initial model (the model as passed to :func:`finetune`, before any checkpoint is
  loaded: resume with the same initial model), and takes one optimizer step on the
  regression loss; the target is ``p_base(x) exp(reward(x))``.

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
rollout, the rewards and what the objectives precompute: GRPO's advantages, old
log-probabilities and KL reference velocities, adjoint matching's lean adjoint);
``backward_seconds`` (the estimator's ``surrogate`` calls and their ``loss.backward()``);
``optimizer_seconds``;
``cost`` (the estimators' :class:`~gradest.protocol.Cost` counts summed over the
step's backwards, their ``model_units``, the rollout's ``sample_forwards``, and
``objective_model_units``, the base model's work for the objectives: ``N`` forwards for
GRPO's KL reference, ``N`` forwards with graph plus ``N`` state VJPs, ``2N`` units, for
adjoint matching's lean adjoint); and
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

The pieces: the settings (:mod:`~gradest_digits.finetune_config`), the two modes
(:mod:`~gradest_digits.finetune_modes`), a run's state and steps
(:mod:`~gradest_digits.finetune_run`), the log records
(:mod:`~gradest_digits.finetune_records`), checkpoints and resume
(:mod:`~gradest_digits.run_state`) and the command line
(:mod:`~gradest_digits.finetune_cli`). This module validates and loops.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gradest_lab.storage.files import check_output_dir, check_output_file
from torch import Tensor
from tqdm.auto import tqdm

from gradest import AffineSampler, InvalidType, InvalidValue
from gradest import estimator as build_estimator
from gradest.integrations.distributed import (
    launched_world,
    process_group_from_env,
    replicas_in_sync,
)
from gradest.plugin import check_steps, is_estimator, supports
from gradest_digits.finetune_config import FinetuneConfig, config_from
from gradest_digits.finetune_modes import mode_of
from gradest_digits.finetune_records import LOG_KEYS
from gradest_digits.finetune_run import Run
from gradest_digits.finetune_tensorboard import check_tensorboard_dir
from gradest_digits.run_state import (
    Checkpoint,
    check_lineage,
    check_same_run,
    earlier_run,
    newest_checkpoint,
    read_log,
)

__all__ = [
    "LOG_KEYS",
    "FinetuneConfig",
    "check_sizes",
    "finetune",
    "resolve_estimator",
    "start_run",
]

Reward = Callable[[Tensor], Tensor]


def finetune(
    model: torch.nn.Module,
    reward: Reward,
    config: FinetuneConfig | None = None,
    *,
    labels: int | Tensor | None = None,
    cond_key: str = "y",
    sample_shape: tuple[int, ...] | None = None,
    log_path: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    resume: str | Path | None = None,
    prior_data: Tensor | None = None,
    tensorboard_dir: str | Path | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Fine-tune ``model`` (in place) to raise ``reward`` of its samples.

    Args:
        model: velocity model called as ``model(z, t, **cond)``; its trainable
            parameters are updated.
        reward: ``reward(images [B, ...]) -> [B]``, higher is better; differentiable in
            the images for ``mode="reward"`` (e.g. ``ClassifierReward(classifier, 3)``).
        config: the run's settings (:class:`FinetuneConfig`: estimator, mode, steps,
            batch size, optimizer, seed, sampler steps, GRPO's settings, ...); None for
            the defaults.
        labels: the model's class condition, passed as ``cond={cond_key: labels}``:
            None (unconditional call), an int for every sample, or a ``[batch_size]``
            integer tensor (several ranks: rank ``r`` trains on its consecutive slice).
        sample_shape: one sample's shape; inferred from a DiT's config when None.
        log_path: append one JSON line per step (keys :data:`LOG_KEYS` plus mode
            extras); every line is written whole (:class:`gradest_lab.storage.files.JsonLog`).
        checkpoint_dir: write ``step_XXXXXX.pt`` every ``config.checkpoint_every`` steps
            (0: only at the end), atomically: the model and optimizer state, every rank's
            generator and torch RNG state, the step, the config, the history and the
            initial reward (:mod:`gradest_digits.run_state`; loadable with
            ``torch.load(weights_only=True)``).
        progress: show a tqdm progress bar.
        resume: a checkpoint file, or a folder of them (or a ``gradest finetune --out``
            folder): continue from the newest checkpoint (one that does not load, or of
            another format, is kept and refused by name). The settings must be the
            checkpoint's (``steps`` may be larger); the continued run ends with bitwise
            the parameters of an uninterrupted one (``auto``'s schedule is in the
            checkpoint), and its log is cut back to the checkpoint's step before it goes
            on, only when its earlier records are the checkpoint's history. Resuming a
            checkpoint file older than others in ``checkpoint_dir`` is refused (it would
            overwrite them): branch into a new ``checkpoint_dir`` and ``log_path``.
            Without ``resume``, a ``log_path`` that holds anything or a
            ``checkpoint_dir`` that holds checkpoints is refused (two runs never mix in
            one place).
        prior_data: real samples ``[M, *sample_shape]`` for ``prior_weight > 0`` (a
            flow-matching loss on a batch of them joins every backward, unconditional).
        tensorboard_dir: also write every logged record's numbers as TensorBoard
            scalars in this folder, at ``global_step = record["step"]`` (needs
            tensorboard; :mod:`~gradest_digits.finetune_tensorboard`). A resumed run
            purges the events from its first step on, so no step appears twice. Not a
            setting: it may differ between a run and its resumption.
        **settings: :class:`FinetuneConfig` fields replacing those of ``config``
            (``finetune(model, reward, estimator="sdo", steps=20)``).

    Returns:
        ``{"initial_reward", "final_reward", "final_reward_std", "history", "checkpoints",
        "log_path", "config", "rank", "world_size", "ranks_in_sync"}``: the rewards are
        means on a fixed evaluation batch (drawn first from the seeded generator, sampled
        with the ODE) before and after training; ``history`` holds the logged records;
        ``ranks_in_sync`` is None for one process, else whether all replicas ended bit
        for bit equal (False also warns).

    Raises:
        ValueError / TypeError: invalid settings or estimator spec, an output path that
            cannot be written (:class:`gradest_lab.storage.files.OutputError`), or a run that
            cannot be
            resumed, all before any model call.
        MissingDependency: ``tensorboard_dir`` is given and tensorboard is not
            installed (an ``ImportError``), also before any model call.

    Data parallelism (``torchrun --nproc_per_node=R ...``): when ``WORLD_SIZE > 1`` and
    no default process group exists, one is initialized from the environment (``gloo``,
    or ``nccl`` for a CUDA model; each rank needs its own GPU) and destroyed on return;
    a group the caller initialized is used and left as is. Every rank starts from rank
    0's weights (the model is wrapped in ``DistributedDataParallel``), samples
    ``batch_size / R`` of the batch with its own generator (``rank_generator(seed)``),
    backpropagates its surrogate loss (DDP averages the gradients) and takes the same
    optimizer step, so the replicas stay equal. The estimators' random draws and gates are
    rank 0's (:mod:`gradest.ranks`), so every rank makes the same model calls. The
    evaluation batch is the global one on every rank. Only rank 0 writes the log,
    checkpoints and TensorBoard events and shows the progress bar (other ranks return
    ``log_path=None`` and no checkpoints). Logged rewards and losses are over the global
    batch; ``cost`` and ``info`` are rank 0's own.
    """
    # -- everything is validated before the first model call --
    config = config_from(config, settings)
    _check_model_and_reward(model, reward)
    if config.checkpoint_every and checkpoint_dir is None:
        raise InvalidValue(
            f"checkpoint_every={config.checkpoint_every} needs checkpoint_dir= (a folder to "
            f"write to)"
        )
    log_path = None if log_path is None else check_output_file(log_path, what="log_path")
    checkpoint_dir = (
        None if checkpoint_dir is None else check_output_dir(checkpoint_dir, what="checkpoint_dir")
    )
    if tensorboard_dir is not None:
        tensorboard_dir = check_tensorboard_dir(tensorboard_dir, what="tensorboard_dir")
    resumed = _resumed(resume, log_path, checkpoint_dir)
    _, world = launched_world()
    model, est, shape, eval_cond, record = _validated(
        model, config, labels=labels, cond_key=cond_key, sample_shape=sample_shape, world=world
    )
    _check_prior(config, prior_data, shape)
    if resumed is not None:
        check_same_run(resumed.config, record, source=resumed.path)
        if resumed.step > config.steps:
            raise InvalidValue(
                f"the checkpoint is at step {resumed.step}, past steps={config.steps}; "
                f"pass steps >= {resumed.step} to continue the run"
            )
        # Nothing of another run or branch is overwritten or cut (append-only folders).
        check_lineage(resumed, log_path, checkpoint_dir)

    device = next(p for p in model.parameters() if p.requires_grad).device
    with process_group_from_env(device) as (rank, world):
        run = Run.start_on_rank(
            config,
            record,
            est,
            reward,
            model,
            rank=rank,
            world=world,
            shape=shape,
            eval_cond=eval_cond,
            log_path=log_path,
            checkpoint_dir=checkpoint_dir,
            resumed=resumed,
            prior_data=prior_data,
            tensorboard_dir=tensorboard_dir,
        )
        try:
            return _train(run, checkpoint_dir, progress=progress, log_path=log_path)
        finally:
            run.close()


def check_sizes(
    config: FinetuneConfig, shape: tuple[int, ...], device: torch.device, *, flags: bool
) -> None:
    """Refuse a batch or a sampler that could not fit in memory, before any work.

    The bound is a floor of what the run needs: the recorded trajectory alone holds
    ``batch_size x (sampler_steps + 1)`` states of ``shape`` in float32 (the model's
    activations come on top). Above the memory of the device (the GPU's, or the host's
    for the CPU) the run cannot even hold its samples.
    """
    memory = device_memory(device)
    if memory is None:
        return
    state_bytes = 4
    for size in shape:
        state_bytes *= size
    per_sample = state_bytes * (config.sampler_steps + 1)
    name = (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)
    where = f"{device.type} memory, {memory / 2**30:.0f} GiB"
    if per_sample > memory:
        most = max(1, memory // state_bytes - 1)
        raise InvalidValue(
            f"{name('sampler_steps')} {config.sampler_steps} is too large: one sample's "
            f"trajectory alone ({config.sampler_steps + 1} states of {state_bytes} bytes) "
            f"would not fit in this machine's {where}; use at most {most}"
        )
    most = memory // per_sample
    if config.batch_size > most:
        need = config.batch_size * per_sample / 2**30
        raise InvalidValue(
            f"{name('batch_size')} {config.batch_size} is too large: the trajectory alone "
            f"(batch_size x (sampler_steps + 1) states of {state_bytes} bytes) would take "
            f"{need:.3g} GiB, more than this machine's {where}; use at most {most}"
        )


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (the GPU's total, or the host's RAM), None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def _check_model_and_reward(model: Any, reward: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidType(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(reward):
        raise InvalidType(
            f"reward must be a callable images [B, ...] -> rewards [B], got {type(reward).__name__}"
        )


def _check_prior(config: FinetuneConfig, prior_data: Any, shape: tuple[int, ...]) -> None:
    """``prior_data`` is given exactly when ``prior_weight > 0``, shaped ``[M, *shape]``."""
    if config.prior_weight and prior_data is None:
        raise InvalidValue(
            f"prior_weight={config.prior_weight} needs prior_data= (real samples "
            f"[M, {', '.join(map(str, shape))}]); pass them or set prior_weight=0"
        )
    if prior_data is None:
        return
    if not config.prior_weight:
        raise InvalidValue(
            "prior_data= is only used with prior_weight > 0; set prior_weight (e.g. 1.0) "
            "or drop prior_data"
        )
    if not isinstance(prior_data, Tensor) or tuple(prior_data.shape[1:]) != tuple(shape):
        got = tuple(prior_data.shape) if isinstance(prior_data, Tensor) else type(prior_data)
        raise InvalidValue(
            f"prior_data must be a tensor [M, {', '.join(map(str, shape))}] of real samples, "
            f"got {got}"
        )
    if prior_data.shape[0] == 0 or not bool(torch.isfinite(prior_data).all()):
        raise InvalidValue("prior_data must hold at least one sample, all finite")


def _validated(
    model: torch.nn.Module,
    config: FinetuneConfig,
    *,
    labels: int | Tensor | None,
    cond_key: str,
    sample_shape: tuple[int, ...] | None,
    world: int,
) -> tuple[torch.nn.Module, Any, tuple[int, ...], dict[str, Tensor] | None, dict[str, Any]]:
    """Everything about the model and the estimator checked before any model call:
    ``(bare model, estimator, sample shape, evaluation condition, config record)``."""
    est = resolve_estimator(config.estimator)
    check_steps(est, config.sampler_steps)  # options that need more than N steps
    kind = "terminal" if config.mode == "reward" else "stepwise"
    if not supports(est, kind):  # GRPO's per-step loss is stepwise: refl, draft_lv cannot
        raise InvalidValue(
            f"estimator={config.estimator!r} is for {' and '.join(est.objectives)} objectives "
            f"only, and mode={config.mode!r} differentiates a {kind} one; use mode='reward' "
            f"or another estimator"
        )
    # Under torchrun the world size is known from the environment before any group
    # exists, so a batch that does not split evenly fails here, on every rank alike.
    _check_world(config, world)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # the run wraps the bare module itself once the group exists
    shape = _sample_shape(model, sample_shape)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise InvalidValue(
            f"model {type(model).__name__} has no parameters with requires_grad=True; "
            f"unfreeze the ones to fine-tune"
        )
    check_sizes(config, shape, trainable[0].device, flags=False)
    eval_cond = _cond(labels, config.batch_size, trainable[0].device, cond_key)
    record = config_record(config, est, labels=labels, shape=shape, world=world)
    return model, est, shape, eval_cond, record


def config_record(
    config: FinetuneConfig,
    est: Any,
    *,
    labels: int | Tensor | None,
    shape: tuple[int, ...],
    world: int,
) -> dict[str, Any]:
    """The run's settings as its checkpoints record them (``config``): what a resume
    compares (:func:`gradest_digits.run_state.check_same_run`)."""
    return {
        **config.record(repr(est)),
        "labels": labels if labels is None or isinstance(labels, int) else labels.tolist(),
        "sample_shape": list(shape),
        "world_size": world,
    }


def sample_shape_of(model: torch.nn.Module) -> tuple[int, ...]:
    """One sample's shape, from a DiT's config (as :func:`finetune` infers it)."""
    return _sample_shape(model, None)


def start_run(
    model: torch.nn.Module,
    reward: Reward,
    config: FinetuneConfig | None = None,
    *,
    labels: int | Tensor | None = None,
    cond_key: str = "y",
    sample_shape: tuple[int, ...] | None = None,
    prior_data: Tensor | None = None,
    **settings: Any,
) -> tuple[Run, AffineSampler]:
    """A fine-tuning run on this process that the caller advances step by step.

    For loops that interleave several runs (``gradest_digits.paired_benchmark`` alternates
    the estimators within each training step, so machine load hits all of them alike).
    Arguments as for :func:`finetune` (no logging, checkpoints or resume). Returns the
    :class:`~gradest_digits.finetune_run.Run` (``run.step(k, sampler)`` for ``k = 0,
    1, ...``, ``run.evaluate()``, ``run.history``, ``run.initial``) and its sampler.
    """
    config = config_from(config, settings)
    _check_model_and_reward(model, reward)
    model, est, shape, eval_cond, record = _validated(
        model, config, labels=labels, cond_key=cond_key, sample_shape=sample_shape, world=1
    )
    _check_prior(config, prior_data, shape)
    run = Run.start_on_rank(
        config,
        record,
        est,
        reward,
        model,
        rank=0,
        world=1,
        shape=shape,
        eval_cond=eval_cond,
        log_path=None,
        checkpoint_dir=None,
        resumed=None,
        prior_data=prior_data,
    )
    return run, mode_of(config).sampler(config)


def _train(
    run: Run, checkpoint_dir: Path | None, *, progress: bool, log_path: Path | None
) -> dict[str, Any]:
    """The loop: one :meth:`Run.step` per outer step, checkpoints as configured."""
    config = run.config
    sampler = mode_of(config).sampler(config)
    steps, every = config.steps, config.checkpoint_every
    bar = tqdm(
        range(run.start, steps),
        desc=f"finetune {config.mode}",
        unit="step",
        initial=run.start,
        total=steps,
        disable=not (progress and run.main),
    )
    with bar:
        for step in bar:
            record = run.step(step, sampler)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
            done = step + 1
            if checkpoint_dir is not None and ((every and done % every == 0) or done == steps):
                run.checkpoint(checkpoint_dir, done)
    final = run.evaluate()
    in_sync = replicas_in_sync(run.model) if run.distributed else None
    if in_sync is False and run.main:
        warnings.warn(
            f"the {run.world} replicas ended with different weights although every rank "
            f"stepped with the same averaged gradient; the ranks' arithmetic differs (mixed "
            f"hardware or nondeterministic kernels): checkpoints hold rank 0's weights",
            RuntimeWarning,
            stacklevel=3,
        )
    return {
        "initial_reward": float(run.initial.mean()),
        "final_reward": float(final.mean()),
        "final_reward_std": float(final.std(unbiased=False)),
        "history": run.history,
        "checkpoints": run.checkpoints,
        "log_path": None if log_path is None or not run.main else str(log_path),
        "config": run.record,
        "rank": run.rank,
        "world_size": run.world,
        "ranks_in_sync": in_sync,
    }


# -- validation (all of it runs before any model call) -----------------------------------


def resolve_estimator(estimator: Any) -> Any:
    """A spec string (``"jagg:window=4"``) or an estimator object -> the estimator.

    Spec errors (unknown name, unknown or invalid option) raise here, before any work.
    """
    if isinstance(estimator, str):
        return build_estimator(estimator)
    if is_estimator(estimator):
        return estimator
    raise InvalidType(
        f"estimator must be a spec string such as 'exact' or 'jagg:window=4', or an "
        f"estimator object with estimate() (and surrogate()); got {type(estimator).__name__}"
    )


def _resumed(
    resume: str | Path | None, log_path: Path | None, checkpoint_dir: Path | None
) -> Checkpoint | None:
    """The checkpoint to continue from; without ``resume``, refuse a place a run used."""
    if resume is None:
        found = earlier_run(log_path, checkpoint_dir)
        if found is not None:
            # Two runs never mix in one place.
            raise InvalidValue(
                f"an earlier run wrote to log_path / checkpoint_dir ({found}); continue it "
                f"with resume=<its folder>, or pass new paths"
            )
        return None
    resumed = newest_checkpoint(resume)
    if resumed is None:
        if log_path is not None:
            read_log(log_path)  # the log it cuts is the run's: a foreign one is kept, refused
        warnings.warn(
            f"resume={str(resume)!r}: no checkpoint was written before the run stopped; "
            f"starting it over from step 0",
            RuntimeWarning,
            stacklevel=3,
        )
    return resumed


def _check_world(config: FinetuneConfig, world: int) -> None:
    """The global batch splits evenly over the ranks (and, for GRPO, into whole groups:
    advantages are normalised within a group, so a group must not straddle two ranks)."""
    batch_size, group_size = config.batch_size, config.group_size
    if batch_size % world:
        raise InvalidValue(
            f"batch_size={batch_size} is the global batch and must be divisible by the world "
            f"size {world} (each rank samples batch_size / world_size); e.g. "
            f"batch_size={world * max(1, batch_size // world)}"
        )
    local = batch_size // world
    if config.mode == "grpo" and local % group_size:
        suggestion = world * group_size * max(1, local // group_size)
        raise InvalidValue(
            f"in mode='grpo' the per-rank batch batch_size / world_size = {batch_size} / {world} "
            f"= {local} must be a multiple of group_size={group_size}, so that no group "
            f"straddles two ranks; e.g. batch_size={suggestion}"
        )


def _sample_shape(model: torch.nn.Module, sample_shape: Any) -> tuple[int, ...]:
    if sample_shape is not None:
        shape = tuple(sample_shape)
        if not shape or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise InvalidValue(
                f"sample_shape must be a tuple of positive ints (one sample, no batch "
                f"dimension), e.g. (1, 8, 8); got {sample_shape!r}"
            )
        return shape
    config = getattr(model, "config", None)
    size, channels = getattr(config, "input_size", None), getattr(config, "in_channels", None)
    if isinstance(size, int) and isinstance(channels, int):
        return (channels, size, size)
    raise InvalidValue(
        f"cannot infer the sample shape of {type(model).__name__}; pass sample_shape=(C, H, W) "
        f"(one sample, without the batch dimension)"
    )


def _cond(labels: Any, batch: int, device: torch.device, key: str) -> dict[str, Tensor] | None:
    """The model's conditioning: ``{key: [B] labels}``, or None for an unconditional call."""
    if labels is None:
        return None
    if isinstance(labels, bool):
        raise InvalidType(f"labels must be None, an int class or a [batch] tensor, got {labels!r}")
    if isinstance(labels, int):
        return {key: torch.full((batch,), labels, dtype=torch.long, device=device)}
    if isinstance(labels, Tensor) and labels.shape == (batch,) and not labels.is_floating_point():
        return {key: labels.to(device=device, dtype=torch.long)}
    shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
    raise InvalidValue(
        f"labels must be None, an int class, or an integer tensor of shape [batch_size] = "
        f"[{batch}], got {shape}"
    )
