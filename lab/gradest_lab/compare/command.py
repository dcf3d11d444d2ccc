"""``gradest compare``: the main job, bias, variance and cost of estimators on an embedded model.

The command behind ``python3 dev.py demo``: it builds an embedded problem (``mlp``, ``dit``,
or one an application registers under ``gradest.problems``, such as ``digits``), measures
the estimators with :func:`gradest.harness.compare` and writes ``report.md``,
``report.json`` and the plots to ``--out``, a run folder
(:mod:`gradest_lab.storage.run_folder`) that holds one compare. Every argument is checked
before the folder is looked at. For a terminal objective the report also holds the
chain's contraction on the first trajectory (``||dz_N/dz_k||_2`` at about ten steps,
:func:`gradest.harness.chain_contraction` with ``compare``'s default iterations), and the
plots ``contraction.png``.
"""

from __future__ import annotations

import argparse

from gradest import InvalidValue, estimator, rollout
from gradest.harness import prepare_compare
from gradest.plugin import (
    Command,
    WholeNumber,
    format_spec_list,
    line_up,
    parse_spec,
    spec_list_text,
    supports,
)
from gradest_lab.command_line import SPEC_LIST_HELP, check_device, estimator_specs
from gradest_lab.storage.files import check_output_dir, check_path_length, refuse_non_file
from gradest_lab.storage.run_folder import RunRecord, claim_run_folder

__all__ = ["COMMAND", "add_arguments", "compare_line_up", "run"]


def compare_line_up() -> list[str]:
    """``gradest compare``'s default estimators: every built-in estimator in its recommended
    forms, the new unbiased ones beside the biased ones they correct, as each estimator's
    class says (``compare_specs``, :func:`gradest.plugin.line_up`)."""
    return line_up("compare")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gradest compare``'s flags."""
    parser.add_argument(
        "--model", default="mlp", help="embedded model: mlp, dit or digits (default mlp)"
    )
    parser.add_argument(
        "--steps", type=WholeNumber(1), default=50, help="sampling steps N (default 50)"
    )
    parser.add_argument(
        "--estimators",
        default=None,  # compare_line_up(), read from the registry when the command runs
        type=spec_list_text,
        help=f"{SPEC_LIST_HELP} (default: every built-in estimator in its recommended form)",
    )
    parser.add_argument(
        "--seeds", type=WholeNumber(1), default=16, help="trajectories (default 16)"
    )
    parser.add_argument(
        "--draws",
        type=WholeNumber(1),
        default=16,
        help="draws per trajectory of stochastic estimators",
    )
    parser.add_argument(
        "--batch", type=WholeNumber(1), default=8, help="samples per trajectory (default 8)"
    )
    parser.add_argument(
        "--objective", default="terminal", help="terminal or stepwise (default terminal)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float64", help="float64 or float32")
    parser.add_argument(
        "--repeats", type=WholeNumber(1), default=3, help="wall-time repeats (median)"
    )
    parser.add_argument(
        "--out", default="runs/compare", help="output folder (default runs/compare)"
    )
    parser.add_argument("--no-sweeps", dest="sweeps", action="store_false", help="skip jagg sweeps")
    parser.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


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


def run(args: argparse.Namespace) -> int:
    """Run ``gradest compare`` with the parsed flags; returns the exit status."""
    import torch

    from gradest_lab.compare.problems import embedded_problem
    from gradest_lab.compare.report_files import write_report
    from gradest_lab.compare.sweeps import jagg_debias_sweep, jagg_span_sweep, jagg_tau_sweep
    from gradest_lab.plots import plots_unavailable

    default = compare_line_up()
    given = args.estimators if args.estimators is not None else format_spec_list(default)
    specs = estimator_specs(given, example="exact,jagg:window=4,sdo")
    if specs == default:
        # The default line-up holds terminal-only estimators; a stepwise run leaves them
        # out and says so (an explicit --estimators list is checked by compare itself).
        kept = [s for s in specs if supports(estimator(s), args.objective)]
        if len(kept) < len(specs) and not args.quiet:
            left = ", ".join(s for s in specs if s not in kept)
            print(f"gradest compare: {left} left out (no {args.objective} objectives)")
        specs = kept
    # --seeds, --draws, --repeats, --steps and --batch are whole numbers >= 1 by their type
    # (gradest.plugin.WholeNumber), checked as they are parsed.
    dtype = {"float64": torch.float64, "float32": torch.float32}.get(args.dtype)
    if dtype is None:
        raise InvalidValue(f"--dtype must be float64 or float32, got {args.dtype!r}")
    check_device(args.device)
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
        # Nothing but a regular file is ever replaced (gradest_lab.storage.files.refuse_non_file).
        refuse_non_file(out / name, what=f"--out {str(out)!r} cannot hold {name}:")
    missing = None if args.no_plots else plots_unavailable()
    if missing is not None and not args.quiet:
        print(f"gradest compare: plots will be skipped: {missing}")
    with claim_run_folder(out, record):
        report = prepared.run()
        if args.sweeps and any(parse_spec(s)[0] == "jagg" for s in specs):
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
        write_report(report, out, plots=plots)
    print(report.to_markdown())
    print(f"wrote {out}/report.md, report.json" + (" and plots" if plots else ""))
    if missing is not None:
        print(f"plots skipped: {missing}")
    return 0


COMMAND = Command(
    help="bias, variance and cost of estimators on an embedded model (the main job)",
    add_arguments=add_arguments,
    run=run,
)
