"""No silent lone rank, and diffusers models inside data-parallel wrappers.

* ``WORLD_SIZE > 1`` in the environment without an initialised process group makes
  ``surrogate()`` / ``estimate()`` warn once per process (each process would train alone);
  no warning with ``WORLD_SIZE`` unset or 1, or with a group initialised. Each case runs
  in a fresh interpreter (the warning is once per process).
* ``DiffusersVelocity`` takes a DDP-wrapped transformer (a one-process gloo group) and an
  ``accelerator.prepare``-d one, and gives the gradients of the bare transformer; both
  orders (wrap then DDP, DDP then wrap) train.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LONE = textwrap.dedent(
    """
    import sys, warnings
    import torch, gradest
    from gradest.models import MLPVelocity
    mode = sys.argv[1]
    if mode == "group":
        import torch.distributed as dist
        store = dist.FileStore(sys.argv[2], 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = MLPVelocity(dim=2, hidden=8)
    flow = gradest.RectifiedFlow(steps=3)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).mean())
    est = gradest.estimator("sdo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            est.surrogate(model, flow, objective, noise=torch.randn(4, 2)).loss.backward()
        est.estimate(model, flow, objective, noise=torch.randn(4, 2))
    lone = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and "trains alone" in str(w.message)]
    print(len(lone))
    for message in lone:
        print(message)
    if mode == "group":
        dist.destroy_process_group()
    """
)


def run(script: str, env_update: dict[str, str | None], *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update({k: v for k, v in env_update.items() if v is not None})
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_world_size_without_group_warns_once():
    out = run(LONE, {"WORLD_SIZE": "2", "RANK": "0"}, "plain").splitlines()
    assert out[0] == "1", out
    message = out[1]
    assert "WORLD_SIZE=2" in message and "RANK=0" in message
    assert "Accelerator(cpu=True)" in message
    assert "torch.distributed.init_process_group" in message
    assert "--multi_gpu" in message


@pytest.mark.parametrize("world", [None, "1"])
def test_no_warning_for_one_process(world):
    out = run(LONE, {"WORLD_SIZE": world, "RANK": "0" if world else None}, "plain")
    assert out.splitlines()[0] == "0", out


def test_no_warning_with_a_process_group(tmp_path):
    out = run(LONE, {"WORLD_SIZE": "2", "RANK": "0"}, "group", str(tmp_path / "store"))
    assert out.splitlines()[0] == "0", out


WRAPPED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradest
    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers_support import tiny_transformer

    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    flow = sampler_from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0), 3)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).mean())
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 2, 4, 4, dtype=torch.float64, generator=g)
    cond = {"encoder_hidden_states": torch.randn(2, 3, 6, dtype=torch.float64, generator=g),
            "pooled_projections": torch.randn(2, 5, dtype=torch.float64, generator=g)}

    def grads(model, name, seed):
        model.zero_grad(set_to_none=True)
        est = gradest.estimator(name)
        sur = est.surrogate(model, flow, objective, noise=noise, cond=cond,
                            generator=torch.Generator().manual_seed(seed))
        sur.loss.backward()
        return {n.split("transformer.")[-1].removeprefix("module."): p.grad.clone()
                for n, p in model.named_parameters() if p.grad is not None}

    bare = DiffusersVelocity(tiny_transformer("sd3"))
    inside = DiffusersVelocity(DDP(tiny_transformer("sd3")))        # prepare, then wrap
    outside = DDP(DiffusersVelocity(tiny_transformer("sd3")))       # wrap, then prepare
    assert inside.config.in_channels == 2 and inside.input_name == "hidden_states"
    assert any(n.startswith("transformer.module.") for n, _ in inside.named_parameters())
    worst = 0.0
    for step in range(2):                                   # two iterations: the reducer
        for name in ("exact", "sdo", "jagg:window=2"):      # must be ready for the next
            want = grads(bare, name, step)
            for model in (inside, outside):
                got = grads(model, name, step)
                assert got.keys() == want.keys(), (sorted(got)[:3], sorted(want)[:3])
                for key in want:
                    worst = max(worst, float((got[key] - want[key]).abs().max()))
    print("ddp", worst)
    del inside, outside
    import gc; gc.collect()
    dist.destroy_process_group()

    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    prepared = DiffusersVelocity(accelerator.prepare(tiny_transformer("sd3")))
    optimizer = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    want = grads(bare, "sdo", 0)
    got = grads(prepared, "sdo", 0)
    print("accelerate", max(float((got[k] - want[k]).abs().max()) for k in want))
    wrapped_first = accelerator.prepare(DiffusersVelocity(tiny_transformer("sd3")))
    got = grads(wrapped_first, "sdo", 0)
    print("accelerate-outside", max(float((got[k] - want[k]).abs().max()) for k in want))
    """
)


def test_diffusers_velocity_inside_ddp_and_accelerate(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    out = dict(
        line.split()
        for line in run(WRAPPED, {}, str(tmp_path / "store")).splitlines()
        if line.split()[0] in ("ddp", "accelerate", "accelerate-outside")
    )
    for key in ("ddp", "accelerate", "accelerate-outside"):
        assert float(out[key]) < 1e-12, out
