"""Subcommands of the ``gradest`` command line that other distributions contribute.

A distribution registers a :class:`Command` under the ``gradest.commands`` entry-point
group (the lab, ``gradest-lab``, registers ``compare``, ``race`` and ``cost``;
``gradest-digits`` registers ``finetune`` and ``pretrain``); ``gradest --help`` lists it
when it is installed and works the same when it is not. The entry point's module should
import lightly (heavy imports inside ``add_arguments`` / ``run``), since ``gradest
--help`` loads every registered command.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence

import attrs

from gradest import entry_points

GROUP = "gradest.commands"

#: ``reparse(parser, subparser, argv, args) -> args``: see :attr:`Command.reparse`.
Reparse = Callable[
    [argparse.ArgumentParser, argparse.ArgumentParser, Sequence[str], argparse.Namespace],
    argparse.Namespace,
]


@attrs.frozen
class Command:
    """One ``gradest NAME`` subcommand.

    Attributes:
        help: the one line ``gradest --help`` shows.
        add_arguments: adds the subcommand's flags to its parser.
        run: runs the parsed flags; returns the exit status. A documented refusal is a
            :class:`gradest.GradestError` (printed as one line, exit 2); Ctrl-C after the
            command kept its progress is :class:`CommandInterrupted`.
        reparse: called once the flags are parsed, before ``run``, with the whole
            parser, the subcommand's parser, the command line and the parsed flags;
            returns the flags to run with (a command whose ``--config FILE`` sets its
            defaults parses again with them). None: the flags as parsed.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    reparse: Reparse | None = None


class CommandInterrupted(KeyboardInterrupt):
    """Ctrl-C in a command that keeps its progress; the message says how to continue it
    (the command line prints ``gradest NAME: interrupted; <message>`` and exits 130)."""


def _command_problem(candidate: object) -> str | None:
    return None if isinstance(candidate, Command) else "is not a gradest.plugin.Command"


@functools.cache
def registered_commands() -> dict[str, Command]:
    """Name -> :class:`Command` for every installed distribution that adds one."""
    return entry_points.load_entry_points(GROUP, what="command", check=_command_problem)
