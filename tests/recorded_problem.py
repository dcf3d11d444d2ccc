"""A recorded path with its dense chain, shared by the sdo and truncated tests.

Small enough for dense Jacobians; ``problem(...)`` is cached, and nothing mutates it.
"""

from __future__ import annotations

import functools

import attrs
import torch
from torch import Tensor

import gradest
from gradest.reference import dense_chain
from gradest.testing import problems
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS, CLASSES = 3, 4, 6, 3


def NoisyAffineSampler() -> problems.NoisyAffineSampler:  # noqa: N802 - stands for the class
    """alpha != 1 and recorded noise (DDIM / flow-SDE shape): estimators see only the step form."""
    return problems.NoisyAffineSampler(STEPS, drift=0.3)


@attrs.frozen(eq=False)
class Problem:
    model: torch.nn.Module
    flow: gradest.AffineSampler
    noise: Tensor
    cond: dict | None
    trajectory: gradest.Trajectory
    chain: object
    seed: int  # the generator seed that reproduces `trajectory` from `noise`


@functools.cache
def problem(
    flow_kind: str = "rectified", conditioned: bool = False, frozen: bool = False
) -> Problem:
    """A recorded path with its dense chain, shared by the tests (nothing mutates it)."""
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES if conditioned else None)
    if frozen:
        model.input.weight.requires_grad_(False)
        model.time_embed.mlp[0].requires_grad_(False)
    flows = {
        "rectified": lambda: gradest.RectifiedFlow(steps=STEPS),
        "noisy": NoisyAffineSampler,
        # Stochastic steps and the rectified-flow interpolant (draft_lv, refl need it).
        "sde": lambda: gradest.FlowSDE(steps=STEPS, noise_level=0.5),
    }
    flow = flows[flow_kind]()
    noise = seeded_normal((BATCH, DIM), seed=11)
    cond = {"y": torch.tensor([0, 2, 1, 3])} if conditioned else None  # 3 is the null class
    seed = 3
    trajectory = gradest.rollout(
        model, flow, noise, cond=cond, generator=torch.Generator().manual_seed(seed)
    )
    chain = dense_chain(model, flow, trajectory, cond)
    return Problem(model, flow, noise, cond, trajectory, chain, seed)


def objective_of(kind: str) -> gradest.TerminalObjective | gradest.StepwiseObjective:
    if kind == "terminal":
        return smooth_terminal_objective(DIM)
    return random_stepwise_objective(STEPS, (BATCH, DIM))


def run(est, p: Problem, objective, source: str, seed: int | None = None, **kwargs):
    inputs = {"noise": p.noise} if source == "noise" else {"trajectory": p.trajectory}
    generator = torch.Generator().manual_seed(p.seed if seed is None else seed)
    return est.estimate(
        p.model, p.flow, objective, cond=p.cond, generator=generator, **inputs, **kwargs
    )


def surrogate_flat(est, p: Problem, objective, source: str = "noise", seed: int | None = None):
    """``(autograd gradient of est.surrogate(...).loss, flat; the Surrogate)`` on ``p``."""
    inputs = {"noise": p.noise} if source == "noise" else {"trajectory": p.trajectory}
    generator = torch.Generator().manual_seed(p.seed if seed is None else seed)
    sur = est.surrogate(p.model, p.flow, objective, cond=p.cond, generator=generator, **inputs)
    params = [q for q in p.model.parameters() if q.requires_grad]
    grads = torch.autograd.grad(sur.loss, params, allow_unused=True)
    flat = torch.cat(
        [
            (torch.zeros_like(q) if g is None else g).reshape(-1)
            for q, g in zip(params, grads, strict=True)
        ]
    )
    return flat, sur
