"""``gradest race``: estimators fine-tuning one task at equal compute, plain or tuned.

The command of :func:`gradest_lab.race.plain_race.race` and, with ``--tune lr=GRID``,
:func:`gradest_lab.race.tuned_race.tuned_race`: the task is one an application registers
under the ``gradest.race_tasks`` entry points (``gradest race --list-tasks``), the
estimators are compared at one budget of backward FLOPs (``--budget 8x``: eight exact
training steps) or wall time, and the race folder (``--out``) keeps every finished run so
that rerunning the same command continues it. Every argument is checked before the folder
is looked at.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from gradest import InvalidValue
from gradest.plugin import Command, CommandInterrupted, WholeNumber, spec_list_text
from gradest_lab.command_line import SPEC_LIST_HELP, check_device, estimator_specs
from gradest_lab.race.refinement import BRACKET_RATIO, parse_bracket_ratio
from gradest_lab.storage.files import check_output_dir, check_path_length

__all__ = ["COMMAND", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gradest race``'s flags."""
    parser.add_argument(
        "--model",
        default=None,
        help="a registered race task, e.g. digits or digits-grpo (--list-tasks shows them)",
    )
    parser.add_argument(
        "--list-tasks",
        action="store_true",
        help="list the installed race tasks and their options (--task-option KEY=VALUE) "
        "instead of racing",
    )
    parser.add_argument(
        "--estimators",
        default="exact,sdo,truncated:k=1",
        type=spec_list_text,
        help=f"{SPEC_LIST_HELP} (exact is added when missing: the reference)",
    )
    parser.add_argument(
        "--seeds",
        default="16",
        help="the (report) seeds: a count (16: seeds 0-15), a range (16-31) or a list (0,3,5)",
    )
    parser.add_argument(
        "--tune",
        default=None,
        metavar="lr=GRID",
        help="tune every estimator's lr on --tune-seeds before the race: lr=3e-5..1e-3:6 (6 "
        "log-spaced points) or lr=1e-4,3e-4,1e-3 (FLOPs budgets only)",
    )
    parser.add_argument(
        "--tune-seeds",
        default=None,
        help="the tuning seeds (with --tune), disjoint from --seeds, e.g. 0-7",
    )
    parser.add_argument(
        "--ceiling-factor",
        type=float,
        default=16.0,
        help="with --tune: the ceiling run's budget in race budgets (default 16)",
    )
    parser.add_argument(
        "--bracket-ratio",
        default=None,
        metavar="RATIO",
        help=f"with --tune: refine each chosen lr on the tuning seeds until the tried rates "
        f"next to it are at most RATIO away (default {BRACKET_RATIO:g}); 'none': the grid's "
        f"choices, flagged as not bracketed",
    )
    parser.add_argument(
        "--budget",
        default=None,
        help="backward-FLOPs budget in exact steps, e.g. 8x (the FLOPs of 8 exact steps)",
    )
    parser.add_argument(
        "--budget-seconds", type=float, default=None, help="a wall-time budget instead (s)"
    )
    parser.add_argument(
        "--fractions",
        default=None,
        help="budget fractions the model is evaluated at (default 0.125,0.25,0.5,1; with "
        "--tune every eighth: time to target interpolates between them)",
    )
    parser.add_argument(
        "--eval-samples",
        type=WholeNumber(1),
        default=256,
        help="fixed evaluation set size (>= 256)",
    )
    parser.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the task, repeatable, e.g. --task-option lr=1e-4 (gradest race "
        "--list-tasks "
        "shows each task's options and defaults; the race records them)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--out", default="runs/race", help="output folder; rerun to resume (default runs/race)"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no table")


def _budget_flag(text: str) -> float:
    """``--budget 8x``: the FLOPs of 8 exact training steps (the number of exact steps)."""
    value = text.strip().lower()
    if not value.endswith("x"):
        raise InvalidValue(
            f"--budget {text!r}: give it in exact steps with an x, e.g. --budget 8x (the "
            f"backward FLOPs of 8 exact training steps), or use --budget-seconds"
        )
    try:
        steps = float(value[:-1])
    except ValueError:
        raise InvalidValue(f"--budget {text!r} is not a number of exact steps like 8x") from None
    if not steps > 0 or steps == float("inf"):
        raise InvalidValue(
            f"--budget must be a positive finite number of exact steps, got {text!r}"
        )
    return steps


def run(args: argparse.Namespace) -> int:
    """Run ``gradest race`` with the parsed flags; returns the exit status."""
    if args.list_tasks:
        _list_race_tasks()
        return 0
    if args.model is None:
        raise InvalidValue(
            "--model is required: a registered race task (gradest race --list-tasks shows "
            "them), e.g. --model digits"
        )
    try:
        return _race_command(args)
    except KeyboardInterrupt:
        out = os.path.abspath(args.out)
        if os.path.isfile(os.path.join(out, "run.json")):
            # The race claimed its folder and keeps every finished evaluation point there.
            raise CommandInterrupted(
                f"its finished runs and evaluation points are kept in {args.out!r}; rerun the "
                f"same command to continue it"
            ) from None
        raise


def _race_command(args: argparse.Namespace) -> int:
    from gradest_lab.plots import plots_unavailable
    from gradest_lab.race.plain_race import (
        DEFAULT_FRACTIONS,
        RACE_TASKS_GROUP,
        _check_fractions,
        race,
        registered_tasks,
    )
    from gradest_lab.race.task_options import parse_task_options
    from gradest_lab.race.tuned_race import (
        DEFAULT_TUNED_FRACTIONS,
        parse_lr_grid,
        parse_seed_list,
        tuned_race,
    )

    specs = estimator_specs(args.estimators, example="exact,sdo,truncated:k=1")
    if "exact" not in specs:
        specs.insert(0, "exact")  # the reference every difference is taken to
    seeds = parse_seed_list(args.seeds, what="--seeds")
    grid = None if args.tune is None else parse_lr_grid(args.tune)
    if grid is None and args.tune_seeds is not None:
        raise InvalidValue("--tune-seeds needs --tune lr=GRID (the rates to choose from)")
    if grid is not None:
        if args.tune_seeds is None:
            raise InvalidValue(
                "--tune needs --tune-seeds, disjoint from --seeds, e.g. --tune-seeds 0-7 "
                "--seeds 16-31 (a rate is chosen on seeds it is not reported on)"
            )
        if args.budget_seconds is not None or args.budget is None:
            raise InvalidValue(
                "--tune races a FLOPs budget: give --budget 8x (a wall-time budget moves with "
                "the machine's load between tuning and report)"
            )
        if any(option.partition("=")[0].strip() == "lr" for option in args.task_option):
            raise InvalidValue(
                "--task-option lr=... and --tune lr=... both set the lr; the tuned race sets "
                "each run's lr from the grid"
            )
    if (args.budget is None) == (args.budget_seconds is None):
        raise InvalidValue(
            "give one budget: --budget 8x (exact steps' FLOPs) or --budget-seconds S"
        )
    steps = None if args.budget is None else _budget_flag(args.budget)
    bracket_ratio = parse_bracket_ratio(args.bracket_ratio)
    if args.budget_seconds is not None and not args.budget_seconds > 0:
        raise InvalidValue(f"--budget-seconds must be positive, got {args.budget_seconds}")
    if args.fractions is None:
        fractions = list(DEFAULT_FRACTIONS if grid is None else DEFAULT_TUNED_FRACTIONS)
    else:
        try:
            fractions = [float(f) for f in args.fractions.split(",")]
        except ValueError:
            raise InvalidValue(
                f"--fractions {args.fractions!r} is not a comma list of numbers"
            ) from None
    _check_fractions(fractions)
    tasks = registered_tasks()
    if args.model not in tasks:
        known = ", ".join(sorted(tasks)) or "none installed"
        raise InvalidValue(
            f"--model {args.model!r} is not a race task ({known}); applications register "
            f"tasks under the {RACE_TASKS_GROUP!r} entry points, e.g. pip install ./apps/digits "
            f"for 'digits' and 'digits-grpo'"
        )
    options = parse_task_options(tasks[args.model], args.task_option, model=args.model)
    check_device(args.device)  # compare's check: before the task loads its model
    check_path_length(args.out, what=f"--out {args.out!r}")
    out = check_output_dir(args.out, what="--out", create=False)
    missing = None if args.no_plots else plots_unavailable()
    if missing is not None and not args.quiet:
        print(f"gradest race: plots will be skipped: {missing}")
    task = tasks[args.model](eval_samples=args.eval_samples, device=args.device, **options)
    plots = not args.no_plots and missing is None
    if grid is not None:
        assert steps is not None
        tune_seeds = parse_seed_list(args.tune_seeds, what="--tune-seeds")
        with warnings.catch_warnings():
            # The command prints these itself, after the report.
            warnings.filterwarnings("ignore", message="gradest race --tune")
            tuned = tuned_race(
                task,
                specs,
                lrs=grid,
                tune_seeds=tune_seeds,
                seeds=seeds,
                budget_exact_steps=steps,
                fractions=fractions,
                ceiling_factor=args.ceiling_factor,
                bracket_ratio=bracket_ratio,
                out=out,
                show_progress=not args.quiet,
                plots=plots,
            )
        if not args.quiet:
            print(tuned.to_markdown())
        print(f"wrote {out}/report.md, report.json" + ("" if not plots else " and plots"))
        for note in tuned.grid_warnings():
            print(f"gradest race: not ready to quote: {note}", file=sys.stderr)
        return 0
    report = race(
        task,
        specs,
        seeds=seeds,
        budget_exact_steps=steps,
        budget_seconds=args.budget_seconds,
        fractions=fractions,
        out=out,
        show_progress=not args.quiet,
        plots=plots,
    )
    if not args.quiet:
        print(report.to_markdown())
    print(
        f"wrote {out}/report.md, report.json" + ("" if args.no_plots or missing else " and plots")
    )
    stalled = sum(len(seeds) for seeds in report.stalls().values())
    if report.axis == "seconds" and stalled:
        print(
            f"gradest race: {stalled} (seed, estimator) runs had machine stalls that spent their "
            f"wall-time budget (report.md, 'Machine stalls'); rerun on a quiet machine",
            file=sys.stderr,
        )
    return 0


def _list_race_tasks() -> None:
    """The installed race tasks and their options (what ``--task-option`` can set)."""
    from gradest_lab.race.plain_race import RACE_TASKS_GROUP, registered_tasks
    from gradest_lab.race.task_options import describe_task_options

    tasks = registered_tasks()
    if not tasks:
        print(
            f"no race tasks installed (applications register them under the "
            f"{RACE_TASKS_GROUP!r} entry points, e.g. pip install ./apps/digits)"
        )
        return
    for name, factory in sorted(tasks.items()):
        print(f"{name}: {describe_task_options(factory)}")


COMMAND = Command(
    help="compute-matched race: reward against compute of estimators fine-tuning one task "
    "under one budget",
    add_arguments=add_arguments,
    run=run,
)
