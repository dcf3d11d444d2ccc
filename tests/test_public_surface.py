"""The public API is a list of namespaces, each with its ``__all__``, all rendered in the
API reference; the lab and the applications use nothing else.

``PUBLIC`` names the public namespaces (docs/api.md lists the same). Checked:

* each namespace declares ``__all__``, and every name in it is there (``getattr``);
* every public name has an entry in the built API reference (an anchor
  ``id="<namespace>.<name>"`` on the namespace's page), and so does every accessor of the
  estimation context that docs/extending.md uses (``ctx.<name>``);
* the lab (``lab/gradest_lab``), the applications and the example plugin import only
  public names: every ``from gradest... import name``, ``import gradest...`` and
  attribute read through an imported gradest module (``gradest.registry.line_up``) is
  resolved and must name a public namespace and a name in its ``__all__``. The walk is
  tested on a file written to break it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The public namespaces, each with the API reference page that renders it.
PUBLIC = {
    "gradest": "api/gradest",
    "gradest.plugin": "api/plugin",
    "gradest.harness": "api/harness",
    "gradest.reference": "api/reference",
    "gradest.testing": "api/testing",
    "gradest.rl": "api/rl",
    "gradest.models": "api/models",
    "gradest.integrations": "api/integrations",
    "gradest.integrations.diffusers": "api/integrations",
    "gradest.integrations.guidance": "api/integrations",
    "gradest.integrations.pipelines": "api/integrations",
    "gradest.integrations.peft": "api/integrations",
    "gradest.integrations.distributed": "api/integrations",
}
# The code that must use the public API only: the lab, the applications, the example plugin.
CLIENTS = [
    ROOT / "lab" / "gradest_lab",
    ROOT / "apps" / "digits" / "gradest_digits",
    ROOT / "apps" / "recipes" / "gradest_recipes",
    ROOT / "examples",
]


def public_names(namespace: str) -> tuple[str, ...]:
    return tuple(importlib.import_module(namespace).__all__)


@pytest.mark.parametrize("namespace", sorted(PUBLIC))
def test_every_public_namespace_declares_its_names(namespace):
    module = importlib.import_module(namespace)
    names = getattr(module, "__all__", None)
    assert names, f"{namespace} declares no __all__"
    assert len(set(names)) == len(names), f"{namespace}.__all__ lists a name twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{namespace}.__all__ lists names it does not have: {missing}"


def test_docs_api_lists_the_public_namespaces():
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"\[`?(gradest(?:\.\w+)*)`?\]|`(gradest(?:\.\w+)*)`", text))
    listed = {name for pair in listed for name in pair if name}
    # `.diffusers`, `.peft`, ... are listed after gradest.integrations.
    short = {f"gradest.integrations{name}" for name in re.findall(r"`(\.\w+)`", text)}
    assert set(PUBLIC) <= listed | short, sorted(set(PUBLIC) - listed - short)


# -- the API reference ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if any(importlib.util.find_spec(name) is None for name in ("mkdocs", "mkdocstrings")):
        pytest.skip("needs mkdocs and mkdocstrings (gradest's docs extra)")
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def anchors(site: Path, page: str) -> set[str]:
    return set(re.findall(r'id="([\w.]+)"', (site / page / "index.html").read_text()))


@pytest.mark.parametrize("namespace", sorted(PUBLIC))
def test_every_public_name_is_rendered(site, namespace):
    rendered = anchors(site, PUBLIC[namespace])
    missing = [
        name
        for name in public_names(namespace)
        if f"{namespace}.{name}" not in rendered
        and not (
            f"{namespace}.{name}" in PUBLIC
            and f"{namespace}.{name}" in anchors(site, PUBLIC[f"{namespace}.{name}"])
        )
    ]
    assert not missing, f"no entry in {PUBLIC[namespace]} for {namespace}.{missing}"


def test_the_context_accessors_extending_uses_are_rendered(site):
    used = set(re.findall(r"\bctx\.(\w+)", (ROOT / "docs" / "extending.md").read_text()))
    assert {"host_coefficients", "host_times", "field"} <= used
    rendered = anchors(site, PUBLIC["gradest.plugin"])
    missing = sorted(
        name for name in used if f"gradest.plugin.EstimationContext.{name}" not in rendered
    )
    assert not missing, f"ctx.{missing} are used in docs/extending.md but not rendered"


# -- who imports what -------------------------------------------------------------------------


def _all_of(namespace: str) -> set[str]:
    return set(public_names(namespace))


def _resolve(namespace: str, name: str) -> tuple[str | None, str | None]:
    """``(namespace it reaches, problem)`` for reading ``name`` from public ``namespace``."""
    if f"{namespace}.{name}" in PUBLIC:
        return f"{namespace}.{name}", None
    if name in _all_of(namespace):
        return None, None
    return None, f"{namespace}.{name} is not public (not in {namespace}.__all__)"


def private_uses(path: Path) -> Iterator[str]:
    """``"path:line: what"`` for every use of a gradest name that is not public."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bound: dict[str, str] = {}  # a local name -> the public gradest namespace it holds

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module != "gradest" and not module.startswith("gradest."):
                continue
            if module not in PUBLIC:
                yield f"{where}:{node.lineno}: imports from {module}, which is not public"
                continue
            for alias in node.names:
                reached, problem = _resolve(module, alias.name)
                if problem:
                    yield f"{where}:{node.lineno}: {problem}"
                elif reached:
                    bound[alias.asname or alias.name] = reached
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                if name != "gradest" and not name.startswith("gradest."):
                    continue
                if name not in PUBLIC:
                    yield f"{where}:{node.lineno}: imports {name}, which is not public"
                elif alias.asname:
                    bound[alias.asname] = name
                else:
                    bound["gradest"] = "gradest"
    # Each chain of attribute reads once, from its outermost node (gradest.a.b.c).
    inner = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain: list[str] = []
        head: ast.AST = node
        while isinstance(head, ast.Attribute):
            chain.append(head.attr)
            head = head.value
        if not isinstance(head, ast.Name) or head.id not in bound:
            continue
        namespace = bound[head.id]
        for attribute in reversed(chain):
            reached, problem = _resolve(namespace, attribute)
            if problem:
                yield f"{where}:{node.lineno}: reads {problem}"
                break
            if reached is None:
                break
            namespace = reached


