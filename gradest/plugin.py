"""Everything a plugin author needs, in one namespace: ``from gradest.plugin import ...``.

gradest takes three kinds of plugins, each registered under an entry-point group of its
installed distribution (``docs/extending.md`` walks through a whole one):

* **an estimator** (group ``gradest.estimators``): a subclass of :class:`EstimatorBase`
  with a hook per objective kind, ``_terminal(ctx)`` and / or ``_stepwise(ctx)``, which
  read the path and the grid from the :class:`EstimationContext` and evaluate every
  vector-Jacobian product through its :class:`VelocityField` (``ctx.field``); options are
  :func:`option` fields; randomness comes from ``ctx.generator`` and, under data
  parallelism, is agreed across ranks with :class:`RankAgreement` (``ctx.ranks``); its
  optional ``definition(chain, objective, decisions)`` evaluates the estimator's formula
  densely on a :class:`DenseChain` for ``gradest check``, re-deriving its random choices
  with the ``replay_*`` functions;
* **a command** (group ``gradest.commands``): a :class:`Command` that adds ``gradest
  NAME``, with the library's conventions for flags (:class:`WholeNumber`, the estimator
  list syntax of :func:`split_spec_list`) and its own entry-point groups
  (:func:`load_entry_points`);
* **a named problem or task** for a command that defines such a group (the lab's
  ``gradest.problems`` and ``gradest.race_tasks``).

Every name here is also documented in the API reference; the modules these names come
from are gradest's own business and may change.
"""

from gradest._checks import (
    check_estimate_grads,
    check_surrogate,
    is_symbolic,
    trainable_parameters,
)
from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase, estimated_surrogate, surrogate_from_estimate
from gradest.commands import Command, CommandInterrupted
from gradest.conditioning import map_tensors, repeat_per_sample, tensor_leaves, with_tensor_leaves
from gradest.context import EstimationContext
from gradest.entry_points import callable_entry, load_entry_points
from gradest.errors import (
    GradestError,
    InvalidType,
    InvalidValue,
    MissingDependency,
    NoNoiseGradient,
)
from gradest.integers import INT64_MAX, WholeNumber, whole_number_problem
from gradest.objectives import Objective
from gradest.options import (
    at_most_steps,
    bool_option,
    choice_option,
    int_option,
    option,
    optional_float_option,
    optional_int_option,
    parse_bool,
    too_many_steps,
)
from gradest.protocol import (
    VERBS,
    Cost,
    Decisions,
    Definition,
    GradientEstimate,
    Surrogate,
    TrajectoryGradientEstimator,
    check_steps,
    is_estimator,
    is_stateful,
    missing_verbs,
    supports,
)
from gradest.ranks import RankAgreement
from gradest.reference import (
    DenseChain,
    dense_chain,
    exact_cotangents,
    exact_gradient,
    one_step_cotangents,
    replay_normal,
    replay_probability_draw,
    replay_stratified,
    replay_subset,
    replay_survival_depth,
    replay_uniform_int,
    replay_uniform_ints,
    terminal_adjoints,
)
from gradest.registry import clear_cache, is_builtin, line_up, parse_spec
from gradest.specs import (
    SPEC_LIST_EXAMPLE,
    SPEC_LIST_HELP,
    format_spec_list,
    spec_list_text,
    split_spec_list,
)
from gradest.vjp import ParamGradient, VelocityField, add_grads, scale_grads

__all__ = [
    "INT64_MAX",
    "SPEC_LIST_EXAMPLE",
    "SPEC_LIST_HELP",
    "Command",
    "CommandInterrupted",
    "Cost",
    "Decisions",
    "Definition",
    "DenseChain",
    "EstimationContext",
    "EstimatorAxes",
    "EstimatorBase",
    "GradestError",
    "GradientEstimate",
    "InvalidType",
    "InvalidValue",
    "MissingDependency",
    "NoNoiseGradient",
    "Objective",
    "ParamGradient",
    "RankAgreement",
    "Surrogate",
    "TrajectoryGradientEstimator",
    "VERBS",
    "VelocityField",
    "WholeNumber",
    "add_grads",
    "at_most_steps",
    "bool_option",
    "callable_entry",
    "check_estimate_grads",
    "check_steps",
    "check_surrogate",
    "choice_option",
    "clear_cache",
    "dense_chain",
    "estimated_surrogate",
    "exact_cotangents",
    "exact_gradient",
    "format_spec_list",
    "int_option",
    "is_builtin",
    "is_estimator",
    "is_stateful",
    "is_symbolic",
    "line_up",
    "missing_verbs",
    "load_entry_points",
    "map_tensors",
    "one_step_cotangents",
    "option",
    "optional_float_option",
    "optional_int_option",
    "parse_bool",
    "parse_spec",
    "repeat_per_sample",
    "replay_normal",
    "replay_probability_draw",
    "replay_stratified",
    "replay_subset",
    "replay_survival_depth",
    "replay_uniform_int",
    "replay_uniform_ints",
    "scale_grads",
    "spec_list_text",
    "split_spec_list",
    "supports",
    "surrogate_from_estimate",
    "tensor_leaves",
    "terminal_adjoints",
    "too_many_steps",
    "trainable_parameters",
    "whole_number_problem",
    "with_tensor_leaves",
]
