"""The one syntax for a list of estimator specs, everywhere a list is given.

``gradest compare --estimators``, ``gradest check --estimators``, ``auto``'s
``candidates`` option, the digits paired benchmark and TOML config files all read a list
of estimator specs with :func:`split_spec_list`, so one list string means the same
estimators in every command. The grammar::

    list   := item ("," item)*
    item   := name [":" option ("," option)*]
    option := key "=" value
    value  := text without "," | "(" list ")"

Some examples:

- ``exact,jagg:window=4,tau=0.9,sdo`` is three specs: ``exact``, ``jagg:window=4,tau=0.9``
  and ``sdo``.
- ``auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)`` is one spec; the parentheses
  group the nested list that is the value of ``candidates``.
- ``auto:candidates=(exact,jagg),max_slowdown=2,sdo`` is two specs: ``auto`` (with both
  options) and ``sdo``.

The comma separates both items and the options inside one item. Which one a comma
separates is decided by the grammar, not guessed: an estimator name never contains
``=`` and an option always does. So a comma-separated piece of the form ``key=value``
(its text before the first ``=`` holding neither ``:`` nor ``(``) is an option and
continues the previous item; any other piece starts a new item. Whitespace around the
pieces is ignored. A value that is itself a list is wrapped in parentheses, so its
commas stay inside it; ``/`` inside a value keeps its meaning there (tuples of numbers,
``truncated:random=0.5/0.3/0.2``).

Errors (:class:`~gradest.errors.InvalidValue`, one line naming the input, the position
and the fix): unbalanced parentheses, an option before any name, an empty item
(``exact,,sdo``), and ``;`` or ``/`` between estimators.

Where a Python API takes a list, a sequence of spec strings and estimator objects is
accepted too (:func:`as_spec_list`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradest.errors import InvalidType, InvalidValue

__all__ = [
    "SPEC_LIST_EXAMPLE",
    "SPEC_LIST_HELP",
    "as_spec_list",
    "format_spec_list",
    "split_options",
    "split_spec_list",
    "spec_list_text",
    "strip_group",
    "top_level_pieces",
]

#: The example every command's help shows.
SPEC_LIST_EXAMPLE = "exact,jagg:window=4,tau=0.9,sdo"
#: Every command's ``--estimators`` help: the one list syntax, one example.
SPEC_LIST_HELP = (
    "estimator specs separated by ',' (options continue their spec; a list-valued option "
    f"in parentheses), e.g. --estimators '{SPEC_LIST_EXAMPLE}'"
)

_REPLACED = "separate estimators with ','; the ';' / '/' separators were replaced"
_FORBIDDEN_IN_NAME = set("()=;/, \t\n")


def _fail(what: str, text: str, position: int, problem: str, fix: str) -> InvalidValue:
    return InvalidValue(f"{what} {text!r}: {problem} at position {position}; {fix}")


def top_level_pieces(text: str, what: str, separators: str = ",") -> list[tuple[int, str]]:
    """``(position, piece)`` for the pieces separated by one of ``separators`` outside
    parentheses; balanced parentheses are checked here."""
    pieces: list[tuple[int, str]] = []
    opened: list[int] = []
    start = 0
    for position, char in enumerate(text):
        if char == "(":
            opened.append(position)
        elif char == ")":
            if not opened:
                raise _fail(
                    what, text, position, "unmatched ')'", "remove it or add the '(' it closes"
                )
            opened.pop()
        elif char in separators and not opened:
            pieces.append((start, text[start:position]))
            start = position + 1
    if opened:
        raise _fail(what, text, opened[-1], "unclosed '('", "close the nested list with ')'")
    pieces.append((start, text[start:]))
    return pieces


def _is_option(piece: str) -> bool:
    """``key=value`` with a key holding neither ``:`` nor ``(``: an option, never a name."""
    key, sep, _ = piece.partition("=")
    return bool(sep) and ":" not in key and "(" not in key


def split_spec_list(text: str, *, what: str = "estimator list") -> list[str]:
    """``"exact,jagg:window=4,tau=0.9,sdo"`` -> ``["exact", "jagg:window=4,tau=0.9", "sdo"]``.

    Each item's spec text, whitespace around the pieces removed and nested parenthesised
    lists kept intact (see the module docstring for the grammar). An empty or blank
    ``text`` is the empty list.

    Args:
        text: the list.
        what: how errors name the input (e.g. ``"--estimators"``).

    Raises:
        InvalidValue: unbalanced parentheses, an option before any name, an empty item,
            or a ``;`` / ``/`` separator.
    """
    if not isinstance(text, str):
        raise InvalidType(
            f"{what} must be a string like {SPEC_LIST_EXAMPLE!r}, got {type(text).__name__}"
        )
    if not text.strip():
        return []
    if ";" in text:
        raise _fail(
            what,
            text,
            text.index(";"),
            "';' between estimators",
            f"{_REPLACED} (write {text.replace(';', ',')!r})",
        )
    items: list[str] = []
    for start, raw in top_level_pieces(text, what):
        piece = raw.strip()
        position = start + len(raw) - len(raw.lstrip())
        if not piece:
            raise _fail(
                what,
                text,
                position,
                "empty item",
                f"remove the extra ',' (e.g. {SPEC_LIST_EXAMPLE!r})",
            )
        if _is_option(piece):
            if not items:
                raise _fail(
                    what,
                    text,
                    position,
                    f"option {piece!r} comes before any estimator name",
                    f"start with the estimator it belongs to, e.g. 'jagg:{piece}'",
                )
            items[-1] += "," + piece
            continue
        name, colon, rest = piece.partition(":")
        bad = next((c for c in name if c in _FORBIDDEN_IN_NAME), None)
        if bad == "/":
            raise _fail(
                what,
                text,
                position + piece.index(bad),
                "'/' between estimators",
                f"{_REPLACED} (write {name.replace('/', ',')!r})",
            )
        if not name or bad is not None:
            raise _fail(
                what,
                text,
                position,
                f"expected an estimator name, got {piece!r}",
                "an item is name or name:key=value,... and a list-valued option is "
                "wrapped in parentheses, e.g. 'auto:candidates=(exact,sdo)'",
            )
        items.append(name + colon + rest.strip())
    return items


def split_options(text: str, *, what: str = "estimator spec") -> list[str]:
    """The ``key=value`` pieces of one spec's option text (after its ``:``), split on the
    commas outside parentheses: ``"candidates=(exact,sdo),draws=2"`` ->
    ``["candidates=(exact,sdo)", "draws=2"]``. Empty pieces are dropped."""
    return [piece.strip() for _, piece in top_level_pieces(text, what) if piece.strip()]


def strip_group(value: str) -> str:
    """``"(exact,sdo)"`` -> ``"exact,sdo"``: the text inside one pair of parentheses that
    wraps a whole value; any other value unchanged."""
    value = value.strip()
    if value.startswith("(") and value.endswith(")"):
        depth = 0
        for position, char in enumerate(value):
            depth += (char == "(") - (char == ")")
            if depth == 0 and position < len(value) - 1:
                return value  # "(a),(b)": the first ')' closes before the end
        return value[1:-1].strip()
    return value


def spec_list_text(text: str) -> str:
    """The argparse ``type=`` of a flag whose value is a spec list (kept as text, parsed
    by the command so its errors are one line); it also tells
    :mod:`gradest_lab.storage.config_file` that a TOML array of spec strings is accepted there."""
    return text


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            return "/".join(repr(v) for v in value)
        return "(" + format_spec_list(value) + ")"
    return str(value)


def _spec_of(est: Any) -> str:
    """The spec string of an estimator object: its name and its non-default options."""
    import attrs

    name = getattr(est, "name", None)
    if not isinstance(name, str) or not attrs.has(type(est)):
        raise InvalidType(
            f"cannot write {est!r} as a spec string (only registered attrs estimators can "
            f"be); pass its spec string instead"
        )
    options = []
    for field in attrs.fields(type(est)):
        value = getattr(est, field.name)
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        if value != default:
            options.append(f"{field.name}={_format_value(value)}")
    return name + (":" + ",".join(options) if options else "")


def format_spec_list(specs: Sequence[Any]) -> str:
    """``["exact", "jagg:window=4,tau=0.9"]`` -> ``"exact,jagg:window=4,tau=0.9"``: the
    inverse of :func:`split_spec_list`. Estimator objects are written as their name and
    non-default options. Each string must be exactly one spec.
    """
    return ",".join(_one_spec_text(spec) for spec in as_spec_list(specs))


def _one_spec_text(spec: Any) -> str:
    return spec.strip() if isinstance(spec, str) else _spec_of(spec)


def as_spec_list(specs: str | Sequence[Any], *, what: str = "estimator list") -> list[Any]:
    """A list given as one string in the list syntax or as a Python sequence of spec
    strings and estimator objects -> a list of spec strings and estimator objects.

    A string in the sequence must hold exactly one spec (``"jagg:window=4,tau=0.9"`` is
    one; ``"exact,sdo"`` is two and is refused: give them as two elements).
    """
    if isinstance(specs, str):
        return split_spec_list(specs, what=what)
    if not isinstance(specs, Sequence):
        raise InvalidType(
            f"{what} must be a spec list string like {SPEC_LIST_EXAMPLE!r} or a sequence of "
            f"spec strings and estimators, got {type(specs).__name__}"
        )
    result: list[Any] = []
    for spec in specs:
        if isinstance(spec, str):
            parsed = split_spec_list(spec, what=f"{what} element")
            if len(parsed) != 1:
                raise InvalidValue(
                    f"{what} element {spec!r} holds {len(parsed)} specs; give one spec per "
                    f"element (or the whole list as one string)"
                )
            result.append(parsed[0])
        else:
            result.append(spec)
    return result
