"""One estimate on a recorded trajectory against the estimator's own dense definition.

Shared by the tests of objectives on recorded paths (FlowSDE rewards, GRPO with and
without KL, adjoint matching): each builds its model, sampler and objective, then asks
:func:`definition_error` how far an estimate is from its definition.
"""

from __future__ import annotations

import pytest
import torch

import gradest
from gradest.protocol import supports
from gradest.reference import dense_chain, relative_error
from gradest.reference.definitions import definition_gradient


def definition_error(spec, model, flow, objective, trajectory, *, seed: int = 2) -> float:
    """Relative error between ``spec``'s estimate on ``trajectory`` (generator seeded with
    ``seed``) and its dense definition for the decisions that estimate made. Skips the
    test for an estimator that does not take ``objective``'s kind."""
    est = gradest.estimator(spec)
    kind = "stepwise" if isinstance(objective, gradest.StepwiseObjective) else "terminal"
    if not supports(est, kind):
        pytest.skip(f"{spec} is for {' and '.join(est.objectives)} objectives only")
    chain = dense_chain(model, flow, trajectory)
    result = est.estimate(
        model, flow, objective, trajectory=trajectory, generator=torch.Generator().manual_seed(seed)
    )
    assert all(bool(torch.isfinite(g).all()) for g in result.grads.values()), spec
    definition = definition_gradient(est, chain, objective, result)
    assert definition is not None, f"{spec} defines no dense formula"
    return relative_error(result.flat(), definition)
