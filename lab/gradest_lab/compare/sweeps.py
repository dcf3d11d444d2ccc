"""JAGG sweeps for the report: error vs group span, and the gate threshold frontier.

* Span sweep: the relative error of one ``jagg`` group (gate off) to ``exact`` as the
  time span the group covers shrinks; interpolation theory predicts error ~
  span^(order+1). The fitted log-log slope is reported.
* Tau sweep: the gate threshold trades cost (parameter VJPs) for agreement with exact;
  ``tau = 1`` falls back everywhere and is exact.
* Debias sweep: ``jagg:debias=m`` (gate off) trades the interpolation's bias for
  variance: its squared bias should vanish for every ``m >= 1`` (up to the noise of the
  draws), its variance fall like ``1/m``, at ``m`` parameter VJPs more at most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradest import AffineSampler, Trajectory, estimator
from gradest.harness import trajectory_stats
from gradest.plugin import Objective


def _flat_error(result: Any, exact: torch.Tensor) -> tuple[float, float]:
    # float64 for the comparison whatever the model's dtype (float32 models included).
    flat, exact = result.flat().to(torch.float64), exact.to(torch.float64)
    error = float((flat - exact).norm() / exact.norm().clamp_min(1e-300))
    cosine = float(flat @ exact / (flat.norm() * exact.norm()).clamp_min(1e-300))
    return error, cosine


def fit_loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (nan with < 2 usable points)."""
    points = [(math.log(a), math.log(b)) for a, b in zip(x, y, strict=True) if a > 0 and b > 0]
    if len(points) < 2:
        return math.nan
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else math.nan


def jagg_span_sweep(
    model: torch.nn.Module,
    objective: Objective,
    state: torch.Tensor,
    cond: Mapping[str, Any] | None = None,
    *,
    start: float = 0.9,
    steps: int = 8,
    spans: Sequence[float] = (0.1, 0.03, 0.01, 3e-3, 1e-3, 5e-4, 2.5e-4, 1.25e-4, 6.25e-5),
    fit_below: float = 1e-3,
    orders: Sequence[int] = (1, 2),
) -> dict[str, Any]:
    """Relative error of one gate-off jagg group vs exact as the group's time span shrinks.

    A single group of ``steps`` steps covers ``[start - span, start]`` starting from
    ``state``. Interpolation theory predicts error ~ span^(order+1) once the span is
    below the time scale on which the model's Jacobian varies; sinusoidal time
    embeddings scale t by 1000, so that scale is ~1e-3 for untrained models, and the
    slope is fitted over ``span <= fit_below``. Larger spans show where the asymptotic
    regime ends, which is the regime a 50-step sampler (step 0.02) actually runs in.
    """
    from gradest import RectifiedFlow, rollout

    exact = estimator("exact")
    out: dict[str, Any] = {"start": start, "steps": steps, "fit_below": fit_below, "orders": {}}
    for order in orders:
        jagg = estimator("jagg", window=steps, order=order, gate="off")
        errors = []
        for span in spans:
            sampler = RectifiedFlow(
                times=torch.linspace(start, start - span, steps + 1, dtype=torch.float64)
            )
            trajectory = rollout(model, sampler, state, cond=cond)
            truth = exact.estimate(
                model, sampler, objective, trajectory=trajectory, cond=cond
            ).flat()
            error, _ = _flat_error(
                jagg.estimate(model, sampler, objective, trajectory=trajectory, cond=cond), truth
            )
            errors.append(error)
        fitted = [(s, e) for s, e in zip(spans, errors, strict=True) if s <= fit_below]
        out["orders"][str(order)] = {
            "spans": list(spans),
            "errors": errors,
            "slope": fit_loglog_slope([s for s, _ in fitted], [e for _, e in fitted]),
            "expected_slope": order + 1,
        }
    return out


def jagg_tau_sweep(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
    *,
    window: int = 4,
    taus: Sequence[float] = (0.0, 0.9, 0.99, 0.995, 0.999, 0.9999, 1.0),
) -> list[dict[str, float]]:
    """Agreement with exact and cost of jagg(window) as the gate threshold varies, on a
    ``trajectory`` recorded on ``sampler``."""
    exact_result = estimator("exact").estimate(
        model, sampler, objective, trajectory=trajectory, cond=cond
    )
    exact = exact_result.flat()
    rows = []
    for tau in taus:
        result = estimator("jagg", window=window, tau=tau).estimate(
            model, sampler, objective, trajectory=trajectory, cond=cond
        )
        error, cosine = _flat_error(result, exact)
        rows.append(
            {
                "tau": tau,
                "relative_error": error,
                "cosine": cosine,
                "param_vjps": result.cost.param_vjps,
                "cost_ratio": result.cost.model_units() / exact_result.cost.model_units(),
                "fallback_fraction": float(result.info.get("fallback_fraction", math.nan)),
            }
        )
    return rows


def jagg_debias_sweep(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    trajectory: Trajectory,
    cond: Mapping[str, Any] | None = None,
    *,
    window: int = 4,
    debias: Sequence[int] = (0, 1, 2, 4, 8),
    draws: int = 32,
) -> list[dict[str, float]]:
    """Squared bias, variance and MSE (relative to ``||exact||^2``) of ``jagg:debias=m``
    (gate off) against exact on one trajectory, with the mean parameter VJPs per call.

    ``m = 0`` is plain jagg (deterministic: its squared bias is the interpolation error).
    Values of ``m`` above the chain's steps are skipped. ``trajectory`` was recorded on
    ``sampler``.
    """
    exact = (
        estimator("exact")
        .estimate(model, sampler, objective, trajectory=trajectory, cond=cond)
        .flat()
    )
    rows = []
    for m in (m for m in debias if m <= sampler.num_steps):
        est = estimator("jagg", window=window, gate="off", debias=m)
        results = [
            est.estimate(
                model,
                sampler,
                objective,
                trajectory=trajectory,
                cond=cond,
                generator=torch.Generator().manual_seed(draw),
            )
            for draw in range(draws if m else 1)
        ]
        stats = trajectory_stats([r.flat() for r in results], exact)
        rows.append(
            {
                "debias": m,
                "bias_squared": stats.bias_squared,
                "variance": stats.variance,
                "mse": stats.mse,
                "draws": len(results),
                "param_vjps": sum(r.cost.param_vjps for r in results) / len(results),
            }
        )
    return rows