def client_files() -> list[Path]:
    return sorted(path for folder in CLIENTS for path in folder.rglob("*.py"))


def test_the_walk_finds_the_clients():
    files = client_files()
    assert any("gradest_lab" in str(path) for path in files)
    assert any("gradest_digits" in str(path) for path in files)
    assert len(files) > 60


def test_the_lab_and_the_applications_use_only_public_names():
    found = sorted({use for path in client_files() for use in private_uses(path)})
    assert not found, "private gradest names used:\n" + "\n".join(found)


def test_the_walk_catches_every_way_of_reaching_a_private_name(tmp_path):
    probe = tmp_path / "client.py"
    probe.write_text(
        "import gradest\n"
        "import gradest.registry\n"
        "import gradest.integrations.diffusers as adapters\n"
        "from gradest import estimator, rl\n"
        "from gradest.base import EstimatorBase\n"
        "from gradest.plugin import option, _not_public\n"
        "from gradest import entry_points\n"
        "gradest.estimator('exact')\n"
        "gradest.registry.line_up('compare')\n"
        "gradest.integrations.diffusers.sampler_from_scheduler\n"
        "gradest.integrations.diffusers.NUM_TRAIN_TIMESTEPS\n"
        "adapters.DiffusersVelocity\n"
        "adapters.flow_match_schedule\n"
        "rl.grpo_objective\n"
        "rl.flow_grpo\n"
    )
    found = sorted(use.split(": ", 1)[1] for use in private_uses(probe))
    assert found == sorted(
        [
            "imports gradest.registry, which is not public",
            "imports from gradest.base, which is not public",
            "gradest.plugin._not_public is not public (not in gradest.plugin.__all__)",
            "gradest.entry_points is not public (not in gradest.__all__)",
            "reads gradest.registry is not public (not in gradest.__all__)",
            "reads gradest.integrations.diffusers.NUM_TRAIN_TIMESTEPS is not public (not in "
            "gradest.integrations.diffusers.__all__)",
            "reads gradest.integrations.diffusers.flow_match_schedule is not public (not in "
            "gradest.integrations.diffusers.__all__)",
            "reads gradest.rl.flow_grpo is not public (not in gradest.rl.__all__)",
        ]
    )
