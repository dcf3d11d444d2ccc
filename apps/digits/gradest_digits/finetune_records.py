"""One step's JSON log record: the keys, the estimators' diagnostics, costs and losses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradest.plugin import Cost

LOG_KEYS = (
    "step",
    "reward_mean",
    "reward_std",
    "loss",
    "grad_norm",
    "sample_seconds",
    "backward_seconds",
    "optimizer_seconds",
    "cost",
    "info",
)
# Lists longer than this (per-step cosines of a long chain, ...) are left out of the log.
_MAX_LOGGED_LIST = 64


def summarize_info(infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON-friendly part of the estimators' ``result.info`` over one step's backwards.

    Numbers are averaged over the backwards (e.g. jagg's ``fallback_fraction`` over
    GRPO's inner epochs); strings, booleans and short flat lists are kept from the last
    one (sdo's ``sampled_steps``, jagg's ``gate_cosines``); nested lists are dropped.
    """
    summary: dict[str, Any] = {}
    if not infos:
        return summary
    for key, last in infos[-1].items():
        if isinstance(last, bool | str):
            summary[key] = last
        elif isinstance(last, int | float):
            values = [float(info[key]) for info in infos if isinstance(info.get(key), int | float)]
            # Equal values (truncated's fixed k) keep their type; others are averaged.
            summary[key] = last if len(set(values)) == 1 else sum(values) / len(values)
        elif isinstance(last, list | tuple) and len(last) <= _MAX_LOGGED_LIST:
            if all(isinstance(x, int | float) and not isinstance(x, bool) for x in last):
                summary[key] = list(last)
    return summary


def mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if len(present) == len(values) else None


def cost_record(cost: Cost, sample_forwards: int, objective_cost: Cost) -> dict[str, Any]:
    """The estimators' counts and ``model_units``, the rollout's ``sample_forwards``, and
    ``objective_model_units``: base-model work the objectives needed before any estimator
    ran (GRPO's KL reference velocities, adjoint matching's lean adjoint)."""
    return {
        "forwards_with_graph": cost.forwards_with_graph,
        "forwards_without_graph": cost.forwards_without_graph,
        "param_vjps": cost.param_vjps,
        "state_vjps": cost.state_vjps,
        "model_units": cost.model_units(),
        "sample_forwards": sample_forwards,
        "objective_model_units": objective_cost.model_units(),
    }
