"""Shared pieces of the RL objectives: the recorded path is data, models are evaluated on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradest._checks import check_model
from gradest.conditioning import check_cond, model_kwargs
from gradest.errors import InvalidValue
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory, check_sampler, check_trajectory_matches, model_time


def checked_path(sampler: Any, trajectory: Any) -> None:
    """``sampler`` is a sampler and ``trajectory`` a whole path recorded on its grid."""
    check_sampler(sampler)
    check_trajectory_matches(sampler, trajectory)


def model_velocities(
    model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
    *,
    what: str = "model",
) -> Tensor:
    """``[N, B, ...]``: ``model(z_k, t_k, **cond)`` at every recorded state, without a graph."""
    check_model(model)
    checked_path(sampler, trajectory)
    batch = trajectory.batch_size
    kwargs = model_kwargs(check_cond(cond, batch), batch)
    states = trajectory.states
    out = []
    with torch.no_grad():
        for k in range(trajectory.num_steps):
            z = states[k]
            v = model(z, model_time(sampler.times[k], z.shape[0], z), **kwargs)
            _check_output(v, z, what, k)
            out.append(v.detach())
    return torch.stack(out)


def _check_output(v: Any, z: Tensor, what: str, k: int) -> None:
    if not isinstance(v, Tensor) or v.shape != z.shape:
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise InvalidValue(
            f"the {what} returned {shape} at step {k} for states of shape {tuple(z.shape)}; "
            f"it must return a velocity shaped like its input"
        )
    if not bool(torch.isfinite(v).all()):
        raise InvalidValue(f"the {what} returned NaN or Inf at step {k}")


def check_recorded(given: Trajectory, trajectory: Trajectory, objective: str) -> None:
    """An objective built on ``trajectory``'s data must be evaluated on that trajectory."""
    if given is trajectory or (
        given.states.shape == trajectory.states.shape
        and torch.equal(given.states, trajectory.states)
    ):
        return
    raise InvalidValue(
        f"this {objective} objective was built for a recorded trajectory; pass that "
        f"trajectory to surrogate/estimate (trajectory=...), not noise="
    )
