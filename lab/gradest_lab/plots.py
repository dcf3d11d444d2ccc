"""PNG plots of a report (matplotlib, headless Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
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


#: The estimators of the committed races, each with its own fixed slot in the style map (a
#: new estimator is appended, never inserted, so every other keeps its style).
_KNOWN_SPECS = (
    "sdo:samples=4",
    "alignprop",
    "sdo",
    "drtune",
    "truncated:k=1",
    "truncated:random=uniform,k_min=2",
    "draft_lv",
    "refl",
    "jagg:window=4",
    "jagg:window=4,tau=-1",
    "telescope",
    "auto",
    "auto:candidates=(exact,sdo,sdo:samples=4,alignprop),probe_budget=300",
    # past the thirteen colours: these two share one with the first two slots (told apart by
    # dash and marker), estimators no committed race runs beside them
    "jagg:window=4,tau=0.9",
    "truncated:random=uniform",
)
#: Thirteen colours told apart on white (tab10 without its grey, which is close to the
#: ceiling line, and four dark ones from tab20b); black is exact's.
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#637939",
    "#843c39",
    "#7b4173",
)
_DASHES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X")
#: Slot ``i`` is (colour ``i % 13``, dash ``i % 4``, marker ``i % 7``): the colour-and-dash
#: pairs repeat only after 52 slots, the triples after 364.
_SLOTS = len(_PALETTE) * len(_DASHES) * len(_MARKERS)
_EXACT_STYLE = {"color": "black", "linestyle": "-", "marker": "o", "linewidth": 2.4}


def _slot_style(slot: int) -> dict[str, Any]:
    return {
        "color": _PALETTE[slot % len(_PALETTE)],
        "linestyle": _DASHES[slot % len(_DASHES)],
        "marker": _MARKERS[slot % len(_MARKERS)],
        "linewidth": 1.3,
    }


def race_styles(specs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The line style (``color``, ``linestyle``, ``marker``, ``linewidth``) of each estimator
    of a race plot, shared by every race plot: ``exact`` is black and thick (the reference),
    an estimator of :data:`_KNOWN_SPECS` has its fixed slot whatever the line-up, any other
    one a slot hashed from its spec (the next free one if that is taken in this figure).
    No two specs of ``specs`` get the same (colour, dash, marker)."""
    import hashlib

    from gradest_lab.race.verdicts import REFERENCE

    styles: dict[str, dict[str, Any]] = {}
    taken: set[int] = set()
    for spec in specs:
        if spec in _KNOWN_SPECS:
            taken.add(_KNOWN_SPECS.index(spec))
    for spec in specs:
        if spec in styles:
            continue
        if spec == REFERENCE:
            styles[spec] = dict(_EXACT_STYLE)
            continue
        if spec in _KNOWN_SPECS:
            slot = _KNOWN_SPECS.index(spec)
        else:
            digest = int(hashlib.sha256(spec.encode()).hexdigest(), 16)
            free = _SLOTS - len(_KNOWN_SPECS)
            slot = len(_KNOWN_SPECS) + digest % free
            while slot in taken:
                slot = len(_KNOWN_SPECS) + (slot - len(_KNOWN_SPECS) + 1) % free
            taken.add(slot)
        styles[spec] = _slot_style(slot)
    return styles


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
    ax.plot(xs, means, markersize=3.5, **style, **kw)
    ax.fill_between(
        xs,
        [band.low for band in bands],
        [band.high for band in bands],
        color=style["color"],
        alpha=0.08,
        linewidth=0,
    )
    return means


def _legend_outside(ax: Any) -> None:
    """The legend right of the axes, where it hides no curve (a full line-up has 15); the
    figure is saved with ``bbox_inches="tight"`` (:func:`_save_outside`) so it is kept."""
    ax.legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        frameon=False,
        handlelength=3.5,
    )


def _save_outside(plt: Any, fig: Any, path: Path) -> Path:
    """A figure whose legend lies outside its axes, saved with the canvas grown to hold it."""
    from gradest_lab.storage.files import atomic_write

    try:
        atomic_write(
            path, lambda file: fig.savefig(file, format="png", dpi=120, bbox_inches="tight")
        )
    finally:
        plt.close(fig)
    return path


_CEILING = {"color": "0.45", "linestyle": (0, (6, 3)), "linewidth": 1, "label": "ceiling"}


