"""``gradest pretrain`` and ``gradest finetune``, registered under ``gradest.commands``.

Imports stay inside the functions: ``gradest --help`` loads this module.
"""

from __future__ import annotations

import argparse

from gradest.commands import Command


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


def _run_finetune(args: argparse.Namespace) -> int:
    from gradest_digits.finetune_cli import run_finetune_from_args

    result = run_finetune_from_args(args)
    if result.get("rank", 0) != 0:  # under torchrun, rank 0 reports for everyone
        return 0
    print(
        f"reward {result['initial_reward']:.4f} -> {result['final_reward']:.4f}; "
        f"log {result['log_path']}"
    )
    return 0


pretrain = Command(
    help="regenerate the shipped digits DiT or digit classifier (a few CPU minutes)",
    add_arguments=_add_pretrain_arguments,
    run=_run_pretrain,
)
finetune = Command(
    help="reward fine-tuning of the pretrained digits DiT with any estimator",
    add_arguments=_add_finetune_arguments,
    run=_run_finetune,
    config_file=True,
)
