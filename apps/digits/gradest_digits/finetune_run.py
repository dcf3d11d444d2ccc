"""One fine-tuning run's state and its steps: what :func:`finetune` sets up and then loops over.

:class:`Run` holds the model (and its DDP wrapper), the optimizer, the generators, the
log and the history; :meth:`Run.step` is one outer step (rollout, rewards, the mode's
objectives, one surrogate backward and optimizer step each), :meth:`Run.checkpoint`
saves everything the next step depends on, and :meth:`Run.evaluate` scores the fixed
evaluation batch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from gradest_lab.errors import Diverged
from gradest_lab.storage.files import JsonLog, remove_stale_temporaries
from torch import Tensor

from gradest import InvalidValue, RectifiedFlow, rollout
from gradest.integrations.distributed import check_same_estimator, rank_generator
from gradest.plugin import Cost, Surrogate, check_surrogate, estimated_surrogate, is_stateful
from gradest_digits.file_schema import first_line
from gradest_digits.finetune_config import FinetuneConfig
from gradest_digits.finetune_modes import Batch, mode_of, needs_base
from gradest_digits.finetune_records import cost_record, mean_or_none, summarize_info
from gradest_digits.finetune_tensorboard import TensorBoardLog
from gradest_digits.run_state import (
    Checkpoint,
    check_fits,
    checkpoint_path,
    checkpoints_in,
    save_checkpoint,
)

Reward = Callable[[Tensor], Tensor]


def surrogate_loss(est: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Surrogate:
    """``est.surrogate(...)``, or for an estimator without one, the linear surrogate of its
    estimate (:func:`gradest.plugin.estimated_surrogate`)."""
    if callable(getattr(est, "surrogate", None)):
        # A plugin's surrogate that is not a scalar loss: one line naming it, before its backward.
        return check_surrogate(est, est.surrogate(model, *args, **kwargs))  # type: ignore[no-any-return]
    return estimated_surrogate(est, model, *args, **kwargs)


def checked_rewards(reward: Reward, images: Tensor, *, finite: bool = True) -> Tensor:
    """``reward(images)`` checked to be a ``[B]`` tensor (and finite)."""
    values = reward(images)
    if not isinstance(values, Tensor) or values.shape != images.shape[:1]:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise InvalidValue(
            f"reward(images) must return one reward per sample, shape [{images.shape[0]}], got "
            f"{shape}; do not reduce over the batch"
        )
    if finite:
        require_finite(values)
    return values


def require_finite(values: Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        raise Diverged(
            "reward(images) returned NaN or Inf; the samples may have diverged (lower lr)"
        )


def draw_stream_seed(seed: int, rank: int) -> int:
    """The seed of a rank's estimator-draw stream: fixed by ``(seed, rank)``, apart from
    the training stream's (a multiplicative hash, not Python's per-process ``hash``)."""
    return ((seed + 1) * 2_654_435_761 + 97 * rank + 12_345) % 2**63


def make_optimizer(
    config: FinetuneConfig, parameters: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The run's optimizer of ``parameters`` (``config.optimizer``, ``lr``, ``weight_decay``)."""
    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD
    return optimizer_class(parameters, lr=config.lr, weight_decay=config.weight_decay)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters never train (the base / reference model)."""
    base = copy.deepcopy(model)
    base.requires_grad_(False)
    return base


def grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


@attrs.define
class Run:
    """A run's state on one rank; built by :meth:`start`, advanced by :meth:`step`.

    Attributes:
        config: the settings; ``record`` the config as checkpoints store it.
        model, trained: the module and what gradients go through (its DDP wrapper).
        parameters: the trainable parameters; ``optimizer`` steps them.
        rank, world: this rank and the world size; ``local_batch`` this rank's share.
        generator: this rank's training stream; ``eval_noise`` the fixed evaluation batch.
        cond, eval_cond: this rank's and the global batch's conditioning.
        log: the JSON log (rank 0 only), ``history`` its records, ``start`` the first step.
        board: the records as TensorBoard scalars (rank 0 only, when asked for).
    """

    config: FinetuneConfig
    record: dict[str, Any]
    est: Any
    reward: Reward
    model: torch.nn.Module
    trained: torch.nn.Module
    parameters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    rank: int
    world: int
    local_batch: int
    shape: tuple[int, ...]
    generator: torch.Generator
    eval_noise: Tensor
    cond: dict[str, Tensor] | None
    eval_cond: dict[str, Tensor] | None
    log: JsonLog | None
    history: list[dict[str, Any]]
    start: int
    initial: Tensor = attrs.field(factory=lambda: torch.zeros(0))
    checkpoints: list[str] = attrs.field(factory=list)
    prior_data: Tensor | None = None  # real samples for config.prior_weight
    # The estimator's random draws (sdo's steps, truncation depths, ...) come from a stream
    # of their own, so that every estimator run with one seed samples the same noise
    # batches whatever it draws (paired comparisons); runs resumed from checkpoints written
    # before this stream existed keep drawing from the training generator.
    draws: torch.Generator | None = None
    # A frozen copy of the model as the run started (before a checkpoint is loaded): the
    # base model of adjoint matching and GRPO's KL reference; None when the mode needs none.
    base: torch.nn.Module | None = None
    # The log's records as TensorBoard scalars (rank 0, when asked for); close() closes it.
    board: TensorBoardLog | None = None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start_on_rank(
        cls,
        config: FinetuneConfig,
        record: dict[str, Any],
        est: Any,
        reward: Reward,
        model: torch.nn.Module,
        *,
        rank: int,
        world: int,
        shape: tuple[int, ...],
        eval_cond: dict[str, Tensor] | None,
        log_path: Path | None,
        checkpoint_dir: Path | None,
        resumed: Checkpoint | None,
        prior_data: Tensor | None = None,
        tensorboard_dir: Path | None = None,
    ) -> Run:
        parameters = [p for p in model.parameters() if p.requires_grad]
        dtype, device = parameters[0].dtype, parameters[0].device
        optimizer = make_optimizer(config, parameters)
        base = frozen_copy(model) if needs_base(config) else None
        if resumed is not None:
            # Before DDP's constructor, which broadcasts rank 0's weights: every rank loads.
            # A state that does not fit is one line naming the checkpoint, before any load.
            check_fits(resumed, model, optimizer)
            try:
                model.load_state_dict(resumed.model)
                optimizer.load_state_dict(resumed.optimizer)
            except (RuntimeError, KeyError, ValueError, TypeError) as err:
                why = f"does not fit ({first_line(err)})"
                raise resumed.refuse("model or optimizer", why) from None
        # DDP's constructor starts every replica from rank 0's weights and buffers; its
        # backward hooks average the surrogate losses' gradients.
        trained = (
            torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None
            )
            if world > 1
            else model
        )
        if world > 1:
            check_same_estimator(est, trained)
        # The evaluation batch is drawn first from a fresh generator: identical on every
        # rank and for every estimator run with this seed. One process continues that
        # stream for training; several ranks draw their shares from (seed, rank) streams.
        eval_generator = torch.Generator().manual_seed(config.seed)
        eval_noise = torch.randn(
            (config.batch_size, *shape), generator=eval_generator, dtype=dtype
        ).to(device)
        generator = rank_generator(config.seed, rank=rank) if world > 1 else eval_generator
        local_batch = config.batch_size // world
        share = slice(rank * local_batch, (rank + 1) * local_batch)
        start = 0 if resumed is None else resumed.step
        log = JsonLog(log_path) if log_path is not None and rank == 0 else None
        if checkpoint_dir is not None and rank == 0:
            remove_stale_temporaries(checkpoint_dir)
        run = cls(
            config=config,
            record=record,
            est=est,
            reward=reward,
            model=model,
            trained=trained,
            parameters=parameters,
            optimizer=optimizer,
            rank=rank,
            world=world,
            local_batch=local_batch,
            shape=shape,
            generator=generator,
            eval_noise=eval_noise,
            cond=None if eval_cond is None else {k: v[share] for k, v in eval_cond.items()},
            eval_cond=eval_cond,
            log=log,
            history=[] if resumed is None else list(resumed.history),
            start=start,
            prior_data=None if prior_data is None else prior_data.to(device=device, dtype=dtype),
            base=base,
        )
        run.draws = torch.Generator().manual_seed(draw_stream_seed(config.seed, rank))
        if resumed is None:
            run.initial = run.evaluate()
        else:
            run.restore(resumed, checkpoint_dir)
        if log is not None:
            # Once everything of the checkpoint is in place: a resumed run redoes the steps
            # after it (the log's records from `start` on are cut); a new one starts empty.
            log.keep(lambda entry: entry["step"] < start)
        if tensorboard_dir is not None and rank == 0:
            # Opened last, so that nothing after it can fail before close() is due. The
            # steps from `start` on are redone: their earlier events are purged.
            run.board = TensorBoardLog(tensorboard_dir, purge_step=start)
        return run

    def restore(self, resumed: Checkpoint, checkpoint_dir: Path | None) -> None:
        """Every stream and the estimator's state continue where ``resumed`` left them."""
        rank, start = self.rank, resumed.step
        self.initial = torch.tensor(resumed.initial_reward)
        self.generator.set_state(resumed.generators[rank])
        torch.set_rng_state(resumed.torch_rng[rank])
        if resumed.draw_generators is None:
            self.draws = None  # an older checkpoint: draws came from the training stream
        elif self.draws is not None:
            self.draws.set_state(resumed.draw_generators[rank])
        # The estimator's own state (auto's schedule: its picks, calls and probes), so
        # that it probes at the same calls as the uninterrupted run.
        saved_estimator = resumed.estimator_state
        if saved_estimator is not None and is_stateful(self.est):
            try:
                self.est.load_state_dict(self.trained, saved_estimator)
            except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as err:
                why = f"is not this estimator's state ({first_line(err)})"
                raise resumed.refuse("estimator_state", why) from None
        # result.json names every checkpoint of the run, not only this process's.
        earlier = resumed.checkpoints
        if earlier is None and checkpoint_dir is not None:
            earlier = [str(p) for s, p in sorted(checkpoints_in(checkpoint_dir)) if s <= start]
        self.checkpoints = list(earlier or [])

    def close(self) -> None:
        """Flush and close the TensorBoard events (the JSON log needs nothing)."""
        if self.board is not None:
            self.board.close()

    def evaluate(self) -> Tensor:
        """Rewards of the fixed evaluation batch, sampled with the ODE."""
        flow = RectifiedFlow(steps=self.config.sampler_steps)
        with torch.no_grad():
            final = rollout(self.model, flow, self.eval_noise, self.eval_cond).states[-1]
            return checked_rewards(self.reward, final).detach()

    def step(self, step: int, sampler: Any) -> dict[str, Any]:
        """One outer step: sample, score, then one backward and optimizer step per objective."""
        started = time.perf_counter()
        dtype, device = self.eval_noise.dtype, self.eval_noise.device
        noise = torch.randn(
            (self.local_batch, *self.shape), generator=self.generator, dtype=dtype
        ).to(device)
        trajectory = rollout(self.model, sampler, noise, self.cond, generator=self.generator)
        with torch.no_grad():
            rewards = checked_rewards(self.reward, trajectory.states[-1], finite=False).detach()
            # Gathered before the finiteness check, so a NaN on one rank raises on every
            # rank instead of leaving the others waiting in a collective.
            all_rewards = self._gather(rewards)
            require_finite(all_rewards)
        mode = mode_of(self.config)
        objectives = mode.objectives(
            Batch(
                config=self.config,
                sampler=sampler,
                trajectory=trajectory,
                rewards=rewards,
                reward=lambda images: checked_rewards(self.reward, images),
                base=self.base,
                cond=self.cond,
            )
        )
        sample_seconds = time.perf_counter() - started

        timings = {"backward": 0.0, "optimizer": 0.0}
        losses: list[float | None] = []
        norms: list[float] = []
        infos: list[dict[str, Any]] = []
        cost = Cost()
        for objective in objectives:
            loss, norm, info, spent = self._descend(step, sampler, objective, trajectory, timings)
            losses.append(loss)
            norms.append(norm)
            infos.append(info)
            cost = cost + spent
        if self.distributed:
            # Each rank's loss is the mean over its share: their mean is the global one.
            losses = self._mean_across_ranks(losses)
        record: dict[str, Any] = {
            "step": step,
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std(unbiased=False)),
            "loss": mean_or_none(losses),
            "grad_norm": sum(norms) / len(norms),
            "sample_seconds": sample_seconds,
            "backward_seconds": timings["backward"],
            "optimizer_seconds": timings["optimizer"],
            "cost": cost_record(
                cost,
                sample_forwards=self.config.sampler_steps,
                objective_cost=mode.objective_cost(self.config),
            ),
            "info": summarize_info(infos),
            **mode.record_extras(losses, norms),
        }
        self.history.append(record)
        if self.log is not None:
            self.log.append(record)
        if self.board is not None:
            self.board.append(record)
        return record

    def _descend(
        self, step: int, sampler: Any, objective: Any, trajectory: Any, timings: dict[str, float]
    ) -> tuple[float | None, float, dict[str, Any], Cost]:
        """One surrogate backward and optimizer step; ``(loss, grad norm, info, cost)``."""
        self.optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        # The objectives are means over the rank's samples, so DDP's average over equal
        # shares is the global batch's gradient.
        result = surrogate_loss(
            self.est,
            self.trained,
            sampler,
            objective,
            trajectory=trajectory,
            cond=self.cond,
            generator=self.generator if self.draws is None else self.draws,
        )
        loss_tensor = result.loss
        if self.config.prior_weight:
            loss_tensor = loss_tensor + self.config.prior_weight * self._prior_loss()
        loss_tensor.backward()
        timings["backward"] += time.perf_counter() - started
        # The averaged gradient is the same on every rank: so are the norm, the clipping
        # and the optimizer step, and the replicas stay equal.
        norm = grad_norm(self.parameters)
        if not math.isfinite(norm):
            raise Diverged(
                f"step {step}: the gradient norm is {norm}; lower lr or set max_grad_norm"
            )
        started = time.perf_counter()
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.config.max_grad_norm)
        self.optimizer.step()
        timings["optimizer"] += time.perf_counter() - started
        info = dict(result.info)
        loss = info.pop("loss", None)
        return (None if loss is None else float(loss)), norm, info, result.cost

    def _prior_loss(self) -> Tensor:
        """Flow matching on a batch of real samples (unconditional): ``mean ||v_theta(z_t,
        t) - (eps - x)||^2`` with ``z_t = t eps + (1 - t) x``, the pretraining loss that
        prior preservation keeps low while the reward moves the model."""
        assert self.prior_data is not None
        data = self.prior_data
        generator, count = self.generator, self.local_batch
        index = torch.randint(0, data.shape[0], (count,), generator=generator)
        x = data[index.to(data.device)]
        t = torch.rand(count, generator=generator, dtype=data.dtype).to(data.device)
        eps = torch.randn(x.shape, generator=generator, dtype=data.dtype).to(data.device)
        weight = t.reshape(-1, *([1] * (x.ndim - 1)))
        z = weight * eps + (1 - weight) * x
        return (self.trained(z, t) - (eps - x)).pow(2).mean()

    def checkpoint(self, directory: Path, done: int) -> None:
        """Save what step ``done`` depends on; every rank takes part (its streams are gathered)."""
        generators, torch_rng, draws = self._rng_states()
        if not self.main:
            return
        path = str(checkpoint_path(directory, done))
        # Every checkpoint of the run so far, this one last (result.json lists them all).
        checkpoints = [*(c for c in self.checkpoints if c != path), path]
        state: dict[str, Any] = {
            "checkpoints": checkpoints,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generators": generators,
            "torch_rng": torch_rng,
            "draw_generators": draws,
            "config": self.record,
            "history": self.history,
            "initial_reward": self.initial.tolist(),
        }
        if is_stateful(self.est):
            state["estimator_state"] = self.est.state_dict(self.trained)
        save_checkpoint(directory, done, state)
        self.checkpoints = checkpoints

    # -- across ranks -------------------------------------------------------------------------

    def _gather(self, values: Tensor) -> Tensor:
        """Every rank's ``[b]`` tensor, concatenated in rank order (the global batch)."""
        if not self.distributed:
            return values
        parts = [torch.empty_like(values) for _ in range(self.world)]
        dist.all_gather(parts, values.contiguous())
        return torch.cat(parts)

    def _mean_across_ranks(self, values: list[float | None]) -> list[float | None]:
        """Each value averaged over the ranks (None, i.e. not reported, stays None)."""
        local = torch.tensor(
            [math.nan if v is None else v for v in values],
            dtype=torch.float64,
            device=self.eval_noise.device,
        )
        dist.all_reduce(local)
        return [None if math.isnan(v) else v / self.world for v in local.tolist()]

    def _rng_states(self) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
        """Every rank's training generator, global torch RNG state and estimator-draw
        generator (None for a run without that stream), in rank order."""
        draws = None if self.draws is None else self.draws.get_state()
        mine = (self.generator.get_state(), torch.get_rng_state(), draws)
        if not self.distributed:
            return [mine[0]], [mine[1]], None if draws is None else [draws]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        all_draws = None if draws is None else [d for _, _, d in gathered]
        return [g for g, _, _ in gathered], [r for _, r, _ in gathered], all_draws
