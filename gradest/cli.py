"""The ``gradest`` command line.

gradest's own subcommands are ``gradest list`` (the registered estimators and their
options) and ``gradest check`` (every estimator against its dense definition on the
embedded toy model). Other distributions add theirs through the ``gradest.commands``
entry points (:class:`gradest.plugin.Command`): the lab (``gradest-lab``) adds
``compare``, ``race`` and ``cost``, the digits application ``pretrain`` and
``finetune``. gradest's own errors (:class:`gradest.GradestError`: bad input, an output
that cannot be written, a missing optional dependency) exit with status 2 and one line;
any other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from gradest import entry_points, registry
from gradest.commands import CommandInterrupted, registered_commands
from gradest.errors import GradestError
from gradest.integers import WholeNumber
from gradest.specs import SPEC_LIST_HELP, spec_list_text, split_spec_list


def _cmd_list(args: argparse.Namespace) -> int:
    from gradest.axes import describe_axes

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


def _cmd_check(args: argparse.Namespace) -> int:
    from gradest.check import run_check

    # The one list syntax (gradest.specs).
    specs = split_spec_list(args.estimators, what="--estimators")
    ok = run_check(specs or None, steps=args.steps, seed=args.seed, show_progress=not args.quiet)
    return 0 if ok else 1


# The library's own subcommands (applications add theirs through gradest.commands).
_OWN_COMMANDS = ("list", "check")


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

    for name, command in sorted(registered_commands().items()):
        if name in sub.choices:  # gradest's own subcommands are not replaceable
            continue
        app = sub.add_parser(name, help=command.help)
        command.add_arguments(app)
        app.set_defaults(run=command.run, reparse=command.reparse, subparser=app)
    return parser


# Subcommands that the distributions beside gradest in its repository contribute
# (gradest.commands entry points): named here only so that calling one without its
# distribution says what to install. gradest imports nothing from them.
APPLICATION_COMMANDS = {
    "compare": ("gradest-lab", "pip install ./lab"),
    "race": ("gradest-lab", "pip install ./lab"),
    "cost": ("gradest-lab", "pip install ./lab"),
    "finetune": ("gradest-digits", "pip install ./lab ./apps/digits"),
    "pretrain": ("gradest-digits", "pip install ./lab ./apps/digits"),
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
        if getattr(args, "reparse", None) is not None:
            # The command's second look at its flags (defaults from a --config file).
            args = args.reparse(parser, args.subparser, argv, args)
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
    except CommandInterrupted as err:
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
