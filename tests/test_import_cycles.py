"""No import cycles, in the library, the lab or either application, read from the source.

Each package's modules are found by walking its folder and parsed with :mod:`ast`. Every
import (module level, in classes, inside functions, and under ``if TYPE_CHECKING:`` too)
becomes an edge to the module it executes, restricted to the package's own modules. A
cycle fails the test, named module by module.

How an import is resolved, and why:

* ``import a.b.c`` and ``from a.b.c import name`` run ``a.b.c``; ``from a.b import c``
  runs ``a.b.c`` when ``c`` is a submodule, else ``a.b`` (the name comes from its
  namespace); relative imports are resolved against the importer's package.
* Importing ``a.b.c`` also runs the packages above it (``a/b/__init__.py``), and those
  are edges too, except the packages above the importer itself: Python initialises them
  before the importer, so reaching a sibling through the package path (``from pkg
  import other``, ``import pkg.other``) is an edge to ``pkg.other`` only. That is why
  ``pkg/__init__.py`` re-exporting ``pkg.sub`` while ``pkg.sub`` imports ``pkg.other`` is
  no cycle. Reading a *name* from a package (``from pkg import name``) is an edge to its
  ``__init__``: in ``pkg.sub``, for a name the ``__init__`` re-exports from ``pkg.sub``,
  that is a cycle (the ``__init__``'s namespace is not filled yet when ``pkg.sub`` runs).
* Function-level imports count: a cycle hidden in a function still means neither module
  can be understood, tested or moved without the other. So do imports for annotations only
  (``if TYPE_CHECKING:``): two modules whose types name each other are one module in two
  files.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "gradest": Path(gradest.__file__).resolve().parent,
    "gradest_lab": ROOT / "lab" / "gradest_lab",
    "gradest_digits": ROOT / "apps" / "digits" / "gradest_digits",
    "gradest_recipes": ROOT / "apps" / "recipes" / "gradest_recipes",
}
# What ``import gradest`` and the command line's help and listing must not load: FSDP
# (about 600 modules with what it pulls in, for a check that only matters once a model
# is sharded), the optional heavy dependencies, imported where they are used, torch's FLOP
# counter (only measuring needs it) and the lab (a distribution beside the library).
HEAVY = ("torch.distributed.fsdp", "diffusers", "matplotlib", "torch.utils.flop_counter")
# What ``import gradest`` alone must not load besides: the measuring tools and the lab.
NOT_ON_IMPORT = ("gradest.harness", "gradest_lab")


def package_modules(folder: Path) -> dict[str, Path]:
    """Every module of the package in ``folder`` by dotted name (``pkg/__init__.py`` is
    ``pkg``)."""
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(name: str, path: Path) -> list[tuple[str, int]]:
    """``(dotted name, line)`` for every import in the file (``TYPE_CHECKING`` ones too),
    with ``from a import b`` written ``a.b`` (resolved to a module or its parent later)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = parts[: len(parts) - (child.level - 1)]
                    module = ".".join([*base, *([module] if module else [])])
                for alias in child.names:
                    found.append((f"{module}.{alias.name}", child.lineno))
            walk(child)

    walk(ast.parse(path.read_text(), filename=str(path)))
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(folder: Path) -> dict[str, dict[str, int]]:
    """``{importer: {imported module: line}}`` for the package in ``folder``, restricted
    to its own modules (resolved as the module docstring says)."""
    modules = package_modules(folder)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        above = set(_ancestors(name)) | {name}
        for dotted, line in _imported_names(name, path):
            # The longest prefix that is a module: ``a.b.c`` if it is one (a submodule, or
            # ``import a.b.c``), else ``a.b`` (a name from its namespace).
            parts = dotted.split(".")
            target = next(
                (
                    ".".join(parts[:i])
                    for i in range(len(parts), 0, -1)
                    if ".".join(parts[:i]) in modules
                ),
                None,
            )
            if target is None:
                continue  # another distribution's module
            for module in [*_ancestors(target), target]:
                # A module importing itself, or a package above it (already initialising
                # when this module runs, except for a name read from its namespace: the
                # target itself), is no edge.
                if module == name or (module in above and module != target):
                    continue
                graph[name].setdefault(module, line)
    return graph


