"""Dense-Jacobian ground truth for small models, independent of the VJP engine.

``dense_chain`` materialises every step's Jacobians; ``exact_gradient`` and each
estimator's definition (``adjoint_definition``, ``jagg_definition``, ``sdo_definition``,
``drtune_definition``, ``truncated_definition``, ``alignprop_definition``)
are evaluated from them by explicit matrix products. ``definition_gradient`` asks an
estimator for its own definition (``EstimatorBase.definition``); ``expected_decisions`` for
the decisions it must make, re-derived with the replays of
:mod:`gradest.reference.decisions` (``replay_subset``, ``replay_uniform_int``, ...).
"""

from gradest.reference.adjoint import adjoint_definition, adjoint_reconstruction
from gradest.reference.alignprop import (
    alignprop_definition,
    alignprop_expectation,
    alignprop_noise_grad_definition,
    keep_probabilities,
)
from gradest.reference.decisions import (
    decisions_mismatch,
    replay_normal,
    replay_probability_draw,
    replay_stratified,
    replay_subset,
    replay_survival_depth,
    replay_uniform_int,
    replay_uniform_ints,
)
from gradest.reference.definitions import (
    definition_at,
    definition_gradient,
    definition_noise_grad,
    expected_decisions,
)
from gradest.reference.dense import (
    DenseChain,
    dense_chain,
    exact_cotangents,
    exact_gradient,
    exact_noise_grad,
    relative_error,
    terminal_adjoints,
)
from gradest.reference.drtune import (
    drtune_definition,
    inclusion_probabilities,
    selection_moments,
    selection_outcomes,
)
from gradest.reference.jagg import jagg_definition, jagg_gate_cosines
from gradest.reference.sdo import (
    one_step_cotangents,
    sdo_definition,
    sdo_full_sum_definition,
    sdo_noise_grad_definition,
)
from gradest.reference.truncated import (
    truncated_definition,
    truncated_expectation,
    truncated_noise_grad_definition,
)

__all__ = [
    "DenseChain",
    "adjoint_definition",
    "adjoint_reconstruction",
    "alignprop_definition",
    "alignprop_expectation",
    "alignprop_noise_grad_definition",
    "decisions_mismatch",
    "definition_at",
    "definition_gradient",
    "definition_noise_grad",
    "dense_chain",
    "drtune_definition",
    "exact_cotangents",
    "exact_gradient",
    "exact_noise_grad",
    "expected_decisions",
    "inclusion_probabilities",
    "jagg_definition",
    "jagg_gate_cosines",
    "keep_probabilities",
    "one_step_cotangents",
    "relative_error",
    "replay_normal",
    "replay_probability_draw",
    "replay_stratified",
    "replay_subset",
    "replay_survival_depth",
    "replay_uniform_int",
    "replay_uniform_ints",
    "sdo_definition",
    "sdo_full_sum_definition",
    "sdo_noise_grad_definition",
    "selection_moments",
    "selection_outcomes",
    "terminal_adjoints",
    "truncated_definition",
    "truncated_expectation",
    "truncated_noise_grad_definition",
]
