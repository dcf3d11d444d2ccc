"""Measuring estimators: bias, variance and cost against ``exact``, as numbers and a report.

:func:`compare` runs every estimator on the same trajectories with common random numbers
and returns a :class:`Report` (markdown and JSON; the lab's ``gradest compare`` writes it
to a folder with plots). The pieces it is built from are public for tools that measure
differently:

* **cost**: :func:`count_flops` and :func:`retained_activation_bytes` (deterministic),
  :func:`peak_allocated_bytes`, :func:`median_wall_time` and
  :func:`interleaved_wall_times` (seconds, meaningful only as :func:`ratio` /
  :func:`speedup` of two functions in one process); :class:`FlopCounter` and
  :class:`StorageTracker` are the dispatch modes behind them, for a tracer of a whole
  training step (the lab's ``gradest cost``);
* **agreement with a reference gradient**: :func:`trajectory_stats` (bias, variance,
  cosine over draws on one trajectory, as :class:`Estimate` means with standard errors)
  and the per-tensor, Adam-aware metrics (:class:`TensorLayout`, :func:`second_moment`,
  :func:`adam_cosine`, :func:`sign_agreement`, :func:`tensor_stats`, :func:`mean_of`);
* **common random numbers**: :func:`draw_generator`, the generator of one draw on one
  trajectory, and :func:`is_stochastic`;
* **the chain's contraction**: :func:`chain_contraction`, ``||dz_N/dz_k||_2`` per step and
  sample of a recorded trajectory by power iteration (:class:`ChainContraction`), the
  condition of the one-step estimators' error bound; :func:`one_step_cotangent_error`, how
  far their cotangents are from the exact ones on a recorded trajectory, for the reward's
  own ``a_N`` (:class:`OneStepCotangentError`);
* **strict JSON**: :func:`json_safe` / :func:`json_restored`, how ``report.json`` writes
  and reads back non-finite numbers.

``import gradest.harness`` imports ``torch.utils.flop_counter``; ``import gradest`` does
not (its ``compare`` and ``Report`` load this package on first use).
"""

from gradest.harness.comparison import (
    PreparedCompare,
    compare,
    draw_generator,
    is_stochastic,
    prepare_compare,
)
from gradest.harness.contraction import ChainContraction, chain_contraction
from gradest.harness.cost import (
    FlopCounter,
    StorageTracker,
    count_flops,
    interleaved_wall_times,
    median_wall_time,
    peak_allocated_bytes,
    ratio,
    retained_activation_bytes,
    speedup,
)
from gradest.harness.one_step_error import OneStepCotangentError, one_step_cotangent_error
from gradest.harness.report import CostRow, EstimatorRow, Report, json_restored, json_safe
from gradest.harness.statistics import Estimate, TrajectoryStats, trajectory_stats
from gradest.harness.tensor_metrics import (
    TensorLayout,
    TensorStats,
    adam_cosine,
    mean_of,
    second_moment,
    sign_agreement,
    tensor_stats,
)

__all__ = [
    "ChainContraction",
    "CostRow",
    "Estimate",
    "EstimatorRow",
    "FlopCounter",
    "OneStepCotangentError",
    "PreparedCompare",
    "Report",
    "StorageTracker",
    "TensorLayout",
    "TensorStats",
    "TrajectoryStats",
    "adam_cosine",
    "chain_contraction",
    "compare",
    "count_flops",
    "draw_generator",
    "interleaved_wall_times",
    "is_stochastic",
    "json_restored",
    "json_safe",
    "mean_of",
    "median_wall_time",
    "one_step_cotangent_error",
    "peak_allocated_bytes",
    "prepare_compare",
    "ratio",
    "retained_activation_bytes",
    "second_moment",
    "sign_agreement",
    "speedup",
    "tensor_stats",
    "trajectory_stats",
]
