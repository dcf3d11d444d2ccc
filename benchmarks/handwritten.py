"""The plain PyTorch loops a user would write instead of calling gradest.

These are the baselines for gradest's overhead: same model, same objective, same
sampler grid, nothing but ``model(z, t)`` and ``loss.backward()``. Both accumulate into
``p.grad`` like ``est.surrogate(...).loss.backward()`` does; zero the gradients between
calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import gradest


def bptt_terminal(
    model: nn.Module,
    flow: gradest.RectifiedFlow,
    noise: Tensor,
    loss_fn: Callable[[Tensor], Tensor],
) -> Tensor:
    """Backpropagation through the whole Euler chain: sample with the graph, then backward.

    ``N`` forwards with graph and one backward through the chain, the ``N(F + 2F)`` of
    gradest's ``exact`` from noise; all ``N`` steps' activations are held until backward.
    """
    batch = noise.shape[0]
    z = noise
    for k in range(flow.num_steps):
        t = torch.full((batch,), float(flow.times[k]), dtype=noise.dtype, device=noise.device)
        z = z + float(flow.step_sizes[k]) * model(z, t)
    loss = loss_fn(z)
    loss.backward()
    return loss.detach()


def stepwise_backward(
    model: nn.Module,
    trajectory: gradest.Trajectory,
    loss_fn: Callable[[int, Tensor, gradest.Trajectory], Tensor],
) -> Tensor:
    """Per-step losses on a recorded path: a forward and ``loss_k.backward()`` per step.

    The GRPO / flow-matching pattern, ``N(F + 2F)``, one step's activations at a time.
    """
    states = trajectory.states
    batch, dtype, device = trajectory.batch_size, states.dtype, states.device
    total = torch.zeros((), dtype=dtype, device=device)
    for k in range(trajectory.num_steps):
        t = torch.full((batch,), float(trajectory.times[k]), dtype=dtype, device=device)
        loss = loss_fn(k, model(states[k], t), trajectory)
        loss.backward()
        total += loss.detach()
    return total
