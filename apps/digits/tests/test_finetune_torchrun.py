"""``gradest finetune`` under ``torchrun``: two CPU ranks (gloo) train one model data-parallel.

Two launches of ``python -m torch.distributed.run --standalone --nproc_per_node=2``:

* the CLI (``-m gradest.cli finetune``, mode ``reward``, the shipped digits model): the
  process group is made from the environment; only rank 0 writes the log, the
  checkpoints and ``result.json``, whose ``ranks_in_sync`` says the replicas ended bit
  for bit equal;
* a script calling :func:`finetune` (mode ``grpo``, a tiny DiT, label tensor) in a group
  it initialized itself: the group is used and left initialized, replicas built with
  different weights start from rank 0's, each rank trains on its own samples while the
  evaluation batch is shared, and the logged statistics are those of the global batch.

A negative control (measured while writing this test): replacing the gradient averaging
by a local ``est.estimate`` written into ``.grad`` makes ``ranks_in_sync`` False and the
digests differ.

The argument checks (global batch divisible by the world size; GRPO groups inside one
rank) need no processes: they read the world size from the environment and fail before
a process group or a model call exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from digits_support import CountingReward, tiny_dit
from gradest_digits.finetune import finetune

from gradest.integrations.distributed import launched_world

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

WORLD = 2
# Each launch starts two interpreters that import torch and gradest: ~15 s on 2 cores.
LAUNCH_TIMEOUT_S = 180
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _launch(tmp_path: Path, *target: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 --redirects 3 <target...>``, one thread
    per rank; each rank's stdout/stderr land under ``tmp_path/logs``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a rendezvous on localhost with a free port
        f"--nproc_per_node={WORLD}",
        "--redirects=3",
        f"--log-dir={tmp_path / 'logs'}",
        *target,
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n" + "\n".join(
        f"--- {path}\n{path.read_text()}" for path in sorted((tmp_path / "logs").rglob("*.log"))
    )
    return done


def _rank_log(tmp_path: Path, rank: int, stream: str) -> str:
    (path,) = (tmp_path / "logs").rglob(f"attempt_0/{rank}/{stream}.log")
    return path.read_text()


# -- the CLI, mode reward, group from the environment ---------------------------------------


@pytest.mark.slow
def test_cli_finetune_under_torchrun(tmp_path):
    assets = pytest.importorskip("gradest_digits.assets")
    for name in (assets.DIT_CHECKPOINT, assets.CLASSIFIER_CHECKPOINT):
        if not assets.asset_path(name).is_file():
            pytest.skip(f"shipped checkpoint missing: {name}")
    out = tmp_path / "ft"
    argv = "finetune --estimator sdo --steps 2 --batch-size 8 --sampler-steps 4 --quiet"
    _launch(tmp_path, "-m", "gradest.cli", *argv.split(), "--out", str(out))

    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 1]
    summary = json.loads((out / "result.json").read_text())
    assert summary["world_size"] == WORLD and summary["config"]["world_size"] == WORLD
    assert summary["config"]["batch_size"] == 8  # the global batch
    assert summary["ranks_in_sync"] is True
    assert summary["log_path"] == str(out / "log.jsonl")
    # Only rank 0 saved: one final checkpoint, holding the (common) weights.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002.pt"]
    assert summary["checkpoints"] == [str(out / "checkpoints" / "step_000002.pt")]


# -- finetune() in a group the caller made, mode grpo ----------------------------------------

SCRIPT = """
import hashlib, json, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from digits_support import CountingReward, tiny_dit
from gradest_digits.finetune import finetune

out = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo")  # the caller's group: finetune uses it and leaves it
rank = dist.get_rank()
model = tiny_dit(seed=10 + rank)  # different replicas: finetune starts them from rank 0's
seen = []

class Recording(CountingReward):
    def __call__(self, images):
        seen.append([images.shape[0], float(images.double().sum())])
        return super().__call__(images)

result = finetune(
    model, Recording(), estimator="sdo:samples=2", mode="grpo", steps=2, batch_size=8,
    group_size=2, inner_epochs=2, lr=1e-2, sampler_steps=4, seed=7,
    labels=torch.arange(8) % 3, log_path=f"{{out}}/log.jsonl", checkpoint_dir=f"{{out}}/ckpt",
    progress=True,
)
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
keys = ("initial_reward", "final_reward", "log_path", "checkpoints", "ranks_in_sync",
        "world_size", "rank", "history")
