"""Settings from a TOML file as a command's defaults, so flags on the command line win.

``gradest finetune --config run.toml --steps 50``: the file's keys are the command's flag
names without the leading ``--`` (``batch-size`` or ``batch_size``), its values TOML's own
types::

    estimator = "jagg:window=4"
    steps = 200
    lr = 1e-4
    labels = "null"

A setting that is a list of estimator specs (a flag with
``type=gradest.plugin.spec_list_text``) takes either one string in the list syntax of
:func:`gradest.plugin.split_spec_list` or an array of spec strings:
``estimators = "exact,jagg:window=4,tau=0.9,sdo"`` and ``estimators = ["exact",
"jagg:window=4,tau=0.9", "sdo"]`` are the same list. A single-estimator setting takes one
spec, whose list-valued options use the same syntax (``estimator =
"auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)"``).

Each value is checked against its flag (type and choices) before anything runs, and an
unknown key is refused with the list of known ones, so a typo never silently keeps a
default. The file becomes the parser's defaults and the command line is parsed again, so
any flag given explicitly overrides the file whatever the order.

Which settings were given at all (on the command line or in the file), rather than left at
their defaults, is known from :func:`track_explicit` / :func:`explicit_settings`: a command
that continues an earlier run (``gradest finetune --resume DIR``) takes the run's settings
for every flag not given and compares only the given ones.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradest import InvalidType, InvalidValue
from gradest.plugin import (
    SPEC_LIST_EXAMPLE,
    WholeNumber,
    format_spec_list,
    spec_list_text,
    split_spec_list,
)
from gradest_lab.storage.files import read_text

# Flags that are about the invocation rather than the run's settings.
NOT_IN_FILE = frozenset({"help", "config", "resume", "command", "run"})


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.dest: action
        for action in parser._actions  # argparse keeps no public list of its actions
        if action.option_strings and action.dest not in NOT_IN_FILE
    }


def _checked(key: str, value: Any, action: argparse.Action, path: Path) -> Any:
    where = f"{key} = {value!r} in {path}"
    if isinstance(
        action,
        argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction,
    ):
        if not isinstance(value, bool):
            raise InvalidType(f"{where}: expected true or false")
        # store_false flags (--no-x) and --x/--no-x pairs keep the meaning of their dest:
        # the file says the value.
        return value
    kind = action.type
    if kind is int or isinstance(kind, WholeNumber):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidType(f"{where}: expected an integer (e.g. {key} = 3)")
        if isinstance(kind, WholeNumber):  # the flag's own range, as on the command line
            try:
                value = kind.check(value)
            except InvalidValue as err:
                raise InvalidValue(f"{where}: {err}") from None
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidType(f"{where}: expected a number (e.g. {key} = 0.5)")
        value = float(value)
    elif kind is spec_list_text:
        # A list of estimator specs: one string in the list syntax or an array of spec
        # strings, both read by gradest.plugin.split_spec_list (the file's text is checked here).
        try:
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                value = format_spec_list(value)
            elif not isinstance(value, str):
                raise InvalidType(
                    f'{where}: expected a spec list, e.g. {key} = "{SPEC_LIST_EXAMPLE}" or '
                    f'{key} = ["exact", "jagg:window=4,tau=0.9"]'
                )
            split_spec_list(value, what=f"{key} in {path}")
        except InvalidValue as err:
            raise InvalidValue(f"{where}: {err}") from err
    elif not isinstance(value, str):
        raise InvalidType(f'{where}: expected a string (e.g. {key} = "...")')
    elif callable(kind):
        value = kind(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise InvalidValue(f"{where}: must be one of {choices}")
    return value


def load_defaults(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings as ``{dest: value}`` for ``parser.set_defaults``, checked."""
    path = Path(path)
    # A regular file of UTF-8 text (gradest_lab.storage.files.read_text: a FIFO, a device or bytes
    # that are not UTF-8 are one line naming the file).
    text = read_text(path, what="--config")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InvalidValue(f"--config {str(path)!r} is not valid TOML: {err}") from err
    except RecursionError:
        # tomllib recurses once per nested array or inline table, as json does per level.
        raise InvalidValue(
            f"--config {str(path)!r} is not valid TOML: it nests arrays or tables deeper than "
            f"the parser can follow; settings are flat keys"
        ) from None
    settable = _settable(parser)
    defaults = {}
    spelled: dict[str, str] = {}  # dest -> the key that set it
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest in spelled:
            # batch_size and batch-size are one setting: neither may silently win.
            raise InvalidValue(
                f"--config {str(path)!r}: {spelled[dest]!r} and {key!r} are the same setting; "
                f"give it once"
            )
        spelled[dest] = key
        if dest not in settable:
            if isinstance(value, dict):
                raise InvalidValue(
                    f"--config {str(path)!r}: [{key}] tables are not settings; write the "
                    f"keys at the top level"
                )
            known = ", ".join(sorted(name.replace("_", "-") for name in settable))
            raise InvalidValue(f"--config {str(path)!r}: unknown setting {key!r}; known: {known}")
        defaults[dest] = _checked(key, value, settable[dest], path)
    return defaults


# The namespace attribute that holds the settings given explicitly (track_explicit).
EXPLICIT = "explicit_settings"


_TRACKING: dict[type, type] = {}


def _tracking(kind: type[argparse.Action]) -> type[argparse.Action]:
    """``kind`` that also records its ``dest`` as given: argparse calls an action only for
    an option present on the command line, never for a default."""
    if getattr(kind, "tracks_explicit", False) or kind in _TRACKING:
        return _TRACKING.get(kind, kind)

    class Tracking(kind):  # type: ignore[valid-type,misc]
        tracks_explicit = True

        def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
            super().__call__(parser, namespace, values, option_string)
            given = getattr(namespace, EXPLICIT, None) or frozenset()
            setattr(namespace, EXPLICIT, given | {self.dest})

    Tracking.__name__ = Tracking.__qualname__ = f"Explicit{kind.__name__}"
    _TRACKING[kind] = Tracking
    return Tracking


def track_explicit(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` record which of its settings a parse was given explicitly.

    Call it once the flags are added. Every parse then sets ``args.explicit_settings``: a
    frozenset of the dests given on the command line or in a ``--config`` file
    (:func:`parse_with_config` adds the file's keys); a default never counts. Read it
    with :func:`explicit_settings`.
    """
    for action in _settable(parser).values():
        action.__class__ = _tracking(type(action))
    # Immutable, so a default shared between parses is never changed in place.
    parser.set_defaults(**{EXPLICIT: frozenset()})


def explicit_settings(args: argparse.Namespace) -> frozenset[str] | None:
    """The dests ``args`` was given explicitly (command line or ``--config`` file); None
    when its parser did not :func:`track_explicit` (then nothing is known to be a
    default)."""
    given = getattr(args, EXPLICIT, None)
    return None if given is None else frozenset(given)


def parse_with_config(
    parser: argparse.ArgumentParser,
    subparser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    args: argparse.Namespace,
) -> argparse.Namespace:
    """``args`` again, with ``args.config``'s settings as ``subparser``'s defaults (``args``
    itself without ``--config``): a :class:`gradest.plugin.Command`'s ``reparse``."""
    if getattr(args, "config", None) is None:
        return args
    defaults = load_defaults(args.config, subparser)
    if EXPLICIT in subparser._defaults:  # track_explicit: the file's settings are given ones
        defaults[EXPLICIT] = frozenset(defaults)
    subparser.set_defaults(**defaults)
    return parser.parse_args(argv)
