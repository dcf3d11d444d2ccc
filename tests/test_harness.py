"""The comparison harness: statistics, determinism, schema, outputs and bad input."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

import gradest
from gradest.base import EstimatorBase
from gradest.cli import main
from gradest.errors import InvalidValue
from gradest.harness.compare import compare, draw_generator
from gradest.harness.cost import COST_DRAWS, count_flops
from gradest.harness.report import SCHEMA, Report
from gradest.options import option
from gradest.specs import split_spec_list
from gradest.statistics import trajectory_stats
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


def test_report_renders_markdown_json_and_plots(tmp_path):
    model, flow, objective, noise_fn = _problem()
    report = compare(
        model,
        flow,
        objective,
        ["exact", "jagg:window=3", "sdo"],
        noise_fn=noise_fn,
        seeds=2,
        draws=3,
        timing_repeats=1,
        show_progress=False,
    )
    out = report.write(tmp_path / "run")
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == SCHEMA
    assert [row["label"] for row in data["estimators"]] == ["exact", "jagg:window=3", "sdo"]
    for row in data["estimators"]:
        assert set(row["mse"]) == {"mean", "stderr"}
        assert row["cost"]["flops"] > 0 and row["cost"]["retained_bytes"] > 0
    assert data["estimators"][0]["cost"]["flops_ratio"] == 1.0
    markdown = (out / "report.md").read_text()
    assert "| `jagg:window=3` |" in markdown
    for plot in ("mse_vs_cost.png", "gate_cosines.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_write_leaves_no_report(tmp_path, monkeypatch):
    model, flow, objective, noise_fn = _problem()
    report = compare(
        model,
        flow,
        objective,
        ["exact"],
        noise_fn=noise_fn,
        seeds=1,
        measure_cost=False,
        show_progress=False,
    )

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("gradest.harness.plots.plot_report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write(tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []


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


def test_cli_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(
        [
            "compare",
            "--steps",
            "8",
            "--seeds",
            "2",
            "--draws",
            "2",
            "--repeats",
            "1",
            "--estimators",
            "exact,jagg:window=4,sdo",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| `jagg` |" in printed  # window=4 is the default, so the label is the name
    names = {p.name for p in out.iterdir()}
    assert {
        "report.md",
        "report.json",
        "mse_vs_cost.png",
        "jagg_span.png",
        "tau_sweep.png",
        "jagg_debias.png",
    } <= names
    sweeps = json.loads((out / "report.json").read_text())["config"]["sweeps"]
    assert abs(sweeps["span"]["orders"]["1"]["slope"] - 2) <= 0.3
    assert [row["debias"] for row in sweeps["debias"]] == [0, 1, 2, 4, 8]
    assert "jagg debias sweep" in printed


def test_default_compare_leaves_terminal_only_estimators_out_of_a_stepwise_run(tmp_path, capsys):
    code = main(
        [
            "compare",
            "--steps",
            "8",
            "--seeds",
            "1",
            "--draws",
            "2",
            "--repeats",
            "1",
            "--objective",
            "stepwise",
            "--no-sweeps",
            "--no-plots",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "draft_lv, refl left out (no stepwise objectives)" in printed
    assert "| `telescope` |" in printed and "| `refl` |" not in printed


def test_compare_refuses_an_estimator_without_the_objective_kind():
    model, flow, objective, noise_fn = _problem("stepwise")
    with pytest.raises(InvalidValue, match="does not define stepwise objectives"):
        compare(model, flow, objective, ["exact", "refl"], noise_fn=noise_fn, seeds=1)


def test_debias_sweep_trades_the_interpolation_bias_for_variance():
    from gradest.harness.sweeps import jagg_debias_sweep

    model, flow, objective, noise_fn = _problem("terminal")
    trajectory = gradest.rollout(model, flow, noise_fn(0))
    rows = jagg_debias_sweep(model, flow, objective, trajectory, window=3, debias=(0, 1, 2, 9))
    assert [r["debias"] for r in rows] == [0, 1, 2]  # 9 > N is skipped
    plain, one, two = rows
    assert plain["variance"] == 0 and plain["bias_squared"] > 0 and plain["draws"] == 1
    # Unbiased draws: the squared bias left after removing the mean's noise is far below
    # plain jagg's; the variance falls with m (the correction's scale N/m).
    assert one["bias_squared"] < 0.2 * plain["bias_squared"]
    assert one["variance"] > two["variance"] > 0


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--estimators", "exakt"], "unknown estimator 'exakt'"),
        (["--estimators", ""], "--estimators is empty"),
        (["--seeds", "0"], "argument --seeds: must be a whole number >= 1, got 0"),
        (["--model", "unet"], "--model 'unet' is not embedded"),
        (["--dtype", "int8"], "--dtype must be float64 or float32"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(argv, message, tmp_path, capsys):
    code = main(["compare", "--out", str(tmp_path / "x"), "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_cli_out_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert main(["compare", "--out", str(target), "--quiet"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_sweeps_work_on_a_float32_model():
    from gradest.harness.sweeps import jagg_span_sweep, jagg_tau_sweep

    model = tiny_mlp(DIM, hidden=8, dtype=torch.float32)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = random_stepwise_objective(STEPS, (BATCH, DIM))
    state = seeded_normal((BATCH, DIM), 0, torch.float32)
    trajectory = gradest.rollout(model, flow, state)
    rows = jagg_tau_sweep(model, flow, objective, trajectory, window=3, taus=(0.0, 1.0))
    assert rows[-1]["relative_error"] <= 1e-6  # tau = 1 falls back everywhere: exact
    span = jagg_span_sweep(model, objective, state, steps=4, spans=(1e-3, 5e-4), orders=(1,))
    assert len(span["orders"]["1"]["errors"]) == 2


def test_compare_without_matplotlib_writes_the_report_and_says_why(tmp_path, capsys, monkeypatch):
    """A plain ``pip install gradest`` has no matplotlib: the report and its JSON are
    written all the same, and the CLI says the plots were skipped and why."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "matplotlib" else real_find_spec(name, *args),
    )
    out = tmp_path / "cmp"
    argv = ["compare", "--steps", "4", "--seeds", "1", "--draws", "1", "--repeats", "1"]
    code = main([*argv, "--estimators", "exact,sdo", "--no-sweeps", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "plots skipped: matplotlib is not installed" in printed
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "run.json"]
    model, flow, objective, noise_fn = _problem()
    report = compare(model, flow, objective, ["exact"], noise_fn=noise_fn, seeds=1)
    with pytest.warns(UserWarning, match="plots skipped: matplotlib is not installed"):
        report.write(tmp_path / "api")
    assert sorted(p.name for p in (tmp_path / "api").iterdir()) == ["report.json", "report.md"]