record = {{key: result[key] for key in keys}}
record.update(
    digest=hashlib.sha256(weights).hexdigest(), still_initialized=dist.is_initialized(),
    reward_calls=seen,
)
with open(f"{{out}}/rank{{rank}}.json", "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_finetune_grpo_in_a_caller_initialized_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    out = tmp_path / "out"
    out.mkdir()
    _launch(tmp_path, str(script), str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for rank, record in enumerate(ranks):
        assert record["rank"] == rank and record["world_size"] == WORLD
        assert record["still_initialized"] is True
        assert record["ranks_in_sync"] is True
    # Bit-identical replicas, although they were built with different weights.
    assert ranks[0]["digest"] == ranks[1]["digest"]
    # The evaluation batch is global and shared; every training rollout is the rank's own.
    evaluation = [[call for call in r["reward_calls"] if call[0] == 8] for r in ranks]
    training = [[call for call in r["reward_calls"] if call[0] == 4] for r in ranks]
    assert len(evaluation[0]) == 2 and evaluation[0] == evaluation[1]
    assert len(training[0]) == 2 and all(
        a[1] != b[1] for a, b in zip(training[0], training[1], strict=True)
    )
    assert ranks[0]["initial_reward"] == ranks[1]["initial_reward"]
    assert ranks[0]["final_reward"] == ranks[1]["final_reward"]
    # Logged statistics are global (gathered rewards, averaged losses, averaged gradient).
    for key in ("reward_mean", "reward_std", "loss", "losses", "grad_norm", "grad_norms"):
        assert [h[key] for h in ranks[0]["history"]] == [h[key] for h in ranks[1]["history"]]
    # Only rank 0 wrote, and only rank 0 showed a progress bar.
    assert ranks[0]["log_path"] == str(out / "log.jsonl") and ranks[1]["log_path"] is None
    assert [Path(p).name for p in ranks[0]["checkpoints"]] == ["step_000002.pt"]
    assert ranks[1]["checkpoints"] == []
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_000002.pt"]
    lines = (out / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert "finetune grpo" in _rank_log(tmp_path, 0, "stderr")
    assert "finetune grpo" not in _rank_log(tmp_path, 1, "stderr")


# -- argument checks: no processes needed ----------------------------------------------------


def _finetune(reward, **overrides):
    arguments = {
        "estimator": "exact",
        "steps": 1,
        "batch_size": 8,
        "sampler_steps": 2,
        "labels": 1,
        "progress": False,
    }
    arguments.update(overrides)
    return finetune(tiny_dit(), reward, **arguments)


@pytest.mark.parametrize(
    ("world", "overrides", "match"),
    [
        (
            2,
            {"batch_size": 7},
            r"batch_size=7 is the global batch and must be divisible by the world size 2 "
            r".*e\.g\. batch_size=6",
        ),
        (3, {"batch_size": 8}, r"divisible by the world size 3 .*e\.g\. batch_size=6"),
        (
            2,
            {"mode": "grpo", "batch_size": 12, "group_size": 4},
            r"per-rank batch batch_size / world_size = 12 / 2 = 6 must be a multiple of "
            r"group_size=4, so that no group straddles two ranks; e\.g\. batch_size=8",
        ),
    ],
)
def test_batch_must_split_evenly_across_ranks(monkeypatch, world, overrides, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    reward = CountingReward()
    with pytest.raises(ValueError, match=match):
        _finetune(reward, **overrides)
    assert reward.calls == 0
    assert not dist.is_initialized()


def test_the_same_arguments_are_fine_for_one_process(monkeypatch):
    """The GRPO batch above splits into whole groups when nothing is split across ranks."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    result = _finetune(CountingReward(), mode="grpo", batch_size=12, group_size=4, inner_epochs=1)
    assert result["world_size"] == 1 and result["ranks_in_sync"] is None


@pytest.mark.parametrize(
    ("rank", "world", "match"),
    [("2", "2", "RANK=2 and WORLD_SIZE=2 are inconsistent"), ("0", "two", "WORLD_SIZE='two'")],
)
def test_launcher_environment_is_validated(monkeypatch, rank, world, match):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=match):
        launched_world()


def test_a_caller_initialized_group_is_used_and_left(tmp_path):
    """A one-rank group: finetune reads the world from it, leaves it initialized, and
    trains exactly as without a group (one rank takes the single-process path)."""
    reference_model = tiny_dit()
    reference = finetune(
        reference_model, CountingReward(), steps=2, batch_size=4, sampler_steps=2, progress=False
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = tiny_dit()
        result = finetune(
            model, CountingReward(), steps=2, batch_size=4, sampler_steps=2, progress=False
        )
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert result["world_size"] == 1
    assert result["final_reward"] == reference["final_reward"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.parameters(), reference_model.parameters(), strict=True)
    )
