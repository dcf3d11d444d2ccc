"""What an estimate's decisions must be, re-derived without the estimator's code.

``gradest check`` does not take an estimator's word for its decisions: each built-in
estimator's ``expected_decisions(chain, objective, generator)`` rebuilds them here from
its options, the dense chain's own velocities and a generator in the state the estimate
started from (the step noise of a stochastic sampler is drawn first, so with a recorded
trajectory the generator is untouched before the estimator's draws):

* ``jagg``: the groups and nodes from the layout rules (own integer arithmetic), the gate
  outcomes from the dense velocities (:func:`~gradest.reference.jagg.
  jagg_gate_cosines`), the debiasing steps replayed and ``N/m``;
* ``sdo`` (and ``drtune``): the sampled steps replayed (a uniform subset, or with
  ``select="stratified"`` the evenly spaced steps from the replayed offset,
  :func:`replay_stratified`) and the factor from ``scale``;
* ``truncated``, ``telescope``, ``refl``: the drawn depth or step replayed from the
  option's distribution (``telescope``'s survival law re-solved independently);
* ``draft_lv``: the re-noising noise replayed;
* ``alignprop``: the per-step draws ``r_k`` replayed (:func:`replay_uniform_ints`).

The estimate's ``gradient`` is then compared with the definition at *these* decisions,
so a node in the wrong place, a wrong scale factor or a draw from the wrong distribution
fails the check even where the arithmetic is right. The replays follow the documented
draw schemes of :mod:`gradest.strategies.sampling` (the torch calls and their order are
part of the reproducibility contract), written out here again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest.reference.dense import DenseChain
from gradest.reference.jagg import jagg_gate_cosines

# Floats in decisions (scale factors, weights) agree to this relative tolerance.
DECISION_RTOL = 1e-9


def replay_subset(num_steps: int, size: int, generator: torch.Generator) -> tuple[int, ...]:
    """A uniform ``size``-subset of ``0..N-1``: the first entries of ``randperm``, sorted."""
    return tuple(sorted(torch.randperm(num_steps, generator=generator)[:size].tolist()))


def replay_stratified(num_steps: int, size: int, generator: torch.Generator) -> tuple[int, ...]:
    """Systematic sampling of ``size`` steps of ``0..N-1``: one offset ``u = a/size`` with
    ``a`` from one ``randint`` on ``{0, ..., N-1}``, then ``floor(u + j N/size)`` for
    ``j = 0..size-1`` in exact rationals (:func:`stratified_steps`)."""
    offset = replay_uniform_int(0, num_steps - 1, generator)
    return stratified_steps(num_steps, size, Fraction(offset, size))


def stratified_steps(num_steps: int, size: int, offset: Fraction) -> tuple[int, ...]:
    """``floor(offset + j N/size)`` for ``j = 0..size-1``: the steps of a systematic sample
    whose offset ``offset`` lies in ``[0, N/size)``."""
    spacing = Fraction(num_steps, size)
    if not 0 <= offset < spacing:
        raise ValueError(f"offset {offset} is outside [0, {spacing})")
    return tuple(math.floor(offset + j * spacing) for j in range(size))


def replay_uniform_int(low: int, high: int, generator: torch.Generator) -> int:
    """Uniform on ``{low, ..., high}``: one ``randint``."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def replay_uniform_ints(
    low: int, high: int, count: int, generator: torch.Generator
) -> tuple[int, ...]:
    """``count`` independent integers uniform on ``{low, ..., high}``: one ``randint``."""
    return tuple(int(r) for r in torch.randint(low, high + 1, (count,), generator=generator))


def replay_probability_draw(probabilities: Sequence[float], generator: torch.Generator) -> int:
    """``k`` with ``P(k) = p_k``: the first ``k`` whose cumulative mass exceeds one uniform."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    cumulative = torch.cumsum(torch.tensor(probabilities, dtype=torch.float64), 0)
    pairs = zip(cumulative.tolist(), probabilities, strict=True)
    above = [k for k, (c, p) in enumerate(pairs, start=1) if u < c and p > 0]
    # Rounding can leave u above the total: that mass goes to the last possible k.
    return above[0] if above else max(k for k, p in enumerate(probabilities, 1) if p > 0)


def replay_survival_depth(survival: Sequence[float], generator: torch.Generator) -> int:
    """``K`` with ``P(K >= j) = q_j``: the largest ``j`` with ``q_j > u``."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    return max(j for j, q in enumerate(survival, start=1) if q > u or j == 1)


def replay_normal(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """Standard normal noise of ``shape``: one ``randn``."""
    return torch.randn(tuple(shape), generator=generator, dtype=dtype)


def jagg_layout(
    num_steps: int, window: int, order: int, shared_knots: bool
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """``(groups, nodes)``: groups of ``window`` consecutive steps; ``order + 1`` nodes at
    ``round(linspace)`` (halves up) of the group's node interval, which with shared knots
    reaches the next group's first step (the last step for the last group); every step of
    an interval of at most ``order + 1`` steps is a node."""
    groups, nodes = [], []
    starts = list(range(0, num_steps, window))
    for first in starts:
        steps = tuple(range(first, min(first + window, num_steps)))
        end = min(first + window, num_steps - 1) if shared_knots else steps[-1]
        span = end - first
        if span <= order:
            positions = tuple(range(first, end + 1))
        else:
            # Exact rationals, so a tie i * span / order = x.5 rounds up, never by float luck.
            positions = tuple(
                first + math.floor(Fraction(i * span, order) + Fraction(1, 2))
                for i in range(order + 1)
            )
        groups.append(steps)
        nodes.append(positions)
    return tuple(groups), tuple(nodes)


Steps = Sequence[Sequence[int]]  # per group, its steps (or its nodes)
Indices = tuple[int, ...]


def jagg_fallbacks(
    chain: DenseChain, groups: Steps, nodes: Steps, tau: float, gate: str
) -> Indices:
    """The groups whose gate cosine (dense velocities) is not ``>= tau`` (none if off)."""
    if gate == "off":
        return ()
    cosines = jagg_gate_cosines(chain, groups, nodes, chain.trajectory.times, gate)
    return tuple(i for i, c in enumerate(cosines) if c is not None and not c >= tau)


def decisions_mismatch(actual: Any, expected: Any) -> list[str]:
    """The fields where ``actual`` differs from ``expected`` (floats to ``DECISION_RTOL``,
    tensors to ``allclose``); empty when they agree."""
    if type(actual) is not type(expected):
        return [f"type {type(actual).__name__} != {type(expected).__name__}"]
    problems = []
    for field in attrs.fields(type(expected)):
        a, b = getattr(actual, field.name), getattr(expected, field.name)
        if not _agree(a, b):
            problems.append(f"{field.name}={_short(a)} (expected {_short(b)})")
    return problems


def _agree(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and torch.allclose(a.detach().cpu().to(torch.float64), b.to(torch.float64))
        )
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=DECISION_RTOL, abs_tol=1e-300)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_agree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
