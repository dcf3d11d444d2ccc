"""The ``gradest`` command line.

``gradest list`` shows the registered estimators and their options; ``gradest check``
(the main job on the embedded toy model) checks every estimator against the dense
reference and prints a table. User errors exit with status 2 and one line, no traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import attrs

from gradest import registry


def _cmd_list(args: argparse.Namespace) -> int:
    del args
    for name, cls in sorted(registry.available_estimators().items()):
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"{name}: {doc[0] if doc else cls.__name__}")
        for option, default, text in registry.describe(name):
            print(f"    {option}={default!r}  {text}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from gradest.check import run_check

    specs = [s for s in (args.estimators.split(";") if args.estimators else []) if s.strip()]
    ok = run_check(specs or None, steps=args.steps, seed=args.seed, show_progress=not args.quiet)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradest",
        description="Gradients through diffusion / flow-model sampling chains.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list estimators and their options").set_defaults(run=_cmd_list)
    check = sub.add_parser(
        "check",
        help="check every estimator against the dense reference on the embedded toy model",
    )
    check.add_argument(
        "--estimators",
        default="",
        help="';'-separated estimator specs (default: every registered estimator with "
        "its defaults and the configurations DESIGN.md pins), e.g. 'jagg:window=4;sdo'",
    )
    check.add_argument("--steps", type=int, default=8, help="sampling steps N (default 8)")
    check.add_argument("--seed", type=int, default=0, help="seed of model, noise and draws")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(run=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return int(args.run(args))
    except (ValueError, TypeError, attrs.exceptions.FrozenInstanceError) as err:
        print(f"gradest {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
