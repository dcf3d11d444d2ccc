"""The comparison harness: statistics, determinism, schema, outputs and bad input."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

import gradest
from gradest.base import EstimatorBase
from gradest.errors import InvalidValue
from gradest.harness.comparison import compare, draw_generator
from gradest.harness.cost import COST_DRAWS, count_flops
from gradest.harness.report import Report
from gradest.harness.statistics import trajectory_stats
from gradest.options import option
from gradest.specs import split_spec_list
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 4, 6


@attrs.frozen
class PlantedBias(EstimatorBase):
    """A planted biased estimator: exact scaled by (1 + bias)."""

    name = "planted_bias"
    bias: float = option(0.1, kind=float, doc="relative bias")

    def _terminal(self, ctx):
        grads, noise_grad = gradest.estimator("exact")._terminal(ctx)
        return {n: (1 + self.bias) * g for n, g in grads.items()}, noise_grad

    def _stepwise(self, ctx):
        grads = gradest.estimator("exact")._stepwise(ctx)
        return {n: (1 + self.bias) * g for n, g in grads.items()}


def _problem(kind="terminal"):
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = (
        smooth_terminal_objective(DIM)
        if kind == "terminal"
        else random_stepwise_objective(STEPS, (BATCH, DIM))
    )
    return model, flow, objective, (lambda seed: seeded_normal((BATCH, DIM), 100 + seed))


def _stats(report: Report) -> list[tuple]:
    return [
        (r.label, r.cosine, r.relative_error, r.bias, r.variance, r.mse, r.counts)
        for r in report.rows
    ]


def test_exact_has_zero_bias_and_variance_and_report_is_deterministic():
    model, flow, objective, noise_fn = _problem()
    specs = ["exact", "exact:checkpoint=true", "sdo", "jagg:window=3"]
    kwargs = dict(noise_fn=noise_fn, seeds=3, draws=5, measure_cost=False, show_progress=False)
    first = compare(model, flow, objective, specs, **kwargs)
    second = compare(model, flow, objective, specs, **kwargs)
    assert _stats(first) == _stats(second)
    for label in ("exact", "exact:checkpoint=True"):
        row = first.row(label)
        assert not row.stochastic and row.draws == 1
        assert row.bias.mean <= 1e-12 and row.variance.mean == 0.0
        assert row.cosine.mean == pytest.approx(1.0, abs=1e-12)
    sdo = first.row("sdo")
    assert sdo.stochastic and sdo.draws == 5 and sdo.variance.mean > 0
    jagg = first.row("jagg:window=3")
    assert not jagg.stochastic and jagg.bias.mean > 0
    assert 0.0 <= jagg.fallback_fraction <= 1.0


def test_a_planted_bias_shows_up_exactly():
    model, flow, objective, noise_fn = _problem("stepwise")
    report = compare(
        model,
        flow,
        objective,
        [PlantedBias(bias=0.25), PlantedBias(bias=-0.1)],
        noise_fn=noise_fn,
        seeds=2,
        measure_cost=False,
        show_progress=False,
    )
    for row, planted in zip(report.rows, (0.25, 0.1), strict=True):
        assert row.bias.mean == pytest.approx(planted, rel=1e-10)
        assert row.variance.mean == 0.0
        assert row.mse.mean == pytest.approx(planted**2, rel=1e-10)
        assert row.norm_ratio.mean == pytest.approx(
            1 + (0.25 if planted == 0.25 else -0.1), rel=1e-10
        )


def test_statistics_remove_the_noise_of_the_mean_from_the_bias():
    # Draws = reference + independent noise of known variance: bias^2 is 0, variance known.
    torch.manual_seed(0)
    reference = torch.ones(400, dtype=torch.float64)
    sigma = 0.05
    draws = [reference + sigma * torch.randn(400, dtype=torch.float64) for _ in range(50)]
    stats = trajectory_stats(draws, reference)
    expected_variance = 400 * sigma**2 / reference.norm() ** 2
    # sum of 400*50 squared Gaussians: relative standard error sqrt(2 / (400 * 49))
    assert stats.variance == pytest.approx(
        float(expected_variance), rel=5 * math.sqrt(2 / (400 * 49))
    )
    # E||mean - ref||^2 = variance / n exactly, and the estimator subtracts that term
    assert stats.bias_squared <= 5 * float(expected_variance) / 50 * math.sqrt(2 / 400)


def test_sdo_variance_scales_like_one_over_samples():
    """Sampling m of N steps without replacement, scaled N/m: Var = Var_1 (N - m) / (m (N - 1))."""
    model, flow, objective, noise_fn = _problem("stepwise")
    draws = 400
    report = compare(
        model,
        flow,
        objective,
        ["sdo:samples=1", "sdo:samples=2", "sdo:samples=3"],
        noise_fn=noise_fn,
        seeds=1,
        draws=draws,
        measure_cost=False,
        show_progress=False,
    )
    var1 = report.row("sdo").variance.mean
    for m in (2, 3):
        ratio = report.row(f"sdo:samples={m}").variance.mean / var1
        theory = (STEPS - m) / (m * (STEPS - 1))
        # each variance estimate over 400 draws has relative standard error ~ sqrt(kurtosis/400);
        # the squared deviations of a 6-point (or 15/20-point) population have kurtosis < 6,
        # so the ratio is within 4 * sqrt(2 * 6 / 400) ~ 0.7 relative only in a pathological
        # case; we assert a 4-sigma band of that bound.
        assert abs(ratio / theory - 1) <= 4 * math.sqrt(2 * 6 / draws), (m, ratio, theory)


def test_cost_ratios_follow_the_cost_model_on_a_matmul_heavy_model():
    # Wide hidden layers make the Linear layers dominate the FLOPs, as in the cost model.
    torch.manual_seed(0)
    model = gradest.models.MLPVelocity(16, hidden=256, depth=3).double()
    steps = 20
    flow = gradest.RectifiedFlow(steps=steps)
    objective = smooth_terminal_objective(16)
    report = compare(
        model,
        flow,
        objective,
        ["exact", "sdo", "truncated:k=2"],
        noise_fn=lambda s: seeded_normal((8, 16), s),
        seeds=1,
        draws=2,
        timing_repeats=1,
        show_progress=False,
    )
    # exact: N(F + 2F); sdo: NF + 3F; truncated(k): (N - k)F + k(F + 2F)
    assert report.row("sdo").flops_ratio == pytest.approx((steps + 3) / (3 * steps), rel=0.03)
    assert report.row("truncated:k=2").flops_ratio == pytest.approx(
        (steps + 4) / (3 * steps), rel=0.03
    )
    # sdo keeps the graph of one step; exact the graph of N
    assert report.row("sdo").retained_ratio <= 1 / steps * 1.1
    assert report.row("exact").wall_ratio == 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"estimators": []}, ValueError, r"estimators is empty"),
        ({"estimators": ["exakt"]}, ValueError, r"unknown estimator 'exakt'"),
        ({"estimators": "exact"}, TypeError, r"list of specs"),
        ({"seeds": 0}, ValueError, r"seeds must be >= 1"),
        ({"seeds": []}, ValueError, r"non-empty list"),
        ({"reference": "sdo"}, ValueError, r"reference='sdo' is not exact-capable"),
        ({"draws": 0}, ValueError, r"draws must be an int >= 1"),
    ],
)
def test_bad_input_fails_before_any_work(kwargs, error, message):
    model, flow, objective, noise_fn = _problem()
    calls = []

    def counting_noise(seed):
        calls.append(seed)
        return noise_fn(seed)

    arguments = {
        "estimators": ["exact"],
        "noise_fn": counting_noise,
        "show_progress": False,
        **kwargs,
    }
    estimators = arguments.pop("estimators")
    with pytest.raises(error, match=message):
        compare(model, flow, objective, estimators, **arguments)
    assert calls == []


def test_split_spec_list_keeps_options_with_their_estimator():
    assert split_spec_list("exact,jagg:window=4,tau=0.9,sdo,truncated:k=1") == [
        "exact",
        "jagg:window=4,tau=0.9",
        "sdo",
        "truncated:k=1",
    ]


def test_compare_refuses_an_estimator_without_the_objective_kind():
    model, flow, objective, noise_fn = _problem("stepwise")
    with pytest.raises(InvalidValue, match="does not define stepwise objectives"):
        compare(model, flow, objective, ["exact", "refl"], noise_fn=noise_fn, seeds=1)


def test_stochastic_costs_are_averaged_over_draws():
    model, flow, objective, noise_fn = _problem("terminal")
    report = compare(
        model, flow, objective, ["truncated:random=uniform"], noise_fn=noise_fn, seeds=1, draws=4
    )
    row = next(r for r in report.rows if r.label.startswith("truncated"))
    noise = noise_fn(0)
    flops = [
        count_flops(
            lambda d=d: gradest.estimator("truncated:random=uniform").estimate(
                model, flow, objective, noise=noise, generator=draw_generator(0, d)
            )
        )
        for d in range(COST_DRAWS)
    ]
    assert row.cost.flops == round(sum(flops) / COST_DRAWS)
    assert len(set(flops)) > 1  # the draws differ in depth, so the mean is not one draw
