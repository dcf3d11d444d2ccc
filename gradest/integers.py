"""Whole numbers a user types: one rule for every integer flag, option and config value.

Every integer gradest reads from text (a command-line flag, ``--task-option KEY=N``, a
``--config`` TOML value) is a size, a count, a seed or an index, so the same three things
are refused everywhere, in one line naming the value and the range:

* **not a whole number**: ``2.5``, ``1e3``, ``x``, ``true``, an empty text;
* **out of range**: below the flag's minimum (``--batch -1``, ``--steps 0``: sizes and
  counts start at 1, seeds and offsets at 0) or above its maximum (``--target 10``);
* **overflow**: above ``2**63 - 1``, the largest integer torch (int64 tensors,
  ``torch.Generator.manual_seed``) and numpy hold; a 20-digit ``--batch`` would
  otherwise reach torch as an ``Overflow when unpacking long`` traceback, or size an
  allocation.

``type=WholeNumber(minimum=1)`` is an argparse type (its errors are argparse's one
``error: argument --batch: ...`` line); :meth:`WholeNumber.parse` and
:meth:`WholeNumber.check` raise :class:`~gradest.errors.InvalidValue` for other readers
(:mod:`gradest_lab.storage.config_file`, :mod:`gradest_lab.race.task_options`).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import attrs

from gradest.errors import InvalidValue

__all__ = ["INT64_MAX", "WholeNumber", "whole_number_problem"]

#: The largest integer a user may give: what torch's int64 and numpy's int64 hold.
INT64_MAX = 2**63 - 1
# Digits only (ASCII), with a sign: int() would also take "1_000", " ٣ " and 4300 digits.
_DIGITS = re.compile(r"[+-]?[0-9]+", re.ASCII)


def _range(minimum: int | None, maximum: int) -> str:
    if minimum is None:
        return "" if maximum == INT64_MAX else f" <= {maximum}"
    if maximum == INT64_MAX:
        return f" >= {minimum}"
    return f" from {minimum} to {maximum}"


def whole_number_problem(
    value: Any, *, minimum: int | None = 1, maximum: int = INT64_MAX
) -> str | None:
    """Why ``value`` (a Python value) is not a whole number in range, or None if it is.

    ``minimum=None``: any sign (the reader checks the bounds itself); the int64 bound
    holds whatever the range.
    """
    expect = f"a whole number{_range(minimum, maximum)}"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be {expect}, got {value!r}"
    if abs(value) > INT64_MAX:
        return (
            f"must be {expect} of at most 2**63 - 1 in size (the largest integer torch "
            f"holds), got {value}"
        )
    if (minimum is not None and value < minimum) or value > maximum:
        return f"must be {expect}, got {value}"
    return None


@attrs.frozen
class WholeNumber:
    """An integer flag's type: a whole number in ``[minimum, maximum]`` within int64.

    Attributes:
        minimum: the smallest value (1 for sizes and counts, 0 for seeds and offsets);
            None for any sign.
        maximum: the largest value (default ``2**63 - 1``).
    """

    minimum: int | None = 1
    maximum: int = INT64_MAX

    def parse(self, text: str) -> int:
        """``text`` as a whole number in range, or :class:`InvalidValue` saying why."""
        stripped = text.strip() if isinstance(text, str) else text
        if not isinstance(stripped, str) or not _DIGITS.fullmatch(stripped):
            raise InvalidValue(
                f"must be a whole number{_range(self.minimum, self.maximum)}, got {text!r}"
            )
        # More digits than int64 has are refused before int() reads thousands of them.
        digits = stripped.lstrip("+-").lstrip("0")
        if len(digits) > len(str(INT64_MAX)):
            shown = (
                stripped if len(stripped) <= 30 else f"{stripped[:24]}... ({len(digits)} digits)"
            )
            raise InvalidValue(
                f"must be a whole number{_range(self.minimum, self.maximum)} of at most "
                f"2**63 - 1 in size (the largest integer torch holds), got {shown}"
            )
        return self.check(int(stripped))

    def check(self, value: Any) -> int:
        """``value`` (an int from a config file) in range, or :class:`InvalidValue`."""
        problem = whole_number_problem(value, minimum=self.minimum, maximum=self.maximum)
        if problem is not None:
            raise InvalidValue(problem)
        return int(value)

    def __call__(self, text: str) -> int:
        # argparse reports an ArgumentTypeError's own message on its one error line
        # ("argument --batch: must be ..."); a ValueError would become "invalid value".
        try:
            return self.parse(text)
        except InvalidValue as err:
            raise argparse.ArgumentTypeError(str(err)) from None
