"""docs/extending.md's minimal plugin, installed from the page itself and checked.

The plugin's two blocks (the module and its entry-point table) are copied out of the page,
written as a distribution (a module and its ``.dist-info`` with ``entry_points.txt``, what
pip installs) on ``sys.path``, and found through the registry like any installed plugin;
``gradest check`` must pass on it. The page's concept list is counted too (the aim of
issue #30: at most five).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import gradest
from gradest import registry
from gradest.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
SECTION = "## The minimal plugin"


def minimal_section() -> str:
    """The page's minimal-plugin section (up to the next ``## `` heading)."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else None]


def fenced(section: str, language: str) -> list[str]:
    """The bodies of the section's code blocks in ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.S | re.M)


@pytest.fixture
def installed_minimal_plugin(tmp_path, monkeypatch):
    """The page's plugin installed as distribution ``gradest-last-step``; its name."""
    section = minimal_section()
    (code,) = fenced(section, "python")
    (table,) = fenced(section, "toml")
    entries = tomllib.loads(table)["project"]["entry-points"]["gradest.estimators"]
    ((name, target),) = entries.items()
    module = target.partition(":")[0]
    (tmp_path / f"{module}.py").write_text(code)
    dist_info = tmp_path / "gradest_last_step-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gradest-last-step\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[gradest.estimators]\n{name} = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.clear_cache()
    yield name
    registry.clear_cache()


def test_the_minimal_plugin_is_found_and_passes_gradest_check(installed_minimal_plugin, capsys):
    name = installed_minimal_plugin
    est = gradest.estimator(name)
    assert type(est).__module__ == "gradest_last_step"
    assert not registry.is_builtin(est)
    # Derived from the one hook written: terminal objectives only.
    assert type(est).objectives == ("terminal",)
    assert main(["check", "--estimators", name, "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = lines[lines.index(name) + 1].split()
    # The derived defaults at work: decisions ok (none recorded, none expected), the
    # definition, the estimate from the noise and the surrogate all compared, nothing n/a.
    assert row[:2] == ["terminal", "ok"]
    assert "n/a" not in row and "FAIL:" not in out
    assert "all estimators make the decisions and match the definitions they define" in out


def test_the_minimal_plugin_uses_the_host_side_accessors():
    (code,) = fenced(minimal_section(), "python")
    assert "ctx.host_coefficients" in code and "ctx.host_times" in code
    # Device tensors read per step would synchronise with the device.
    assert "ctx.coefficients" not in code and "ctx.times[" not in code


def test_the_page_lists_at_most_five_concepts():
    section = minimal_section()
    intro = section.index("It needs five concepts:")
    items = re.findall(r"^(\d+)\. \*\*", section[intro:], flags=re.M)
    assert items == [str(n) for n in range(1, len(items) + 1)]
    assert len(items) == 5
