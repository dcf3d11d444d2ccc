"""Packaging: the version is written once, and every package ships its annotations.

The version lives in ``gradest/__init__.py`` (``__version__``); pyproject.toml declares it
dynamic and setuptools reads it from there statically (a plain string assignment, so a
build never imports gradest, nor torch). Each package of the library and of the
applications carries a ``py.typed`` marker (PEP 561) that its package data ships.
"""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import gradest

ROOT = Path(__file__).resolve().parents[1]
# (the folder holding pyproject.toml, the package) for the library and each application
DISTRIBUTIONS = [
    (ROOT, "gradest"),
    (ROOT / "apps/digits", "gradest_digits"),
    (ROOT / "apps/recipes", "gradest_recipes"),
]


def pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_pyproject_reads_the_version_from_gradest():
    config = pyproject(ROOT)
    assert "version" not in config["project"]
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradest.__version__"}


def test_the_version_is_a_literal_setuptools_reads_without_importing():
    tree = ast.parse((ROOT / "gradest" / "__init__.py").read_text())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(target, "id", None) for target in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    assert literals == [gradest.__version__]


def test_the_installed_version_is_gradest_version():
    try:
        installed = importlib.metadata.version("gradest")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gradest is imported from a folder, not installed")
    assert installed == gradest.__version__, (
        "the installed metadata is stale: reinstall gradest (python3 dev.py test does)"
    )


@pytest.mark.parametrize("folder, package", DISTRIBUTIONS, ids=[p for _, p in DISTRIBUTIONS])
def test_every_package_ships_py_typed(folder, package):
    assert (folder / package / "py.typed").is_file()
    package_data = pyproject(folder)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data[package]
