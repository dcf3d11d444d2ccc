"""PNG plots of a report (matplotlib, headless Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gradest import MissingDependency

_REQUIRES = "plots need matplotlib: pip install 'gradest[plot]'"


def plots_unavailable() -> str | None:
    """Why plots cannot be drawn here (matplotlib is not installed), or None if they can.

    Checked without importing matplotlib, so a report can say up front that it will
    skip its plots rather than fail after the work.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'gradest[plot]' to get the plots)"
    return None


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise MissingDependency(_REQUIRES) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    """The figure as a PNG at ``path``, written atomically (``gradest_lab.storage.files``)."""
    from gradest_lab.storage.files import atomic_write

    try:
        atomic_write(path, lambda file: fig.savefig(file, format="png", dpi=120))
    finally:
        plt.close(fig)


def _figure(width: float, height: float) -> tuple[Any, Any, Any]:
    """``(plt, fig, ax)``: pyplot and a new single-axes figure of ``width`` x ``height`` in."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(width, height))
    return plt, fig, ax


def _save_tight(plt: Any, fig: Any, path: Path) -> Path:
    """The figure laid out tight (labels inside the canvas) and saved at ``path``."""
    fig.tight_layout()
    _save(plt, fig, path)
    return path


def plot_report(report: Any, folder: Path) -> list[Path]:
    """Write every plot the report has data for into ``folder``; returns the paths."""
    written = [_mse_vs_cost(report, folder)]
    if any(row.gate_cosines for row in report.rows):
        written.append(_gate_cosines(report, folder))
    sweeps = report.config.get("sweeps") or {}
    if sweeps.get("span"):
        written.append(_span_sweep(sweeps["span"], folder))
    if sweeps.get("tau"):
        written.append(_tau_sweep(sweeps["tau"], folder))
    if sweeps.get("debias"):
        written.append(_debias_sweep(sweeps["debias"], folder))
    if report.contraction is not None:
        written.append(_contraction(report.contraction, folder))
    return [p for p in written if p is not None]


def _mse_vs_cost(report: Any, folder: Path) -> Path:
    plt, fig, ax = _figure(8, 4.5)
    floor = min((r.mse.mean for r in report.rows if r.mse.mean > 0), default=1e-16) / 10
    for row in report.rows:
        x = row.flops_ratio if row.flops_ratio is not None else row.counts.model_units()
        y = max(row.mse.mean, floor)
        ax.scatter([x], [y], s=40, label=row.label)
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs ratio to exact" if report.rows[0].flops_ratio is not None else "cost (F)")
    ax.set_ylabel("MSE / |exact gradient|²  (0 drawn at the floor)")
    ax.set_title(
        f"{report.config['model']}, {report.config['objective']}, N={report.config['steps']}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save_tight(plt, fig, folder / "mse_vs_cost.png")


def _gate_cosines(report: Any, folder: Path) -> Path:
    plt, fig, ax = _figure(6, 4)
    for row in report.rows:
        if not row.gate_cosines:
            continue
        points = [
            (sum(group) / len(group), cosine)
            for group, cosine in zip(row.groups, row.gate_cosines, strict=False)
            if cosine is not None and not math.isnan(cosine)
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=row.label)
    ax.set_xlabel("step (group centre)")
    ax.set_ylabel("gate cosine (actual vs interpolated velocity)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save_tight(plt, fig, folder / "gate_cosines.png")


def _span_sweep(span: dict[str, Any], folder: Path) -> Path:
    plt, fig, ax = _figure(6, 4)
    for order, data in span["orders"].items():
        if data["spans"]:
            ax.loglog(
                data["spans"],
                data["errors"],
                marker="o",
                label=f"order {order}: fitted slope {data['slope']:.2f} "
                f"(theory {data['expected_slope']})",
            )
    ax.axvline(
        span["fit_below"], color="grey", linestyle=":", label="slope fitted left of this line"
    )
    ax.set_xlabel("time span of one group")
    ax.set_ylabel("relative error vs exact (gate off)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save_tight(plt, fig, folder / "jagg_span.png")


def _tau_sweep(rows: list[dict[str, float]], folder: Path) -> Path:
    plt, fig, ax = _figure(6, 4)
    xs = [r["cost_ratio"] for r in rows]
    ys = [max(r["relative_error"], 1e-17) for r in rows]
    ax.plot(xs, ys, marker="o")
    # Thresholds that give the same estimate share a point: one label lists them all.
    labels: dict[tuple[float, float], list[str]] = {}
    for r, x, y in zip(rows, xs, ys, strict=True):
        labels.setdefault((x, y), []).append(f"{r['tau']:g}")
    for (x, y), taus in labels.items():
        ax.annotate(
            "τ=" + ", ".join(taus), (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points"
        )
    ax.set_yscale("log")
    ax.set_xlabel("cost ratio to exact (cost model units)")
    ax.set_ylabel("relative error vs exact")
    ax.set_title("jagg gate threshold: speed vs agreement")
    ax.grid(True, which="both", alpha=0.3)
    return _save_tight(plt, fig, folder / "tau_sweep.png")


def _debias_sweep(rows: list[dict[str, float]], folder: Path) -> Path:
    """Squared bias and variance of jagg:debias=m against m: the trade of the option."""
    plt, fig, ax = _figure(6, 4)
    ms = [r["debias"] for r in rows]
    floor = 1e-17  # log axis: a zero bias (or the deterministic m=0's variance) at the floor
    ax.plot(ms, [max(r["bias_squared"], floor) for r in rows], marker="o", label="bias²")
    ax.plot(ms, [max(r["variance"], floor) for r in rows], marker="s", label="variance")
    ax.plot(ms, [max(r["mse"], floor) for r in rows], marker="^", label="MSE", linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("debias m (steps corrected per call; 0 = plain jagg)")
    ax.set_ylabel("relative to ||exact||²")
    ax.set_title("jagg debias: interpolation bias traded for variance")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save_tight(plt, fig, folder / "jagg_debias.png")


def _contraction(summary: dict[str, Any], folder: Path) -> Path:
    """||dz_N/dz_k||_2 against k (mean and largest over the samples), with the line at 1
    below which every perturbation of z_k shrinks by the end of the chain."""
    plt, fig, ax = _figure(6, 4)
    ax.plot(summary["steps"], summary["mean"], marker="o", markersize=3, label="mean")
    ax.plot(summary["steps"], summary["max"], linestyle=":", label="largest sample")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    values = [v for v in (*summary["mean"], *summary["max"]) if v > 0]
    if values and max(values) > 10 * min(values):  # a log axis only for a wide range
        ax.set_yscale("log")
    ax.set_xlabel("step k (0 = noise)")
    ax.set_ylabel("||dz_N / dz_k||₂")
    ax.set_title(
        f"chain contraction, trajectory {summary['seed']}\n"
        f"({summary['samples']} samples, {summary['iters']} power iterations)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save_tight(plt, fig, folder / "contraction.png")


def _line_styles() -> Iterator[dict[str, Any]]:
    """Colour and dash for each line of a plot: the ten tab10 colours, then again dashed,
    dotted, dash-dotted, so that up to 40 estimators stay apart (a race's full line-up has
    fifteen)."""
    for dash in ("-", "--", ":", "-."):
        for index in range(10):
            yield {"color": f"C{index}", "linestyle": dash}


def _band_line(
    ax: Any,
    xs: Sequence[float],
    samples: Sequence[Sequence[float]],
    style: dict[str, Any],
    **kw: Any,
) -> list[float]:
    """Plot the mean of each ``samples[i]`` at ``xs[i]`` with its 95% bootstrap band
    (resampling the values: the seeds); returns the means."""
    from gradest_lab.race.bootstrap import bootstrap_mean

    bands = [bootstrap_mean(list(values)) for values in samples]
    means = [band.mean for band in bands]
    ax.plot(xs, means, marker="o", markersize=3, **style, **kw)
    ax.fill_between(
        xs,
        [band.low for band in bands],
        [band.high for band in bands],
        color=style["color"],
        alpha=0.15,
        linewidth=0,
    )
    return means


def _legend_outside(ax: Any) -> None:
    """The legend right of the axes, where it hides no curve (a full line-up has 15)."""
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def plot_race(report: Any, folder: Path) -> list[Path]:
    """``reward_vs_compute.png`` of a race (:class:`gradest_lab.race.plain_race.RaceReport`): per
    estimator the mean reward over seeds against the mean compute at each evaluation
    point, with its 95% bootstrap band (resampling seeds), the pretrained model at
    compute 0, and the ceiling (dashed) when the task knows it."""
    plt, fig, ax = _figure(6.4, 4.2)
    initial = report.initial["reward"]
    fractions = report.config["fractions"]
    for spec, style in zip(report.runs, _line_styles(), strict=False):
        xs = [0.0]
        samples: list[Sequence[float]] = [[initial]]
        for i in range(len(fractions)):
            compute = report.at_fraction(spec, i, report.axis)
            xs.append(sum(compute) / len(compute) / report.unit)
            samples.append(report.at_fraction(spec, i))
        _band_line(ax, xs, samples, style, label=spec)
    ceiling = report.config.get("ceiling")
    if ceiling is not None and math.isfinite(ceiling):
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label="ceiling")
    ax.set_xlabel(f"compute ({report.unit_name})")
    ax.set_ylabel("reward on the fixed evaluation set")
    ax.set_title(
        f"{report.config['task']}: mean and 95% bootstrap band over "
        f"{len(report.config['seeds'])} seeds",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    path = folder / "reward_vs_compute.png"
    _save(plt, fig, path)
    return [path]


def plot_tuned_race(report: Any, folder: Path) -> list[Path]:
    """A tuned race's two pictures (:class:`gradest_lab.race.tuned_race.TunedRaceReport`):

    * ``reward_vs_compute.png``: per estimator, at its lr chosen for the full budget, the
      mean reward over the report seeds against compute (exact steps), with its 95%
      bootstrap band, the pretrained model at 0 and the measured ceiling (dashed);
    * ``tuning_curves.png``: per estimator, the mean final reward over the tuning seeds
      against the lr (log axis) with its band, the chosen lr marked.
    """
    from gradest_lab.race.shards import lr_label

    config, initial = report.config, report.initial["reward"]
    choices = report.choices()
    plt, fig, ax = _figure(9.0, 4.2)
    for spec, style in zip(config["estimators"], _line_styles(), strict=False):
        lr = choices[spec]["by_fraction"][-1]
        rows = report.runs[spec][lr_label(lr)]
        xs = [0.0]
        samples: list[Sequence[float]] = [[initial]]
        for i in range(len(config["fractions"])):
            xs.append(sum(r["curve"][i]["flops"] for r in rows) / len(rows) / report.unit)
            samples.append([r["curve"][i]["reward"] for r in rows])
        _band_line(ax, xs, samples, style, label=f"{spec} (lr {lr:.2g})")
    ax.axhline(report.ceiling, color="black", linestyle="--", linewidth=1, label="ceiling")
    ax.set_xlabel("compute (exact training steps)")
    ax.set_ylabel("reward on the fixed evaluation set")
    ax.set_title(
        f"{config['task']}: tuned lrs, mean and 95% band over {len(config['seeds'])} report seeds",
        fontsize=9,
    )
    _legend_outside(ax)
    first = _save_tight(plt, fig, folder / "reward_vs_compute.png")

    plt, fig, ax = _figure(9.0, 4.2)
    lrs = config["lrs"]
    for spec, style in zip(config["estimators"], _line_styles(), strict=False):
        finals = [
            [r["curve"][-1]["reward"] for r in report.tuning[spec][lr_label(lr)]] for lr in lrs
        ]
        means = _band_line(ax, lrs, finals, style, label=spec)
        chosen = choices[spec]["by_fraction"][-1]
        ax.plot(
            [chosen], [means[lrs.index(chosen)]], marker="*", markersize=10, color=style["color"]
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final reward, tuning seeds")
    ax.set_title(
        f"{config['task']}: tuning curves ({len(config['tune_seeds'])} tuning seeds; * chosen)",
        fontsize=9,
    )
    _legend_outside(ax)
    second = _save_tight(plt, fig, folder / "tuning_curves.png")
    return [first, second]
