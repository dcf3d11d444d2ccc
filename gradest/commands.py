"""Subcommands of the ``gradest`` command line that applications contribute.

An application registers a :class:`Command` under the ``gradest.commands`` entry-point
group (``gradest-digits`` registers ``finetune`` and ``pretrain``); ``gradest --help``
lists it when the application is installed and works the same when it is not. The entry
point's module should import lightly (heavy imports inside ``add_arguments`` / ``run``),
since ``gradest --help`` loads every registered command.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import attrs

from gradest import entry_points

GROUP = "gradest.commands"


@attrs.frozen
class Command:
    """One ``gradest NAME`` subcommand.

    Attributes:
        help: the one line ``gradest --help`` shows.
        add_arguments: adds the subcommand's flags to its parser.
        run: runs the parsed flags; returns the exit status.
        config_file: the subcommand takes ``--config FILE`` (TOML whose keys are its flags;
            :mod:`gradest.config_file`), which ``add_arguments`` must add.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    config_file: bool = False


def _command_problem(candidate: object) -> str | None:
    return None if isinstance(candidate, Command) else "is not a gradest.commands.Command"


@functools.cache
def registered_commands() -> dict[str, Command]:
    """Name -> :class:`Command` for every installed application."""
    return entry_points.load_installed(GROUP, what="command", check=_command_problem)
