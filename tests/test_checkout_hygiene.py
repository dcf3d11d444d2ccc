"""Tests never use the checkout as a folder (the repository's ``conftest.py``).

Each test starts in an empty working folder outside the checkout, and a test run that
changes anything in the checkout fails, naming what changed: checked here in the running
session, and on a scratch copy of the rule run by pytest in a child process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_starts_in_an_empty_folder_outside_the_checkout(tmp_path):
    here = Path.cwd().resolve()
    assert not here.is_relative_to(ROOT), here
    assert list(here.iterdir()) == []
    assert here != tmp_path.resolve()  # tmp_path stays the test's own, and empty


def _scratch_run(tmp_path: Path, test_body: str) -> subprocess.CompletedProcess[str]:
    """pytest, in a child process, on a scratch repository holding the rule's conftest.py
    and one test with ``test_body``."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "conftest.py", project / "conftest.py")
    (project / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (project / "tests" / "test_it.py").write_text(textwrap.dedent(test_body))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_that_writes_into_the_checkout_fails_naming_the_file(tmp_path):
    done = _scratch_run(
        tmp_path,
        """
        from pathlib import Path

        def test_writes_a_default_output_into_the_checkout():
            runs = Path(__file__).resolve().parents[1] / "runs" / "compare"
            runs.mkdir(parents=True)
            (runs / "report.md").write_text("left behind")
        """,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout  # the test itself passed: the run fails
    assert "the checkout changed during the tests" in done.stdout
    assert "runs/compare/report.md" in done.stdout


def test_a_run_that_writes_only_where_it_stands_passes(tmp_path):
    done = _scratch_run(
        tmp_path,
        """
        from pathlib import Path

        def test_writes_its_default_output_where_it_stands():
            Path("runs/compare").mkdir(parents=True)
            Path("runs/compare/report.md").write_text("in the test's own folder")
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the checkout changed" not in done.stdout
    assert not (tmp_path / "project" / "runs").exists()


def test_a_test_does_not_see_what_the_checkout_holds(tmp_path):
    """A folder the demo leaves (``runs/compare``) in the scratch checkout is not where
    the test stands."""
    (tmp_path / "project" / "runs" / "compare").mkdir(parents=True)
    done = _scratch_run(
        tmp_path,
        """
        from pathlib import Path

        def test_sees_no_runs():
            assert not Path("runs").exists()
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
