"""Bad input at every public entry point, and ``docs/errors.md`` kept in step with it.

``CASES`` lists one bad input per row of the table in ``docs/errors.md``: the input as the
table shows it, how to run it, the argument and value the message must name, and what is
known to fall short. The tests check that

* every case raises what the table says, with the message the table shows (``...`` in the
  table stands for any text: abbreviations and machine-dependent parts such as paths);
* every table row has a case and every case a row, so the table cannot drift;
* the message names the argument and the offending value, and the error is a ``TypeError``
  or ``ValueError`` (or a subclass), raised by gradest before any work starts; command-line
  errors exit non-zero with one ``gradest <command>: error: ...`` line and no traceback.
  Cases with a known ``defect`` fail that standard today and are strict xfails: fixing
  the defect turns them into failures that ask for the table to be updated.

Regenerate the table after changing a message (the test prints the command when they
differ)::

    .venv/bin/python tests/test_bad_input_sweep.py > docs/errors.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from gradest_lab.storage.run_folder import RUN_RECORD, RunRecord
from torch import nn

import gradest
from gradest import cli
from gradest.base import surrogate_from_estimate
from gradest.testing.problems import (
    NoisyAffineSampler,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
DIM, BATCH, STEPS = 3, 2, 4


# -- the problem every case perturbs -----------------------------------------------------------


class _WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM + 1).double()

    def forward(self, z, t):
        return self.linear(z)


class _ReturnsTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return self.inner(z, t), None


class _NaNVelocity(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return self.inner(z, t) * float("nan")


def _frozen_mlp() -> nn.Module:
    return tiny_mlp(DIM).requires_grad_(False)


model = tiny_mlp(DIM)
flow = gradest.RectifiedFlow(steps=STEPS)
noise = seeded_normal((BATCH, DIM), 0)
data = seeded_normal((BATCH, DIM), 1)
objective = smooth_terminal_objective(DIM)
stepwise = random_stepwise_objective(STEPS, (BATCH, DIM))
trajectory = gradest.rollout(model, flow, noise)


class _BatchNormVelocity(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM).double()
        self.norm = nn.BatchNorm1d(DIM).double()

    def forward(self, z, t):
        return self.norm(self.linear(z))


class _BatchNormVelocityNoStats(_BatchNormVelocity):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM, track_running_stats=False).double()


class _IntegerVelocity(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM).double()

    def forward(self, z, t):
        return self.linear(z).round().long()


class _SyncBatchNormVelocity(nn.Module):
    def __init__(self, **options: Any):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM).double()
        self.norm = nn.SyncBatchNorm(DIM, **options).double()

    def forward(self, z, t):
        return self.norm(self.linear(z))


class _ComplexVelocity(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return self.inner(z, t) * (1 + 0j)


class _ShapeChangesAtStep3(nn.Module):
    """The right shape until t = 0.25 (step 3 of 4), then one entry short."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        v = self.inner(z, t)
        return v if float(t[0]) > 0.3 else v[:, :-1]


class _Plugin:
    """A plugin estimator whose ``estimate`` returns ``grads(params)``."""

    name = "plugin"
    objectives = ("terminal", "stepwise")

    def __init__(self, grads: Callable[[dict[str, torch.Tensor]], Any]):
        self.grads = grads

    def __repr__(self) -> str:
        return "Plugin()"

    def estimate(self, model, sampler, objective, **inputs):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return gradest.GradientEstimate(
            grads=self.grads(params), noise_grad=None, cost=gradest.protocol.Cost()
        )


_Plugin.__module__ = "a_plugin"


