"""The ``gradest`` command line.

``gradest list`` shows the registered estimators and their options; ``gradest check``
checks every estimator against its dense definition on the embedded toy model;
``gradest compare`` (the main job) measures bias, variance and cost of estimators on an
embedded model and writes a report with plots. Applications add their own subcommands
through the ``gradest.commands`` entry points (:mod:`gradest.commands`; ``gradest-digits``
adds ``pretrain`` and ``finetune``). gradest's own errors (:class:`gradest.errors.GradestError`: bad
input, an output that cannot be written, a missing optional dependency) exit with status
2 and one line; any other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from gradest import cost_command, entry_points, registry
from gradest._checks import check_path_length
from gradest.commands import registered_commands
from gradest.errors import GradestError, InvalidValue
from gradest.files import check_output_dir, refuse_non_file
from gradest.integers import WholeNumber
from gradest.protocol import supports
from gradest.specs import SPEC_LIST_EXAMPLE, format_spec_list, spec_list_text, split_spec_list


def compare_line_up() -> list[str]:
    """``gradest compare``'s default estimators: every built-in estimator in its recommended
    forms, the new unbiased ones beside the biased ones they correct, as each estimator's
    class says (``compare_specs``, :func:`gradest.registry.line_up`)."""
    return registry.line_up("compare")


# Both commands' --estimators help: the one list syntax (gradest.specs), one example.
SPEC_LIST_HELP = (
    "estimator specs separated by ',' (options continue their spec; a list-valued option "
    f"in parentheses), e.g. --estimators '{SPEC_LIST_EXAMPLE}'"
)


def _cmd_list(args: argparse.Namespace) -> int:
    from gradest.axes import describe_axes

    if getattr(args, "tasks", False):
        _list_race_tasks()
        return 0
    verbose = getattr(args, "verbose", False)
    for name, cls in sorted(registry.available_estimators().items()):
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"{name}: {doc[0] if doc else cls.__name__}")
        if verbose:
            for field, text in describe_axes(cls):
                print(f"  {field}: {text}")
            print("  options:")
        for option, default, text in registry.describe(name):
            print(f"    {option}={default!r}  {text}")
    return 0


def _list_race_tasks() -> None:
    """The installed race tasks and their options (what ``--task-option`` can set)."""
    from gradest.harness.race import RACE_TASKS_GROUP, registered_tasks
    from gradest.harness.task_options import describe_task_options

    tasks = registered_tasks()
    if not tasks:
        print(
            f"no race tasks installed (applications register them under the "
            f"{RACE_TASKS_GROUP!r} entry points, e.g. pip install ./apps/digits)"
        )
        return
    for name, factory in sorted(tasks.items()):
        print(f"{name}: {describe_task_options(factory)}")


def _cmd_check(args: argparse.Namespace) -> int:
    from gradest.check import run_check

    # The one list syntax (gradest.specs).
    specs = split_spec_list(args.estimators, what="--estimators")
    ok = run_check(specs or None, steps=args.steps, seed=args.seed, show_progress=not args.quiet)
    return 0 if ok else 1


def _estimator_specs(text: str, *, example: str) -> list[str]:
    """The specs of ``--estimators``, each built once so that a bad one fails before any
    work starts; an empty list is refused with ``example`` as the fix."""
    specs = split_spec_list(text, what="--estimators")
    if not specs:
        raise InvalidValue(f"--estimators is empty; e.g. --estimators {example}")
    for spec in specs:
        registry.estimator(spec)
    return specs


# What defines a compare's numbers (besides its estimators): a folder holds one compare.
_COMPARE_SETTINGS = (
    "model",
    "objective",
    "steps",
    "batch",
    "seeds",
    "draws",
    "repeats",
    "dtype",
    "device",
    "sweeps",
)


def _cmd_compare(args: argparse.Namespace) -> int:
    import torch

    from gradest.harness.compare import prepare_compare
    from gradest.harness.embedded import embedded_problem
    from gradest.harness.plots import plots_unavailable
    from gradest.harness.sweeps import jagg_debias_sweep, jagg_span_sweep, jagg_tau_sweep
    from gradest.run_folder import RunRecord, claim_run_folder

    default = compare_line_up()
    given = args.estimators if args.estimators is not None else format_spec_list(default)
    specs = _estimator_specs(given, example="exact,jagg:window=4,sdo")
    if specs == default:
        # The default line-up holds terminal-only estimators; a stepwise run leaves them
        # out and says so (an explicit --estimators list is checked by compare itself).
        kept = [s for s in specs if supports(registry.estimator(s), args.objective)]
        if len(kept) < len(specs) and not args.quiet:
            left = ", ".join(s for s in specs if s not in kept)
            print(f"gradest compare: {left} left out (no {args.objective} objectives)")
        specs = kept
    # --seeds, --draws, --repeats, --steps and --batch are whole numbers >= 1 by their type
    # (gradest.integers.WholeNumber), checked as they are parsed.
    dtype = {"float64": torch.float64, "float32": torch.float32}.get(args.dtype)
    if dtype is None:
        raise InvalidValue(f"--dtype must be float64 or float32, got {args.dtype!r}")
    _check_device(args.device)
    # The folder holds one compare: its settings (all but where the output goes and how it
    # is shown) are its identity; rerunning the same compare rewrites its report.
    record = RunRecord(
        command="gradest compare",
        settings={
            "estimators": specs,
            **{k: getattr(args, k) for k in _COMPARE_SETTINGS},
        },
    )
    # Every argument is checked before the folder is looked at: a mistyped --model in a
    # folder that holds another run is told about the --model, not about the folder. The
    # folder last: its path, then (claim_run_folder) whose run it holds. Nothing is
    # created before the report is written.
    problem = embedded_problem(
        args.model,
        steps=args.steps,
        objective=args.objective,
        batch=args.batch,
        dtype=dtype,
        device=args.device,
    )
    prepared = prepare_compare(
        problem.model,
        problem.sampler,
        problem.objective,
        specs,
        noise_fn=problem.noise_fn,
        cond_fn=problem.cond_fn,
        seeds=args.seeds,
        draws=args.draws,
        timing_repeats=args.repeats,
        show_progress=not args.quiet,
    )
    check_path_length(args.out, what=f"--out {args.out!r}")
    out = check_output_dir(args.out, what="--out", create=False)
    for name in ("report.md", "report.json"):
        # Nothing but a regular file is ever replaced (gradest.files.refuse_non_file).
        refuse_non_file(out / name, what=f"--out {str(out)!r} cannot hold {name}:")
    missing = None if args.no_plots else plots_unavailable()
    if missing is not None and not args.quiet:
        print(f"gradest compare: plots will be skipped: {missing}")
    with claim_run_folder(out, record):
        report = prepared.run()
        if args.sweeps and any(registry.parse_spec(s)[0] == "jagg" for s in specs):
            from gradest.trajectory import rollout

            cond = problem.cond_fn(0)
            trajectory = rollout(problem.model, problem.sampler, problem.noise_fn(0), cond=cond)
            report.config["sweeps"] = {
                # one group of at most 8 steps (a stepwise objective knows only N steps)
                "span": jagg_span_sweep(
                    problem.model,
                    problem.objective,
                    problem.noise_fn(0),
                    cond,
                    steps=min(8, args.steps),
                ),
                "tau": jagg_tau_sweep(
                    problem.model, problem.sampler, problem.objective, trajectory, cond
                ),
                "debias": jagg_debias_sweep(
                    problem.model, problem.sampler, problem.objective, trajectory, cond
                ),
            }
        plots = not args.no_plots and missing is None
        report.write(out, plots=plots)
    print(report.to_markdown())
    print(f"wrote {out}/report.md, report.json" + (" and plots" if plots else ""))
    if missing is not None:
        print(f"plots skipped: {missing}")
    return 0


def _check_device(text: str) -> None:
    """``--device``: cpu or cuda, and cuda only where torch sees a CUDA device (before any
    model is built: one line instead of torch's error from deep inside)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise InvalidValue(f"--device {text!r} is not a torch device; use cpu or cuda") from err
    if device.type not in ("cpu", "cuda"):
        raise InvalidValue(f"--device {text!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidValue(f"--device {text} requested but CUDA is not available; use --device cpu")


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


class _RunInterrupted(KeyboardInterrupt):
    """Ctrl-C in a command that keeps its progress: the message says how to continue."""


def _cmd_race(args: argparse.Namespace) -> int:
    try:
        return _race_command(args)
    except KeyboardInterrupt:
        out = os.path.abspath(args.out)
        if os.path.isfile(os.path.join(out, "run.json")):
            # The race claimed its folder and keeps every finished evaluation point there.
            raise _RunInterrupted(
                f"its finished runs and evaluation points are kept in {args.out!r}; rerun the "
                f"same command to continue it"
            ) from None
        raise


def _race_command(args: argparse.Namespace) -> int:
    from gradest.harness.plots import plots_unavailable
    from gradest.harness.race import (
        DEFAULT_FRACTIONS,
        RACE_TASKS_GROUP,
        _check_fractions,
        race,
        registered_tasks,
    )
    from gradest.harness.task_options import parse_task_options
    from gradest.harness.tuned_race import (
        DEFAULT_TUNED_FRACTIONS,
        parse_lr_grid,
        parse_seed_list,
        tuned_race,
    )

    specs = _estimator_specs(args.estimators, example="exact,sdo,truncated:k=1")
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
    _check_device(args.device)  # compare's check: before the task loads its model
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


# The library's own subcommands (applications add theirs through gradest.commands).
_OWN_COMMANDS = ("list", "check", "compare", "race", "cost")


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag's value refused while parsing (a type's error:
    ``--batch -1`` under :mod:`gradest.integers`' rule, ``--seeds x``, a bad choice)
    reaches :func:`main` as an ``ArgumentError``, printed as one line like every other
    refusal (argparse would print the usage first); unknown and missing flags keep
    argparse's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradest",
        description="Gradients through diffusion / flow-model sampling chains.",
        exit_on_error=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    listing = sub.add_parser("list", help="list estimators and their options")
    listing.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print each estimator's design axes (cotangents, evaluation), memory "
        "policy and where its cost formula is",
    )
    listing.add_argument(
        "--tasks",
        action="store_true",
        help="list the installed race tasks (gradest race --model) and their options "
        "(--task-option KEY=VALUE) instead",
    )
    listing.set_defaults(run=_cmd_list)
    check = sub.add_parser(
        "check",
        help="check every estimator against the dense reference on the embedded toy model",
    )
    check.add_argument(
        "--estimators",
        default="",
        type=spec_list_text,
        help=f"{SPEC_LIST_HELP} (default: every registered estimator with its defaults and "
        "the known truths of docs/design.md#known-truths)",
    )
    check.add_argument(
        "--steps", type=WholeNumber(1), default=8, help="sampling steps N (default 8)"
    )
    check.add_argument(
        "--seed", type=WholeNumber(0), default=0, help="seed of model, noise and draws"
    )
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(run=_cmd_check)

    cmp = sub.add_parser(
        "compare",
        help="bias, variance and cost of estimators on an embedded model (the main job)",
    )
    cmp.add_argument(
        "--model", default="mlp", help="embedded model: mlp, dit or digits (default mlp)"
    )
    cmp.add_argument(
        "--steps", type=WholeNumber(1), default=50, help="sampling steps N (default 50)"
    )
    cmp.add_argument(
        "--estimators",
        default=None,  # compare_line_up(), read from the registry when the command runs
        type=spec_list_text,
        help=f"{SPEC_LIST_HELP} (default: every built-in estimator in its recommended form)",
    )
    cmp.add_argument("--seeds", type=WholeNumber(1), default=16, help="trajectories (default 16)")
    cmp.add_argument(
        "--draws",
        type=WholeNumber(1),
        default=16,
        help="draws per trajectory of stochastic estimators",
    )
    cmp.add_argument(
        "--batch", type=WholeNumber(1), default=8, help="samples per trajectory (default 8)"
    )
    cmp.add_argument(
        "--objective", default="terminal", help="terminal or stepwise (default terminal)"
    )
    cmp.add_argument("--device", default="cpu", help="cpu or cuda")
    cmp.add_argument("--dtype", default="float64", help="float64 or float32")
    cmp.add_argument("--repeats", type=WholeNumber(1), default=3, help="wall-time repeats (median)")
    cmp.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    cmp.add_argument("--no-sweeps", dest="sweeps", action="store_false", help="skip jagg sweeps")
    cmp.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    cmp.add_argument("--quiet", action="store_true", help="no progress bar")
    cmp.set_defaults(run=_cmd_compare)

    rc = sub.add_parser(
        "race",
        help="compute-matched race: reward against compute of estimators fine-tuning one "
        "task under one budget",
    )
    rc.add_argument(
        "--model", required=True, help="a registered race task, e.g. digits or digits-grpo"
    )
    rc.add_argument(
        "--estimators",
        default="exact,sdo,truncated:k=1",
        type=spec_list_text,
        help=f"{SPEC_LIST_HELP} (exact is added when missing: the reference)",
    )
    rc.add_argument(
        "--seeds",
        default="16",
        help="the (report) seeds: a count (16: seeds 0-15), a range (16-31) or a list (0,3,5)",
    )
    rc.add_argument(
        "--tune",
        default=None,
        metavar="lr=GRID",
        help="tune every estimator's lr on --tune-seeds before the race: lr=3e-5..1e-3:6 (6 "
        "log-spaced points) or lr=1e-4,3e-4,1e-3 (FLOPs budgets only)",
    )
    rc.add_argument(
        "--tune-seeds",
        default=None,
        help="the tuning seeds (with --tune), disjoint from --seeds, e.g. 0-7",
    )
    rc.add_argument(
        "--ceiling-factor",
        type=float,
        default=16.0,
        help="with --tune: the ceiling run's budget in race budgets (default 16)",
    )
    rc.add_argument(
        "--budget",
        default=None,
        help="backward-FLOPs budget in exact steps, e.g. 8x (the FLOPs of 8 exact steps)",
    )
    rc.add_argument(
        "--budget-seconds", type=float, default=None, help="a wall-time budget instead (s)"
    )
    rc.add_argument(
        "--fractions",
        default=None,
        help="budget fractions the model is evaluated at (default 0.125,0.25,0.5,1; with "
        "--tune every eighth: time to target interpolates between them)",
    )
    rc.add_argument(
        "--eval-samples",
        type=WholeNumber(1),
        default=256,
        help="fixed evaluation set size (>= 256)",
    )
    rc.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the task, repeatable, e.g. --task-option lr=1e-4 (gradest list --tasks "
        "shows each task's options and defaults; the race records them)",
    )
    rc.add_argument("--device", default="cpu", help="cpu or cuda")
    rc.add_argument(
        "--out", default="runs/race", help="output folder; rerun to resume (default runs/race)"
    )
    rc.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    rc.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    rc.set_defaults(run=_cmd_race)

    cost = sub.add_parser(
        "cost",
        help="FLOPs, retained activations and peak memory of a training step per estimator, "
        "traced on the meta device (SD3, Flux, SDXL presets or a diffusers config; no GPU)",
    )
    cost_command.add_arguments(cost)
    cost.set_defaults(run=cost_command.run)

    for name, command in sorted(registered_commands().items()):
        if name in sub.choices:  # gradest's own subcommands are not replaceable
            continue
        app = sub.add_parser(name, help=command.help)
        command.add_arguments(app)
        # ``subparser``: where --config's settings become defaults (see gradest.config_file).
        app.set_defaults(run=command.run, subparser=app if command.config_file else None)
    return parser


# Subcommands that this repository's applications contribute (gradest.commands entry
# points): named here only so that calling one without its application says what to install.
# gradest imports nothing from them.
APPLICATION_COMMANDS = {
    "finetune": ("gradest-digits", "pip install ./apps/digits"),
    "pretrain": ("gradest-digits", "pip install ./apps/digits"),
}


def _missing_application(argv: Sequence[str], known: Sequence[str]) -> str | None:
    """The one-line error for an application command whose application is not installed."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or command in known or command not in APPLICATION_COMMANDS:
        return None
    distribution, install = APPLICATION_COMMANDS[command]
    return (
        f"gradest {command}: error: the {command!r} command belongs to the {distribution} "
        f"application, which is not installed (or {entry_points.DISABLE_ENV} is set); install "
        f"it from the repository root with `{install}`"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    missing = _missing_application(argv, tuple(registered_commands()) + _OWN_COMMANDS)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        print(f"{_argument_prog(argv, err)}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "config", None) is not None and getattr(args, "subparser", None):
            from gradest.config_file import parse_with_config

            args = parse_with_config(parser, args.subparser, argv, args)
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return int(args.run(args))
    except (GradestError, argparse.ArgumentError) as err:
        # gradest's own documented errors (bad input, unwritable output, missing extra, a
        # plugin that failed: registry.PluginError), and a flag refused when --config's
        # settings are parsed again: one line. Anything else is a bug and keeps its
        # traceback.
        print(f"gradest {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (gradest list | head): stop quietly, as Unix tools do, and
        # keep the interpreter's final flush from failing on the closed pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except _RunInterrupted as err:
        print(f"gradest {args.command}: interrupted; {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt as err:
        where = f" ({err})" if isinstance(err, registry.PluginInterrupt) else ""
        print(f"gradest {args.command}: interrupted{where}; nothing was written", file=sys.stderr)
        return 130
    except SystemExit as err:
        if args.command not in _OWN_COMMANDS:
            raise  # an application's command may end itself with a status
        # gradest's own commands return their status and never call sys.exit: something
        # they ran did (a plugin), and a silent exit 0 would pass for success.
        print(
            f"gradest {args.command}: error: SystemExit({err.code!r}) raised inside the "
            f"command by {_raised_in(err)}; nothing was written",
            file=sys.stderr,
        )
        return 2


def _argument_prog(argv: Sequence[str], err: argparse.ArgumentError) -> str:
    """``gradest <command>`` for a refused flag of a subcommand, ``gradest`` for the
    subcommand's name itself (as argparse names them)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or err.argument_name == "command":
        return "gradest"
    return f"gradest {command}"


def _one_line(err: BaseException) -> str:
    """The message on one line (a plugin's message may hold several)."""
    return " ".join(str(err).split("\n"))


def _raised_in(err: BaseException) -> str:
    """The module outside gradest (a plugin) whose code raised ``err``, as best known."""
    traceback = err.__traceback__
    culprit = None
    while traceback is not None:
        module = traceback.tb_frame.f_globals.get("__name__", "?")
        if module != "gradest" and not module.startswith("gradest."):
            culprit = module
        traceback = traceback.tb_next
    return f"code in module {culprit!r} (a plugin?)" if culprit else "code the command ran"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