def knots(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module: the modules that
    import one another, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)

    return [component for component in components if len(component) > 1]


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per :func:`knots` component, each as ``[a, b, ..., a]``
    starting at the component's first module by name."""
    cycles = []
    for component in knots(graph):
        start = min(component)
        # Breadth-first inside the component: the shortest way back to ``start``.
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            following = []
            for node in frontier:
                for succ in sorted(graph[node]):
                    if succ in component and succ not in parent:
                        parent[succ] = node
                        following.append(succ)
            frontier = following
        path = [start]
        node = parent[start]
        while node != start:
            path.append(node)
            node = parent[node]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``a (line 12) -> b (line 30) -> a``: the cycle with the line of each import."""
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([*hops, cycle[-1]])


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package):
    graph = import_graph(PACKAGES[package])
    assert len(graph) > 5, f"the walk found only {sorted(graph)} in {PACKAGES[package]}"
    cycles = [describe(cycle, graph) for cycle in find_cycles(graph)]
    tangled = [", ".join(sorted(knot)) for knot in sorted(knots(graph), key=min)]
    assert not cycles, (
        "import cycles:\n"
        + "\n".join(cycles)
        + "\nmodules that import one another:\n"
        + "\n".join(tangled)
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    """The shape this test was written for: two modules that import each other, one of
    them only inside a function."""
    folder = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.samplers import Grid\n",
            "pkg/samplers.py": """
                class Grid:
                    @classmethod
                    def build(cls):
                        from pkg.convert import build
                        return build(cls)
            """,
            "pkg/convert.py": "from .samplers import Grid\n\ndef build(cls): ...\n",
        },
    )
    graph = import_graph(folder)
    assert knots(graph) == [{"pkg.convert", "pkg.samplers"}]
    assert find_cycles(graph) == [["pkg.convert", "pkg.samplers", "pkg.convert"]]
    assert describe(find_cycles(graph)[0], graph) == (
        "pkg.convert (line 1) -> pkg.samplers (line 5) -> pkg.convert"
    )


def test_the_package_layout_is_no_cycle_but_reading_the_init_is(tmp_path):
    """``pkg/__init__.py`` re-exporting its submodules, which import their siblings
    through the package path (``from pkg import other``, ``import pkg.other``,
    ``from . import other``), is the normal layout; a submodule reading a name from the
    ``__init__`` that the ``__init__`` re-exports from it is a cycle."""
    files = {
        "pkg/__init__.py": "from pkg.sub import thing\nfrom pkg.other import helper\n",
        "pkg/sub.py": """
            import pkg.other
            from pkg import other
            from . import other as again
            from .other import helper

            thing = 1
        """,
        "pkg/other.py": "helper = 2\n",
        "pkg/deep/__init__.py": "",
        "pkg/deep/leaf.py": "from pkg.other import helper\nfrom ..other import helper\n",
    }
    graph = import_graph(_write(tmp_path / "fine", files))
    assert graph["pkg"] == {"pkg.sub": 1, "pkg.other": 2}
    assert graph["pkg.sub"] == {"pkg.other": 2}
    assert graph["pkg.deep.leaf"] == {"pkg.other": 1}
    assert find_cycles(graph) == []

    reading = {**files, "pkg/other.py": "def helper():\n    from pkg import thing\n"}
    graph = import_graph(_write(tmp_path / "cycle", reading))
    assert find_cycles(graph) == [["pkg", "pkg.other", "pkg"]]


def test_what_the_walk_resolves(tmp_path):
    """Relative imports at any depth, a package above the target that the importer is
    not inside (it runs first), ``TYPE_CHECKING`` blocks (edges like any other) and other
    distributions (left out)."""
    folder = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": """
                from typing import TYPE_CHECKING

                import torch
                from pkg.inner.b import x

                if TYPE_CHECKING:
                    from pkg import c
                else:
                    from . import d

                def later():
                    from .inner import b
            """,
            "pkg/c.py": "",
            "pkg/d.py": "",
            "pkg/inner/__init__.py": "",
            "pkg/inner/b.py": "from .. import c\nfrom ..inner import b\nx = 1\n",
        },
    )
    graph = import_graph(folder)
    assert graph["pkg.a"] == {"pkg.inner": 5, "pkg.inner.b": 5, "pkg.c": 8, "pkg.d": 10}
    assert graph["pkg.inner.b"] == {"pkg.c": 1}
    assert find_cycles(graph) == []


# ``import gradest`` and the command line's cheap subcommands, in a fresh interpreter:
# which heavy modules are loaded when the interpreter exits.
LOADED_AT_EXIT = """
import atexit
import sys

HEAVY = {heavy!r}


def report():
    loaded = sorted(m for m in sys.modules if m.startswith(HEAVY))
    sys.__stdout__.write("HEAVY-LOADED " + repr(loaded) + "\\n")


atexit.register(report)
sys.argv = {argv!r}
{run}
"""


@pytest.mark.parametrize(
    "argv, run, heavy",
    [
        (["python"], "import gradest", HEAVY + NOT_ON_IMPORT),
        (["gradest", "--help"], "from gradest.cli import main; main()", HEAVY),
        (["gradest", "list"], "from gradest.cli import main; sys.exit(main())", HEAVY),
        (
            ["python -m gradest", "--help"],
            "import runpy; runpy.run_module('gradest', run_name='__main__')",
            HEAVY,
        ),
    ],
    ids=["import gradest", "gradest --help", "gradest list", "python -m gradest --help"],
)
def test_no_heavy_imports(argv, run, heavy):
    script = LOADED_AT_EXIT.format(heavy=heavy, argv=argv, run=run)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("HEAVY-LOADED ")]
    assert lines == ["HEAVY-LOADED []"], (lines, done.stderr[-3000:])
