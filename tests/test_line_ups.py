"""The commands' default estimators come from the registry: no command pins a list.

``gradest check``'s pinned configurations, ``gradest compare``'s and ``gradest cost``'s
default line-ups are each estimator class's ``check_specs`` / ``compare_specs`` /
``cost_specs`` (:func:`gradest.registry.line_up`). An estimator added to the registry
joins all three without any other file changing; a list written back into a command
would leave it out and fail here.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
from gradest_lab.compare.command import compare_line_up
from gradest_lab.cost import command as cost_command

from gradest import check, entry_points, registry
from gradest.base import EstimatorBase
from gradest.options import option


@attrs.frozen
class NewBuiltin(EstimatorBase):
    """A stand-in for a newly added built-in estimator (exact's gradient, scaled)."""

    name: ClassVar[str] = "newbuiltin"
    check_specs: ClassVar[tuple[str, ...]] = ("newbuiltin:factor=2",)
    compare_specs: ClassVar[tuple[str, ...]] = ("newbuiltin", "newbuiltin:factor=0.5")
    cost_specs: ClassVar[tuple[str, ...]] = ("newbuiltin:factor=3",)

    factor: float = option(1.0, kind=float, doc="scale of exact's gradient")


@pytest.fixture
def with_new_builtin(monkeypatch):
    """The registry as if gradest's own entry points held ``newbuiltin`` too."""
    real = registry._loaded()
    loaded = entry_points.Loaded(
        {**real.objects, "newbuiltin": NewBuiltin},
        {**real.sources, "newbuiltin": entry_points.OWN_DISTRIBUTION},
    )
    monkeypatch.setattr(registry, "_loaded", lambda: loaded)


def test_a_new_builtin_joins_every_default_line_up(with_new_builtin):
    assert "newbuiltin" in check.default_specs(8)
    assert "newbuiltin:factor=2" in check.default_specs(8)
    assert {"newbuiltin", "newbuiltin:factor=0.5"} <= set(compare_line_up())
    assert "newbuiltin:factor=3" in cost_command.default_estimators()


def test_the_commands_defaults_are_the_registrys_line_ups():
    steps = 8
    pinned = [spec.format(N=steps) for spec in registry.line_up("check")]
    assert check.default_specs(steps) == [
        spec
        for spec in sorted(registry.available_estimators()) + pinned
        if check._runs_at(spec, steps)
    ]
    assert compare_line_up() == registry.line_up("compare")
    assert cost_command.default_estimators() == registry.line_up("cost")
    # The reference first: an estimator whose every estimate is exact.
    assert compare_line_up()[0] == "exact" and cost_command.default_estimators()[0] == "exact"


@pytest.mark.parametrize("command", sorted(registry.LINE_UPS))
def test_every_line_up_entry_is_its_own_estimators_and_builds(command):
    attribute, _ = registry.LINE_UPS[command]
    entries = registry.line_up(command)
    assert entries, command
    assert len(entries) == len(set(entries)), entries  # a subclass repeats no base's
    for name, cls in registry.builtin_estimators().items():
        for spec in vars(cls).get(attribute, ()):
            assert registry.parse_spec(spec)[0] == name, (name, spec)
            registry.estimator(spec.format(N=8))  # a valid spec of a real option


def test_plugins_join_the_check_but_not_compare_or_cost(monkeypatch):
    real = registry._loaded()
    loaded = entry_points.Loaded(
        {**real.objects, "newbuiltin": NewBuiltin},
        {**real.sources, "newbuiltin": "gradest-some-plugin"},
    )
    monkeypatch.setattr(registry, "_loaded", lambda: loaded)
    assert "newbuiltin:factor=2" in registry.line_up("check")
    assert not any(s.startswith("newbuiltin") for s in registry.line_up("compare"))
    assert not any(s.startswith("newbuiltin") for s in registry.line_up("cost"))
