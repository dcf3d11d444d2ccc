"""The estimator registry: entry points, broken plugins, names, options, spec strings."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points

import attrs
import pytest
import torch

import gradest
from gradest import entry_points as entry_point_loader
from gradest import registry
from gradest.base import EstimatorBase
from gradest.options import option
from gradest.registry import UnknownEstimatorError, parse_spec


@attrs.frozen
class PlantedEstimator(EstimatorBase):
    """A plugin defined in the test."""

    name = "planted"
    strength: float = option(1.0, kind=float, doc="how strong", valid=lambda x: x > 0, expect="> 0")


class _FakeDist:
    def __init__(self, name: str):
        self.name = name


def _entry(name: str, value: str, dist: str) -> EntryPoint:
    entry = EntryPoint(name=name, value=value, group=registry.GROUP)
    return entry._for(_FakeDist(dist))  # type: ignore[attr-defined]


@pytest.fixture
def fake_plugins(monkeypatch):
    """Install extra entry points next to the real ones, for one test."""

    def install(*extra: EntryPoint) -> None:
        real = list(entry_points(group=registry.GROUP))

        def with_extra(group: str) -> list[EntryPoint]:
            return (
                real + list(extra) if group == registry.GROUP else list(entry_points(group=group))
            )

        # The one loader (gradest.entry_points) reads importlib.metadata's entry points.
        monkeypatch.setattr(entry_point_loader, "entry_points", with_extra)
        registry.clear_cache()

    yield install
    registry.clear_cache()


def test_builtins_are_registered_through_entry_points():
    names = {e.name for e in entry_points(group="gradest.estimators") if e.dist.name == "gradest"}
    assert {"exact", "jagg", "sdo", "truncated"} <= names
    assert "exact" in gradest.available_estimators()


def test_a_plugin_is_used_by_name(fake_plugins):
    fake_plugins(_entry("planted", f"{__name__}:PlantedEstimator", "planted-dist"))
    est = gradest.estimator("planted:strength=2")
    assert isinstance(est, PlantedEstimator) and est.strength == 2.0
    assert "planted" in gradest.available_estimators()


def test_a_broken_plugin_warns_and_is_skipped(fake_plugins):
    fake_plugins(_entry("broken", "gradest_no_such_module:Thing", "broken-dist"))
    with pytest.warns(RuntimeWarning, match="broken.*broken-dist"):
        available = gradest.available_estimators()
    assert "broken" not in available and "exact" in available


def test_a_duplicate_plugin_warns_and_builtins_win(fake_plugins):
    fake_plugins(_entry("exact", f"{__name__}:PlantedEstimator", "shadow-dist"))
    with pytest.warns(RuntimeWarning, match="shadow-dist.*duplicate"):
        available = gradest.available_estimators()
    assert available["exact"].__name__ == "Exact"


def test_plugins_can_be_disabled_by_environment(fake_plugins, monkeypatch):
    fake_plugins(_entry("planted", f"{__name__}:PlantedEstimator", "planted-dist"))
    monkeypatch.setenv("GRADEST_DISABLE_PLUGINS", "1")
    assert "planted" not in gradest.available_estimators()
    assert "exact" in gradest.available_estimators()


def test_a_broken_plugin_never_breaks_import():
    # A fresh interpreter whose metadata lists a broken plugin must still import gradest.
    code = (
        "import importlib.metadata as md, warnings\n"
        "from importlib.metadata import EntryPoint\n"
        "real = md.entry_points\n"
        "def fake(group=None, **kw):\n"
        "    eps = real(group=group, **kw) if group is not None else real(**kw)\n"
        "    if group == 'gradest.estimators':\n"
        "        return list(eps) + [EntryPoint('broken', 'nope_module:X', group)]\n"
        "    return eps\n"
        "md.entry_points = fake\n"
        "import gradest\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    names = gradest.available_estimators()\n"
        "assert 'exact' in names and 'broken' not in names\n"
        "assert any('broken' in str(x.message) for x in w)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownEstimatorError, match=r"unknown estimator 'exakt'.*exact"):
        gradest.estimator("exakt")


def test_misspelled_option_lists_valid_options():
    with pytest.raises(TypeError, match=r"no option 'chekpoint'.*valid options: checkpoint"):
        gradest.estimator("exact", chekpoint=True)
    with pytest.raises(TypeError, match=r"no option 'chekpoint'"):
        gradest.estimator("exact:chekpoint=true")


def test_option_of_the_wrong_type_names_the_option():
    with pytest.raises(TypeError, match=r"checkpoint='yes'.*expected bool"):
        gradest.estimator("exact", checkpoint="yes")
    with pytest.raises(TypeError, match=r"checkpoint='maybe'"):
        gradest.estimator("exact:checkpoint=maybe")


def test_spec_strings_parse_and_keywords_override():
    assert parse_spec("jagg:window=4, tau=0.995") == ("jagg", {"window": "4", "tau": "0.995"})
    assert parse_spec("exact") == ("exact", {})
    assert gradest.estimator("exact:checkpoint=true", checkpoint=False).checkpoint is False
    with pytest.raises(ValueError, match="not key=value"):
        parse_spec("jagg:window")
    with pytest.raises(ValueError, match="non-empty"):
        gradest.estimator("")


@pytest.mark.parametrize(
    ("statement", "kind"),
    [
        ("raise SystemExit(3)", "SystemExit"),
        ("import sys; sys.exit('plugin says bye')", "SystemExit"),
        ("raise GeneratorExit()", "GeneratorExit"),
        ("raise RuntimeError('boom')", "RuntimeError"),
    ],
)
def test_a_plugin_failing_with_any_exception_is_isolated(
    statement, kind, fake_plugins, tmp_path, monkeypatch
):
    """Even SystemExit at a plugin's import is a warning naming the entry point; built-ins
    load and gradest keeps working (only KeyboardInterrupt propagates)."""
    module = f"gradest_test_plugin_{abs(hash(statement))}"
    (tmp_path / f"{module}.py").write_text(statement + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_plugins(_entry("exiting", f"{module}:Thing", "exiting-dist"))
    with pytest.warns(RuntimeWarning, match=rf"'exiting' from exiting-dist.*{kind}"):
        available = gradest.available_estimators()
    assert "exiting" not in available
    assert {"exact", "jagg", "sdo", "truncated"} <= set(available)
    gradest.estimator("exact")


def test_keyboard_interrupt_in_a_plugin_is_not_swallowed(fake_plugins, tmp_path, monkeypatch):
    (tmp_path / "gradest_test_interrupting.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_plugins(_entry("interrupting", "gradest_test_interrupting:Thing", "interrupting-dist"))
    with pytest.raises(KeyboardInterrupt):
        gradest.available_estimators()


def test_without_entry_points_there_are_no_builtins_and_the_error_says_why(monkeypatch):
    """The built-ins are read from the entry points only: a source checkout that is not
    pip-installed has none, and the error says to install it."""
    monkeypatch.setattr(entry_point_loader, "entry_points", lambda group: [])
    registry.clear_cache()
    try:
        assert gradest.available_estimators() == {}
        assert registry.builtin_estimators() == {}
        with pytest.raises(UnknownEstimatorError, match="pip install -e"):
            gradest.estimator("jagg")
    finally:
        registry.clear_cache()


def test_pyproject_entry_points_are_exactly_the_builtins():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["gradest.estimators"]
    loaded = {
        name: f"{cls.__module__}:{cls.__qualname__}"
        for name, cls in registry.builtin_estimators().items()
    }
    assert loaded == declared


class EstimateOnly:
    """A protocol-only class with one verb of the two."""

    name = "estimate_only"

    def estimate(self, model, sampler, objective, **inputs):
        return gradest.estimator("exact").estimate(model, sampler, objective, **inputs)


class BothVerbs(EstimateOnly):
    """The same, with the surrogate the protocol asks for, made from its estimate."""

    name = "both_verbs"

    def surrogate(self, model, sampler, objective, **inputs):
        from gradest.plugin import estimated_surrogate

        return estimated_surrogate(self, model, sampler, objective, **inputs)


def test_the_registry_accepts_what_the_protocol_declares(fake_plugins):
    """Both verbs of TrajectoryGradientEstimator: a plugin with one is refused, naming the
    missing verb and the fix; the same plugin with a surrogate made from its estimate is
    taken and trains with the estimate's gradient."""
    from gradest.plugin import VERBS, TrajectoryGradientEstimator

    assert set(VERBS) == {
        name
        for name, member in vars(TrajectoryGradientEstimator).items()
        if callable(member) and not name.startswith("_")
    }
    fake_plugins(
        _entry("estimate_only", f"{__name__}:EstimateOnly", "one-verb-dist"),
        _entry("both_verbs", f"{__name__}:BothVerbs", "two-verbs-dist"),
    )
    with pytest.warns(
        RuntimeWarning,
        match=r"'estimate_only' from one-verb-dist.* has no surrogate\(\) method: the protocol "
        r"has two verbs; .*gradest\.plugin\.estimated_surrogate",
    ):
        available = gradest.available_estimators()
    assert "estimate_only" not in available and "both_verbs" in available
    from gradest.testing import seeded_normal, smooth_terminal_objective, tiny_mlp

    model, sampler = tiny_mlp(3), gradest.RectifiedFlow(steps=4)
    objective, noise = smooth_terminal_objective(3), seeded_normal((2, 3), 0)
    est = gradest.estimator("both_verbs")
    sur = est.surrogate(model, sampler, objective, noise=noise)
    sur.loss.backward()
    result = est.estimate(model, sampler, objective, noise=noise)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, result.grads[name], rtol=1e-12, atol=0)
    assert sur.value == result.value and sur.cost == result.cost
