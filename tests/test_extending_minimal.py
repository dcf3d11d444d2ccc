"""docs/extending.md's minimal plugin, as a user writes it: a folder, pip-installed, checked.

The page's two blocks are ``examples/minimal_plugin``'s two files (the test compares
them); that folder is installed with pip (``--target``, offline, from a copy: pip builds
in the source tree) and ``gradest check`` runs on it in a fresh interpreter that finds it
through its installed metadata, like any plugin. The names the page says the plugin uses
are counted from the folder's files, not written as a target.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
FOLDER = ROOT / "examples" / "minimal_plugin"
MODULE = FOLDER / "gradest_last_step.py"
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


def test_the_page_shows_the_folders_two_files():
    section = minimal_section()
    assert fenced(section, "python") == [MODULE.read_text()]
    assert fenced(section, "toml") == [(FOLDER / "pyproject.toml").read_text()]
    assert sorted(path.name for path in FOLDER.iterdir() if not path.name.startswith(".")) == [
        "gradest_last_step.py",
        "pyproject.toml",
    ]


def uses(module: Path, pyproject: Path) -> list[str]:
    """The names the plugin uses, read from its files: its entry-point groups, the names
    it imports from gradest, the methods it writes, and the members of ``ctx`` and
    ``chain`` it reads (each once, in order of appearance)."""
    table = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    found = [group for group in table if group.startswith("gradest.")]
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradest"):
            found += [alias.name for alias in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found += [item.name for item in node.body if isinstance(item, ast.FunctionDef)]
    for owner in ("ctx", "chain"):
        reads = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == owner
        ]
        reads.sort(key=lambda node: (node.lineno, node.col_offset))
        found += [f"{owner}.{node.attr}" for node in reads]
    return list(dict.fromkeys(found))


def test_the_page_counts_the_names_the_example_uses():
    section = minimal_section()
    counted = uses(MODULE, FOLDER / "pyproject.toml")
    stated = re.search(r"it uses (\d+) names:", section)
    assert stated, "the page states how many names the example uses"
    assert int(stated.group(1)) == len(counted), (stated.group(1), counted)
    listing = section[stated.end() : section.index("What they do:")]
    for name in counted:
        bare = name.split(".", 1)[1] if name.startswith(("ctx.", "chain.")) else name
        assert f"`{bare}`" in listing, f"{name} is used but not listed on the page"


def test_the_count_follows_the_code(tmp_path):
    """A name added to the example is a name more (the count is not a target)."""
    module = tmp_path / "plugin.py"
    module.write_text(MODULE.read_text().replace("ctx.num_steps - 1", "ctx.num_steps - ctx.k"))
    before = uses(MODULE, FOLDER / "pyproject.toml")
    after = uses(module, FOLDER / "pyproject.toml")
    assert after == [
        *before[: before.index("ctx.num_steps") + 1],
        "ctx.k",
        *before[before.index("ctx.num_steps") + 1 :],
    ]


def test_the_minimal_plugin_uses_the_host_side_accessors():
    code = MODULE.read_text()
    assert "ctx.host_coefficients" in code and "ctx.host_times" in code
    # Device tensors read per step would synchronise with the device.
    assert "ctx.coefficients" not in code and "ctx.times[" not in code


def _require_offline_build_backend() -> None:
    """pip builds without isolation here (offline), with this environment's setuptools,
    which builds wheels by itself from 70.1 on (older ones need the wheel package)."""
    setuptools = pytest.importorskip("setuptools", reason="building a plugin needs setuptools")
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1):
        pytest.importorskip("wheel", reason="setuptools < 70.1 needs wheel to build wheels")


CHECK = """
import sys
from importlib.metadata import distribution

import gradest
from gradest.cli import main

est = gradest.estimator("laststep")
assert type(est).__module__ == "gradest_last_step", type(est).__module__
assert type(est).objectives == ("terminal",), type(est).objectives
assert distribution("gradest-last-step").entry_points.select(group="gradest.estimators")
sys.exit(main(["check", "--estimators", "laststep", "--quiet"]))
"""


@pytest.mark.slow
def test_the_folder_installs_with_pip_and_passes_gradest_check(tmp_path):
    _require_offline_build_backend()
    source = tmp_path / "src"
    shutil.copytree(FOLDER, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--target", str(site),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(path.name.startswith("gradest_last_step-") for path in site.iterdir())
    env = {key: value for key, value in os.environ.items() if key != "GRADEST_DISABLE_PLUGINS"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    row = lines[lines.index("laststep") + 1].split()
    # The derived defaults at work: decisions ok (none recorded, none expected), the
    # definition, the estimate from the noise and the surrogate all compared, nothing n/a.
    assert row[:2] == ["terminal", "ok"] and "n/a" not in row, row
    assert "FAIL:" not in done.stdout
    assert "all estimators make the decisions and match the definitions they define" in (
        done.stdout
    )
