"""``drtune``'s definition, and the exact distribution of ``sdo``'s two step selections.

``drtune`` is ``sdo`` with stratified (systematic) step selection, so its definition is
``sdo``'s at the stratified decisions:

    drtune(S, s) = s * sum_{k in S} J_k^T c~_k          (c~_k the one-step cotangents)

The selections are finite distributions over step sets, enumerated here exactly (with
``N`` steps and ``m = samples``):

* ``uniform``: every ``m``-subset of ``0..N-1``, each with probability ``1 / C(N, m)``;
* ``stratified``: ``S(u) = {floor(u + j N/m) : j = 0..m-1}`` for an offset ``u`` uniform
  on ``[0, N/m)``. ``S(u)`` depends on ``u`` only through ``floor(m u)``, so the offsets
  fall into ``N`` intervals ``[a/m, (a+1)/m)`` of probability ``1/N`` each, and
  ``S(a/m)`` is that interval's set (several intervals may give the same set).

Both include every step with probability ``m/N``, so at ``scale = N/m`` both have the
one-step sum as their expectation; their variances differ, and
:func:`selection_moments` computes them exactly from the dense chain.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from fractions import Fraction

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective
from gradest.reference.decisions import stratified_steps
from gradest.reference.dense import DenseChain
from gradest.reference.sdo import one_step_cotangents, sdo_definition

SELECTIONS = ("uniform", "stratified")


def drtune_definition(
    chain: DenseChain,
    objective: Objective,
    sampled_steps: Iterable[int],
    scale_factor: float,
) -> Tensor:
    """``scale_factor * sum_{k in sampled_steps} J_k^T c~_k`` (flat ``[P]``): ``sdo``'s
    definition, at the steps of a stratified draw."""
    return sdo_definition(chain, objective, sampled_steps, scale_factor)


def selection_outcomes(
    num_steps: int, samples: int, select: str
) -> list[tuple[tuple[int, ...], Fraction]]:
    """Every step set a selection can draw, with its exact probability (they sum to 1)."""
    if select not in SELECTIONS:
        raise InvalidValue(f"select must be one of {SELECTIONS}, got {select!r}")
    if not 1 <= samples <= num_steps:
        raise InvalidValue(f"cannot select {samples} distinct steps out of {num_steps}")
    if select == "uniform":
        share = Fraction(1, math.comb(num_steps, samples))
        return [(s, share) for s in itertools.combinations(range(num_steps), samples)]
    outcomes: dict[tuple[int, ...], Fraction] = {}
    for a in range(num_steps):
        steps = stratified_steps(num_steps, samples, Fraction(a, samples))
        outcomes[steps] = outcomes.get(steps, Fraction(0)) + Fraction(1, num_steps)
    return list(outcomes.items())


def inclusion_probabilities(num_steps: int, samples: int, select: str) -> list[Fraction]:
    """``P(k in S)`` for every step ``k``, summed over :func:`selection_outcomes`."""
    totals = [Fraction(0)] * num_steps
    for steps, probability in selection_outcomes(num_steps, samples, select):
        for k in steps:
            totals[k] += probability
    return totals


def selection_moments(
    chain: DenseChain, objective: Objective, samples: int, select: str
) -> tuple[Tensor, float, float]:
    """``(mean, variance, fourth)`` of the unbiased estimate ``(N/m) sum_{k in S} t_k``,
    ``t_k = J_k^T c~_k``, over the selection's exact distribution: the mean ``[P]``,
    ``E||g - mean||^2`` (the total variance, the trace of the covariance) and
    ``E||g - mean||^4`` (for the standard error of a sample variance)."""
    cotangents = one_step_cotangents(chain, objective)
    terms = torch.stack([chain.gradient(cotangents, steps=[k]) for k in range(chain.num_steps)])
    factor = chain.num_steps / samples
    outcomes = selection_outcomes(chain.num_steps, samples, select)
    weights = torch.tensor([float(p) for _, p in outcomes], dtype=terms.dtype)
    estimates = torch.stack([factor * terms[list(steps)].sum(0) for steps, _ in outcomes])
    mean = (weights[:, None] * estimates).sum(0)
    squared = (estimates - mean).pow(2).sum(1)
    return mean, float((weights * squared).sum()), float((weights * squared.pow(2)).sum())
