#!/usr/bin/env python3
"""Set up gradest in ./.venv and run the main job or the tests; needs only python3.

    python3 dev.py demo     # the main job on the embedded default (gradest compare)
    python3 dev.py test     # the test suites of the library and of apps/* (extra
                            # arguments go to pytest)

The environment is (re)installed when pyproject.toml or constraints.txt change. It pins
torch through constraints.txt, so setup never pulls a different multi-GB torch build.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if sys.platform == "win32" else "bin")
STAMP = VENV / ".gradest-installed"
# The applications beside the library, each a distribution of its own (apps/*/pyproject.toml).
APPS = ("apps/digits", "apps/recipes")
APPS_PYPROJECTS = tuple(f"{app}/pyproject.toml" for app in APPS)
# Their optional extras the tests exercise (TensorBoard logs, offline wandb runs).
APP_EXTRAS = {"apps/digits": "[tensorboard]", "apps/recipes": "[wandb]"}
# The tests of the library and of each application.
TEST_PATHS = ("tests", *(f"{app}/tests" for app in APPS))


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt", *APPS_PYPROJECTS):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def ensure_environment() -> None:
    if not (BIN / "python").exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    print("dev.py: installing gradest, its applications and their test/benchmark "
          "dependencies", flush=True)
    editable = [f"{ROOT}[dev]", *(f"{ROOT / app}{APP_EXTRAS.get(app, '')}" for app in APPS)]
    subprocess.run(
        [str(BIN / "python"), "-m", "pip", "install", "--quiet",
         "-c", str(ROOT / "constraints.txt"), *(arg for path in editable for arg in ("-e", path))],
        check=True,
    )
    STAMP.write_text(_fingerprint())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ensure_environment()
    if argv[0] == "demo":
        command = [str(BIN / "gradest"), "compare", "--out", "runs/compare", *argv[1:]]
    else:
        command = [str(BIN / "python"), "-m", "pytest", *TEST_PATHS, *argv[1:]]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
