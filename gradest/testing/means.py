"""Statistical checks of randomized estimators: a mean of draws against a target.

Norm bound: for ``n`` independent draws with ``se^2 = tr(Cov)/n`` (unbiased sample
covariance), ``||mean - E||^2 / se^2`` is (by the CLT) a weighted sum of chi-square(1)
variables with weights summing to 1, and above a threshold of about 1.5 such a tail is
largest when one weight carries everything (Szekely and Bakirov, 2003), so
``P(||mean - E|| > 5 se) <= P(|Z| > 5) ~ 6e-7``. A test that accepts a target with it
should also check that it *rejects* a wrong one (:func:`assert_biased`), so the bound has
power.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

SE_BOUND = 5.0
"""Standard errors (in norm) a mean may be from its expectation (:func:`assert_unbiased`)."""
# Chi-square goodness of fit: reject at this tail probability.
CHI_SQUARE_TAIL = 1e-6


def standard_error(draws: Tensor) -> float:
    """``sqrt(tr(Cov) / n)`` of the mean of ``draws [n, P]`` (unbiased sample covariance)."""
    if draws.shape[0] < 2:
        raise ValueError("a standard error needs at least 2 draws")
    centred = draws - draws.mean(0)
    return math.sqrt(float(centred.pow(2).sum()) / (draws.shape[0] - 1) / draws.shape[0])


def distance_in_se(draws: Tensor, target: Tensor) -> float:
    """``||mean(draws) - target|| / se`` (:func:`standard_error`)."""
    return float((draws.mean(0) - target.to(draws.dtype)).norm()) / standard_error(draws)


def assert_unbiased(draws: Tensor, target: Tensor, *, se_bound: float = SE_BOUND) -> None:
    """Assert that the mean of ``draws [n, P]`` (flat estimates, e.g. ``result.flat()``
    of ``n`` independent calls) is within ``se_bound`` standard errors (in norm) of
    ``target [P]``, the expectation the estimator claims. A false alarm has probability
    below ``P(|Z| > se_bound)`` (about 6e-7 at the default 5)."""
    distance = distance_in_se(draws, target)
    if not distance <= se_bound:
        raise AssertionError(
            f"the mean of {draws.shape[0]} draws is {distance:.2f} standard errors from the "
            f"target (bound {se_bound:g}): biased"
        )


def assert_biased(draws: Tensor, wrong: Tensor, *, se_bound: float = SE_BOUND) -> None:
    """Assert that the draws *reject* ``wrong``: the power check that goes with
    :func:`assert_unbiased` (enough draws to tell the target from a wrong one)."""
    distance = distance_in_se(draws, wrong)
    if not distance > se_bound:
        raise AssertionError(
            f"the mean of {draws.shape[0]} draws is within {se_bound:g} standard errors of "
            f"the wrong target ({distance:.2f}): too few draws to tell them apart"
        )


def fits_distribution(observed: Sequence[int], probabilities: Sequence[float]) -> bool:
    """Chi-square goodness of fit of observed values ``0..K-1`` to ``probabilities``
    (indexed alike); cells of zero probability must never be observed. Needs scipy."""
    import scipy.stats

    probs = torch.tensor(probabilities, dtype=torch.float64)
    counts = torch.bincount(torch.tensor(observed), minlength=probs.numel()).double()
    if counts.numel() != probs.numel() or bool((counts[probs == 0] > 0).any()):
        return False
    support = probs > 0
    expected = len(observed) * probs[support]
    chi_square = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi_square <= scipy.stats.chi2.ppf(1 - CHI_SQUARE_TAIL, df=int(support.sum()) - 1)
