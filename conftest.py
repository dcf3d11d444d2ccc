"""What every test suite of this repository shares: tests never use the checkout as a folder.

pytest loads this file for every suite under the repository root (``tests/``, each
application's and the lab's), whatever paths it is given.

* **Each test starts in an empty folder of its own.** The working folder is a fresh
  temporary one for the session (where session- and module-scoped fixtures run) and
  another for each test, so a command run with its default output (``gradest compare``
  writes ``runs/compare``) writes there, and nothing a user left in the checkout (the
  demo's ``runs/``) changes what a test sees. A test that needs a file of the repository
  names it from its own path (``Path(__file__).parents[1] / "docs"``).
* **The checkout is the same after the run as before.** Every file and folder under the
  repository root (but the version control, the virtualenv and caches of bytecode and
  tools) is listed with its size and modification time when the session starts and when
  it ends; any difference fails the run, naming the paths. A test that writes into the
  checkout fails even where it passes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
# Not a test's output: version control, the virtualenv dev.py makes, and what Python,
# pytest, hypothesis and the linters cache for themselves.
_NOT_OUTPUT = frozenset(
    {
        ".git",
        ".venv",
        "__pycache__",
        ".pytest_cache",
        ".hypothesis",
        ".mypy_cache",
        ".ruff_cache",
        ".tox",
    }
)
_BEFORE = pytest.StashKey[dict[str, tuple[int, int] | None]]()
_CHANGED = pytest.StashKey[list[str]]()
# At most this many changed paths are named (the rest are counted).
_NAMED = 20


def checkout_listing(root: Path = ROOT) -> dict[str, tuple[int, int] | None]:
    """Every path under ``root`` but :data:`_NOT_OUTPUT`: a file's (modification time in
    ns, size), None for a folder (a folder's own time changes with what it holds, which
    the files already say)."""
    listing: dict[str, tuple[int, int] | None] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name not in _NOT_OUTPUT]
        here = Path(folder).relative_to(root)
        for name in dirs:
            listing[f"{here / name}/"] = None
        for name in files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:  # removed while we walked: not there
                continue
            listing[str(here / name)] = (info.st_mtime_ns, info.st_size)
    return listing


def changed_paths(before: dict, after: dict) -> list[str]:
    """The paths added, removed or rewritten between two :func:`checkout_listing` calls."""
    missing = object()
    return sorted(
        path
        for path in before.keys() | after.keys()
        if before.get(path, missing) != after.get(path, missing)
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = checkout_listing()


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    changed = changed_paths(before, checkout_listing())
    session.config.stash[_CHANGED] = changed
    if changed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    changed = config.stash.get(_CHANGED, [])
    if not changed:
        return
    terminalreporter.section("the checkout changed during the tests", red=True)
    for path in changed[:_NAMED]:
        terminalreporter.line(f"  {path}")
    if len(changed) > _NAMED:
        terminalreporter.line(f"  ... and {len(changed) - _NAMED} more")
    terminalreporter.line(
        f"A test wrote into the repository at {ROOT}: write under tmp_path (each test "
        f"starts in an empty folder of its own; see conftest.py)"
    )


@pytest.fixture(scope="session", autouse=True)
def session_working_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty working folder for what runs before a test's own (session and module
    fixtures)."""
    folder = tmp_path_factory.mktemp("session-cwd")
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(previous)


@pytest.fixture(autouse=True)
def test_working_folder(
    session_working_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """Each test's own empty working folder (beside its ``tmp_path``, which stays empty
    for the test)."""
    folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(folder)
    return folder
