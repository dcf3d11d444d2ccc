"""gradest under torch.distributed: two CPU ranks (gloo) reproduce the full-batch gradient.

Each rank holds half of a batch and calls ``distributed_backward`` on a
``DistributedDataParallel`` model. The objective is a mean over samples, so the full-batch
loss is the mean of the two half-batch losses and DDP-style averaging of the ranks'
gradients must equal the single-process gradient on the whole batch, to float64 round-off.
The same spawn also checks the failure modes: mismatched estimator options, an input
error on one rank and a non-finite loss on one rank must surface on *every* rank (never
leave one rank waiting in a collective).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradest
from gradest.integrations.distributed import (
    allreduce_gradients,
    distributed_backward,
    rank_generator,
)
from gradest.objectives import TerminalObjective
from gradest.reference import exact_gradient
from gradest.reference.problems import seeded_normal, tiny_mlp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

WORLD = 2
DIM, BATCH, CLASSES, STEPS = 4, 4, 3, 4
EXACTNESS = 1e-10  # float64: the two sides differ only in summation order
# The tests that share one spawn of two ranks (each imports torch: ~10-15 s on 2 cores).
SPAWN = pytest.mark.slow


def mean_over_samples_objective(poison: bool = False) -> TerminalObjective:
    """``mean_i [sum_d sin(w_d z_id)^2 + 0.1 |z_i|^2]``: a mean over samples, like a
    mean-reduced loss under DDP. ``poison`` makes the loss Inf (a non-finite rank)."""
    weights = seeded_normal((DIM,), 1)

    def loss_fn(z):
        per_sample = torch.sin(z * weights.to(z.dtype)).pow(2).sum(-1) + 0.1 * z.pow(2).sum(-1)
        loss = per_sample.mean()
        return loss * float("inf") if poison else loss

    return TerminalObjective(loss_fn)


def full_batch():
    noise = seeded_normal((BATCH, DIM), 11)
    labels = torch.arange(BATCH) % CLASSES
    return noise, labels


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_difference(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: every scenario in turn; results go to ``out_dir/rank{rank}.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out: dict = {}
    try:
        model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        flow = gradest.RectifiedFlow(steps=STEPS)
        objective = mean_over_samples_objective()
        noise, labels = full_batch()
        half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        exact = gradest.estimator("exact")

        # Single-process truth on the concatenated batch, twice: gradest's exact and the
        # dense reference.
        full = exact.estimate(model, flow, objective, noise=noise, cond={"y": labels}).grads
        trajectory = gradest.rollout(model, flow, noise, cond={"y": labels})
        dense, _ = exact_gradient(model, flow, objective, trajectory, {"y": labels})
        out["exact_vs_dense"] = max_difference(full, dense)

        # 1. distributed_backward == full-batch gradient, on every rank.
        result = distributed_backward(
            exact, ddp, flow, objective, noise=noise[half], cond={"y": labels[half]}
        )
        out["grad_vs_full"] = max_difference(grads_of(model), full)
        out["result_vs_full"] = max_difference(result.grads, full)
        local = exact.estimate(model, flow, objective, noise=noise[half], cond={"y": labels[half]})
        out["local_vs_full"] = max_difference(local.grads, full)  # must NOT be ~0
        # A second call accumulates into .grad, like two loss.backward() calls.
        distributed_backward(
            exact,
            ddp,
            flow,
            objective,
            noise=noise[half],
            cond={"y": labels[half]},
            check_options=False,
        )
        out["accumulated_vs_twice_full"] = max_difference(
            grads_of(model), {n: 2 * g for n, g in full.items()}
        )

        # 2. allreduce_gradients after a plain local estimator.backward.
        model.zero_grad(set_to_none=True)
        exact.backward(model, flow, objective, noise=noise[half], cond={"y": labels[half]})
        allreduce_gradients(ddp)
        out["allreduce_vs_full"] = max_difference(grads_of(model), full)

        # 3. A stochastic estimator with per-rank generators: ranks draw their own steps,
        # and end with identical averaged gradients.
        model.zero_grad(set_to_none=True)
        sdo = gradest.estimator("sdo", samples=2)
        result = distributed_backward(
            sdo,
            ddp,
            flow,
            objective,
            noise=noise[half],
            cond={"y": labels[half]},
            generator=rank_generator(seed=0),
        )
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, (result.info["sampled_steps"], grads_of(model)))
        out["sdo_steps"] = [steps for steps, _ in gathered]
        out["sdo_grads_equal_across_ranks"] = max_difference(gathered[0][1], gathered[1][1])

        # 4. Mismatched options raise on every rank, naming the ranks and the options.
        before = grads_of(model)
        try:
            distributed_backward(
                gradest.estimator("sdo", samples=1 + rank),
                ddp,
                flow,
                objective,
                noise=noise[half],
                cond={"y": labels[half]},
            )
            out["mismatch_error"] = None
        except ValueError as err:
            out["mismatch_error"] = str(err)
        out["mismatch_left_grad"] = max_difference(grads_of(model), before)

        # 5. An input error on rank 1 only: rank 1 gets its own error, rank 0 is told.
        bad = noise[half].clone()
        if rank == 1:
            bad[0, 0] = float("nan")
        try:
            distributed_backward(exact, ddp, flow, objective, noise=bad, cond={"y": labels[half]})
            out["input_error"] = None
        except (ValueError, RuntimeError) as err:
            out["input_error"] = f"{type(err).__name__}: {err}"

        # 6. A non-finite loss on rank 1 only: "skip" drops it everywhere, "raise" raises
        # everywhere.
        poisoned = mean_over_samples_objective(poison=rank == 1)
        skipped = distributed_backward(
            exact,
            ddp,
            flow,
            poisoned,
            noise=noise[half],
            cond={"y": labels[half]},
            on_nonfinite="skip",
        )
        out["skip_usable"] = skipped.usable
        out["skip_left_grad"] = max_difference(grads_of(model), before)
        try:
            distributed_backward(
                exact, ddp, flow, poisoned, noise=noise[half], cond={"y": labels[half]}
            )
            out["raise_error"] = None
        except gradest.NonFiniteError as err:
            out["raise_error"] = str(err)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("ddp")
    # fork: the ranks inherit this process's imports (spawn re-imports torch per rank,
    # ~10 s on 2 cores); nothing CUDA or distributed is initialised here before forking.
    start = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker,
        args=(str(work / "init"), str(work)),
        nprocs=WORLD,
        join=True,
        start_method=start,
    )
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]


@SPAWN
def test_ddp_average_equals_the_full_batch_gradient(ranks):
    for out in ranks:
        assert out["exact_vs_dense"] < EXACTNESS
        assert out["grad_vs_full"] < EXACTNESS
        assert out["result_vs_full"] < EXACTNESS
        assert out["allreduce_vs_full"] < EXACTNESS
        assert out["accumulated_vs_twice_full"] < EXACTNESS
        # The control: without the all-reduce a rank's half-batch gradient is far off.
        assert out["local_vs_full"] > 1e-3


@SPAWN
def test_per_rank_generators_draw_different_steps_but_agree_on_the_average(ranks):
    steps = ranks[0]["sdo_steps"]
    assert steps == ranks[1]["sdo_steps"]  # every rank saw the same gathered list
    # Seed 0 draws steps {0, 3} on rank 0 and {0, 2} on rank 1 (pinned: a regression in
    # rank_generator that gave both ranks one stream would draw the same subset).
    assert steps[0] != steps[1]
    for out in ranks:
        assert out["sdo_grads_equal_across_ranks"] == 0.0


@SPAWN
def test_mismatched_options_raise_on_every_rank(ranks):
    for out in ranks:
        message = out["mismatch_error"]
        assert message is not None
        assert "estimator options differ across ranks" in message
        assert "ranks [0]: ShortcutDiffusion(samples=1" in message
        assert "ranks [1]: ShortcutDiffusion(samples=2" in message
        assert "rank_generator" in message
        assert out["mismatch_left_grad"] == 0.0


@SPAWN
def test_an_error_on_one_rank_reaches_every_rank(ranks):
    assert "NaN" in ranks[1]["input_error"] and ranks[1]["input_error"].startswith("ValueError")
    assert ranks[0]["input_error"].startswith("RuntimeError")
    assert "raised on rank(s) [1] of 2" in ranks[0]["input_error"]


@SPAWN
def test_a_nonfinite_rank_is_skipped_or_raised_everywhere(ranks):
    for out in ranks:
        assert out["skip_usable"] is False
        assert out["skip_left_grad"] == 0.0
    assert "estimate on rank(s) [1] of 2" in ranks[0]["raise_error"]
    # The failing rank keeps its own diagnosis: which tensor, where, in which estimator.
    assert ranks[1]["raise_error"].startswith("rank 1 of 2: non-finite (NaN/Inf) loss")
    assert "Exact(checkpoint=False)" in ranks[1]["raise_error"]


def test_rank_generator_streams():
    def draw(seed, rank):
        return torch.randn(4, generator=rank_generator(seed, rank=rank))

    assert torch.equal(draw(3, 1), draw(3, 1))
    draws = [draw(0, 0), draw(0, 1), draw(1, 0)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        rank_generator(-1)


def test_distributed_backward_needs_an_initialized_process_group():
    model = tiny_mlp(DIM, hidden=8, seed=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed_backward(
            gradest.estimator("exact"),
            model,
            gradest.RectifiedFlow(steps=2),
            mean_over_samples_objective(),
            noise=full_batch()[0],
        )