def _one_tensor_only(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(iter(params))
    return {name: torch.ones_like(params[name])}


class _ExitingPlugin:
    """A plugin whose ``estimate`` calls ``sys.exit(0)``."""

    name = "exiting"
    objectives = ("terminal", "stepwise")

    def estimate(self, *args: Any, **kwargs: Any) -> Any:
        sys.exit(0)


_ExitingPlugin.__module__ = "exiting_plugin"


@contextlib.contextmanager
def _with_exiting_plugin():
    """``exiting`` registered next to the installed estimators, for one case."""
    real = gradest.registry.available_estimators
    everything = {**real(), "exiting": _ExitingPlugin}
    gradest.registry.available_estimators = lambda: everything
    try:
        yield
    finally:
        gradest.registry.available_estimators = real


def _malformed(**fields: Any) -> gradest.Trajectory:
    """The module's recorded trajectory with some fields replaced."""
    return attrs.evolve(trajectory, **fields)


def _finetune(**overrides: Any) -> Any:
    from gradest_digits.finetune import finetune

    arguments = {
        "sample_shape": (DIM,),
        "steps": 1,
        "batch_size": BATCH,
        "sampler_steps": 2,
        "progress": False,
    }
    arguments.update(overrides)
    return finetune(model, lambda images: -images.pow(2).sum(-1), **arguments)


def _used_log() -> Path:
    """A log file that holds one record of an earlier run."""
    folder = Path(tempfile.mkdtemp())
    (folder / "log.jsonl").write_text('{"step": 0}\n')
    return folder / "log.jsonl"


class _CheckpointedMLP(nn.Module):
    """Layer checkpointing inside the model (saved-tensor hooks)."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return torch.utils.checkpoint.checkpoint(self.inner, z, t, use_reentrant=False)


def _in_inference_mode(run: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return run()


def estimate(*args: Any, estimator: str = "exact", **kwargs: Any) -> Any:
    """``gradest.estimator(estimator).estimate(...)`` with the defaults filled in."""
    call_args = list(args) + [model, flow, objective][len(args) :]
    if "noise" not in kwargs and "trajectory" not in kwargs:
        kwargs["noise"] = noise
    return gradest.estimator(estimator).estimate(*call_args, **kwargs)


def _stepwise_inf_at_step_2(k, v, traj):
    return v.sum() * (float("inf") if k == 2 else 1.0)


def _compare(**overrides: Any) -> Any:
    arguments = {
        "model": model,
        "sampler": flow,
        "objective": objective,
        "estimators": ["exact"],
        "noise_fn": lambda seed: noise,
        "seeds": 1,
        "draws": 1,
        "measure_cost": False,
        "show_progress": False,
    }
    arguments.update(overrides)
    return gradest.compare(**arguments)


# -- the cases ---------------------------------------------------------------------------------


@attrs.frozen
class Case:
    """One bad input.

    Attributes:
        input: the row's key, as the table shows it.
        run: performs the input (Python API) -- or ``argv`` for ``gradest.cli.main``.
        names: substrings the message must contain: the argument and the offending value.
        elide: regular expressions of message parts the table abbreviates to ``...``.
        defect: why the case fails the automated standard (then a strict xfail), or "".
        gap: what the message lacks that no test can judge (usually the fix), or "".
        within: a context the case runs in (e.g. a plugin installed for it).
    """

    input: str
    run: Callable[[], Any] | None = None
    argv: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    elide: tuple[str, ...] = ()
    defect: str = ""
    gap: str = ""
    within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def is_cli(self) -> bool:
        return self.run is None


def api(input: str, run: Callable[[], Any], *names: str, **extra: Any) -> Case:
    return Case(input=input, run=run, names=names, **extra)


def command(shown: str, *names: str, argv: Sequence[str] | None = None, **extra: Any) -> Case:
    """``gradest <shown>``; ``argv`` when the shown command has a placeholder (``{file}``)."""
    return Case(
        input=f"gradest {shown}",
        argv=tuple(argv if argv is not None else shown.split()),
        names=names,
        **extra,
    )


NAN = float("nan")
AVAILABLE = (r"(?<=available: )[\w, ]+?(?= \(plugins)",)  # plugins may add names

CASES: list[Case] = [
    # RectifiedFlow
    api("RectifiedFlow()", lambda: gradest.RectifiedFlow(), "steps=", "times="),
    api(
        "RectifiedFlow(steps=4, times=[1.0, 0.0])",
        lambda: gradest.RectifiedFlow(steps=4, times=[1.0, 0.0]),
        "steps=4",
        "times=",
    ),
    api("RectifiedFlow(steps=0)", lambda: gradest.RectifiedFlow(steps=0), "steps", "0"),
    api("RectifiedFlow(steps=2.5)", lambda: gradest.RectifiedFlow(steps=2.5), "steps", "2.5"),
    api("RectifiedFlow(steps=True)", lambda: gradest.RectifiedFlow(steps=True), "steps", "True"),
    api('RectifiedFlow(times="1,0")', lambda: gradest.RectifiedFlow(times="1,0"), "times", "str"),
    api("RectifiedFlow(times=[1.0])", lambda: gradest.RectifiedFlow(times=[1.0]), "times", "(1,)"),
    api(
        "RectifiedFlow(times=[[1.0, 0.0]])",
        lambda: gradest.RectifiedFlow(times=[[1.0, 0.0]]),
        "times",
        "(1, 2)",
    ),
    api(
        "RectifiedFlow(times=[1.0, nan])",
        lambda: gradest.RectifiedFlow(times=[1.0, NAN]),
        "times",
        "nan",
    ),
    api(
        "RectifiedFlow(times=[1.0, 0.5, 0.5, 0.0])",
        lambda: gradest.RectifiedFlow(times=[1.0, 0.5, 0.5, 0.0]),
        "times[1]=0.5",
    ),
    api(
        "RectifiedFlow(times=[0.0, 0.5, 1.0])",
        lambda: gradest.RectifiedFlow(times=[0.0, 0.5, 1.0]),
        "times[0]=0",
    ),
    api(
        "RectifiedFlow(times=[1.5, 0.5, 0.0])",
        lambda: gradest.RectifiedFlow(times=[1.5, 0.5, 0.0]),
        "times",
        "1.5",
    ),
    # rollout
    api(
        "rollout(lambda z, t: z, flow, noise)",
        lambda: gradest.rollout(lambda z, t: z, flow, noise),
        "model",
        "function",
    ),
    api(
        "rollout(model, 50, noise)",
        lambda: gradest.rollout(model, 50, noise),
        "sampler",
        "50",
    ),
    api(
        "rollout(model, flow, [[0.0, 0.0, 0.0]])",
        lambda: gradest.rollout(model, flow, [[0.0, 0.0, 0.0]]),
        "noise",
        "list",
    ),
    api(
        "rollout(model, flow, torch.zeros(2, 3, dtype=torch.long))",
        lambda: gradest.rollout(model, flow, torch.zeros(2, 3, dtype=torch.long)),
        "noise",
        "torch.int64",
    ),
    api(
        "rollout(model, flow, noise[0])",
        lambda: gradest.rollout(model, flow, noise[0]),
        "noise",
        "(3,)",
    ),
    api(
        "rollout(model, flow, noise.float())",
        lambda: gradest.rollout(model, flow, noise.float()),
        "noise",
        "torch.float32",
    ),
    api(
        'rollout(model, flow, noise.to("meta"))',
        lambda: gradest.rollout(model, flow, noise.to("meta")),
        "noise",
        "meta",
    ),
    api(
        "rollout(model, flow, noise * nan)",
        lambda: gradest.rollout(model, flow, noise * NAN),
        "noise",
        "NaN",
        gap="no fix, and not where the NaN is (which samples)",
    ),
    api(
        "rollout(model, flow, torch.zeros(2, 7))",
        lambda: gradest.rollout(model, flow, torch.zeros(2, 7, dtype=torch.float64)),
        "model(z, t, **cond)",
        "(2, 7)",
    ),
    api(
        "rollout(model, flow, noise, cond=[1])",
        lambda: gradest.rollout(model, flow, noise, cond=[1]),
        "cond",
        "list",
    ),
    api(
        'rollout(model, flow, noise, cond={"label": 1})',
        lambda: gradest.rollout(model, flow, noise, cond={"label": 1}),
        "cond",
        "['label']",
    ),
    api(
        "rollout(model, flow, noise, cond={1: labels})",
        lambda: gradest.rollout(model, flow, noise, cond={1: torch.zeros(2)}),
        "cond",
        "1 (int)",
    ),
    api(
        'estimate(..., cond={"extra": {"ids": {torch.zeros(2, 6)}}})',
        lambda: estimate(cond={"extra": {"ids": {torch.zeros(2, 6)}}}),
        "cond['extra']['ids']",
        "(2, 6)",
        "SharedCondition",
    ),
    api(
        "rollout(<model returning [B, D+1]>, flow, noise)",
        lambda: gradest.rollout(_WrongShape(), flow, noise),
        "model(z, t)",
        "(2, 4)",
    ),
    api(
        "rollout(<model returning a tuple>, flow, noise)",
        lambda: gradest.rollout(_ReturnsTuple(), flow, noise),
        "model(z, t)",
        "tuple",
    ),
    api(
        "rollout(model, flow, noise, generator=0)",
        lambda: gradest.rollout(model, flow, noise, generator=0),
        "generator",
        "int",
    ),
    # objectives
    api(
        "TerminalObjective(3)",
        lambda: gradest.TerminalObjective(3),
        "loss_fn",
        "3",
        gap="attrs' generic message: not the expected loss_fn(z_final) -> scalar signature",
    ),
    api(
        'StepwiseObjective("loss")',
        lambda: gradest.StepwiseObjective("loss"),
        "loss_fn",
        "loss",
        gap="attrs' generic message: not the expected loss_fn(k, v_k, trajectory) signature",
    ),
    api(
        "estimate(..., TerminalObjective(lambda z: z))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: z)),
        "loss on the final sample",
        "(2, 3)",
    ),
    api(
        "estimate(..., TerminalObjective(lambda z: 1.0))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: 1.0)),
        "loss on the final sample",
        "float",
    ),
    api(
        "estimate(..., TerminalObjective(lambda z: z.sum() / 0.0))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: z.sum() / 0.0)),
        "loss on the final sample",
        "inf",
    ),
    api(
        "estimate(..., StepwiseObjective(lambda k, v, traj: v), trajectory=traj)",
        lambda: estimate(
            model, flow, gradest.StepwiseObjective(lambda k, v, traj: v), trajectory=trajectory
        ),
        "loss at step 0",
        "(2, 3)",
    ),
    api(
        "estimate(..., StepwiseObjective(<inf at step 2>), trajectory=traj)",
        lambda: estimate(
            model, flow, gradest.StepwiseObjective(_stepwise_inf_at_step_2), trajectory=trajectory
        ),
        "loss at step 2",
        "inf",
    ),
    api(
        "estimate(<model with NaN velocity>, ...)",
        lambda: estimate(_NaNVelocity()),
        "velocity",
        "step 0",
    ),
    # flow matching
    api(
        "flow_matching_trajectory(flow, data, noise[:1])",
        lambda: gradest.flow_matching_trajectory(flow, data, noise[:1]),
        "data",
        "(1, 3)",
    ),
    api(
        "flow_matching_trajectory(flow, data.tolist(), noise)",
        lambda: gradest.flow_matching_trajectory(flow, data.tolist(), noise),
        "data",
        "list",
    ),
    api(
        "flow_matching_objective(torch.zeros(2, 3), torch.zeros(2, 4))",
        lambda: gradest.flow_matching_objective(torch.zeros(2, 3), torch.zeros(2, 4)),
        "data",
        "(2, 4)",
    ),
    api(
        "flow_matching_objective(data, noise[:1])",
        lambda: gradest.flow_matching_objective(data, noise[:1]),
        "data",
        "(1, 3)",
    ),
    # estimate / backward arguments
    api(
        "estimate(model, flow, objective)",
        lambda: estimate(model, flow, objective, noise=None),
        "noise=",
        "trajectory=",
        "neither",
    ),
    api(
        "estimate(..., noise=noise, trajectory=traj)",
        lambda: estimate(noise=noise, trajectory=trajectory),
        "noise=",
        "trajectory=",
        "both",
    ),
    api(
        "estimate(model, 50, objective, noise=noise)",
        lambda: estimate(model, 50),
        "sampler",
        "int",
    ),
    api(
        "estimate(model, flow, lambda z: z.sum(), noise=noise)",
        lambda: estimate(model, flow, lambda z: z.sum()),
        "objective",
        "function",
    ),
    api(
        "estimate(lambda z, t: z, flow, objective, noise=noise)",
        lambda: estimate(lambda z, t: z),
        "model",
        "function",
    ),
    api(
        "estimate(..., trajectory=noise)",
        lambda: estimate(trajectory=noise),
        "trajectory",
        "Tensor",
    ),
    api(
        "estimate(..., trajectory=<rollout on RectifiedFlow(steps=5)>)",
        lambda: estimate(trajectory=gradest.rollout(model, gradest.RectifiedFlow(steps=5), noise)),
        "trajectory",
        "5 steps",
    ),
    api(
        "estimate(..., trajectory=<float32 rollout>) with a float64 model",
        lambda: estimate(
            trajectory=gradest.rollout(tiny_mlp(DIM, dtype=torch.float32), flow, noise.float())
        ),
        "trajectory.states[0]",
        "torch.float32",
    ),
    api("estimate(..., cond=[1])", lambda: estimate(cond=[1]), "cond", "list"),
    api("estimate(..., generator=0)", lambda: estimate(generator=0), "generator", "int"),
    api(
        'estimate(..., noise_grad="yes")', lambda: estimate(noise_grad="yes"), "noise_grad", "'yes'"
    ),
    api(
        "estimate(model, flow, stepwise, noise=noise, noise_grad=True)",
        lambda: estimate(model, flow, stepwise, noise_grad=True),
        "noise_grad=True",
        "StepwiseObjective",
    ),
    api(
        'estimate(..., on_nonfinite="ignore")',
        lambda: estimate(on_nonfinite="ignore"),
        "on_nonfinite",
        "'ignore'",
    ),
    api(
        "estimate(<model with every parameter frozen>, ...)",
        lambda: estimate(_frozen_mlp()),
        "requires_grad=True",
        "MLPVelocity",
    ),
    api('estimate(..., engine="jax")', lambda: estimate(engine="jax"), "engine", "'jax'"),
    api(
        'estimate(<model with torch.utils.checkpoint inside>, ..., engine="func")',
        lambda: estimate(_CheckpointedMLP(), engine="func"),
        "engine='func'",
        "checkpoint",
    ),
    api(
        "estimate(model, flow, TerminalObjective(lambda z: z.detach().sum()))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: z.detach().sum())),
        "loss_fn",
        "z_final",
    ),
    api(
        "estimate(model, flow, TerminalObjective(lambda z: (z > 0).sum()))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: (z > 0).sum())),
        "loss_fn",
        "integer/bool",
    ),
    api(
        "estimate(model, flow, StepwiseObjective(lambda k, v, traj: v.detach().sum()), "
        "trajectory=traj)",
        lambda: estimate(
            model,
            flow,
            gradest.StepwiseObjective(lambda k, v, traj: v.detach().sum()),
            trajectory=gradest.rollout(model, flow, noise),
        ),
        "loss_fn",
        "v_k",
    ),
    api(
        "estimator(...).surrogate(...) inside torch.inference_mode()",
        lambda: _in_inference_mode(
            lambda: gradest.estimator("exact").surrogate(model, flow, objective, noise=noise)
        ),
        "inference_mode",
        "torch.no_grad()",
    ),
    api(
        "estimate(<model with BatchNorm1d in training mode>, ...)",
        lambda: estimate(_BatchNormVelocity().train()),
        "batch-norm",
        "norm",
    ),
    api(
        "estimate(<model with BatchNorm1d(track_running_stats=False) in eval mode>, ...)",
        lambda: estimate(_BatchNormVelocityNoStats().eval()),
        "track_running_stats=False",
        "GroupNorm",
    ),
    api(
        "estimate(<model with SyncBatchNorm in training mode>, ...)",
        lambda: estimate(_SyncBatchNormVelocity().train(), estimator="sdo"),
        "SyncBatchNorm",
        "training mode",
    ),
    api(
        "estimate(<model returning .round().long()>, ...)",
        lambda: estimate(_IntegerVelocity()),
        "dtype torch.int64",
        "floating point",
    ),
    api(
        "estimate(..., trajectory=<traj with states[:-1]>)",
        lambda: estimate(trajectory=_malformed(states=trajectory.states[:-1])),
        "trajectory.states",
        "(4, 2, 3)",
    ),
    api(
        "estimate(..., trajectory=<traj with velocities[:, :1]>)",
        lambda: estimate(trajectory=_malformed(velocities=trajectory.velocities[:, :1])),
        "trajectory.velocities",
        "(4, 1, 3)",
    ),
    api(
        "estimate(..., trajectory=<traj with states as a list>)",
        lambda: estimate(trajectory=_malformed(states=list(trajectory.states))),
        "trajectory.states",
        "list",
    ),
    api(
        "estimate(..., trajectory=<traj with a NaN at step 2>)",
        lambda: estimate(
            trajectory=_malformed(
                states=torch.cat(
                    [trajectory.states[:2], trajectory.states[2:3] * NAN, trajectory.states[3:]]
                )
            )
        ),
        "trajectory.states",
        "[2]",
    ),
    api(
        "estimate(..., trajectory=<traj with float32 velocities>)",
        lambda: estimate(trajectory=_malformed(velocities=trajectory.velocities.float())),
        "trajectory.velocities",
        "torch.float32",
    ),
    api(
        "finetune(..., log_path=<a log holding a record>)",
        lambda: _finetune(log_path=_used_log()),
        "log_path",
        "1 log records",
        elide=(r"'/[^']*'",),
    ),
    api(
        "finetune(..., resume=<a folder that does not exist>)",
        lambda: _finetune(resume="no/such/run"),
        "resume",
        "'no/such/run'",
    ),
    api(
        "finetune(..., checkpoint_dir=<a path under a file>)",
        lambda: _finetune(checkpoint_dir=_used_log() / "checkpoints"),
        "checkpoint_dir",
        "a part of the path is a file",
        elide=(r"'/[^']*'",),
    ),
    # estimator options: exact
    api(
        'estimator("exact", checkpoint="yes")',
        lambda: gradest.estimator("exact", checkpoint="yes"),
        "checkpoint",
        "'yes'",
    ),
    api(
        'estimator("exact:checkpoint=maybe")',
        lambda: gradest.estimator("exact:checkpoint=maybe"),
        "checkpoint",
        "'maybe'",
        gap="says 'expected true or false' twice",
    ),
    # jagg
    api('estimator("jagg", window=1)', lambda: gradest.estimator("jagg", window=1), "window=1"),
    api(
        'estimator("jagg", window=2.5)', lambda: gradest.estimator("jagg", window=2.5), "window=2.5"
    ),
    api('estimator("jagg", order=0)', lambda: gradest.estimator("jagg", order=0), "order=0"),
    api(
        'estimator("jagg", window=4, order=4)',
        lambda: gradest.estimator("jagg", window=4, order=4),
        "order=4",
        "window=4",
        gap="typo: '3th-order'",
    ),
    api('estimator("jagg", tau=1.5)', lambda: gradest.estimator("jagg", tau=1.5), "tau=1.5"),
    api(
        'estimator("jagg", tau="high")', lambda: gradest.estimator("jagg", tau="high"), "tau='high'"
    ),
    api(
        'estimator("jagg", gate="max")', lambda: gradest.estimator("jagg", gate="max"), "gate='max'"
    ),
    api(
        'estimator("jagg", shared_knots=1)',
        lambda: gradest.estimator("jagg", shared_knots=1),
        "shared_knots=1",
    ),
    # sdo
    api('estimator("sdo", samples=0)', lambda: gradest.estimator("sdo", samples=0), "samples=0"),
    api(
        'estimator("sdo", samples=5).estimate(<4-step flow>)',
        lambda: estimate(estimator="sdo:samples=5"),
        "samples=5",
        "N=4",
    ),
    api(
        'estimator("sdo", scale="biased")',
        lambda: gradest.estimator("sdo", scale="biased"),
        "scale='biased'",
    ),
    api(
        'estimator("sdo", full_sum="yes")',
        lambda: gradest.estimator("sdo", full_sum="yes"),
        "full_sum='yes'",
    ),
    # truncated
    api('estimator("truncated", k=0)', lambda: gradest.estimator("truncated", k=0), "k=0"),
    api(
        'estimator("truncated", k=5).estimate(<4-step flow>)',
        lambda: estimate(estimator="truncated:k=5"),
        "k=5",
        "N=4",
    ),
    api(
        'estimator("truncated", random="uniform", k=5).estimate(<4-step flow>)',
        lambda: estimate(estimator="truncated:random=uniform,k=5"),
        "k=5",
        "N=4",
    ),
    api(
        'estimator("truncated", random="normal")',
        lambda: gradest.estimator("truncated", random="normal"),
        "random='normal'",
    ),
    api(
        'estimator("truncated", random=(0.5, 0.6))',
        lambda: gradest.estimator("truncated", random=(0.5, 0.6)),
        "random=(0.5, 0.6)",
        "1.1",
    ),
    api(
        'estimator("truncated", random=())',
        lambda: gradest.estimator("truncated", random=()),
        "random=()",
    ),
    api(
        'estimator("truncated", random=(-0.5, 1.5))',
        lambda: gradest.estimator("truncated", random=(-0.5, 1.5)),
        "random=(-0.5, 1.5)",
    ),
    api(
        'estimator("truncated", random=5)',
        lambda: gradest.estimator("truncated", random=5),
        "random=5",
    ),
    api(
        'estimator("truncated", random=np.array([[0.5, 0.5]]))',
        lambda: gradest.estimator("truncated", random=np.array([[0.5, 0.5]])),
        "random=",
        "(1, 2)",
    ),
    api(
        'estimator("truncated", k=2, random=(0.5, 0.5))',
        lambda: gradest.estimator("truncated", k=2, random=(0.5, 0.5)),
        "k=2",
        "random=(0.5, 0.5)",
    ),
    api(
        'estimator("truncated:random=0.5/x")',
        lambda: gradest.estimator("truncated:random=0.5/x"),
        "random='0.5/x'",
    ),
    api('estimator("truncated:k=two")', lambda: gradest.estimator("truncated:k=two"), "k='two'"),
    api(
        'estimator("truncated", k=3, k_min=2)',
        lambda: gradest.estimator("truncated", k=3, k_min=2),
        "k_min=2",
        "random='uniform'",
    ),
    api(
        'estimator("truncated", random="uniform", k=2, k_min=3)',
        lambda: gradest.estimator("truncated", random="uniform", k=2, k_min=3),
        "k_min=3",
        "k=2",
    ),
    # telescope
    api(
        'estimator("telescope", mean_depth=0.5)',
        lambda: gradest.estimator("telescope", mean_depth=0.5),
        "mean_depth=0.5",
    ),
    api(
        'estimator("telescope", mean_depth=2, min_depth=3)',
        lambda: gradest.estimator("telescope", mean_depth=2.0, min_depth=3),
        "min_depth=3",
        "mean_depth=2",
    ),
    api(
        'estimator("telescope", mean_depth=5).estimate(<4-step flow>)',
        lambda: estimate(estimator="telescope:mean_depth=5"),
        "mean_depth=5",
        "N=4",
    ),
    # draft_lv and refl: terminal objectives, samplers with an interpolant
    api(
        'estimator("draft_lv").estimate(<stepwise objective>)',
        lambda: estimate(model, flow, stepwise, estimator="draft_lv"),
        "draft_lv",
        "stepwise",
    ),
    api(
        'estimator("refl").estimate(<sampler without an interpolant>)',
        lambda: estimate(model, NoisyAffineSampler(STEPS), estimator="refl"),
        "refl",
        "noised",
    ),
    api(
        'estimator("refl", last_steps=5).estimate(<4-step flow>)',
        lambda: estimate(estimator="refl:last_steps=5"),
        "last_steps=5",
        "N=4",
    ),
    api(
        'estimator("draft_lv", copies=0)',
        lambda: gradest.estimator("draft_lv", copies=0),
        "copies=0",
    ),
    # registry spec strings
    api('estimator("")', lambda: gradest.estimator(""), "spec", "''"),
    api(
        "estimator(3)",
        lambda: gradest.estimator(3),
        "spec",
        "3",
        gap="a non-string spec raises ValueError where a TypeError is expected",
    ),
    api('estimator("nope")', lambda: gradest.estimator("nope"), "'nope'", elide=AVAILABLE),
    api('estimator("jagg:window")', lambda: gradest.estimator("jagg:window"), "'window'"),
    api('estimator("jagg:windw=4")', lambda: gradest.estimator("jagg:windw=4"), "'windw'"),
    api('estimator("jagg", windw=4)', lambda: gradest.estimator("jagg", windw=4), "'windw'"),
    api(
        'estimator("jagg:window=four")',
        lambda: gradest.estimator("jagg:window=four"),
        "window='four'",
    ),
    # gradest.compare
    api(
        "compare(model, flow, lambda z: z.sum(), ...)",
        lambda: _compare(objective=lambda z: z.sum()),
        "objective",
        "function",
    ),
    api(
        'compare(..., estimators="exact")',
        lambda: _compare(estimators="exact"),
        "estimators",
        "'exact'",
    ),
    api("compare(..., estimators=[])", lambda: _compare(estimators=[]), "estimators", "empty"),
    api("compare(..., estimators=[3])", lambda: _compare(estimators=[3]), "estimator", "3"),
    api(
        'compare(..., estimators=["nope"])',
        lambda: _compare(estimators=["nope"]),
        "'nope'",
        elide=AVAILABLE,
    ),
    api(
        'compare(..., reference="jagg")', lambda: _compare(reference="jagg"), "reference", "'jagg'"
    ),
    api("compare(..., seeds=0)", lambda: _compare(seeds=0), "seeds", "0"),
    api("compare(..., seeds=True)", lambda: _compare(seeds=True), "seeds", "True"),
    api("compare(..., seeds=[])", lambda: _compare(seeds=[]), "seeds", "[]"),
    api("compare(..., draws=0)", lambda: _compare(draws=0), "draws", "0"),
    api(
        "compare(..., timing_repeats=0)", lambda: _compare(timing_repeats=0), "timing_repeats", "0"
    ),
    api(
        "compare(..., noise_fn=noise)",
        lambda: _compare(noise_fn=noise),
        "noise_fn",
        "tensor",
        elide=(r"(?s)(?<=got )tensor\(.*\)",),
        gap="prints the whole tensor (several lines) instead of its type",
    ),
    # classes of mistakes (issue 24): types, classes for instances, numpy arrays, complex
    # dtypes, shapes at every step, allocations that cannot fit, what a plugin returns
    api(
        "estimator(<an estimator class, e.g. Exact>)",
        lambda: gradest.estimator(type(gradest.estimator("exact"))),
        "the class Exact",
        "instance",
    ),
    api(
        'estimator("jagg", window=np.array([4, 8]))',
        lambda: gradest.estimator("jagg", window=np.array([4, 8])),
        "window",
        "(2,)",
    ),
    api(
        "rollout(model, RectifiedFlow, noise)",
        lambda: gradest.rollout(model, gradest.RectifiedFlow, noise),
        "sampler",
        "the class RectifiedFlow",
    ),
    api(
        "estimate(model, FlowSDE, objective, noise=noise)",
        lambda: estimate(model, gradest.FlowSDE),
        "sampler",
        "the class FlowSDE",
    ),
    api(
        "rollout(MLPVelocity, flow, noise)",
        lambda: gradest.rollout(type(model), flow, noise),
        "model",
        "the class MLPVelocity",
    ),
    api(
        "RectifiedFlow(steps=2**62)",
        lambda: gradest.RectifiedFlow(steps=2**62),
        "steps=4611686018427387904",
        "use steps <=",
        elide=(r"(?<=allocate )[^(]*(?= \()", r"(?<=memory \()[^)]*", r"(?<=<= )\d+"),
    ),
    api(
        'estimator("draft_lv", copies=10**12).estimate(...)',
        lambda: estimate(estimator="draft_lv:copies=1000000000000"),
        "copies=1000000000000",
        "use copies <=",
        elide=(r"(?<=allocate )[^(]*(?= \()", r"(?<=memory \()[^)]*", r"(?<=<= )\d+"),
    ),
    api(
        "estimate(..., TerminalObjective(lambda z: (z * 1j).sum()))",
        lambda: estimate(model, flow, gradest.TerminalObjective(lambda z: (z * 1j).sum())),
        "loss on the final sample",
        "complex",
    ),
    api(
        "estimate(..., StepwiseObjective(lambda k, v, traj: (v * 1j).sum()), trajectory=traj)",
        lambda: estimate(
            model,
            flow,
            gradest.StepwiseObjective(lambda k, v, traj: (v * 1j).sum()),
            trajectory=trajectory,
        ),
        "loss at step 0",
        "complex",
    ),
    api(
        "rollout(<model returning a complex velocity>, flow, noise)",
        lambda: gradest.rollout(_ComplexVelocity(), flow, noise),
        "model(z, t)",
        "complex",
    ),
    api(
        "rollout(<model whose output shape changes at step 3>, flow, noise)",
        lambda: gradest.rollout(_ShapeChangesAtStep3(), flow, noise),
        "at step 3",
        "(2, 2)",
    ),
    api(
        'estimate(<model whose output shape changes at step 3>, ..., estimator="truncated")',
        lambda: estimate(_ShapeChangesAtStep3(), estimator="truncated"),
        "at step 3",
        "(2, 2)",
    ),
    api(
        "compare(..., estimators=[<plugin returning a gradient for one tensor only>])",
        lambda: _compare(estimators=[_Plugin(_one_tensor_only)]),
        "'plugin'",
        "no gradient for",
    ),
    api(
        "compare(..., estimators=[<plugin returning floats as gradients>])",
        lambda: _compare(estimators=[_Plugin(lambda params: {n: 0.0 for n in params})]),
        "'plugin'",
        "float",
    ),
    api(
        "compare(..., estimators=[<plugin returning NaN gradients>])",
        lambda: _compare(
            estimators=[
                _Plugin(lambda params: {n: torch.full_like(p, NAN) for n, p in params.items()})
            ]
        ),
        "'plugin'",
        "NaN",
    ),
    api(
        "surrogate_from_estimate(model, <estimate with a gradient of the wrong shape>)",
        lambda: surrogate_from_estimate(
            model,
            _Plugin(lambda params: {n: torch.zeros(1) for n in params}).estimate(
                model, flow, objective
            ),
        ),
        "the estimate",
        "shape (1,)",
    ),
    command(
        "compare --estimators <plugin calling sys.exit(0) in estimate()>",
        "'exiting'",
        "SystemExit",
        argv=(
            *"compare --estimators exiting --steps 2 --seeds 1 --draws 1 --batch 2".split(),
            *"--repeats 1 --no-plots --no-sweeps --quiet --out {file}.out".split(),
        ),
        within=_with_exiting_plugin,
    ),
    command(
        "compare --out <a folder name of 300 characters>",
        "--out",
        "path component of 300 bytes",
        elide=(r"'[^']*'",),
        argv=("compare", "--out", "{file}.d/" + "x" * 300, "--quiet"),
    ),
    # the command line
    command("compare --estimators ,", "--estimators"),
    command("compare --estimators exact,,sdo", "--estimators", "position 6"),
    command("compare --estimators exact;sdo", "--estimators", "separate estimators with ','"),
    command("compare --estimators exact,nope", "'nope'", elide=AVAILABLE),
    command("compare --estimators jagg:window=1", "window=1"),
    command("compare --seeds 0", "--seeds", "0"),
    command(
        "compare --draws 0",
        "--draws",
        "0",
    ),
    command(
        "compare --repeats 0",
        "--repeats",
        "0",
    ),
    command(
        "compare --steps 0",
        "--steps",
        "0",
    ),
    command(
        "compare --batch 0 --steps 2 --seeds 1 --draws 1 --quiet",
        "--batch",
        "0",
    ),
    api(
        'estimator("jagg:window=4:tau=0.9")',
        lambda: gradest.estimator("jagg:window=4:tau=0.9"),
        "'jagg:window=4:tau=0.9'",
        "':'",
    ),
    api(
        'estimator("jagg:window=4,window=8")',
        lambda: gradest.estimator("jagg:window=4,window=8"),
        "'window'",
        "twice",
    ),
    api(
        'estimator("EXACT")',
        lambda: gradest.estimator("EXACT"),
        "'EXACT'",
        "did you mean 'exact'",
        elide=AVAILABLE,
    ),
    command(
        "finetune --resume A --out B",
        "--resume",
        "'A'",  # a missing --resume folder is refused first (issue 24)
        argv=("finetune", "--resume", "A", "--out", "B"),
    ),
    command(
        "pretrain --what dit --out <a path under a file>",
        "out",
        "is a file",
        elide=(r"'[^']*'",),
        argv=("pretrain", "--what", "dit", "--out", "{file}/model.pt", "--quiet"),
    ),
    command(
        "compare --out <a path under a file>",
        "--out",
        "a part of the path is a file",
        elide=(r"'[^']*'",),
        argv=("compare", "--out", "{file}/sub", "--quiet"),
    ),
    command("compare --model vit", "--model", "'vit'", elide=(r"(?<=choose one of ).*",)),
    command("compare --objective both", "--objective", "'both'"),
    command("compare --dtype float16", "--dtype", "'float16'"),
    command(
        "compare --device tpu",
        "--device",
        "tpu",
    ),
    command(
        "compare --out <an existing file>",
        "--out",
        "file",
        elide=(r"'[^']*'",),
        argv=("compare", "--out", "{file}"),
    ),
    command("compare --seeds x", "--seeds", "'x'"),
    command(
        "compare --draws 99999999999",
        "draws",
        "99999999999",
        elide=(r"\d+(\.\d+)?(e\+\d+)? [KMGT]iB", r"(?<=draws <= )\d+"),
    ),
    command(
        "compare --out <a folder of another tool's files>",
        "--out",
        "not a gradest run's",
        elide=(r"'[^']*'",),
        argv=("compare", "--out", "{foreign}", "--quiet"),
    ),
    command(
        "race --model digits --budget 1x --out <a folder of another tool's files>",
        "--out",
        "not a gradest run's",
        elide=(r"'[^']*'",),
        argv=("race", "--model", "digits", "--budget", "1x", "--out", "{foreign}", "--quiet"),
    ),
    command(
        "race --model digits --budget 1x --estimators sdo:samples=99",
        "samples=99",
        "N=16",
        argv=(
            "race",
            "--model",
            "digits",
            "--budget",
            "1x",
            "--estimators",
            "sdo:samples=99",
            "--quiet",
        ),
    ),
    command(
        "race --model digits --budget 8x --tune lr=1e-4,1.0000001e-4 --tune-seeds 0-1 --seeds 2-3",
        "--tune",
        "1.0000001e-4",
    ),
    command(
        "race --model digits --budget 8x --tune lr=1e-4..1e-3:999999999 --tune-seeds 0-1 "
        "--seeds 2-3",
        "--tune",
        "999999999",
    ),
    command("cost --model mlp --batch -1", "--batch", "-1"),
    command(
        "cost --model mlp --estimators ''",
        "--estimators",
        "empty",
        argv=("cost", "--model", "mlp", "--estimators", ""),
    ),
    command(
        "cost --model sd3-medium --lora-rank 99999999999999",
        "rank",
        "99999999999999",
        argv=("cost", "--model", "sd3-medium", "--lora-rank", "99999999999999", "--quiet"),
    ),
    command("cost --model mlp --steps 99999999999999999999", "--steps", "99999999999999999999"),
    command(
        "cost --model mlp --json <a FIFO>",
        "--json",
        "FIFO",
        elide=(r"'[^']*'",),
        argv=("cost", "--model", "mlp", "--json", "{fifo}", "--quiet"),
    ),
    command("compare --bogus", "--bogus"),
    command("check --steps 0", "--steps", "0"),
    command("check --estimators nope", "'nope'", elide=AVAILABLE),
    command("check --estimators jagg:window=x", "window='x'"),
    command("list extra", "extra"),
    command("frobnicate", "'frobnicate'", elide=(r"(?<=choose from ).*(?=\))",)),
]

if not torch.cuda.is_available():
    CASES.append(command("compare --device cuda", "--device", "cuda", gap="no fix (--device cpu)"))
    CASES.append(
        command(
            "race --model digits --budget 8x --device cuda",
            "--device",
            "cuda",
            argv=("race", "--model", "digits", "--budget", "8x", "--device", "cuda", "--quiet"),
        )
    )

_BY_INPUT = {case.input: case for case in CASES}
assert len(_BY_INPUT) == len(CASES), "duplicate inputs in CASES"


# -- running a case ------------------------------------------------------------------------------


@attrs.frozen
class Outcome:
    """What the user sees: the exception (or exit status) and its message."""

    error: str  # "ValueError", "UnknownEstimatorError (ValueError)", "exit 2", "none", ...
    message: str
    stderr_lines: tuple[str, ...] = ()
    traceback: bool = False
    error_type: type | None = None


def _error_label(error: BaseException) -> str:
    cls = type(error)
    if cls.__module__ == "builtins":
        return cls.__name__
    builtin = next(base for base in cls.__mro__ if base.__module__ == "builtins")
    return f"{cls.__name__} ({builtin.__name__})"


def _argv(case: Case, scratch: Path) -> list[str]:
    """The case's argv with ``{file}`` replaced by an existing file in ``scratch``,
    ``{fifo}`` by a FIFO there and ``{foreign}`` by a folder of another tool's files."""
    existing = scratch / "report.md"
    existing.write_text("")
    fifo = scratch / "pipe"
    if any("{fifo}" in arg for arg in case.argv):
        os.mkfifo(fifo)
    foreign = scratch / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not gradest's")
    return [
        arg.replace("{file}", str(existing))
        .replace("{fifo}", str(fifo))
        .replace("{foreign}", str(foreign))
        for arg in case.argv
    ]


def outcome(case: Case) -> Outcome:
    with case.within():
        return _outcome(case)


def _outcome(case: Case) -> Outcome:
    if not case.is_cli:
        try:
            case.run()
        except Exception as error:  # recording what the user gets
            return Outcome(_error_label(error), str(error), error_type=type(error))
        return Outcome("none (accepted)", "")
    with tempfile.TemporaryDirectory() as scratch:
        argv = _argv(case, Path(scratch))
        stderr, stdout = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
                status = cli.main(argv)
        except SystemExit as exit_:  # argparse
            status = exit_.code
        except Exception as error:  # an uncaught error is a traceback
            return Outcome(
                f"{_error_label(error)}, traceback",
                str(error),
                traceback=True,
                error_type=type(error),
            )
    lines = tuple(line for line in stderr.getvalue().splitlines() if line.strip())
    return Outcome(f"exit {status}", lines[-1] if lines else "", stderr_lines=lines)


# -- docs/errors.md ------------------------------------------------------------------------------


def _elide(case: Case, message: str) -> str:
    for pattern in case.elide:
        message = re.sub(pattern, "...", message)
    return message


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", r"\|")


def _uncode(cell: str) -> str:
    cell = cell.strip().replace(r"\|", "|")
    for fence in ("`` ", "``", "`"):
        closing = fence[::-1]
        if cell.startswith(fence) and cell.endswith(closing) and len(cell) >= 2 * len(fence):
            return cell[len(fence) : len(cell) - len(closing)]
    return cell


HEADER = """# Errors

gradest checks its input before any work starts. A bad argument raises one of gradest's
documented errors (`gradest.errors`: `InvalidValue` and `InvalidType`, which are a
`ValueError` and a `TypeError`, and `UnknownEstimatorError`, `NonFiniteError`,
`OutputError`, and `SurrogateOutdated`, a `RuntimeError` raised by a surrogate loss's
backward (below), all subclasses of `gradest.GradestError`) whose message names the
argument, the value and the fix; the command line prints the same message as one
`gradest <command>: error: ...` line and exits with status 2 (argparse's own errors, such
as an unknown flag, print the usage first). Any other exception is a bug and the command
line shows its traceback.

One row per bad input. The exception column is what the caller gets: an exception class
(its built-in base in parentheses), `exit 2` for the command line, `traceback` where the
command line lets an exception escape, or `none (accepted)` where the input is not
rejected. Rows that are not a `TypeError`/`ValueError` (or `exit 2`) are known defects.
`...` in a message stands for text that depends on the machine, the installed plugins,
or a printed value.

In the inputs, `model` is a small `torch.nn.Module` velocity model, `flow =
gradest.RectifiedFlow(steps=4)`, `noise` and `data` are `[2, 3]` float64 tensors,
`objective` a `TerminalObjective`, `stepwise` a `StepwiseObjective`, `traj` a trajectory
recorded with `gradest.rollout(model, flow, noise)`, and `estimate(...)` stands for
`gradest.estimator("exact").estimate(...)`. The table is generated by
`python tests/test_bad_input_sweep.py > docs/errors.md` and checked row by row by that
test file.

Unusual inputs that are *not* errors, and give the right answer (checked against the
dense reference or the hand-written loop in `tests/test_unusual_inputs.py`): tied weights
(one `Parameter` used twice, or one submodule under two names: gradients appear once,
under the first name), `torch.nn.utils.parametrize` (weight norm), layers in two dtypes
(the noise must have one of them), a model that updates a buffer in its forward (it moves
once per model call), conditioning values that are not per-sample (scalars, 0-dim tensors,
non-tensors, and `[B, ...]` tensors wrapped in `gradest.SharedCondition`), nested conditioning
(dicts, lists and tuples of per-sample tensors at any depth, as SDXL's `added_cond_kwargs`:
`tests/test_nested_conditioning.py`), noise that carries a graph or is expanded, a recorded
trajectory whose tensors carry a graph (used as data: nothing flows back into it), a
stochastic sampler's trajectory recorded without its step noise (estimates need only the
recorded states), and a float32 velocity for a float64 state. Degenerate shapes (one
sample, one step, a window longer than the chain) give exact's answer where it is defined
(`tests/test_nonfinite.py`).

Errors that come from the caller's backward of a surrogate loss, not from the call
(`tests/test_adversarial_gradients.py`, `tests/test_surrogate_outdated.py`):

- `sur.loss.backward()` after the model changed since `est.surrogate(...)` raises
  `gradest.SurrogateOutdated` (a `GradestError` and a `RuntimeError`; also
  `gradest.base.SurrogateOutdated`), for every estimator, naming each change: a parameter,
  buffer or submodule replaced (`model.lin.weight = nn.Parameter(...)`, also with equal
  values) or modified in place (an `optimizer.step()` in between, frozen parameters too),
  or a module switched between train and eval: `the model changed between surrogate() and
  the backward of its loss (estimator ...): parameter 'lin.weight' was replaced, module
  'drop' switched train -> eval ...; ... call est.surrogate(...) again after changing the
  model (...), or change the model after backward()`. The check runs at the start of the
  backward, before any gradient is computed or any step recomputed
  (`exact:checkpoint=true` once recomputed with the changed model: a mixed gradient, or
  torch's `CheckpointError` after a dropout mode switch); `.grad` is untouched. Zeroing
  gradients, a `no_grad` evaluation, an eval/train round trip and other surrogates built
  or backpropagated in between (gradient accumulation) are not changes; neither is what
  the model's own forwards change in the `surrogate()` call (a buffer it updates, DDP's
  buffer broadcast, FSDP2's parameter swaps).
- A NaN/Inf produced by the backward of a step (a custom autograd function, `sqrt` at 0)
  raises `NonFiniteError` at the end of that backward, with `.steps` the step(s) where it
  first appeared: `non-finite (NaN/Inf) gradient in the backward of the surrogate loss at
  step 2 in estimator ...`. Where a model call evaluated several steps at once on recorded
  states (stepwise estimators, sdo, jagg's nodes), `.steps` are that call's steps; a NaN
  that reaches only the parameters of a call whose input is tracked names no step.
  `.grad` already holds the non-finite values (zero it before the next step). Under a loss
  scaler (the gradient reaching `sur.loss` is larger than 1, as with `GradScaler`) the
  check stands aside: overflow is the scaler's signal to skip the step.
- `NonFiniteError.steps` is filled whenever its message names a step (also for a stepwise
  loss's "loss at step 2").

Concurrency, which raises nothing but used to give wrong numbers: a model with dropout (any
module in training mode that draws from torch's default generator) gets the same masks at
every evaluation of a step, whichever step first draws, and with a `generator=` its masks
come from a stream seeded from that generator (the same in any thread; see
`gradest/replay.py`).

Classes of mistakes are checked by principle, so that an unseen variant of a class gets
the same one-line error as the rows below (`tests/test_unseen_inputs.py` tries several
variants of each):

- **Types.** An estimator object is accepted wherever a spec is (`gradest.estimator(est)`
  returns it; with options, an `attrs.evolve`-d copy). A *class* where an instance is
  expected (an estimator, a sampler such as `RectifiedFlow`, a model class) is refused
  saying to construct it. Numbers of any kind (numpy integers and floats, 0-d numpy
  arrays and tensors) are accepted wherever a number is (estimator options, `steps=`); an
  array of several values where one is expected is one line naming the option.
- **Dtypes.** Complex losses, velocities and states are refused (gradients are defined
  for real losses), as are integer velocities.
- **Shapes at every step.** The model's output is checked at every step of every chain
  (type, dtype and shape: host metadata, no device sync), so a velocity whose shape
  changes at a late step fails naming that step.
- **Allocations.** Values that size an allocation (`steps`, `draft_lv:copies`, a
  rollout's recorded states) are bounded by what they would allocate (e.g. copies x
  batch x state size x element size x tensors) against the device's memory (on the CPU,
  the machine's physical memory), before any work; the message gives the largest value
  that fits. `from_pipeline`'s sizes are bounded the same way before any model call:
  `num_inference_steps` by its schedule (on the CPU) and, for DDIM / DDPM, by the
  scheduler's `num_train_timesteps`; `height` / `width` and `num_images_per_prompt` by the
  initial latents and prompt embeddings (twice under CFG) in the denoiser's dtype against
  the pipeline device's memory.
- **Pipeline sizes.** Every size of `gradest.integrations.pipelines` (`from_pipeline`'s
  `num_inference_steps`, `num_images_per_prompt`, `height`, `width`,
  `max_sequence_length`; the sides and `rows` of `unpack_latents`, `flux_image_ids` and
  `sdxl_time_ids`; `dynamic_shift_mu`'s `image_seq_len`) is an int (numpy / torch integers
  too) >= 1 within int64: a bool, float or string is `InvalidType`, `0`, `-3` or `2**64`
  `InvalidValue`, naming `name=value`. `max_sequence_length` is at most 512 T5 tokens (the
  SD3 / Flux pipelines' limit) or the T5 tokenizer's `model_max_length` where smaller.
  `pack_latents` takes `[B, C, H, W]` with H and W even, naming the shape and the fix
  (image sides multiples of 2 x `vae_scale_factor`); Flux's latent sides are even
  (`tests/test_pipeline_sizes.py`).
- **Setups that would run with wrong numbers.** A flow-matching transformer (SD3, Flux,
  ...) under a `DDIM` sampler; classifier-free guidance given a negative value for some of
  the prompt keys the model takes but not all (`negative_pooled_projections` missing); a
  conditioning tensor without one row per sample under CFG, named itself rather than its
  negative counterpart (`tests/test_guided_setups.py`).
- **Saved states.** `auto`'s `load_state_dict` checks the state against the schema
  `state_dict` writes (keys, types, bounds, choices among the candidates, the model's
  signature, gradient shapes and dtypes) and refuses in one line naming the field path,
  leaving its schedules unchanged (`lab/tests/test_auto_state_validation.py`).
- **Batch statistics.** A model with a batch-norm layer (any
  `torch.nn.modules.batchnorm._BatchNorm`, `SyncBatchNorm` included) that normalizes with
  the call's batch statistics (training mode, or `track_running_stats=False` in any mode)
  is refused naming the layer: estimators stack several steps' states into one call, so
  the statistics would not be those of the sampled batch. Eval mode with running
  statistics, `GroupNorm`, `LayerNorm` and `InstanceNorm` are per-sample and accepted.
- **In-place ops in a loss.** A loss gets a copy of its argument, so an in-place op on
  the sample or the velocity (`z.mul_(2)`) is differentiated like its out-of-place form
  and never changes the recorded path.
- **Random draws that miss the loss.** A stochastic estimator (`sdo`, randomized
  `truncated`, `telescope`, `jagg:debias`) whose draw misses every step a stepwise loss
  depends on returns a zero estimate, the right one for that draw; only a loss that
  depends on no step's velocity at all is refused.
- **Plugins.** What a plugin estimator returns is checked wherever gradest uses it
  (`gradest.compare`, `gradest check`, `auto`, `gradest.plugin.surrogate_from_estimate`):
  one gradient tensor per trainable parameter, none for anything else, of the parameter's
  shape, dtype and device, and finite; anything else is one line naming the plugin. A
  plugin that raises, or calls `sys.exit()`, in its constructor or `estimate()` (in
  `gradest.estimator`, `gradest.compare`, `gradest check`) raises
  `gradest.registry.PluginError` (a `GradestError`, chained to the original), so the
  command exits 2 with one line naming it; a `KeyboardInterrupt` inside a plugin exits
  130 naming it. A command never ends with status 0 because a plugin exited.
- **Output paths.** `gradest compare` checks `--out` before the work: a path component
  longer than the file system's name limit (255 bytes) or a path longer than its path
  limit, a folder where the report's files go, a file on the way, an unwritable folder.
  Every file gradest writes (reports, `gradest cost --json`, checkpoints, logs, settings,
  plots; `gradest_lab.storage.files`) is refused in one line, never replaced, where the path exists
  and is not a regular file: a character device such as `/dev/null`, a FIFO, a socket, a
  block device or a folder, through a symbolic link too; so is a path through a loop of
  symbolic links. A config file read back (`--config`) must be a regular file of UTF-8
  text (`tests/test_refusals_by_principle.py`).
- **Integers.** Every integer flag of every command (`--batch`, `--steps`, `--seeds`,
  `--seed`, `--lora-rank`, ...) has one type, `gradest.integers.WholeNumber`: a whole
  number in the flag's range (sizes and counts >= 1, seeds and offsets >= 0) and within
  int64 (what torch holds), so `2.5`, `-1`, `0` and a 20-digit number are one line
  naming the flag; the same rule holds for a `--config` file's values and, for
  overflow, for `--task-option` integers (whose range is the task's).
- **diffusers configs.** `gradest cost` checks every field of a diffusers config (a
  preset or a user's `config.json`) before building, against the diffusers class's own
  `__init__` (its annotations and defaults, read with `inspect`): a field left out gets
  diffusers' default, a given one the annotated type (no `null`, bool, float or string
  for a size), every integer a size or a count >= 1 (`num_layers=-1` would price a model
  without layers) except offsets and indices (>= 0), and the family's relations hold
  (SD3's caption projection as wide as its blocks, Flux's rope axes summing to the head
  size, a UNet's widths divisible by its heads and norm groups, per-block lists as long
  as the blocks); each refusal names the field, the value and the fix.
- **Reward and VAE configs.** `gradest cost --reward file.json` / `--decoder`, and the
  recipes' learned rewards (CLIP `config.json`, ImageReward's `med_config.json`, HPSv2's
  open_clip `arch=` file), check every size or count field, found by name (`*_size`,
  `*_dim`, `num_*`, `*_layers`, `*_heads`, `*_channels`, `layers_per_block`, ...) and in
  nested sections too, as a whole number >= 1 (no bool, float, string or, in gradest's own
  formats, null), and the architecture (`kind`, `model_type`) against the ones the code
  builds; each refusal is one line naming the file, the dotted field
  (`vision.num_hidden_layers=0`), the value and the fix.
- **Reports.** Non-finite values are shown as such: `nan`, `inf` in report.md (`-` is
  "not measured"), and report.json stays strict JSON (`json.dumps(allow_nan=False)`):
  a non-finite float is the string `"NaN"`, `"Infinity"` or `"-Infinity"`.

| input | exception | message |
|---|---|---|
"""


def render_table() -> str:
    rows = []
    for case in CASES:
        result = outcome(case)
        if "\n" in _elide(case, result.message):
            raise ValueError(f"{case.input}: a multi-line message needs an elide pattern")
        rows.append(
            f"| {_code(case.input)} | {result.error} | {_code(_elide(case, result.message))} |"
        )
    return HEADER + "\n".join(rows) + "\n"


def parse_table(text: str) -> dict[str, tuple[str, str]]:
    """``input -> (exception, message)`` from the table in ``docs/errors.md``."""
    rows: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        assert len(cells) == 3, f"docs/errors.md: a row needs 3 cells: {line}"
        key = _uncode(cells[0])
        assert key not in rows, f"docs/errors.md: duplicate row {key!r}"
        rows[key] = (cells[1].strip(), _uncode(cells[2]))
    return rows


def _pattern(documented: str) -> re.Pattern:
    """The documented message with each ``...`` matching any text."""
    return re.compile(".*".join(re.escape(part) for part in documented.split("...")), re.DOTALL)


# -- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def documented() -> dict[str, tuple[str, str]]:
    return parse_table(DOC.read_text())


def test_every_table_row_has_a_case_and_every_case_a_row(documented):
    regenerate = f"regenerate with: .venv/bin/python tests/{Path(__file__).name} > docs/errors.md"
    assert sorted(set(documented) - set(_BY_INPUT)) == [], f"rows without a case; {regenerate}"
    assert sorted(set(_BY_INPUT) - set(documented)) == [], f"cases without a row; {regenerate}"


@pytest.mark.parametrize("case", CASES, ids=[case.input for case in CASES])
def test_the_input_fails_as_documented(case, documented):
    if case.input not in documented:
        pytest.fail(f"no row for {case.input!r} in docs/errors.md")
    error, message = documented[case.input]
    result = outcome(case)
    assert result.error == error
    assert _pattern(message).fullmatch(result.message), (
        f"message changed; regenerate docs/errors.md:\n  now: {result.message}\n  doc: {message}"
    )


def occupy_default_run_folders(folder: Path) -> list[Path]:
    """Put another run of each command in every folder under ``folder`` that a command
    writes by default: ``runs/<command>`` for each subcommand the parser knows (the
    applications' too) and every ``--out`` default the parser declares. Each holds a
    ``run.json`` of the same command with other settings, as an earlier run leaves it.
    Returns the folders."""
    parser = cli.build_parser()
    subcommands = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    occupied = []
    for name, subparser in subcommands.choices.items():
        declared = {
            action.default
            for action in subparser._actions
            if action.dest == "out" and isinstance(action.default, str)
        }
        for default in sorted({f"runs/{name}"} | declared):
            target = folder / default
            target.mkdir(parents=True, exist_ok=True)
            record = RunRecord(
                command=f"gradest {name}", settings={"model": "another", "seeds": [999]}
            )
            (target / RUN_RECORD).write_text(record.to_json())
            occupied.append(target)
    return occupied


@pytest.mark.parametrize(
    "case", [case for case in CASES if case.is_cli], ids=lambda case: case.input
)
def test_a_command_error_does_not_depend_on_the_runs_in_the_folder(case, documented):
    """Arguments are checked before the run folder: each command-line case, run where every
    default run folder (``runs/compare`` ...) holds another run, fails as documented (as
    in an empty folder), not with the folder's refusal."""
    occupied = occupy_default_run_folders(Path.cwd())
    assert Path("runs/compare") in [path.relative_to(Path.cwd()) for path in occupied]
    error, message = documented[case.input]
    result = outcome(case)
    assert result.error == error
    assert _pattern(message).fullmatch(result.message), (
        f"beside another run the message is\n  {result.message}\nnot as documented\n  {message}"
    )


def _standard_cases() -> list[Any]:
    return [
        pytest.param(
            case,
            id=case.input,
            marks=[pytest.mark.xfail(strict=True, reason=case.defect)] if case.defect else [],
        )
        for case in CASES
    ]


@pytest.mark.parametrize("case", _standard_cases())
def test_the_error_meets_the_standard(case, capsys):
    """A ValueError/TypeError naming the argument and value; CLI: exit 2, one line."""
    if case.is_cli:
        with tempfile.TemporaryDirectory() as scratch, case.within():
            try:
                status = cli.main(_argv(case, Path(scratch)))
            except SystemExit as exit_:
                status = exit_.code
        stderr = capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert status not in (0, None)
        assert "Traceback" not in stderr
        assert lines and re.match(r"gradest( \w+)?: error: ", lines[-1]), stderr
        # argparse prints its usage first; errors gradest raises are exactly one line.
        assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), stderr
        message = lines[-1]
    else:
        with pytest.raises(Exception) as info, case.within():  # noqa: B017 - checked below
            case.run()
        assert isinstance(info.value, TypeError | ValueError), traceback.format_exception(
            info.value
        )
        # gradest's own, documented errors only (the CLI shows anything else as a bug).
        assert isinstance(info.value, gradest.GradestError), type(info.value)
        message = str(info.value)
    for name in case.names:
        assert name in message, f"{name!r} not in {message!r}"


def _print_table(stream: Any = sys.stdout) -> None:
    stream.write(render_table())


if __name__ == "__main__":
    _print_table()


__all__: Sequence[str] = ["CASES", "parse_table", "render_table"]
