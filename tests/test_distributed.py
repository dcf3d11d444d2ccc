"""gradest under torch.distributed: two CPU ranks (gloo), DDP and the surrogate loss.

Each rank holds half of a batch and backpropagates ``est.surrogate(ddp_model, ...).loss``.
The objective is a mean over samples, so DDP's average of the ranks' gradients must equal
the single-process gradient on the whole batch, to float64 round-off (the dense reference
too); two backwards accumulate like any loss. A stochastic estimator given per-rank
generators takes rank 0's draws on every rank (``gradest.ranks``). Mismatched estimator
options are caught on every rank by ``check_same_estimator``. (FSDP2, accelerate and
every estimator family under torchrun: ``tests/test_data_parallel.py``.)
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradest
from gradest.integrations.distributed import check_same_estimator, rank_generator
from gradest.objectives import TerminalObjective
from gradest.reference import exact_gradient
from gradest.testing.problems import seeded_normal, tiny_mlp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

WORLD = 2
DIM, BATCH, CLASSES, STEPS = 4, 4, 3, 4
EXACTNESS = 1e-10  # float64: the two sides differ only in summation order
# The tests that share one spawn of two ranks.
SPAWN = pytest.mark.slow


def mean_over_samples_objective() -> TerminalObjective:
    """``mean_i [sum_d sin(w_d z_id)^2 + 0.1 |z_i|^2]``: a mean over samples, like a
    mean-reduced loss under DDP."""
    weights = seeded_normal((DIM,), 1)

    def loss_fn(z):
        per_sample = torch.sin(z * weights.to(z.dtype)).pow(2).sum(-1) + 0.1 * z.pow(2).sum(-1)
        return per_sample.mean()

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
        mine = {"noise": noise[half], "cond": {"y": labels[half]}}
        exact = gradest.estimator("exact")

        # Single-process truth on the concatenated batch, twice: gradest's exact and the
        # dense reference.
        full = exact.estimate(model, flow, objective, noise=noise, cond={"y": labels}).grads
        trajectory = gradest.rollout(model, flow, noise, cond={"y": labels})
        dense, _ = exact_gradient(model, flow, objective, trajectory, {"y": labels})
        out["exact_vs_dense"] = max_difference(full, dense)

        # 1. DDP averages the surrogate's gradient: the full-batch gradient on every rank.
        exact.surrogate(ddp, flow, objective, **mine).loss.backward()
        out["grad_vs_full"] = max_difference(grads_of(model), full)
        local = exact.estimate(model, flow, objective, **mine)
        out["local_vs_full"] = max_difference(local.grads, full)  # must NOT be ~0
        # A second backward accumulates into .grad, like two loss.backward() calls.
        exact.surrogate(ddp, flow, objective, **mine).loss.backward()
        out["accumulated_vs_twice_full"] = max_difference(
            grads_of(model), {n: 2 * g for n, g in full.items()}
        )

        # 2. A stochastic estimator with per-rank generators: every rank takes rank 0's
        # steps, and the ranks end with identical averaged gradients.
        model.zero_grad(set_to_none=True)
        sdo = gradest.estimator("sdo", samples=2)
        generator = rank_generator(seed=0)
        own_draw = sdo.estimate(model, flow, objective, generator=generator.clone_state(), **mine)
        sur = sdo.surrogate(ddp, flow, objective, generator=generator, **mine)
        sur.loss.backward()
        gathered: list = [None] * WORLD
        dist.all_gather_object(
            gathered,
            (own_draw.info["sampled_steps"], sur.info["sampled_steps"], grads_of(model)),
        )
        out["sdo_own_steps"] = [own for own, _, _ in gathered]
        out["sdo_used_steps"] = [used for _, used, _ in gathered]
        out["sdo_grads_equal_across_ranks"] = max_difference(gathered[0][2], gathered[1][2])

        # 3. Mismatched options raise on every rank, naming the ranks and the options.
        try:
            check_same_estimator(gradest.estimator("sdo", samples=1 + rank), ddp)
            out["mismatch_error"] = None
        except ValueError as err:
            out["mismatch_error"] = str(err)
        del ddp
        gc.collect()  # no DDP wrapper may outlive the group (see distributed.py)
        dist.barrier()
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
def test_ddp_average_of_the_surrogate_equals_the_full_batch_gradient(ranks):
    for out in ranks:
        assert out["exact_vs_dense"] < EXACTNESS
        assert out["grad_vs_full"] < EXACTNESS
        assert out["accumulated_vs_twice_full"] < EXACTNESS
        # The control: without DDP's average a rank's half-batch gradient is far off.
        assert out["local_vs_full"] > 1e-3


@SPAWN
def test_per_rank_generators_draw_different_steps_but_use_rank_0s(ranks):
    own, used = ranks[0]["sdo_own_steps"], ranks[0]["sdo_used_steps"]
    # Seed 0 draws different steps on the two ranks (a regression in rank_generator that
    # gave both ranks one stream would draw the same subset) ...
    assert own[0] != own[1]
    # ... and both ranks differentiate rank 0's.
    assert used == [own[0], own[0]]
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


def test_rank_generator_streams():
    def draw(seed, rank):
        return torch.randn(4, generator=rank_generator(seed, rank=rank))

    assert torch.equal(draw(3, 1), draw(3, 1))
    draws = [draw(0, 0), draw(0, 1), draw(1, 0)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        rank_generator(-1)


def test_check_same_estimator_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        check_same_estimator(gradest.estimator("exact"), tiny_mlp(DIM, hidden=8, seed=0))
