"""Step subsets for ``sdo`` and ``truncated``: drawing them, and the stepwise VJP over them.

``sdo`` draws a subset of timesteps and randomized ``truncated`` draws a truncation
depth, each **once per call**. Every draw goes through these helpers so that the only
source of randomness is the ``generator`` passed to ``estimate`` (with ``None``,
torch's default generator, which is reproducible only through ``torch.manual_seed``).

The context draws the sampler's step noise first, when it is built, so an estimator
given the same generator state as ``gradest.rollout`` samples the same path as it does,
and the draws below always come after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.vjp import ParamGradient


def _device(generator: torch.Generator | None) -> torch.device:
    # A CUDA generator can only fill tensors on its own device.
    return generator.device if generator is not None else torch.device("cpu")


def draw_steps(num_steps: int, samples: int, generator: torch.Generator | None) -> list[int]:
    """``samples`` distinct steps of ``0..num_steps-1``, uniformly without replacement, sorted.

    Every subset of that size is equally likely (the first ``samples`` entries of a
    uniform random permutation), so each step is included with probability
    ``samples / num_steps``, which is what the ``N/m`` scaling of ``sdo`` relies on.
    """
    if not 1 <= samples <= num_steps:
        raise InvalidValue(f"cannot draw {samples} distinct steps out of {num_steps}")
    order = torch.randperm(num_steps, generator=generator, device=_device(generator))
    return sorted(int(step) for step in order[:samples].tolist())


def draw_uniform_int(low: int, high: int, generator: torch.Generator | None) -> int:
    """An integer uniform on ``{low, ..., high}`` (both ends included)."""
    if low > high:
        raise InvalidValue(f"empty range {{{low}, ..., {high}}}")
    value = torch.randint(low, high + 1, (), generator=generator, device=_device(generator))
    return int(value)


def draw_from_probabilities(
    probabilities: Sequence[float], generator: torch.Generator | None
) -> int:
    """``k`` in ``{1, ..., len(probabilities)}`` with ``P(k) = probabilities[k-1]``.

    Inverse-CDF sampling from one uniform draw; probabilities must be non-negative and
    sum to 1 (validated by the estimator's options). Rounding in the cumulative sum can
    leave ``u`` above its last entry; that mass goes to the last ``k`` with nonzero
    probability, so a zero-probability ``k`` is never returned.
    """
    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=_device(generator)))
    cumulative = 0.0
    for k, p in enumerate(probabilities, start=1):
        cumulative += p
        if p > 0 and u < cumulative:
            return k
    return max(k for k, p in enumerate(probabilities, start=1) if p > 0)


def stepwise_vjp_over(ctx: EstimationContext, steps: Sequence[int]) -> ParamGradient:
    """``sum_{k in steps} J_k^T c_k`` for a stepwise objective, in one batched VJP.

    The listed recorded states are forwarded together with a graph; each ``c_k =
    d l_k / d v_k`` is taken at the velocity of that forward (the current model), then
    pulled back at once. Cost: ``len(steps)`` forwards with graph and as many parameter
    VJPs; activations of those steps only.
    """
    steps = list(steps)
    states = ctx.trajectory().states[steps]
    velocities, pull = ctx.field.param_pullback(states, ctx.times[steps])
    cotangents = torch.stack(
        [ctx.step_cotangent(step, velocities[row]) for row, step in enumerate(steps)]
    )
    return pull(cotangents)