def race_figure(report: Any) -> tuple[Any, Any, Any]:
    """``(plt, fig, ax)`` of a plain race's ``reward_vs_compute.png``, legend drawn, not saved."""
    plt, fig, ax = _figure(7.0, 4.2)
    initial = report.initial["reward"]
    fractions = report.config["fractions"]
    styles = race_styles(list(report.runs))
    for spec in report.runs:
        xs = [0.0]
        samples: list[Sequence[float]] = [[initial]]
        for i in range(len(fractions)):
            compute = report.at_fraction(spec, i, report.axis)
            xs.append(sum(compute) / len(compute) / report.unit)
            samples.append(report.at_fraction(spec, i))
        _band_line(ax, xs, samples, styles[spec], label=spec)
    ceiling = report.config.get("ceiling")
    if ceiling is not None and math.isfinite(ceiling):
        ax.axhline(ceiling, **_CEILING)
    ax.set_xlabel(f"compute ({report.unit_name})")
    ax.set_ylabel("reward on the fixed evaluation set")
    ax.set_title(
        f"{report.config['task']}: mean and 95% bootstrap band over "
        f"{len(report.config['seeds'])} seeds",
        fontsize=9,
    )
    ax.grid(True, alpha=0.25)
    _legend_outside(ax)
    return plt, fig, ax


def plot_race(report: Any, folder: Path) -> list[Path]:
    """``reward_vs_compute.png`` of a race (:class:`gradest_lab.race.plain_race.RaceReport`): per
    estimator the mean reward over seeds against the mean compute at each evaluation
    point, with its 95% bootstrap band (resampling seeds), the pretrained model at
    compute 0, and the ceiling (dashed) when the task knows it."""
    plt, fig, _ = race_figure(report)
    return [_save_outside(plt, fig, folder / "reward_vs_compute.png")]


def tuned_reward_figure(report: Any) -> tuple[Any, Any, Any]:
    """``(plt, fig, ax)`` of a tuned race's ``reward_vs_compute.png``, not saved."""
    from gradest_lab.race.shards import lr_label

    config, initial = report.config, report.initial["reward"]
    choices = report.choices()
    styles = race_styles(config["estimators"])
    plt, fig, ax = _figure(7.0, 4.6)
    for spec in config["estimators"]:
        lr = choices[spec]["by_fraction"][-1]
        rows = report.runs[spec][lr_label(lr)]
        xs = [0.0]
        samples: list[Sequence[float]] = [[initial]]
        for i in range(len(config["fractions"])):
            xs.append(sum(r["curve"][i]["flops"] for r in rows) / len(rows) / report.unit)
            samples.append([r["curve"][i]["reward"] for r in rows])
        _band_line(ax, xs, samples, styles[spec], label=f"{spec} (lr {lr:.2g})")
    ax.axhline(report.ceiling, **_CEILING)
    ax.set_xlabel("compute (exact training steps)")
    ax.set_ylabel("reward on the fixed evaluation set")
    ax.set_title(
        f"{config['task']}: tuned lrs, mean and 95% band over {len(config['seeds'])} report seeds",
        fontsize=9,
    )
    ax.grid(True, alpha=0.25)
    _legend_outside(ax)
    return plt, fig, ax


