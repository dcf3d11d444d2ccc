"""Statistical checks shared by the unbiasedness tests: a mean of draws against a target.

Norm bound: for ``n`` independent draws with ``se^2 = tr(Cov)/n`` (unbiased sample
covariance), ``||mean - E||^2 / se^2`` is (by the CLT) a weighted sum of chi-square(1)
variables with weights summing to 1, and above a threshold of about 1.5 such a tail is
largest when one weight carries everything (Szekely and Bakirov, 2003), so
``P(||mean - E|| > 5 se) <= P(|Z| > 5) ~ 6e-7``. Every test that accepts a target with it
also checks that it *rejects* a wrong one, so the bound has power.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import scipy.stats
import torch
from torch import Tensor

# Standard errors (in norm) a mean may be from its expectation.
SE_BOUND = 5.0
# Chi-square goodness of fit: reject at this tail probability.
CHI_SQUARE_TAIL = 1e-6


def standard_error(draws: Tensor) -> float:
    """``sqrt(tr(Cov) / n)`` of the mean of ``draws [n, P]`` (unbiased sample covariance)."""
    centred = draws - draws.mean(0)
    return math.sqrt(float(centred.pow(2).sum()) / (draws.shape[0] - 1) / draws.shape[0])


def distance_in_se(draws: Tensor, target: Tensor) -> float:
    """``||mean(draws) - target|| / se``."""
    return float((draws.mean(0) - target.to(draws.dtype)).norm()) / standard_error(draws)


def fits_distribution(observed: Sequence[int], probabilities: Sequence[float]) -> bool:
    """Chi-square goodness of fit of observed values ``1..K`` (or ``0..K-1`` with
    ``probabilities`` indexed alike) to ``probabilities``; cells of zero probability must
    never be observed."""
    probs = torch.tensor(probabilities, dtype=torch.float64)
    counts = torch.bincount(torch.tensor(observed), minlength=probs.numel()).double()
    if counts.numel() != probs.numel() or bool((counts[probs == 0] > 0).any()):
        return False
    support = probs > 0
    expected = len(observed) * probs[support]
    chi_square = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi_square <= scipy.stats.chi2.ppf(1 - CHI_SQUARE_TAIL, df=int(support.sum()) - 1)
