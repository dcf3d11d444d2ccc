"""The documented install command of library + application works in a fresh environment.

gradest and its lab are not on PyPI, so ``pip install ./apps/recipes`` alone cannot find
the ``gradest[integrations]`` and ``gradest-lab`` it depends on unless they are installed
already; the pages name the library's folder and the lab's too (``pip install . ./lab
./apps/recipes``); the lab's own command names the library's folder. Checked with pip's resolver
(``--dry-run``, nothing installed) in a new environment that sees every third-party package
of this one but no gradest distribution, offline (``--no-index``: a same-named package on an
index would otherwise be taken for gradest), so a missing ``.`` fails here as it would for a
reader.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (page, application folder): the page's first ``pip install`` naming the application is
# its install command.
PAGES = [
    ("docs/recipes.md", "apps/recipes"),
    ("apps/recipes/README.md", "apps/recipes"),
    ("apps/digits/README.md", "apps/digits"),
    ("README.md", "lab"),
    ("lab/README.md", "lab"),
]
# What each distribution beside the library depends on, in the repository: its install
# command must name these folders.
NEEDS = {"lab": (".",), "apps/digits": (".", "./lab"), "apps/recipes": (".", "./lab")}


def documented_command(page: str, app: str) -> list[str]:
    """The first ``pip install`` command on ``page`` that names ``./<app>``, in a code span
    or an indented code line (a trailing ``# comment`` dropped), as arguments after
    ``pip install``."""
    text = (ROOT / page).read_text("utf-8")
    spans = re.findall(r"`(pip install [^`]*)`", text)
    lines = [line.strip() for line in text.splitlines() if line.startswith("    pip install ")]
    found = [command for command in sorted(spans + lines, key=text.find) if f"./{app}" in command]
    assert found, f"{page} names no pip install command for ./{app}"
    words = shlex.split(found[0], comments=True)
    assert words[:2] == ["pip", "install"], found[0]
    return words[2:]


@pytest.mark.parametrize(("page", "app"), PAGES)
def test_the_documented_command_names_the_library_and_the_application(page, app):
    arguments = [a.split("[")[0] for a in documented_command(page, app) if a != "-e"]
    for needed in NEEDS[app]:
        assert needed in arguments, f"{page}: {arguments} does not name {needed!r}"
    assert f"./{app}" in arguments, arguments


def importlib_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def without_gradest(tmp_path_factory) -> Path:
    """A new environment's python that sees this environment's packages except gradest's
    distributions (links to them in a folder named by a .pth file): what a fresh
    environment with the dependencies installed looks like to pip."""
    if not importlib_available("setuptools"):
        pytest.skip("setuptools is needed to build the local projects without isolation")
    place = tmp_path_factory.mktemp("fresh")
    venv.create(place / "env", with_pip=False)
    visible = place / "site"
    visible.mkdir()
    here = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for site in here:
        for entry in site.iterdir():
            if "gradest" in entry.name.lower() or (visible / entry.name).exists():
                continue  # the distributions, their editable finders and .pth files
            (visible / entry.name).symlink_to(entry)
    python = place / "env" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "visible.pth").write_text(f"{visible}\n")
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('gradest'))"],
        cwd=place, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == "None"  # gradest is not importable there (outside ROOT)
    return python


def dry_run(python: Path, arguments: list[str]) -> subprocess.CompletedProcess[str]:
    """``pip install --dry-run`` for ``python``'s environment, offline, from the root."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--no-build-isolation", "--disable-pip-version-check", *arguments],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pip_with_python_option() -> None:
    import importlib.metadata

    major, minor = (int(part) for part in importlib.metadata.version("pip").split(".")[:2])
    if (major, minor) < (22, 3):
        pytest.skip("pip --python needs pip 22.3 or newer")


@pytest.mark.parametrize(("page", "app"), PAGES)
def test_the_documented_command_resolves_without_gradest_installed(
    page, app, without_gradest, pip_with_python_option
):
    arguments = documented_command(page, app)
    done = dry_run(without_gradest, arguments)
    assert done.returncode == 0, done.stderr[-2000:]
    name = Path(app).name
    assert re.search(rf"Would install .*gradest-0\S* .*gradest-{name}-", done.stdout), done.stdout


def test_the_application_alone_does_not_resolve_there(without_gradest, pip_with_python_option):
    """The trap the pages warn about: the application's folder alone needs a gradest from
    an index."""
    done = dry_run(without_gradest, ["./apps/recipes"])
    assert done.returncode != 0
    assert "No matching distribution found for gradest[integrations]" in done.stderr
