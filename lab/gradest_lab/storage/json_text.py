"""JSON text read back, bounded: the one parser of every JSON file the lab reads.

Python's :mod:`json` recurses once per nesting level, so a file of 200,000 ``[`` raises
``RecursionError`` from deep inside the parser (and, under a raised recursion limit, the
pure-Python scanner can overflow the C stack and kill the interpreter). No file gradest
writes nests deeper than a handful of levels, so :func:`parse_json` measures the text's
nesting first, with a scan that never recurses, and refuses text deeper than
:data:`MAX_JSON_DEPTH` before the parser sees it. Every failure is a ``ValueError`` with a
one-line reason, which the caller puts beside the file's name (what each reader already
does with :class:`json.JSONDecodeError`, itself a ``ValueError``).

:func:`non_finite_field` finds a ``NaN`` or ``Infinity`` in a parsed value: the parser
accepts those literals, but no file gradest writes holds one (its writers use
``allow_nan=False``), so a reader refuses one by name.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "json_field", "non_finite_field", "parse_json"]

#: The deepest nesting (objects and arrays) a JSON file the lab reads may have. gradest's own
#: files nest at most about 8 levels (a report's config), a model config about 5.
MAX_JSON_DEPTH = 64

# A JSON string (escapes included), whose brackets are text, not nesting; or a bracket. The
# closing quote is optional so that an unterminated string is one match to the end, not a
# retry from every quote inside it (which would make the scan quadratic).
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def _too_deep_at(text: str, limit: int) -> int | None:
    """The offset of the first bracket that opens more than ``limit`` objects or arrays
    inside each other, or None.

    A linear scan of the brackets outside strings: it never recurses, whatever the text.
    Unbalanced or unterminated text is left to the parser to refuse.
    """
    depth = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return match.start()
        elif token in "]}":
            depth -= 1
    return None


def parse_json(text: str | bytes) -> Any:
    """The JSON value of ``text``, nested at most :data:`MAX_JSON_DEPTH` levels.

    Raises:
        ValueError: one line: the parser's message (with its position), or where the text
            nests deeper than :data:`MAX_JSON_DEPTH` levels (refused before parsing).
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # a UnicodeDecodeError is a ValueError too
    offset = _too_deep_at(text, MAX_JSON_DEPTH)
    if offset is not None:
        line = text.count("\n", 0, offset) + 1
        column = offset - text.rfind("\n", 0, offset)
        raise ValueError(
            f"it nests objects or arrays more than {MAX_JSON_DEPTH} levels deep (at line {line} "
            f"column {column}), the most gradest reads: its own files nest fewer than 10"
        )
    try:
        return json.loads(text)
    except RecursionError:
        # Not reached under the scan's bound; kept so that no RecursionError escapes a read.
        raise ValueError(
            f"it nests deeper than the parser can follow ({MAX_JSON_DEPTH}+)"
        ) from None


def json_field(path: str, key: Any) -> str:
    """The name of ``key`` inside the field ``path``: ``row.curve[3]``, ``settings.seeds``
    (``""`` is the file's object itself)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def non_finite_field(value: Any, path: str = "") -> str | None:
    """The name of the first field of the parsed ``value`` that is ``NaN``, ``Infinity`` or
    ``-Infinity`` (``row.curve[3].reward``), or None when every number is finite.

    Iterative, so that no value can exhaust the stack (a value parsed by
    :func:`parse_json` is shallow anyway).
    """
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where or "the value"
        if isinstance(item, dict):
            pending.extend((json_field(where, k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend((json_field(where, i), v) for i, v in reversed(list(enumerate(item))))
    return None
