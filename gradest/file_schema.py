"""What every reader of a file read back shares: the applications' readers of their own
files (``gradest_digits.file_schema``, ``gradest_recipes.file_schema``) build on it.

A reader builds a ``refuse(field, why)`` that names its file, so that every failure is one
:class:`~gradest.errors.InvalidValue` line naming the file and the field, and the file is
never changed; the helpers here describe a value in such a line and check a field's kind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from torch import Tensor

from gradest.errors import InvalidValue, first_line

__all__ = ["Refuse", "describe", "is_int", "is_number", "json_object", "with_article"]

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
        data = json.loads(text)
    except ValueError as err:
        raise refuse("the text", f"is not JSON ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise refuse("the file", f"holds {describe(data)}, not an object")
    return data
