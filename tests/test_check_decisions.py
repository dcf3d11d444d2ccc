"""``gradest check`` verifies decisions, not only arithmetic.

The check re-derives every built-in estimator's decisions (node placement, gate
outcomes from the reference's own velocities, scale factors and weights, replayed random
draws) and evaluates the definition at those. Each test here plants one bug in an
estimator, in its decisions, its arithmetic or both at once (so the estimate still matches
its own reported decisions, which the old check accepted), and asserts that the check fails.
"""

from __future__ import annotations

import attrs
import pytest

from gradest import check
from gradest.strategies import jagg, sdo, telescope, truncated
from gradest.strategies.jagg_layout import Group

STEPS = 8


def failing_rows(capsys) -> list[str]:
    """The lines that say what failed, one below each failing row."""
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("    FAIL: ")]


def test_the_unmutated_estimators_pass(capsys):
    assert check.run_check(steps=STEPS, show_progress=False)
    assert not failing_rows(capsys)


def test_a_moved_node_fails(monkeypatch, capsys):
    layout = jagg.layout_groups

    def moved(num_steps, window, order, shared_knots):
        first, *rest = layout(num_steps, window, order, shared_knots)
        # The first group's last node one step early: a consistent but wrong layout.
        return (Group(first.steps, (first.nodes[0], first.nodes[-1] - 1)), *rest)

    monkeypatch.setattr(jagg, "layout_groups", moved)
    assert not check.run_check(["jagg:gate=off"], steps=STEPS, show_progress=False)
    rows = failing_rows(capsys)
    assert len(rows) == 2 and all("FAIL: nodes=" in row for row in rows)


def test_a_wrong_gate_fails(monkeypatch, capsys):
    # A gate that always passes: the dense velocities fail every group at tau = 1.
    monkeypatch.setattr(
        jagg, "gate_cosines", lambda groups, *args: [None if g.is_exact else 1.0 for g in groups]
    )
    assert not check.run_check(["jagg:tau=1.0"], steps=STEPS, show_progress=False)
    assert all("fallback_groups=()" in row for row in failing_rows(capsys))


@pytest.mark.parametrize("recorded", [True, False], ids=["factor-reported", "factor-hidden"])
def test_a_wrong_sdo_factor_fails(monkeypatch, capsys, recorded):
    # (N-1)/m instead of N/m, applied to the estimate; reported or not in the decisions.
    draw = sdo.ShortcutDiffusion._draw

    def wrong(self, ctx):
        steps, factor = draw(self, ctx)
        off = factor * (ctx.num_steps - 1) / ctx.num_steps
        if recorded:
            ctx.decide(attrs.evolve(ctx.decisions, scale=off))
        return steps, off

    monkeypatch.setattr(sdo.ShortcutDiffusion, "_draw", wrong)
    assert not check.run_check(["sdo:samples=2"], steps=STEPS, show_progress=False)
    rows = failing_rows(capsys)
    assert len(rows) == 2
    assert all(("FAIL: scale=" in row) == recorded for row in rows)


def test_a_draw_from_the_wrong_distribution_fails(monkeypatch, capsys):
    # Uniform truncation that always keeps the largest k it may: consistent, not uniform.
    monkeypatch.setattr(truncated, "draw_uniform_int", lambda low, high, generator: high)
    assert not check.run_check(["truncated:random=uniform"], steps=STEPS, show_progress=False)
    assert all("FAIL: k=8" in row for row in failing_rows(capsys))


def test_a_wrong_survival_law_fails(monkeypatch, capsys):
    # telescope weights from a law with a different mean depth than its option says.
    law = telescope.survival_probabilities
    monkeypatch.setattr(
        telescope,
        "survival_probabilities",
        lambda steps, mean, minimum: law(steps, mean + 1.0, minimum),
    )
    assert not check.run_check(["telescope:mean_depth=6"], steps=STEPS, show_progress=False)
    assert len(failing_rows(capsys)) == 2


def test_a_plugin_without_expected_decisions_is_reported_not_failed(monkeypatch, capsys):
    class Unverified(jagg.Jagg):
        def expected_decisions(self, chain, objective, generator):
            raise NotImplementedError

    monkeypatch.setattr(check, "estimator", lambda spec: Unverified())
    assert check.run_check(["jagg"], steps=STEPS, show_progress=False)
    lines = capsys.readouterr().out.splitlines()
    # Under its spec's line, one row per objective kind; the decisions column says n/a.
    start = lines.index("jagg") + 1
    rows = [line.split() for line in lines[start : start + 2]]
    assert [row[0] for row in rows] == ["terminal", "stepwise"]
    assert all(row[1] == "n/a" for row in rows)
