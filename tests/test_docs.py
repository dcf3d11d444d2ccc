"""The code in README.md and docs/ runs, so it cannot rot; the docs site builds.

Every fenced ``python`` block is executed, in order, in one namespace per file (like a
notebook), from a temporary working directory. A block whose first line is
``# not run: <reason>`` is an excerpt (it needs hub weights or a launched process
group) and is skipped; the reason names where the same code does run.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return [b for b in BLOCK.findall(page.read_text()) if not b.startswith("# not run:")]


RUNNABLE = [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_code_in_docs_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for index, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page.name} block {index}", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_excerpts_say_where_they_run():
    for page in PAGES:
        for block in BLOCK.findall(page.read_text()):
            if block.startswith("# not run:"):
                assert len(block.splitlines()[0]) > len("# not run: "), page


@pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "mkdocstrings")),
    reason="needs mkdocs and mkdocstrings (gradest's docs extra)",
)
def test_docs_site_builds_strictly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "index.html").exists()


# The repository describes itself: its contract is docs/design.md, and no file may point
# at a document or a path outside the checkout (an old design file, a sibling folder).
OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|\.\./|\bshared/papers")


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and path != Path(__file__).resolve():
            files.append(path)
    return files


def test_no_file_refers_outside_the_repository():
    offenders = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (shipped weights)
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, (
        "these lines refer outside the repository; point at docs/design.md#<section> "
        "instead:\n" + "\n".join(offenders)
    )


def readme_commands() -> list[str]:
    """The commands of README.md's "Two commands" section (its indented code lines)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    python3 ")]


def test_ci_runs_the_readme_commands_in_the_readme_order():
    """CI runs the README's two commands, one after the other in one checkout, as a new
    user does (a test that passes on a clean clone but not after the demo fails there)."""
    commands = readme_commands()
    assert len(commands) == 2, commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = []
    for command in commands:
        found = [i for i, line in enumerate(ci) if line.split("#")[0].strip().startswith(command)]
        assert found, f".ci/run does not run {command!r}"
        positions.append(found[0])
    assert positions == sorted(positions), f".ci/run runs {commands} out of the README's order"
