"""The command line shared by the pages whose figures are generated from committed data.

:mod:`gradest_lab.race.quoting` (race numbers from the race reports) and
:mod:`gradest_lab.cost.doc_figures` (``gradest cost`` figures from its JSONs) each give a
page's problems and its updated text; :func:`page_command` is their ``python -m`` entry:
rewrite stale generated text (or, with ``--check``, only report it) and fail on every
other problem, one line per page and problem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gradest import InvalidValue

__all__ = ["page_command"]


def page_command(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    problems_of: Callable[[Path, str], list[str]],
    updated: Callable[[Path, str], str],
    stale: str,
) -> int:
    """Parse ``PAGES [--root ROOT] [--check]`` and check or update each page.

    Args:
        argv: the arguments (None: ``sys.argv``).
        prog, description: the command's name and help line.
        problems_of: ``(root, text) -> problems`` of one page.
        updated: ``(root, text) -> text`` with every generated part rewritten.
        stale: the problem that ``updated`` fixes (generated text that differs from its
            data); any other problem is reported and fails the command.

    Returns:
        0 when every page is (now) right, 1 otherwise.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("pages", nargs="+", type=Path)
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root")
    parser.add_argument("--check", action="store_true", help="write nothing; fail on a difference")
    args = parser.parse_args(argv)
    failures = []
    for page in args.pages:
        text = page.read_text(encoding="utf-8")
        try:
            problems = problems_of(args.root, text)
        except InvalidValue as err:
            failures.append(f"{page}: {err}")
            continue
        if stale in problems and not args.check:
            page.write_text(updated(args.root, text), encoding="utf-8")
            print(f"wrote {page}")
            problems.remove(stale)
        failures += [f"{page}: {item}" for item in problems]
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0
