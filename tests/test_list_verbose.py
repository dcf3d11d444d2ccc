"""Each estimator's axes and memory policy (``axes``), ``gradest list --verbose``, and the
one name of the memory option (``checkpoint``; jagg's old ``low_memory`` warns)."""

from __future__ import annotations

import re
import warnings
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
from gradest.errors import GradestDeprecationWarning, InvalidType
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
        "alignprop", "auto",
    }  # fmt: skip
    for name, cls in builtins.items():
        axes = axes_of(cls)
        assert isinstance(axes, EstimatorAxes), name
        assert axes.cotangents and axes.evaluation and axes.memory, name
        assert axes.cost == COST_FORMULAS == "docs/design.md#cost-formulas"
    # The link's target: the one place where cost formulas are written.
    assert "\n### Cost formulas\n" in (ROOT / "docs" / "design.md").read_text()
    assert "chooses among candidates" in builtins["auto"].axes.evaluation


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
    assert Jagg.deprecated_options == {"low_memory": "checkpoint"}


@pytest.mark.parametrize("flag", [(), ("--verbose",)])
def test_list_shows_checkpoint_for_jagg_not_low_memory(capsys, flag):
    block = _blocks(_run_list(capsys, *flag))["jagg"]
    assert "    checkpoint=False" in block
    assert "low_memory" not in block


@pytest.mark.parametrize(
    "make",
    [
        lambda: gradest.estimator("jagg:low_memory=true,window=3"),
        lambda: gradest.estimator("jagg:window=3", low_memory=True),
        lambda: Jagg(window=3, low_memory=True),
    ],
    ids=["spec", "keyword", "constructor"],
)
def test_low_memory_warns_and_equals_checkpoint(make):
    with pytest.warns(
        GradestDeprecationWarning, match="'low_memory' is deprecated, use 'checkpoint'"
    ):
        old = make()
    assert (
        old == Jagg(window=3, checkpoint=True) == gradest.estimator("jagg:window=3,checkpoint=true")
    )
    assert hash(old) == hash(Jagg(window=3, checkpoint=True))


def test_the_deprecation_warning_points_at_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Jagg(low_memory=False)
        gradest.estimator("jagg", low_memory=False)
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name] * 2
    assert all(issubclass(w.category, DeprecationWarning) for w in caught)


def test_the_new_name_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gradest.estimator("jagg:checkpoint=true") == Jagg(checkpoint=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Jagg(low_memory=True, checkpoint=False),
        lambda: gradest.estimator("jagg:low_memory=true,checkpoint=false"),
        lambda: gradest.estimator("jagg", low_memory=True, checkpoint=True),
    ],
)
def test_old_and_new_name_together_are_refused(make):
    with pytest.raises(InvalidType, match="same option"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make()


def test_the_spec_string_old_name_and_a_keyword_new_name():
    # Keyword options override the string's, under the option's one (new) name.
    with pytest.warns(GradestDeprecationWarning):
        est = gradest.estimator("jagg:low_memory=true", checkpoint=False)
    assert est.checkpoint is False


def test_a_plugins_deprecated_options_are_honoured_by_the_registry(monkeypatch):
    @attrs.frozen
    class Renamed(EstimatorBase):
        name = "renamed"
        deprecated_options = {"old": "checkpoint"}
        checkpoint: bool = bool_option(False, doc="recompute")

    monkeypatch.setattr(registry, "available_estimators", lambda: {"renamed": Renamed})
    with pytest.warns(GradestDeprecationWarning, match="'old' is deprecated"):
        assert gradest.estimator("renamed:old=true") == Renamed(checkpoint=True)
