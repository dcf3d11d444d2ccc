"""Learning rates refined until bracketed, residual tuning gaps, and the verdict they gate
(gradest_lab.race.refinement, and the tuned race that runs it)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from gradest_lab.race.refinement import (
    BRACKET_RATIO,
    MAX_ROUNDS,
    bracket,
    merge_close,
    next_rates,
    residual_gap,
    round_rate,
    verdict,
)
from gradest_lab.race.tuned_race import tuned_race
from test_race import QuadraticTask
from test_tuned_race import SETTINGS, SPECS

from gradest.errors import InvalidValue

GRID = [4e-5, 1e-4, 2.5e-4, 6.3e-4, 1.6e-3, 4e-3]


def _refine(optimum: float, grid: list[float], *, ratio: float = BRACKET_RATIO):
    """Refine a concave profile in log lr peaking at ``optimum``, as the race does: the
    choice is the best tried rate; returns (tried rates, choice, rounds taken)."""

    def value(lr: float) -> float:
        return -((math.log(lr) - math.log(optimum)) ** 2)

    tried = list(grid)
    for rounds in range(MAX_ROUNDS + 1):
        values = {lr: value(lr) for lr in tried}
        chosen = max(tried, key=values.__getitem__)
        wanted = next_rates(tried, values, chosen, ratio=ratio)
        if not wanted:
            return tried, chosen, rounds
        assert not set(wanted) & set(tried)
        tried = sorted(tried + wanted)
    raise AssertionError("not bracketed within MAX_ROUNDS")


@pytest.mark.parametrize("optimum", [4.1e-5, 1.3e-4, 3.3e-4, 5.9e-4, 8e-4, 3.9e-3])
def test_a_coarse_choice_ends_bracketed_near_the_optimum(optimum: float) -> None:
    tried, chosen, rounds = _refine(optimum, GRID)
    below, above = bracket(tried, chosen)
    assert below is not None and above is not None
    assert chosen / below <= BRACKET_RATIO and above / chosen <= BRACKET_RATIO
    # the best tried rate of a bracketed choice lies within half a bracket of the optimum
    assert abs(math.log(chosen / optimum)) <= math.log(BRACKET_RATIO) / 2 + 1e-9
    # a 2.5x grid closes in two rounds (three when the optimum sits between two refinements)
    assert rounds <= 3
    # every refined rate has at most 3 significant digits (its label is its value)
    assert all(lr == round_rate(lr) for lr in tried)


def test_an_optimum_past_the_grid_extends_it_until_bracketed() -> None:
    tried, chosen, _ = _refine(2e-2, GRID)
    assert tried[-1] > GRID[-1] and bracket(tried, chosen)[1] is not None
    tried, chosen, _ = _refine(1e-5, GRID)
    assert tried[0] < GRID[0] and bracket(tried, chosen)[0] is not None


def test_a_flat_profile_or_a_fine_grid_asks_for_nothing() -> None:
    # an estimator that never steps: a tie with each neighbour, nothing a finer rate adds
    assert next_rates(GRID, dict.fromkeys(GRID, -3.0), GRID[0]) == []
    fine = [1e-4 * 1.25**i for i in range(5)]
    values = {lr: -abs(i - 2) for i, lr in enumerate(fine)}
    assert next_rates(fine, values, fine[2]) == []
    # ...but one rate farther than the bracket on one side asks for one rate on that side
    values[fine[1]] = -5.0
    wider = [fine[0], *fine[2:]]
    assert next_rates(wider, values, fine[2]) == [round_rate(fine[2] / (1.26 / 1.008))]


def test_two_choices_share_a_rate_only_where_it_brackets_both() -> None:
    # 2.5e-4 and 6.3e-4 both chosen (at different budgets): each asks for a rate towards
    # the other, 3.91e-4 and 4.03e-4; one run between them serves both
    assert merge_close([(3.91e-4, 2.5e-4), (4.03e-4, 6.3e-4)]) == [3.97e-4]
    # 2.5e-4 and 3.97e-4 ask for 3.13e-4 and 3.18e-4: their mean, 3.15e-4, lies 1.2603x
    # from 3.97e-4, outside a refinement step of it: both run (a merged one would cost a
    # round more)
    assert merge_close([(3.13e-4, 2.5e-4), (3.18e-4, 3.97e-4)]) == [3.13e-4, 3.18e-4]
    # rates far apart, or asked twice, run once each
    assert merge_close([(1e-4, 2e-4), (1e-3, 2e-3), (1e-4, 2e-4)]) == [1e-4, 1e-3]
    assert merge_close([]) == []


def test_a_rate_on_the_bracket_counts_as_inside() -> None:
    # 3.15e-4 / 2.5e-4 is 1.26 up to rounding either way: bracketed
    lrs = [2.5e-4, 3.15e-4, 3.9e-4]
    values = {2.5e-4: 0.0, 3.15e-4: 1.0, 3.9e-4: 0.5}
    assert next_rates(lrs, values, 3.15e-4) == []


def test_residual_gap_is_the_fits_rise_over_the_bracket() -> None:
    lrs = [1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3]
    centre = math.log(3e-4)

    def profile(lr: float) -> float:
        return 5.0 - 2.0 * (math.log(lr) - centre) ** 2

    values = {lr: profile(lr) for lr in lrs}
    chosen = 4e-4  # the best tried rate
    assert max(lrs, key=values.__getitem__) == chosen
    # a quadratic in log lr is fitted exactly: the gap is its peak (inside the bracket)
    # minus its value at the choice
    assert residual_gap(lrs, values, chosen) == pytest.approx(5.0 - profile(chosen), rel=1e-9)
    # the fit's peak outside the bracket only counts up to the bracket's edge
    values = {lr: 5.0 - 2.0 * (math.log(lr) - math.log(1.9e-4)) ** 2 for lr in lrs}
    gap = residual_gap(lrs, values, 4e-4)
    assert gap == pytest.approx(values[2e-4] - values[4e-4], rel=1e-9)
    # at the optimum the gap is zero; too few finite rates: not measurable
    values = {lr: -((math.log(lr) - math.log(4e-4)) ** 2) for lr in lrs}
    assert residual_gap(lrs, values, 4e-4) == pytest.approx(0.0, abs=1e-12)
    assert residual_gap(lrs[:2], values, 2e-4) is None
    # a flat profile has no gap, not the fit's rounding
    assert residual_gap(lrs, dict.fromkeys(lrs, -3.0), 4e-4) == 0.0
    values[2e-4] = values[4e-4] = values[1.6e-3] = -math.inf  # e.g. a target not reached
    assert residual_gap(lrs, values, 8e-4) is None
    # noisy means: the gap is never negative
    rng = np.random.default_rng(0)
    for _ in range(50):
        noisy = {lr: float(rng.normal()) for lr in lrs}
        best = max(lrs, key=noisy.__getitem__)
        gap = residual_gap(lrs, noisy, best)
        assert gap is not None and gap >= 0


def test_a_difference_counts_only_past_both_gaps() -> None:
    assert verdict(0.05, 0.3, 0.0) == "ahead"
    assert verdict(0.05, 0.3, 0.05) == "level"  # clears zero, not the margin
    assert verdict(0.051, 0.3, 0.05) == "ahead"
    assert verdict(-0.3, -0.2, 0.1) == "behind"
    assert verdict(-0.3, -0.05, 0.1) == "level"
    assert verdict(None, None, 0.0) == "level"


def _race(task, out, **overrides):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradest race --tune")
        return tuned_race(task, SPECS, out=out, **{**SETTINGS, **overrides})


def test_the_race_refines_every_choice_and_reuses_every_shard(tmp_path, counted_runs) -> None:
    out = tmp_path / "race"
    coarse = _race(QuadraticTask(), out, bracket_ratio=None)
    # unrefined: the grid's 4x steps leave choices the report will not quote
    assert any("not bracketed at 1.26x" in note for note in coarse.grid_warnings())
    assert "(not refined)" in coarse.to_markdown()
    counted_runs.clear()
    refined = _race(QuadraticTask(), out)
    assert not any("bracketed" in note for note in refined.grid_warnings())
    for spec in SPECS:
        tried = refined.tried_lrs(spec)
        choice = refined.choices()[spec]
        assert choice["unbracketed"] == [] and choice["wanted"] == []
        for lr in {*choice["by_fraction"], choice["primary"]}:
            below, above = bracket(tried, lr)
            for neighbour in (below, above):
                assert neighbour is not None
                ratio = max(lr, neighbour) / min(lr, neighbour)
                # bracketed, or flat there (a tie: nothing to refine)
                means = refined.summary()["tuning"][spec]["per_lr"]
                assert ratio <= BRACKET_RATIO or _tie(means, lr, neighbour)
        # the grid's tuning runs were reused: only new rates (and report runs) ran
    tuning_runs = [run for run in counted_runs if run[2] in (0, 1)]
    assert tuning_runs and not [run for run in tuning_runs if run[1] in SETTINGS["lrs"]]
    assert len(tuning_runs) == len(set(tuning_runs))
    # the page says how finely, and every gap is quoted beside its difference
    page = refined.to_markdown()
    assert "(refined until bracketed at 1.26x)" in page
    assert "margin" in page and "residual tuning gap per budget" in page
    counted_runs.clear()
    again = _race(QuadraticTask(), out)
    assert counted_runs == []  # everything is a shard already
    assert again.summary() == refined.summary()


def _tie(means, lr, neighbour) -> bool:
    from gradest_lab.race.shards import lr_label

    values = [means[lr_label(x)]["reward_by_fraction"] for x in (lr, neighbour)]
    return values[0] == values[1]


@pytest.mark.parametrize("ratio", [1.0, 1.05, 5, True, "1.26", math.nan])
def test_a_bracket_ratio_out_of_bounds_is_refused_before_any_run(
    tmp_path, counted_runs, ratio
) -> None:
    with pytest.raises(InvalidValue, match="bracket_ratio"):
        _race(QuadraticTask(), tmp_path / "race", bracket_ratio=ratio)
    assert counted_runs == []