def tuning_figure(report: Any) -> tuple[Any, Any, Any]:
    """``(plt, fig, ax)`` of a tuned race's ``tuning_curves.png``, not saved: per estimator
    its mean final reward on the tuning seeds at every rate it was tuned at (filled markers:
    the grid's rates; hollow: the refinement's), the choice for the full budget starred and,
    above the star, a bar as tall as its residual tuning gap (what a finer rate could add)."""
    from gradest_lab.race.shards import lr_label

    config = report.config
    choices = report.choices()
    styles = race_styles(config["estimators"])
    grid = set(config["lrs"])
    plt, fig, ax = _figure(7.0, 4.6)
    for spec in config["estimators"]:
        style = styles[spec]
        lrs = report.tried_lrs(spec)
        finals = [
            [r["curve"][-1]["reward"] for r in report.tuning[spec][lr_label(lr)]] for lr in lrs
        ]
        means = _band_line(ax, lrs, finals, style, label=spec)
        refined = [i for i, lr in enumerate(lrs) if lr not in grid]
        if refined:
            ax.plot(
                [lrs[i] for i in refined],
                [means[i] for i in refined],
                marker=style["marker"],
                markersize=5,
                markerfacecolor="white",
                markeredgecolor=style["color"],
                linestyle="none",
            )
        chosen = choices[spec]["by_fraction"][-1]
        top = means[lrs.index(chosen)]
        gap = choices[spec]["gap_by_fraction"][-1]
        if gap:
            ax.plot([chosen, chosen], [top, top + gap], color=style["color"], linewidth=2.5)
        ax.plot(
            [chosen],
            [top],
            marker="*",
            markersize=11,
            color=style["color"],
            markeredgecolor="black",
            markeredgewidth=0.5,
            linestyle="none",
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final reward, tuning seeds")
    ax.set_title(
        f"{config['task']}: tuning curves ({len(config['tune_seeds'])} tuning seeds; * chosen; "
        f"hollow: refined rates; bar above *: residual tuning gap)",
        fontsize=8,
    )
    ax.grid(True, alpha=0.25)
    _legend_outside(ax)
    return plt, fig, ax


#: The cell colours of ``decision.png`` (blue and red rather than green and red, for
#: readers who cannot tell green from red).
VERDICT_COLOURS = {"ahead": "#2c7bb6", "level": "#d9d9d9", "behind": "#d7191c"}
_VERDICT_LABELS = {
    "ahead": "ahead of exact (95% CI of Δ reward above the margin: both residual tuning gaps)",
    "level": "level with exact (CI reaches within the margin of 0)",
    "behind": "behind exact (CI below minus the margin)",
}


def decision_figure(report: Any) -> tuple[Any, Any, Any]:
    """``(plt, fig, ax)`` of a tuned race's ``decision.png``: one row per estimator, one
    column per budget, each cell coloured by the estimator's verdict against exact at that
    budget and labelled with its mean Δ reward; the legend is below the axes. Cell ``(row,
    column)`` is centred at data point ``(column, row)``."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from gradest_lab.race.verdicts import decision_grid

    decision = report.summary()["decision"]
    specs, budgets, verdicts = decision_grid(report, decision)
    deltas = {
        (entry["spec"], i): entry["minus_exact"]["mean"]
        for i, row in enumerate(decision)
        for key in ("beats_exact", "no_clear_difference", "behind_exact")
        for entry in row[key]
    }
    order = list(VERDICT_COLOURS)
    plt = _pyplot()
    fig, ax = plt.subplots(
        figsize=(2.6 + 0.62 * len(budgets), 1.6 + 0.32 * len(specs)),
        dpi=120,
        layout="constrained",
    )
    codes = [[order.index(word) for word in row] for row in verdicts]
    ax.pcolormesh(
        [c - 0.5 for c in range(len(budgets) + 1)],
        [r - 0.5 for r in range(len(specs) + 1)],
        codes,
        cmap=ListedColormap([VERDICT_COLOURS[word] for word in order]),
        vmin=-0.5,
        vmax=len(order) - 0.5,
        edgecolors="white",
        linewidth=1.5,
    )
    for r, spec in enumerate(specs):
        for c in range(len(budgets)):
            delta = deltas.get((spec, c))
            if delta is None:
                continue
            ax.text(
                c,
                r,
                f"{delta:+.2g}",
                ha="center",
                va="center",
                fontsize=6,
                color="black" if verdicts[r][c] == "level" else "white",
            )
    ax.set_xticks(range(len(budgets)), [f"{b:g}" for b in budgets], fontsize=7)
    ax.set_yticks(range(len(specs)), specs, fontsize=7)
    ax.set_xlim(-0.5, len(budgets) - 0.5)
    ax.set_ylim(len(specs) - 0.5, -0.5)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("budget (exact training steps)", fontsize=8)
    # The figure's title, not the axes': centred on the figure, a long estimator label on
    # the left does not push it past the right edge.
    fig.suptitle(
        f"{report.config['task']}: each estimator against exact, at its tuned lr per budget\n"
        "(in a cell: mean Δ reward over the report seeds)",
        fontsize=8,
    )
    fig.legend(
        handles=[Patch(color=VERDICT_COLOURS[w], label=_VERDICT_LABELS[w]) for w in order],
        loc="outside lower center",
        ncols=1,
        fontsize=7,
        frameon=False,
    )
    return plt, fig, ax


def plot_decision(report: Any, folder: Path) -> Path:
    """``decision.png`` of a tuned race (:func:`decision_figure`)."""
    plt, fig, _ = decision_figure(report)
    path = folder / "decision.png"
    _save(plt, fig, path)
    return path


def plot_tuned_race(report: Any, folder: Path) -> list[Path]:
    """A tuned race's three pictures (:class:`gradest_lab.race.tuned_race.TunedRaceReport`),
    every estimator in its :func:`race_styles` style, legends right of the axes:

    * ``reward_vs_compute.png``: per estimator, at its lr chosen for the full budget, the
      mean reward over the report seeds against compute (exact steps), with its 95%
      bootstrap band, the pretrained model at 0 and the measured ceiling (dashed);
    * ``tuning_curves.png``: per estimator, the mean final reward over the tuning seeds
      against the lr (log axis) with its band, the refined rates hollow, the chosen lr
      starred with its residual tuning gap (:func:`tuning_figure`);
    * ``decision.png``: the decision table as a picture (:func:`decision_figure`).
    """
    plt, fig, _ = tuned_reward_figure(report)
    first = _save_outside(plt, fig, folder / "reward_vs_compute.png")
    plt, fig, _ = tuning_figure(report)
    second = _save_outside(plt, fig, folder / "tuning_curves.png")
    return [first, second, plot_decision(report, folder)]
