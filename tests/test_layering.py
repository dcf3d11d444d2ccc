"""The import direction (docs/design.md "Import direction"), read from the source.

Every module of the ``gradest`` package is found by walking the package folder (nothing
is listed by hand) and parsed with :mod:`ast`; its imports at any depth (module level, in
classes, inside functions, under ``if TYPE_CHECKING:``) are resolved to absolute module
names. Checked:

* the library never imports the lab (``gradest_lab``), an application
  (``gradest_digits``, ``gradest_recipes``) or their own dependencies, not even lazily
  inside a function;
* an optional dependency of the library is imported only where it is used (inside a
  function), never at module level, so ``import gradest`` needs only the core
  dependencies;
* the core (everything but the public namespaces ``gradest`` and ``gradest.plugin``,
  which only gather names, and the outer layers: the command line, ``gradest check``,
  the harness, the integrations and ``gradest.testing``) never imports an outer layer,
  without exception;
* ``gradest.reference`` never imports the VJP engine or the strategies (the ground truth
  stays independent of the code it checks); the samplers, the trajectory and the
  objectives never import an estimator;
* and, run in a fresh interpreter that cannot import any optional dependency or
  application, ``import gradest``, ``gradest --help`` and ``gradest list`` work.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gradest

PACKAGE = Path(gradest.__file__).resolve().parent
APPLICATIONS = ("gradest_lab", "gradest_digits", "gradest_recipes")
# Dependencies of the applications only (apps/*/pyproject.toml), never of the library.
APPLICATION_DEPENDENCIES = ("sklearn", "torch_fidelity", "torchvision", "tensorboard", "wandb")
# The library's optional dependencies (pyproject.toml's extras); tqdm, numpy, attrs and
# torch are required.
OPTIONAL = ("diffusers", "peft", "accelerate", "matplotlib", "scipy", "transformers")
# The outer layers, built on the core: nothing in the core imports them (but LEAVES).
OUTER = (
    "gradest.__main__",  # python -m gradest: the command line
    "gradest.cli",
    "gradest.check",
    "gradest.commands",
    "gradest.harness",
    "gradest.integrations",
    "gradest.testing",
)
# The public namespaces: they gather names from the core and the outer layers alike.
FACADES = ("gradest", "gradest.plugin")
# The rules of docs/design.md inside the core: importer prefix -> forbidden prefixes.
INSIDE_THE_CORE = {
    "gradest.reference": ("gradest.vjp", "gradest.strategies", "gradest.base", "gradest.context"),
    **{
        module: ("gradest.strategies", "gradest.base", "gradest.registry", "gradest.vjp")
        for module in (
            "gradest.samplers",
            "gradest.diffusion_samplers",
            "gradest.trajectory",
            "gradest.objectives",
        )
    },
}


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def imports(name: str, path: Path) -> Iterator[tuple[str, bool, int]]:
    """``(imported module, at module level, line)`` for every import in the file.

    ``from a import b`` yields ``a.b`` where that is a module of the package, else ``a``;
    relative imports are resolved; imports under ``if TYPE_CHECKING:`` count like any other
    (an annotation names the layer it depends on).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[str, bool, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from ((alias.name, top, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    module = ".".join([*base, *([module] if module else [])])
                for alias in child.names:
                    full = f"{module}.{alias.name}"
                    yield (full if full in MODULES else module), top, child.lineno
            inner = top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text(), filename=str(path)), True)


def _names(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offenders(rule) -> list[str]:
    """``"path:line: module"`` for every import for which ``rule(importer, module, top)``."""
    found = []
    for name, path in MODULES.items():
        for module, top, line in imports(name, path):
            if rule(name, module, top):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module}")
    return found


def test_the_walk_finds_the_package():
    assert {"gradest", "gradest.base", "gradest.cli", "gradest.reference.dense"} <= set(MODULES)
    assert any(name.startswith("gradest.strategies.") for name in MODULES)
    assert len(MODULES) > 40


def test_the_library_never_imports_an_application_or_its_dependencies():
    forbidden = APPLICATIONS + APPLICATION_DEPENDENCIES
    assert not offenders(lambda name, module, top: _names(module, forbidden))


def test_optional_dependencies_are_imported_where_used():
    assert not offenders(lambda name, module, top: top and _names(module, OPTIONAL))


def test_the_core_never_imports_an_outer_layer():
    def rule(name: str, module: str, top: bool) -> bool:
        core = name not in FACADES and not _names(name, OUTER)
        return core and _names(module, OUTER)

    assert not offenders(rule)


@pytest.mark.parametrize("importer", sorted(INSIDE_THE_CORE))
def test_the_layers_inside_the_core(importer):
    forbidden = INSIDE_THE_CORE[importer]
    assert not offenders(
        lambda name, module, top: _names(name, (importer,)) and _names(module, forbidden)
    )


def test_the_rules_see_imports_at_every_depth(tmp_path):
    """The walk finds an import inside a function (and relative ones), so the rules
    above would catch a lazy import; module-level status is reported right."""
    source = textwrap.dedent(
        """
        import torch
        from .samplers import RectifiedFlow
        from gradest import registry

        def later():
            import diffusers
            from . import vjp

        if TYPE_CHECKING:
            import scipy
        """
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = {(module, top) for module, top, _ in imports("gradest.probe", path)}
    assert found == {
        ("torch", True),
        ("gradest.samplers", True),
        ("gradest.registry", True),
        ("diffusers", False),
        ("gradest.vjp", False),
        ("scipy", True),
    }


BLOCKED_RUN = """
import importlib.abc
import sys

BLOCKED = {blocked!r}


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked in this test")
        return None


sys.meta_path.insert(0, Blocked())
import gradest
import gradest.cli

gradest.cli.build_parser()
assert gradest.cli.main(["list"]) == 0
try:
    gradest.cli.main(["--help"])
except SystemExit as done:
    assert done.code == 0, done.code
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not loaded, loaded
print("LAYERING-OK")
"""


def test_gradest_and_its_cli_work_without_optional_dependencies_or_applications():
    blocked = set(OPTIONAL + APPLICATIONS + APPLICATION_DEPENDENCIES)
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN.format(blocked=blocked)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LAYERING-OK" in done.stdout
    assert "usage: gradest" in done.stdout and "exact" in done.stdout
