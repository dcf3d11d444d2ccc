"""Rerun a tuned race folder with the settings it records: to resume it, or to refine it.

``python -m gradest_lab.race.rerun FOLDER [FOLDER ...]`` reads each folder's ``race.json``
(the task, its settings, the line-up, the grid, both seed lists, the budget, the fractions
and the levels) and runs :func:`gradest_lab.race.tuned_race.tuned_race` on it again: every
finished shard is read back, so only what is missing runs: the refinement's new rates
(:mod:`gradest_lab.race.refinement`) when the folder was raced before refinement existed,
and the report runs at the choices that moved. Stop it at any point and run it again.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gradest import GradestError, InvalidValue
from gradest_lab.race.refinement import BRACKET_RATIO, parse_bracket_ratio
from gradest_lab.storage.files import read_json

__all__ = ["race_task", "rerun_tuned_race"]


def race_task(settings: dict[str, Any]) -> Any:
    """The task a tuned race's ``race.json`` names, built with the settings it records."""
    from gradest_lab.race.plain_race import registered_tasks

    tasks = registered_tasks()
    name = settings["task"]
    if name not in tasks:
        raise InvalidValue(
            f"race.json names the task {name!r}, which no installed application registers "
            f"(installed: {', '.join(sorted(tasks)) or 'none'})"
        )
    options = dict(settings["task_settings"])
    device = options.pop("device", "cpu")
    return tasks[name](eval_samples=settings["eval_samples"], device=device, **options)


_RECORDED = object()


def rerun_tuned_race(
    folder: str | os.PathLike[str],
    *,
    bracket_ratio: Any = _RECORDED,
    show_progress: bool = True,
) -> Any:
    """Run the tuned race ``folder`` records again (module docstring); returns its report.

    ``bracket_ratio``: the refinement's (:mod:`gradest_lab.race.refinement`); by default the
    one ``race.json`` records, or the default ratio for a race of before the refinement."""
    from gradest_lab.race.tuned_race import tuned_race

    folder = Path(folder)
    settings = read_json(folder / "race.json", what="a tuned race's settings")
    if settings.get("kind") != "tuned":
        raise InvalidValue(f"{str(folder)!r}: race.json is not a tuned race's (kind 'tuned')")
    if bracket_ratio is _RECORDED:
        bracket_ratio = settings.get("bracket_ratio", BRACKET_RATIO)
    return tuned_race(
        race_task(settings),
        settings["estimators"],
        lrs=settings["lrs"],
        tune_seeds=settings["tune_seeds"],
        seeds=settings["seeds"],
        budget_exact_steps=settings["budget_given"]["value"],
        fractions=settings["fractions"],
        levels=settings["levels"],
        primary_level=settings["primary_level"],
        ceiling_factor=settings["ceiling_factor"],
        bracket_ratio=bracket_ratio,
        out=folder,
        show_progress=show_progress,
    )


def main(argv: list[str] | None = None) -> int:
    """The command: 0 when every folder is done; 2 (the error in one line) when one is
    refused, e.g. a malformed shard, which stays as it is; 130 when interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m gradest_lab.race.rerun", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folders", nargs="+", help="tuned race folders (each has race.json)")
    parser.add_argument(
        "--bracket-ratio",
        default=None,
        metavar="RATIO",
        help="refine to this bracket (or none); default: the one race.json records",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        for folder in args.folders:
            if args.bracket_ratio is None:
                rerun_tuned_race(folder, show_progress=not args.quiet)
            else:
                ratio = parse_bracket_ratio(args.bracket_ratio)
                rerun_tuned_race(folder, bracket_ratio=ratio, show_progress=not args.quiet)
            print(f"rerun: {folder} done")
    except GradestError as err:
        print(f"rerun: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Stopping a long rerun is how it is meant to be used (module docstring): every
        # finished shard is on disk, a run in progress keeps its state.
        print(
            "rerun: interrupted; the finished runs are kept: run it again to resume",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
