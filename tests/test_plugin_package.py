"""A real plugin package, end to end: pip-installed, found through its metadata, used by name.

``examples/plugin`` (the ``gradest-example-plugin`` distribution, estimator ``sdo_mean``)
is installed with pip into a temporary folder, without network, and used from fresh
interpreters that have that folder on ``PYTHONPATH``: through ``gradest.estimator``,
``gradest check`` (against the dense definition the plugin's class carries), ``gradest compare``
and ``python -m gradest.cli list``. A second distribution built in the test registers a
duplicate name, a name that tries to shadow a built-in and a broken entry point; each
warns naming the distributions involved and none breaks gradest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from check_table import check_rows

import gradest
from gradest.registry import builtin_estimators

# Two pip builds and two fresh interpreters (each imports torch): about 20-40 s on 2 cores.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = ROOT / "examples" / "plugin"
EXAMPLE_DIST = "gradest-example-plugin"
CLASH_DIST = "gradest-clashing-plugin"
BUILTIN_NAMES = tuple(builtin_estimators())

CLASH_PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{CLASH_DIST}"
version = "0.0.1"

[project.entry-points."gradest.estimators"]
sdo_mean = "gradest_clashing_plugin:Clash"
exact = "gradest_clashing_plugin:Clash"
broken = "gradest_clashing_plugin.missing_module:Nothing"

[tool.setuptools]
packages = ["gradest_clashing_plugin"]
"""

CLASH_MODULE = '''\
"""A plugin whose names clash with installed ones, and one broken entry point."""

import attrs

from gradest.base import EstimatorBase


@attrs.frozen
class Clash(EstimatorBase):
    """An estimator that must never be picked: its names are taken."""
'''

# Run in one fresh interpreter with the plugin's install folder on PYTHONPATH; prints JSON.
USE_PLUGIN_SCRIPT = """\
import contextlib, io, json, os, sys

import torch

import gradest
from gradest import registry
from gradest.cli import main
from gradest.reference import definition_gradient, dense_chain, relative_error
from gradest.testing.problems import (
    random_stepwise_objective, seeded_normal, smooth_terminal_objective, tiny_mlp,
)

out = {}
est = gradest.estimator("sdo_mean:draws=3", samples=2)
out["repr"] = repr(est)
out["module"] = type(est).__module__
out["listed"] = "sdo_mean" in gradest.available_estimators()

model = tiny_mlp(3, hidden=6, seed=4)
flow = gradest.RectifiedFlow(steps=5)
trajectory = gradest.rollout(model, flow, seeded_normal((2, 3), 7))
chain = dense_chain(model, flow, trajectory)
objectives = {
    "terminal": smooth_terminal_objective(3),
    "stepwise": random_stepwise_objective(5, (2, 3)),
}
for kind, objective in objectives.items():
    def run(seed):
        return est.estimate(
            model, flow, objective, trajectory=trajectory,
            generator=torch.Generator().manual_seed(seed),
        )
    first, again, other = run(0), run(0), run(1)
    definition = definition_gradient(est, chain, objective, first)
    out[kind] = {
        "vs_definition": relative_error(first.flat(), definition),
        "reproducible": bool(torch.equal(first.flat(), again.flat())),
        "draws": [list(d) for d in first.decisions.draws],
        "other_draws": [list(d) for d in other.decisions.draws],
        "keys": list(first.grads),
        "norm": float(first.flat().norm()),
    }
out["parameter_names"] = [name for name, _ in model.named_parameters()]

os.environ["GRADEST_DISABLE_PLUGINS"] = "1"
registry.clear_cache()
out["disabled_names"] = sorted(gradest.available_estimators())
try:
    gradest.estimator("sdo_mean")
    out["disabled_error"] = None
except gradest.UnknownEstimatorError as err:
    out["disabled_error"] = str(err)
del os.environ["GRADEST_DISABLE_PLUGINS"]
registry.clear_cache()
out["enabled_again"] = "sdo_mean" in gradest.available_estimators()


def cli(*args):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


out["check"] = cli(
    "check", "--estimators", "sdo_mean,sdo_mean:draws=2,samples=3", "--steps", "4", "--quiet"
)
out["compare"] = cli(
    "compare", "--estimators", "exact,sdo_mean:draws=2", "--steps", "6", "--seeds", "1",
    "--draws", "2", "--batch", "2", "--repeats", "1", "--no-sweeps", "--no-plots",
    "--quiet", "--out", sys.argv[1],
)
print(json.dumps(out))
"""


def _pip_install(source: Path, target: Path) -> subprocess.CompletedProcess:
    # Offline: no index, no build isolation (setuptools comes from the test environment),
    # no dependencies (gradest, torch and attrs are already installed).
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _require_offline_build_backend() -> None:
    """pip builds without isolation here (offline), with this environment's setuptools,
    which builds wheels by itself from 70.1 on (older ones need the wheel package)."""
    setuptools = pytest.importorskip("setuptools", reason="building a plugin needs setuptools")
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1):
        pytest.importorskip("wheel", reason="setuptools < 70.1 needs wheel to build wheels")


@pytest.fixture(scope="module")
def install_dirs(tmp_path_factory) -> dict[str, Path]:
    """Install folders: ``"plugin"`` (the example plugin), ``"clash"`` (the clashing dist)."""
    _require_offline_build_backend()
    root = tmp_path_factory.mktemp("plugins")
    # Build from copies: pip builds in the source tree, which must stay clean.
    plugin_source = root / "src" / "example"
    shutil.copytree(
        EXAMPLE_PLUGIN,
        plugin_source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    clash_source = root / "src" / "clash"
    (clash_source / "gradest_clashing_plugin").mkdir(parents=True)
    (clash_source / "pyproject.toml").write_text(CLASH_PYPROJECT)
    (clash_source / "gradest_clashing_plugin" / "__init__.py").write_text(CLASH_MODULE)
    targets = {"plugin": root / "site-plugin", "clash": root / "site-clash"}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_pip_install, [plugin_source, clash_source], targets.values()))
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    return targets


