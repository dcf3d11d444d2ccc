"""What every reader of a file read back shares: the applications' readers of their own
files (``gradest_digits.file_schema``, ``gradest_recipes.file_schema``) build on it.

A reader builds a ``refuse(field, why)`` that names its file, so that every failure is one
:class:`~gradest.errors.InvalidValue` line naming the file and the field, and the file is
never changed; the helpers here describe a value in such a line and check a field by the
same principles for every format: its type (a bool is not a number), its length, its bounds,
the order of a sequence, finite numbers. JSON is parsed by
:func:`gradest_lab.storage.json_text.parse_json` (nesting bounded, never a
``RecursionError``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from gradest import GradestError, InvalidValue
from gradest_lab.storage.files import read_text
from gradest_lab.storage.json_text import non_finite_field, parse_json

__all__ = [
    "Refuse",
    "describe",
    "first_line",
    "is_int",
    "is_number",
    "json_object",
    "read_report_json",
    "require",
    "require_finite",
    "require_finite_numbers",
    "require_increasing",
    "require_int",
    "require_list",
    "require_object",
    "with_article",
]

#: ``refuse(field, why)``: the reader's one-line error naming its file.
Refuse = Callable[[str, str], InvalidValue]


def describe(value: Any) -> str:
    """A value as a message shows it: short values as written, others by their type (and
    a container by its length, a tensor by its dtype and shape)."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a str of {len(value)} characters"
    if isinstance(value, Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return with_article(f"{dtype} tensor {tuple(value.shape)}")
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)}"
    return with_article(type(value).__name__)


def with_article(noun: str) -> str:
    """``noun`` with its indefinite article (``an int64 tensor``, ``a dict``)."""
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is an int to Python, not to a schema)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def json_object(text: str, refuse: Refuse) -> dict[str, Any]:
    """The JSON object ``text`` holds: text that is not JSON, or JSON that is not an
    object, is one line from ``refuse``."""
    try:
        data = parse_json(text)
    except ValueError as err:
        raise refuse("the text", f"is not JSON ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise refuse("the file", f"holds {describe(data)}, not an object")
    return data


def require(ok: bool, refuse: Refuse, field: str, value: Any, wanted: str) -> None:
    """Refuse ``field`` unless ``ok``: ``field is <value>, not <wanted>``."""
    if not ok:
        raise refuse(field, f"is {describe(value)}, not {wanted}")


def require_finite(value: Any, refuse: Refuse, field: str) -> None:
    """``value`` is a finite number (not a bool, NaN or an infinity)."""
    require(is_number(value) and math.isfinite(value), refuse, field, value, "a finite number")


def require_int(value: Any, refuse: Refuse, field: str, *, low: int | None = None) -> int:
    """``value`` is an integer (not a bool), at least ``low`` when given."""
    wanted = "an integer" if low is None else f"an integer >= {low}"
    require(is_int(value) and (low is None or value >= low), refuse, field, value, wanted)
    return int(value)


def require_object(value: Any, refuse: Refuse, field: str) -> dict[str, Any]:
    """``value`` is a JSON object."""
    require(isinstance(value, dict), refuse, field, value, "an object")
    return value


def require_list(
    value: Any, refuse: Refuse, field: str, *, length: int | None = None, why: str = ""
) -> list[Any]:
    """``value`` is a list, of ``length`` items when given (``why`` says where that length
    comes from: ``"one point per budget fraction"``)."""
    wanted = "a list" if length is None else f"a list of {length}"
    ok = isinstance(value, list) and (length is None or len(value) == length)
    require(ok, refuse, field, value, f"{wanted} ({why})" if why else wanted)
    return value


def require_increasing(
    values: Sequence[Any], refuse: Refuse, field: str, *, strict: bool, key: str = ""
) -> None:
    """The numbers ``values`` (each item's ``key`` where given) never go down, and with
    ``strict`` never repeat: the first that breaks the order is refused by name."""
    for index in range(1, len(values)):
        before, now = values[index - 1], values[index]
        if key:
            before, now = before[key], now[key]
        if now < before or (strict and now == before):
            item = f"{field}[{index}]" + (f".{key}" if key else "")
            order = "increase" if strict else "not decrease"
            raise refuse(item, f"is {describe(now)} after {describe(before)}: it must {order}")


def require_finite_numbers(data: Any, refuse: Refuse) -> None:
    """Every number in the parsed JSON ``data`` is finite: a ``NaN`` or ``Infinity`` literal
    (which the parser accepts and no gradest writer writes) is refused by its field."""
    field = non_finite_field(data)
    if field is not None:
        raise refuse(field, "is not a finite number (NaN or Infinity)")


def first_line(err: BaseException, *, limit: int = 200) -> str:
    """The first line of ``err``'s message (at most ``limit`` characters), or its type's
    name: what a one-line refusal quotes of an error raised deep inside a library (torch's
    unpickler, a ``load_state_dict`` mismatch)."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]


def read_report_json(
    path: str | os.PathLike[str], *, kinds: Mapping[str, str], fields: Sequence[str] = ()
) -> dict[str, Any]:
    """The JSON object of a report gradest wrote (``report.json``, or the folder holding
    it), checked against its schema: the one reader of every report format.

    Args:
        path: the file, or its folder.
        kinds: the schemas accepted, each with what it is called in messages
            (``{"gradest.race/1": "race report"}``).
        fields: the top-level fields that must be objects.

    Returns:
        The parsed object (its non-finite floats still as :func:`gradest.harness.json_safe`
        wrote them).

    Raises:
        InvalidValue / MissingFile: one line naming the file and what is wrong (missing,
            not a regular file, not UTF-8 JSON, another schema, a field missing or not an
            object); the file is left as it is.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "report.json"
    what = " or ".join(dict.fromkeys(kinds.values()))
    try:
        data = parse_json(read_text(file, what="the report"))
    except (GradestError, ValueError) as err:
        raise InvalidValue(f"{str(file)!r} is not a readable {what}.json ({err})") from None
    if not isinstance(data, dict) or data.get("schema") not in kinds:
        schema = data.get("schema") if isinstance(data, dict) else None
        expected = " or ".join(repr(k) for k in kinds)
        raise InvalidValue(
            f"{str(file)!r} is not a {what} (schema {schema!r}, expected {expected})"
        )
    for field in fields:
        if not isinstance(data.get(field), dict):
            raise InvalidValue(f"{str(file)!r}: field {field!r} is missing or not an object")
    return data
