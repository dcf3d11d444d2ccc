"""Test helpers for estimator authors: check an estimator against its own definition.

As :mod:`torch.testing` does for tensors, this module gives a plugin's test suite the
checks gradest's own tests use, so a third-party estimator is held to the same standard
as the built-ins::

    import torch
    import gradest
    from gradest import testing

    def test_my_estimator_matches_its_definition():
        model = testing.tiny_mlp(3, hidden=8)            # float64, dense Jacobians
        sampler = gradest.RectifiedFlow(steps=6)
        noise = testing.seeded_normal((4, 3), seed=11)
        objective = testing.smooth_terminal_objective(3)
        testing.assert_matches_definition(
            MyEstimator(), model, sampler, objective, noise=noise,
            generator=torch.Generator().manual_seed(0),
        )

**Definition checks** (:mod:`gradest.testing.checks`): an estimator that implements
``definition`` (and optionally ``expected_decisions``, see
:class:`gradest.base.EstimatorBase`) is compared with that formula, evaluated densely by
:mod:`gradest.reference`: :func:`assert_matches_definition` raises ``AssertionError`` when
the decisions, the estimate on the path, the estimate from the noise (and its noise
gradient) or the surrogate's gradient differ; :func:`definition_errors` returns the
numbers. ``gradest check`` runs the same checks on every registered estimator.

**Statistical checks** (:mod:`gradest.testing.means`): for a randomized estimator,
:func:`assert_unbiased` accepts the expectation it claims from ``n`` independent draws,
with a tolerance of :data:`SE_BOUND` sample standard errors; :func:`assert_biased` checks
the draws have the power to reject a wrong target; :func:`fits_distribution` tests the
distribution of a discrete decision (needs scipy).

**Problems** (:mod:`gradest.testing.problems`): seeded tiny models, objectives and
samplers small enough for dense Jacobians (:func:`tiny_mlp`, :class:`AffineVelocity`,
:class:`NoisyAffineSampler`, :func:`smooth_terminal_objective`,
:func:`random_stepwise_objective`, ...).

Shared by gradest's own test suites and its applications', imported from their modules
(not re-exported here): :mod:`gradest.testing.fixtures` (pytest fixtures) and
:mod:`gradest.testing.processes` (a child process started as a terminal starts it, for
the Ctrl-C tests).
"""

from gradest.testing.checks import (
    DEFINITION_RTOL,
    assert_matches_definition,
    definition_error,
    definition_errors,
    noise_grad_error,
    surrogate_gradient,
    verify_decisions,
)
from gradest.testing.means import (
    SE_BOUND,
    assert_biased,
    assert_unbiased,
    distance_in_se,
    fits_distribution,
    standard_error,
)
from gradest.testing.problems import (
    AffineVelocity,
    NoisyAffineSampler,
    five_step_ddim,
    perturb_parameters,
    perturbed_dit,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    straight_trajectory,
    tiny_mlp,
)

__all__ = [
    "DEFINITION_RTOL",
    "SE_BOUND",
    "AffineVelocity",
    "NoisyAffineSampler",
    "assert_biased",
    "assert_matches_definition",
    "assert_unbiased",
    "definition_error",
    "definition_errors",
    "distance_in_se",
    "fits_distribution",
    "five_step_ddim",
    "noise_grad_error",
    "perturb_parameters",
    "perturbed_dit",
    "random_stepwise_objective",
    "seeded_normal",
    "smooth_terminal_objective",
    "standard_error",
    "straight_trajectory",
    "surrogate_gradient",
    "tiny_mlp",
    "verify_decisions",
]
