"""The race pictures: written from a committed report, every line told apart, legends off
the data, and the decision picture coloured by the report's own verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gradest_lab.plots import (
    VERDICT_COLOURS,
    decision_figure,
    plot_decision,
    plot_race,
    plot_tuned_race,
    race_figure,
    race_styles,
    tuned_reward_figure,
    tuning_figure,
)
from gradest_lab.race.plain_race import RaceReport
from gradest_lab.race.tuned_race import TunedRaceReport
from gradest_lab.race.verdicts import decision_grid

pytest.importorskip("matplotlib")
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
PNG = b"\x89PNG\r\n\x1a\n"

LINE_UP = [
    "exact",
    "sdo",
    "sdo:samples=4",
    "alignprop",
    "drtune",
    "truncated:k=1",
    "truncated:random=uniform",
    "truncated:random=uniform,k_min=2",
    "draft_lv",
    "refl",
    "jagg:window=4",
    "jagg:window=4,tau=-1",
    "jagg:window=4,tau=0.9",
    "telescope",
    "auto",
    "auto:candidates=(exact,sdo,sdo:samples=4,alignprop),probe_budget=300",
    "new_one",
    "new_one:k=2",
    "another",
    "yet_another:x=3",
]


def _key(style: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (style["color"], str(style["linestyle"]), style["marker"])


def test_twenty_estimators_get_twenty_styles() -> None:
    assert len(LINE_UP) == 20
    styles = race_styles(LINE_UP)
    assert len({_key(styles[spec]) for spec in LINE_UP}) == 20
    # the main race's line-up (all but the last six): no colour twice, so colour alone tells
    main = [spec for spec in LINE_UP[:16] if "tau=0.9" not in spec and spec[-7:] != "uniform"]
    assert len({styles[spec]["color"] for spec in main}) == len(main)
    exact = styles["exact"]
    assert exact["color"] == "black"
    assert all(exact["linewidth"] > styles[s]["linewidth"] for s in LINE_UP[1:])


def test_a_spec_keeps_its_style_across_figures() -> None:
    full = race_styles(LINE_UP)
    again = race_styles(list(reversed(LINE_UP)))
    small = race_styles(["exact", "drtune", "new_one", "alignprop"])
    for spec in LINE_UP:
        assert again[spec] == full[spec]
    for spec in ("exact", "drtune", "new_one", "alignprop"):
        assert small[spec] == full[spec]


def _legend_off_the_axes(fig: Any, ax: Any) -> Any:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    axes = ax.get_window_extent(renderer)
    assert not legend.overlaps(axes)
    assert legend.x0 >= axes.x1  # right of the axes
    return legend.x1 - axes.x0


@pytest.mark.parametrize("which", ["tuned reward", "tuning", "plain"])
def test_the_legend_lies_outside_the_axes(which: str, tmp_path: Path) -> None:
    import matplotlib.image

    if which == "plain":
        plt, fig, ax = race_figure(RaceReport.load(RESULTS / "race_digits"))
    else:
        report = TunedRaceReport.load(RESULTS / "race_digits_tuned")
        build = tuned_reward_figure if which == "tuned reward" else tuning_figure
        plt, fig, ax = build(report)
    try:
        span = _legend_off_the_axes(fig, ax)
        path = tmp_path / "figure.png"
        fig.savefig(path, dpi=fig.dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    # the saved canvas grew to hold the legend rather than cutting it off
    assert matplotlib.image.imread(path).shape[1] >= span


class _FakeReport:
    """The part of a tuned race report the decision picture reads."""

    def __init__(self, verdicts: dict[str, list[str]], budgets: list[float]) -> None:
        self.config = {"task": "fake", "estimators": ["exact", *verdicts]}
        keys = {"ahead": "beats_exact", "level": "no_clear_difference", "behind": "behind_exact"}
        self.decision = []
        for i, budget in enumerate(budgets):
            row: dict[str, Any] = {"fraction": (i + 1) / len(budgets)}
            row["budget_exact_steps"] = budget
            for key in keys.values():
                row[key] = []
            for spec, words in verdicts.items():
                mean = {"ahead": 0.5, "level": 0.0, "behind": -0.5}[words[i]]
                entry = {"spec": spec, "lr": 1e-3, "minus_exact": {"mean": mean}}
                row[keys[words[i]]].append(entry)
            self.decision.append(row)

    def summary(self) -> dict[str, Any]:
        return {"decision": self.decision}


def test_decision_cells_are_coloured_by_the_verdicts(tmp_path: Path) -> None:
    import matplotlib.image
    from matplotlib.colors import to_rgb

    verdicts = {
        "sdo": ["ahead", "level", "behind"],
        "alignprop": ["behind", "behind", "ahead"],
        "new_one": ["level", "ahead", "level"],
    }
    report = _FakeReport(verdicts, [2.0, 4.0, 8.0])
    specs, budgets, grid = decision_grid(report)
    assert (specs, budgets, grid) == (list(verdicts), [2.0, 4.0, 8.0], list(verdicts.values()))

    path = plot_decision(report, tmp_path)
    assert path == tmp_path / "decision.png" and path.read_bytes().startswith(PNG)
    image = matplotlib.image.imread(path)
    plt, fig, ax = decision_figure(report)  # the same layout, to find the cells in the image
    try:
        fig.canvas.draw()
        assert ax.get_legend() is None and fig.legends  # legend on the figure, below the axes
        legend = fig.legends[0].get_window_extent(fig.canvas.get_renderer())
        assert not legend.overlaps(ax.get_window_extent())
        height = fig.bbox.height
        assert image.shape[0] == round(height)
        for row, spec in enumerate(specs):
            for column in range(len(budgets)):
                # off the cell's centre, where its number is written
                x, y = ax.transData.transform((column - 0.3, row - 0.3))
                pixel = image[int(height - y), int(x), :3]
                want = to_rgb(VERDICT_COLOURS[verdicts[spec][column]])
                assert max(abs(a - b) for a, b in zip(pixel, want, strict=True)) < 0.02, (
                    spec,
                    column,
                )
    finally:
        plt.close(fig)


def test_a_tuned_race_draws_its_three_pictures(tmp_path: Path) -> None:
    report = TunedRaceReport.load(RESULTS / "race_digits_tuned")
    assert len(report.config["estimators"]) > 10  # more lines than one colour cycle
    paths = plot_tuned_race(report, tmp_path)
    names = ["reward_vs_compute.png", "tuning_curves.png", "decision.png"]
    assert [p.name for p in paths] == names
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_a_plain_race_draws_its_picture(tmp_path: Path) -> None:
    (path,) = plot_race(RaceReport.load(RESULTS / "race_digits"), tmp_path)
    assert path.read_bytes().startswith(PNG)
