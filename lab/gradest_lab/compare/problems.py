"""The embedded default problems that ``gradest compare`` runs without any download.

* ``mlp``: a class-conditional MLP velocity model on 8-dimensional states.
* ``dit``: the tiny DiT config on 8x8 single-channel images. adaLN-Zero makes a fresh DiT
  the zero map (its gradients would be degenerate), so the zero-initialised modulation
  and output layers are re-drawn with small random weights: a generic non-trivial DiT.

Both are seeded, so every run compares estimators on the same model. Applications add
named problems through the ``gradest.problems`` entry-point group (``gradest-digits``
registers ``digits``: its DiT pretrained on real 8x8 digits with a classifier reward): an
entry point names a function with :func:`embedded_problem`'s keyword arguments (less
``name``) that returns a :class:`Problem`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest import InvalidValue, RectifiedFlow, TerminalObjective
from gradest.plugin import Objective, callable_entry, load_entry_points
from gradest.testing import (
    perturbed_dit,
    random_stepwise_objective,
    smooth_terminal_objective,
    tiny_mlp,
)

MODELS = ("mlp", "dit")
PROBLEMS_GROUP = "gradest.problems"
NUM_CLASSES = 4


@attrs.frozen(eq=False)
class Problem:
    """A model, its sampler, an objective and how to draw each seed's noise and labels."""

    model: nn.Module
    sampler: RectifiedFlow
    objective: Objective
    noise_fn: Callable[[int], Tensor]
    cond_fn: Callable[[int], dict[str, Any]]


def _dit(seed: int) -> nn.Module:
    return perturbed_dit("tiny", seed, num_classes=NUM_CLASSES)


def embedded_problem(
    name: str,
    *,
    steps: int,
    objective: str,
    batch: int = 8,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Problem:
    """Build one of :data:`MODELS` (or a registered problem) with a terminal or stepwise
    objective."""
    registered = registered_problems()
    if name not in MODELS and name not in registered:
        known = ", ".join((*MODELS, *sorted(registered)))
        raise InvalidValue(
            f"--model {name!r} is not embedded; choose one of {known} (applications add "
            f"problems through the {PROBLEMS_GROUP!r} entry points, e.g. pip install "
            f"./apps/digits for 'digits')"
        )
    if objective not in ("terminal", "stepwise"):
        raise InvalidValue(f"--objective must be 'terminal' or 'stepwise', got {objective!r}")
    if name in registered and name not in MODELS:
        return registered[name](  # type: ignore[no-any-return]
            steps=steps, objective=objective, batch=batch, dtype=dtype, device=device, seed=seed
        )
    if name == "mlp":
        model: nn.Module = tiny_mlp(8, hidden=64, depth=3, num_classes=NUM_CLASSES, seed=seed)
        state_shape: tuple[int, ...] = (8,)
    else:
        model = _dit(seed)
        state_shape = (1, 8, 8)
    model = model.to(device=device, dtype=dtype)
    flat = int(torch.tensor(state_shape).prod())
    objective_value = (
        _flattened_terminal(smooth_terminal_objective(flat, seed=seed + 1))
        if objective == "terminal"
        else random_stepwise_objective(steps, (batch, *state_shape), seed=seed + 2)
    )

    def cond_fn(s: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(20_000 + s)
        return {"y": torch.randint(0, NUM_CLASSES, (batch,), generator=gen).to(device)}

    noise_fn = seeded_noise((batch, *state_shape), dtype=dtype, device=device)
    return Problem(model, RectifiedFlow(steps=steps), objective_value, noise_fn, cond_fn)


def seeded_noise(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: str | torch.device
) -> Callable[[int], Tensor]:
    """Every problem's ``noise_fn``: seed ``s`` draws the same noise in every run (and for
    every estimator), from a CPU generator of its own."""

    def noise_fn(s: int) -> Tensor:
        gen = torch.Generator().manual_seed(10_000 + s)
        return torch.randn(shape, generator=gen, dtype=dtype).to(device)

    return noise_fn


def registered_problems() -> dict[str, Callable[..., Problem]]:
    """Problems that installed applications register under ``gradest.problems``."""
    return load_entry_points(PROBLEMS_GROUP, what="problem", check=callable_entry)


def _flattened_terminal(objective: Any) -> Any:
    """Apply a loss on vectors to image states by flattening all but the batch dimension."""
    return TerminalObjective(lambda z: objective.loss_fn(z.reshape(z.shape[0], -1)))
