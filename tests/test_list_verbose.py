"""Each estimator's axes and memory policy (``axes``), ``gradest list --verbose``, and the
one name of the memory option (``checkpoint``)."""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import attrs
import pytest

import gradest
from gradest import entry_points as entry_point_loader
from gradest import registry
from gradest.axes import COST_FORMULAS, NOT_DECLARED, EstimatorAxes, axes_of
from gradest.base import EstimatorBase
from gradest.cli import main
from gradest.options import bool_option
from gradest.strategies.jagg import Jagg

ROOT = Path(__file__).resolve().parents[1]


def _run_list(capsys, *flags: str) -> str:
    assert main(["list", *flags]) == 0
    return capsys.readouterr().out


def _blocks(out: str) -> dict[str, str]:
    """name -> that estimator's lines of ``gradest list`` output."""
    blocks: dict[str, str] = {}
    name = None
    for line in out.splitlines():
        head = re.match(r"^(\w+): ", line)
        if head:
            name = head.group(1)
            blocks[name] = ""
        assert name is not None
        blocks[name] += line + "\n"
    return blocks


def test_every_builtin_declares_its_axes_and_points_at_the_cost_formulas():
    builtins = registry.builtin_estimators()
    assert set(builtins) == {
        "exact", "jagg", "sdo", "drtune", "truncated", "telescope", "draft_lv", "refl",
        "alignprop", "adjoint",
    }  # fmt: skip
    for name, cls in builtins.items():
        axes = axes_of(cls)
        assert isinstance(axes, EstimatorAxes), name
        assert axes.cotangents and axes.evaluation and axes.memory, name
        assert axes.cost == COST_FORMULAS == "docs/design.md#cost-formulas"
    # The link's target: the one place where cost formulas are written.
    assert "\n### Cost formulas\n" in (ROOT / "docs" / "design.md").read_text()


@pytest.mark.parametrize("flag", ["--verbose", "-v"])
def test_list_verbose_prints_each_builtins_axes(capsys, flag):
    blocks = _blocks(_run_list(capsys, flag))
    for name, cls in registry.builtin_estimators().items():
        block = blocks[name]
        for field in ("cotangents", "evaluation", "memory", "cost"):
            assert f"  {field}: {getattr(cls.axes, field)}\n" in block, (name, field)
        # ... beside its options.
        for option, default, _ in registry.describe(name):
            assert f"    {option}={default!r}" in block


def test_plain_list_keeps_its_output(capsys):
    out = _run_list(capsys)
    assert "cotangents:" not in out and "memory:" not in out and "options:" not in out
    blocks = _blocks(out)
    assert blocks["exact"] == (
        "exact: Exact gradient: backpropagation through every sampling step.\n"
        "    checkpoint=False  recompute steps in reverse instead of keeping the chain's "
        "graph (O(1) memory, +N forwards)\n"
    )


@attrs.frozen
class UndeclaredEstimator(EstimatorBase):
    """A plugin that declares no axes."""

    name = "undeclared"
    checkpoint: bool = bool_option(False, doc="recompute")


def test_a_plugin_without_axes_still_works_and_lists_not_declared(capsys, monkeypatch):
    real = list(entry_points(group=registry.GROUP))
    plugin = EntryPoint(
        name="undeclared", value=f"{__name__}:UndeclaredEstimator", group=registry.GROUP
    )

    def with_plugin(group: str) -> list[EntryPoint]:
        return real + [plugin] if group == registry.GROUP else list(entry_points(group=group))

    monkeypatch.setattr(entry_point_loader, "entry_points", with_plugin)
    registry.clear_cache()
    try:
        assert gradest.estimator("undeclared:checkpoint=true").checkpoint is True
        blocks = _blocks(_run_list(capsys, "--verbose"))
        assert f"  axes: {NOT_DECLARED}\n" in blocks["undeclared"]
        assert "    checkpoint=False" in blocks["undeclared"]
    finally:
        registry.clear_cache()


# -- one name for the memory option --------------------------------------------------------


def test_checkpoint_is_the_memory_option_of_exact_and_jagg():
    assert "checkpoint" in registry.option_names(registry.available_estimators()["exact"])
    assert "checkpoint" in registry.option_names(Jagg)
    assert "low_memory" not in registry.option_names(Jagg)


@pytest.mark.parametrize("flag", [(), ("--verbose",)])
def test_list_shows_checkpoint_for_jagg_not_low_memory(capsys, flag):
    block = _blocks(_run_list(capsys, *flag))["jagg"]
    assert "    checkpoint=False" in block
    assert "low_memory" not in block
