"""``gradest pretrain`` and ``gradest finetune``, registered under ``gradest.commands``.

Imports stay inside the functions: ``gradest --help`` loads this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradest.plugin import Command


def _add_pretrain_arguments(parser: argparse.ArgumentParser) -> None:
    from gradest_digits.pretrain import add_arguments

    add_arguments(parser)


def _run_pretrain(args: argparse.Namespace) -> int:
    from gradest_digits.pretrain import run

    for key, value in run(args).items():
        print(f"{key}: {value}")
    return 0


def _add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    from gradest_digits.finetune_cli import add_finetune_arguments

    add_finetune_arguments(parser)


def _reparse_finetune(
    parser: argparse.ArgumentParser,
    subparser: argparse.ArgumentParser,
    argv: Sequence[str],
    args: argparse.Namespace,
) -> argparse.Namespace:
    """``--config FILE``'s settings as the flags' defaults (the lab's config files)."""
    from gradest_lab.storage.config_file import parse_with_config

    return parse_with_config(parser, subparser, argv, args)


#: The exit status after Ctrl-C (128 + SIGINT), as shells report an interrupted command.
INTERRUPTED = 130


def _run_finetune(args: argparse.Namespace) -> int:
    import sys

    from gradest.integrations.distributed import launched_world
    from gradest_digits.finetune_cli import run_finetune_from_args

    try:
        result = run_finetune_from_args(args)
    except KeyboardInterrupt:
        # Ctrl-C: gradest's own handler would say "nothing was written", but a run has
        # written its log and checkpoints (each atomically: complete or absent); say how to
        # continue, once (rank 0 under torchrun).
        if launched_world()[0] == 0:
            print(interrupted_line(args), file=sys.stderr)
        return INTERRUPTED
    if result.get("rank", 0) != 0:  # under torchrun, rank 0 reports for everyone
        return 0
    print(
        f"reward {result['initial_reward']:.4f} -> {result['final_reward']:.4f}; "
        f"log {result['log_path']}"
    )
    return 0


def interrupted_line(args: argparse.Namespace) -> str:
    """The one line ``gradest finetune`` stopped by Ctrl-C ends with: the newest complete
    checkpoint and ``gradest finetune --resume OUT``, which continues from it."""
    import shlex
    from pathlib import Path

    from gradest_digits.run_state import checkpoints_in

    # The run's folder, as run_finetune_from_args decides it.
    out = Path(args.resume or args.out or "runs/finetune")
    resume = f"gradest finetune --resume {shlex.quote(str(out))}"
    found = checkpoints_in(out / "checkpoints")
    if not found:
        return (
            f"gradest finetune: interrupted before its first checkpoint (--checkpoint-every N "
            f"saves one every N steps, the default 0 only the final one); {resume} starts it "
            f"over from step 0"
        )
    step, path = found[0]
    return (
        f"gradest finetune: interrupted; the last complete checkpoint is step {step} "
        f"({path}); continue with: {resume}"
    )


pretrain = Command(
    help="regenerate the shipped digits DiT or digit classifier (a few CPU minutes)",
    add_arguments=_add_pretrain_arguments,
    run=_run_pretrain,
)
finetune = Command(
    help="reward fine-tuning of the pretrained digits DiT with any estimator",
    add_arguments=_add_finetune_arguments,
    run=_run_finetune,
    reparse=_reparse_finetune,
)
