"""One rank of ``tests/test_data_parallel.py``, launched by torchrun (2 CPU ranks, gloo).

Every scenario trains nothing: it backpropagates one surrogate loss through a data-parallel
wrapper (DDP, FSDP2's ``fully_shard``, or ``accelerate``'s prepared model) on this rank's
half of a batch, and records the largest difference between the gradient autograd left in
``.grad`` and one process's ``estimate()`` on the whole batch. Rank 1 is given a different
generator seed than rank 0: the estimators' draws must follow rank 0's (``gradest.ranks``),
which is also what keeps the ranks' model calls, and so FSDP's all-gathers, in step.

Usage: ``torchrun --nproc_per_node=2 tests/data_parallel_worker.py OUT_DIR``; writes
``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import gradest
from gradest.testing.problems import seeded_normal, tiny_mlp

DIM, BATCH, STEPS, CLASSES = 4, 4, 6, 3
SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=3,tau=0.99",
    "jagg:window=4,shared_knots=true,gate=mean,tau=0.999",
    "sdo:samples=2",
    "sdo:full_sum=true",
    "truncated:k=2",
    "truncated:random=uniform",
]


def terminal_objective() -> gradest.TerminalObjective:
    weights = seeded_normal((DIM,), 1)
    # A mean over samples: the mean of the ranks' losses is the whole batch's.
    return gradest.TerminalObjective(
        lambda z: (torch.sin(z * weights).pow(2).sum(-1) + 0.1 * z.pow(2).sum(-1)).mean()
    )


def stepwise_objective() -> gradest.StepwiseObjective:
    directions = seeded_normal((STEPS, DIM), 2)
    return gradest.StepwiseObjective(
        lambda k, v, trajectory: ((v * directions[k]).sum(-1) + 0.5 * v.pow(2).sum(-1)).mean()
    )


def share(trajectory: gradest.Trajectory, rows: slice) -> gradest.Trajectory:
    return gradest.Trajectory(
        times=trajectory.times,
        states=trajectory.states[:, rows],
        velocities=trajectory.velocities[:, rows],
        step_noise=None,
    )


def max_difference(model: torch.nn.Module, want: dict, sharded: bool) -> float:
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if sharded else param.grad
        key = name.removeprefix("module.")
        worst = max(
            worst, float((grad - want[key]).abs().max()) / float(want[key].abs().max() + 1e-30)
        )
    return worst


def main(out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 11)
    labels = torch.arange(BATCH) % CLASSES
    reference_model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
    trajectory = gradest.rollout(reference_model, flow, noise, cond={"y": labels})
    problems = {
        "terminal": (terminal_objective(), {"noise": noise}, {"noise": noise[rows]}),
        "stepwise": (
            stepwise_objective(),
            {"trajectory": trajectory},
            {"trajectory": share(trajectory, rows)},
        ),
    }
    results: dict[str, float | dict] = {}
    for spec in SPECS:
        est = gradest.estimator(spec)
        for kind, (objective, whole, mine) in problems.items():
            want = est.estimate(
                reference_model,
                flow,
                objective,
                cond={"y": labels},
                generator=torch.Generator().manual_seed(5),
                **whole,
            )
            for wrapper in ("ddp", "fsdp2"):
                model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
                if wrapper == "ddp":
                    wrapped = torch.nn.parallel.DistributedDataParallel(model)
                else:
                    fully_shard(model)
                    wrapped = model
                sur = est.surrogate(
                    wrapped,
                    flow,
                    objective,
                    cond={"y": labels[rows]},
                    generator=torch.Generator().manual_seed(5 + 100 * rank),
                    **mine,
                )
                sur.loss.backward()
                results[f"{wrapper} {kind} {spec}"] = {
                    "difference": max_difference(model, want.grads, wrapper == "fsdp2"),
                    "decisions": {
                        key: sur.info[key]
                        for key in ("sampled_steps", "k", "fallback_groups")
                        if key in sur.info
                    },
                    "want": {
                        key: want.info[key]
                        for key in ("sampled_steps", "k", "fallback_groups")
                        if key in want.info
                    },
                }

    # accelerate under torchrun: Accelerator() prepares a DDP wrapper from the environment.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
    prepared = accelerator.prepare(model)
    objective, whole, mine = problems["terminal"]
    est = gradest.estimator("jagg:window=3,tau=0.99")
    want = est.estimate(reference_model, flow, objective, cond={"y": labels}, **whole)
    sur = est.surrogate(prepared, flow, objective, cond={"y": labels[rows]}, **mine)
    accelerator.backward(sur.loss)
    results["accelerate terminal jagg"] = {
        "difference": max_difference(model, want.grads, sharded=False),
        "decisions": {},
        "want": {},
        "wrapper": type(prepared).__name__,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    # DDP wrappers alive when the group is destroyed can abort the process at exit
    # (torch 2.14, gloo): drop them first (see gradest.integrations.distributed).
    del wrapped, prepared, accelerator
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