def _python(args: list[str], pythonpath: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "GRADEST_DISABLE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(str(path) for path in pythonpath)
    # One thread, as in conftest.py: on a shared 2-core box torch's thread pool spins
    # against the other processes and makes these tiny models ~10x slower.
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def plugin_run(install_dirs, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("use-plugin")
    script = work / "use_plugin.py"
    script.write_text(USE_PLUGIN_SCRIPT)
    result = _python([str(script), str(work / "compare")], [install_dirs["plugin"]], work)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["compare_dir"] = str(work / "compare")
    return out


def test_the_plugin_is_not_visible_without_its_install_folder():
    # The negative control for everything below: this process lacks the folder.
    try:
        distribution(EXAMPLE_DIST)
        pytest.skip(f"{EXAMPLE_DIST} is installed in this environment itself")
    except PackageNotFoundError:
        pass
    assert "sdo_mean" not in gradest.available_estimators()


def test_installed_plugin_is_used_by_name(plugin_run):
    assert plugin_run["listed"]
    assert plugin_run["module"] == "gradest_example_plugin.estimator"
    assert plugin_run["repr"] == "MeanOfSdoDraws(draws=3, samples=2)"
    for kind in ("terminal", "stepwise"):
        run = plugin_run[kind]
        assert run["keys"] == plugin_run["parameter_names"]
        assert run["norm"] > 0
        # 3 draws of 2 distinct steps out of 5, from the generator only.
        assert len(run["draws"]) == 3
        assert all(len(set(d)) == 2 and all(0 <= k < 5 for k in d) for d in run["draws"])
        assert run["reproducible"]
        assert run["draws"] != run["other_draws"]


def test_plugin_matches_the_dense_definition_it_registers(plugin_run):
    # float64 on a 3-dimensional toy MLP: agreement at round-off.
    for kind in ("terminal", "stepwise"):
        assert plugin_run[kind]["vs_definition"] < 1e-12, kind
    check = plugin_run["check"]
    assert check["code"] == 0, check["stdout"] + check["stderr"]
    assert "all estimators make the decisions and match the definitions" in check["stdout"]
    table = check_rows(check["stdout"])
    rows = [
        row
        for spec, objectives in table.items()
        if spec.startswith("sdo_mean")
        for row in objectives
    ]
    assert len(rows) == 4  # two specs x (terminal, stepwise)
    assert all("n/a" not in row and "FAIL" not in row for row in rows)


def test_gradest_disable_plugins_hides_it(plugin_run):
    assert "sdo_mean" not in plugin_run["disabled_names"]
    assert set(BUILTIN_NAMES) <= set(plugin_run["disabled_names"])
    assert "unknown estimator 'sdo_mean'" in plugin_run["disabled_error"]
    assert plugin_run["enabled_again"]


def test_compare_runs_the_plugin_next_to_exact(plugin_run):
    compare = plugin_run["compare"]
    assert compare["code"] == 0, compare["stderr"]
    assert "`sdo_mean:draws=2`" in compare["stdout"]
    report = json.loads((Path(plugin_run["compare_dir"]) / "report.json").read_text())
    rows = {row["label"]: row for row in report["estimators"]}
    assert set(rows) == {"exact", "sdo_mean:draws=2"}
    plugin = rows["sdo_mean:draws=2"]
    assert plugin["name"] == "sdo_mean" and plugin["stochastic"]
    assert 0.0 < plugin["cosine"]["mean"] <= 1.0
    # Two draws of one step each: at most 2 distinct steps get a parameter VJP.
    assert 1 <= plugin["counts"]["param_vjps"] <= 2


def test_cli_list_warns_about_clashing_and_broken_plugins(install_dirs, tmp_path):
    # The example plugin comes first on the path, so its sdo_mean is the one kept.
    result = _python(
        ["-m", "gradest.cli", "list"], [install_dirs["plugin"], install_dirs["clash"]], tmp_path
    )
    assert result.returncode == 0, result.stderr
    listed = [line.split(":")[0] for line in result.stdout.splitlines() if not line[:1].isspace()]
    # Every estimator installed here (the built-ins, the lab's auto), and the plugin's.
    assert sorted(listed) == sorted([*gradest.available_estimators(), "sdo_mean"])
    assert "sdo_mean: Mean of K independent SDO draws" in result.stdout
    assert "    draws=4  independent SDO draws averaged" in result.stdout
    warnings_text = " ".join(result.stderr.split())  # warnings may wrap
    assert (
        f"estimator plugin 'sdo_mean' from {CLASH_DIST} is a duplicate of the one "
        f"from {EXAMPLE_DIST}" in warnings_text
    )
    assert f"estimator plugin 'exact' from {CLASH_DIST} is a duplicate of the one from gradest" in (
        warnings_text
    )
    assert f"skipping estimator plugin 'broken' from {CLASH_DIST}" in warnings_text
    assert "ModuleNotFoundError" in warnings_text


@pytest.fixture(autouse=True)
def _no_plugin_state_leaks():
    yield
    gradest.registry.clear_cache()


def test_docs_walkthrough_matches_the_example():
    text = (ROOT / "docs" / "extending.md").read_text()
    for needle in (
        'sdo_mean = "gradest_example_plugin.estimator:MeanOfSdoDraws"',
        "def definition(",
        "_terminal",
        "_stepwise",
        "option(",
    ):
        assert needle in text, needle
