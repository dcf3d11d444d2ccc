"""``gradest compare`` and its report folder (the lab): the command end to end, its bad
input, jagg's sweeps, and the report written at once with its plots."""

from __future__ import annotations

import json

import pytest
import torch
from gradest_lab.compare.report_files import write_report

import gradest
from gradest.cli import main
from gradest.harness import compare
from gradest.harness.report import SCHEMA
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 4, 6


def _problem(kind="terminal"):
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = (
        smooth_terminal_objective(DIM)
        if kind == "terminal"
        else random_stepwise_objective(STEPS, (BATCH, DIM))
    )
    return model, flow, objective, (lambda seed: seeded_normal((BATCH, DIM), 100 + seed))


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
    out = write_report(report, tmp_path / "run")
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

    monkeypatch.setattr("gradest_lab.plots.plot_report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(report, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []


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
        "contraction.png",
    } <= names
    data = json.loads((out / "report.json").read_text())
    sweeps = data["config"]["sweeps"]
    assert abs(sweeps["span"]["orders"]["1"]["slope"] - 2) <= 0.3
    assert [row["debias"] for row in sweeps["debias"]] == [0, 1, 2, 4, 8]
    assert "jagg debias sweep" in printed
    # The chain's contraction on the first trajectory, every step of the 8 (N <= 10).
    contraction = data["contraction"]
    assert contraction["steps"] == list(range(8)) and len(contraction["mean"]) == 8
    assert contraction["seed"] == 0 and contraction["samples"] == 8
    assert "Chain contraction" in printed


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


def test_debias_sweep_trades_the_interpolation_bias_for_variance():
    from gradest_lab.compare.sweeps import jagg_debias_sweep

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
    from gradest_lab.compare.sweeps import jagg_span_sweep, jagg_tau_sweep

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
        write_report(report, tmp_path / "api")
    assert sorted(p.name for p in (tmp_path / "api").iterdir()) == ["report.json", "report.md"]
