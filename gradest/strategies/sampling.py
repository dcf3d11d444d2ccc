"""Random draws of the estimators (steps, depths, noise), and the stepwise VJP over steps.

``sdo`` and ``jagg:debias`` draw subsets of timesteps (``sdo:select=stratified`` and
``drtune`` evenly spaced ones with a random offset), randomized ``truncated``,
``telescope`` and ``refl`` a depth or a step, ``draft_lv`` re-noising noise, each **once
per call**. Every draw goes through these helpers so that the only source of randomness
is the ``generator`` passed to ``estimate`` (with ``None``, torch's default generator,
which is reproducible only through ``torch.manual_seed``). The schemes (which torch call,
in which order) are part of the contract: :mod:`gradest.reference.decisions` replays them
independently, and ``gradest check`` fails an estimator whose decisions differ.

The context draws the sampler's step noise first, when it is built, so an estimator
given the same generator state as ``gradest.rollout`` samples the same path as it does,
and the draws below always come after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradest._checks import outside_fake_mode
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.vjp import ParamGradient


def _device(generator: torch.Generator | None) -> torch.device:
    # A CUDA generator can only fill tensors on its own device.
    return generator.device if generator is not None else torch.device("cpu")


def _uniform(generator: torch.Generator | None) -> float:
    """One uniform draw in ``[0, 1)`` as a host float (real even under FakeTensorMode)."""
    with outside_fake_mode():
        dtype, device = torch.float64, _device(generator)
        return float(torch.rand((), dtype=dtype, generator=generator, device=device))


def draw_steps(num_steps: int, samples: int, generator: torch.Generator | None) -> list[int]:
    """``samples`` distinct steps of ``0..num_steps-1``, uniformly without replacement, sorted.

    Every subset of that size is equally likely (the first ``samples`` entries of a
    uniform random permutation), so each step is included with probability
    ``samples / num_steps``, which is what the ``N/m`` scaling of ``sdo`` relies on.
    """
    if not 1 <= samples <= num_steps:
        raise InvalidValue(f"cannot draw {samples} distinct steps out of {num_steps}")
    with outside_fake_mode():  # a host decision from a real generator
        order = torch.randperm(num_steps, generator=generator, device=_device(generator))
        return sorted(int(step) for step in order[:samples].tolist())


def draw_stratified_steps(
    num_steps: int, samples: int, generator: torch.Generator | None
) -> list[int]:
    """``samples`` evenly spaced steps of ``0..num_steps-1`` with one random offset, sorted.

    Systematic sampling: with ``N = num_steps``, ``m = samples`` and one offset ``u``
    uniform on ``[0, N/m)``, the steps are ``floor(u + j N/m)`` for ``j = 0..m-1``. The
    points ``u + j N/m`` are a lattice of spacing ``N/m >= 1`` shifted uniformly over one
    period, so the interval ``[k, k+1)`` of step ``k`` holds at most one of them, and on
    average ``1 / (N/m)`` of one: each step is included with probability exactly ``m/N``
    for every ``m <= N`` (what the ``N/m`` scaling of ``sdo`` relies on), and the steps
    are distinct. ``u`` enters only through ``a = floor(m u)``, uniform on
    ``{0, ..., N-1}``: ``floor(u + j N/m) = floor((m u + j N)/m) = (a + j N) // m``, since
    ``a + jN`` is an integer and the fraction of ``m u`` adds less than ``1/m``. So the
    offset is drawn as that integer (one ``randint``) and the steps follow in integer
    arithmetic, with no rounding at the top of the range. ``m = 1`` is a uniform step
    (``sdo``'s distribution), ``m = N`` every step.
    """
    if not 1 <= samples <= num_steps:
        raise InvalidValue(f"cannot draw {samples} distinct steps out of {num_steps}")
    offset = draw_uniform_int(0, num_steps - 1, generator)
    return [(offset + j * num_steps) // samples for j in range(samples)]


def draw_uniform_int(low: int, high: int, generator: torch.Generator | None) -> int:
    """An integer uniform on ``{low, ..., high}`` (both ends included)."""
    if low > high:
        raise InvalidValue(f"empty range {{{low}, ..., {high}}}")
    with outside_fake_mode():  # a host decision from a real generator
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
    u = _uniform(generator)
    cumulative = 0.0
    for k, p in enumerate(probabilities, start=1):
        cumulative += p
        if p > 0 and u < cumulative:
            return k
    return max(k for k, p in enumerate(probabilities, start=1) if p > 0)


def draw_normal(shape: Sequence[int], like: torch.Tensor, generator: torch.Generator | None):
    """Standard normal noise of ``shape`` with ``like``'s dtype, on the generator's device
    (moved to ``like``'s device), so a CPU generator reproduces the same draw anywhere."""
    noise = torch.randn(
        tuple(shape), generator=generator, dtype=like.dtype, device=_device(generator)
    )
    return noise.to(like.device)


def draw_survival_depth(survival: Sequence[float], generator: torch.Generator | None) -> int:
    """``K`` with ``P(K >= j) = survival[j-1]`` (``survival[0] = 1``, non-increasing): the
    number of ``j`` with ``survival[j-1] > u`` for one uniform ``u`` in ``[0, 1)``."""
    u = _uniform(generator)
    return sum(1 for q in survival if q > u)


def stepwise_vjp_over(
    ctx: EstimationContext, steps: Sequence[int], weights: Sequence[float] | None = None
) -> ParamGradient:
    """``sum_{k in steps} w_k J_k^T c_k`` for a stepwise objective, in one batched VJP.

    The listed recorded states are forwarded together with a graph; each ``c_k =
    d l_k / d v_k`` is taken at the velocity of that forward (the current model), scaled
    by its weight (default 1), then pulled back at once. Cost: ``len(steps)`` forwards
    with graph and as many parameter VJPs; activations of those steps only.
    """
    steps = list(steps)
    scales = [1.0] * len(steps) if weights is None else [float(w) for w in weights]
    states = ctx.trajectory().states[steps]
    velocities, pull = ctx.field.param_pullback(states, ctx.times_at(steps))
    cotangents = torch.stack(
        [
            scale * ctx.step_cotangent(step, velocities[row])
            for row, (step, scale) in enumerate(zip(steps, scales, strict=True))
        ]
    )
    return pull(cotangents)
