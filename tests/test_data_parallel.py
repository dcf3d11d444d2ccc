"""DDP, FSDP2 and accelerate under torchrun: two CPU ranks (gloo) and the surrogate loss.

One ``torchrun --nproc_per_node=2`` launch of ``tests/data_parallel_worker.py``. Each rank
backpropagates ``est.surrogate(wrapped_model, ...).loss`` for its half of a batch, through
``DistributedDataParallel``, through FSDP2 (``fully_shard``, parameters sharded across the
ranks) and through ``accelerate``'s prepared model; the gradient autograd leaves in
``.grad`` (FSDP2: its ``full_tensor()``) must equal one process's ``estimate()`` on the
whole batch, for every estimator family, terminal and stepwise, to float64 round-off.

Rank 1 gets another generator seed than rank 0; the estimators' random draws and jagg's
gate decisions must be rank 0's / the whole batch's (``gradest.ranks``): otherwise the
gradients would not match, and under FSDP2 the ranks would make different numbers of
model calls and wait forever in an all-gather (the launch's timeout turns that into a
failure). Measured while writing this test: without the agreement, FSDP2 with
``truncated:random=uniform`` hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available",
    ),
    pytest.mark.slow,
]
pytest.importorskip("accelerate")

WORLD = 2
EXACTNESS = 1e-10  # float64; the ranks' sums are split differently than one process's
LAUNCH_TIMEOUT_S = 240
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
WORKER = Path(__file__).with_name("data_parallel_worker.py")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("data_parallel")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={WORLD}",
            str(WORKER),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_every_scenario_ran_on_every_rank(rank_results):
    names = [set(results) for results in rank_results]
    assert names[0] == names[1]
    # 8 specs x 2 objectives x 2 wrappers, plus accelerate.
    assert len(names[0]) == 8 * 2 * 2 + 1


def test_gradients_equal_one_process_on_the_whole_batch(rank_results):
    failures = {
        (rank, name): entry["difference"]
        for rank, results in enumerate(rank_results)
        for name, entry in results.items()
        if not entry["difference"] <= EXACTNESS
    }
    assert not failures


def test_random_and_gate_decisions_are_the_whole_batchs(rank_results):
    for results in rank_results:
        for name, entry in results.items():
            assert entry["decisions"] == entry["want"], name


def test_accelerate_prepared_a_ddp_wrapper(rank_results):
    assert rank_results[0]["accelerate terminal jagg"]["wrapper"] == "DistributedDataParallel"
