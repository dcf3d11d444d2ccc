#!/usr/bin/env python3
"""Set up gradest in ./.venv and run the main job, the tests or the checks; needs only python3.

    python3 dev.py demo     # the main job on the embedded default (gradest compare)
    python3 dev.py test     # the test suites of the library, the lab and apps/* (extra
                            # arguments go to pytest)
    python3 dev.py lint     # ruff check, ruff format --check, mypy (the library, the lab
                            # and both applications) and mkdocs build --strict; all four run, and
                            # it fails if any does (CI runs it before the tests)

The environment is (re)installed when pyproject.toml or constraints.txt change. It pins
torch through constraints.txt, so setup never pulls a different multi-GB torch build.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if sys.platform == "win32" else "bin")
STAMP = VENV / ".gradest-installed"
# The distributions beside the library, each with its own pyproject.toml: the lab (races,
# gradest cost, run folders, gradest compare) and the applications, which use it.
APPS = ("lab", "apps/digits", "apps/recipes")
APPS_PYPROJECTS = tuple(f"{app}/pyproject.toml" for app in APPS)
# Their optional extras the tests exercise (plots, the cost presets' diffusers models,
# TensorBoard logs, offline wandb runs, the learned rewards on tiny random models).
APP_EXTRAS = {
    "lab": "[plot,integrations]",
    "apps/digits": "[tensorboard]",
    "apps/recipes": "[wandb,learned-rewards]",
}
# The tests of the library, of the lab and of each application.
TEST_PATHS = ("tests", *(f"{app}/tests" for app in APPS))
# What ruff checks and formats (tox's lint environment runs the same).
LINT_PATHS = (
    "gradest",
    "lab",
    "apps",
    "tests",
    "benchmarks",
    "examples",
    "dev.py",
    "conftest.py",
    "docs/griffe_rst_roles.py",
)


def _checks(site: str) -> list[tuple[str, list[str]]]:
    """``python3 dev.py lint``: each check's name and command, run from the root."""
    return [
        ("ruff check", [str(BIN / "ruff"), "check", *LINT_PATHS]),
        ("ruff format --check", [str(BIN / "ruff"), "format", "--check", *LINT_PATHS]),
        # pyproject.toml's [tool.mypy] names the packages: gradest and both applications.
        ("mypy", [str(BIN / "mypy")]),
        ("mkdocs build --strict", [str(BIN / "mkdocs"), "build", "--strict", "-d", site]),
    ]


def lint() -> int:
    failed = []
    with tempfile.TemporaryDirectory() as site:
        for name, command in _checks(site):
            print(f"dev.py lint: {name}", flush=True)
            if subprocess.run(command, cwd=ROOT).returncode:
                failed.append(name)
    if failed:
        print(f"dev.py lint: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("dev.py lint: all checks passed")
    return 0


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt", *APPS_PYPROJECTS):
        digest.update((ROOT / name).read_bytes())
    # The version is written in gradest/__init__.py (pyproject reads it from there): a new
    # one reinstalls, so the installed metadata says it too.
    init = (ROOT / "gradest" / "__init__.py").read_text().splitlines()
    digest.update("".join(line for line in init if line.startswith("__version__")).encode())
    return digest.hexdigest()


def ensure_environment() -> None:
    if not (BIN / "python").exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    print(
        "dev.py: installing gradest, the lab, the applications and their test dependencies",
        flush=True,
    )
    editable = [f"{ROOT}[dev]", *(f"{ROOT / app}{APP_EXTRAS.get(app, '')}" for app in APPS)]
    subprocess.run(
        [
            str(BIN / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(ROOT / "constraints.txt"),
            *(arg for path in editable for arg in ("-e", path)),
        ],
        check=True,
    )
    STAMP.write_text(_fingerprint())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "lint"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ensure_environment()
    if argv[0] == "lint":
        return lint()
    if argv[0] == "demo":
        command = [str(BIN / "gradest"), "compare", "--out", "runs/compare", *argv[1:]]
    else:
        command = [str(BIN / "python"), "-m", "pytest", *TEST_PATHS, *argv[1:]]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
