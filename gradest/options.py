"""Estimator options: attrs fields that validate themselves and parse from spec strings.

An estimator's options are its attrs fields. :func:`option` attaches what the registry
and the CLI need (a one-line doc, how to parse the value from ``"name:key=value"``
strings, what a valid value looks like) and a validator whose message names the option,
the value and the valid range.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import attrs

from gradest.errors import InvalidType, InvalidValue

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidValue(f"expected true or false, got {text!r}")


def parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() == "none" else int(text)


def parse_float_tuple(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split("/"))


_PARSERS: dict[Any, Callable[[str], Any]] = {bool: parse_bool, int: int, float: float, str: str}


def _accepts(kind: Any, value: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for expected in kinds:
        if expected is None and value is None:
            return True
        if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if expected is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if expected not in (None, int, float) and isinstance(value, expected):
            return True
    return False


def _kind_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is None else k.__name__ for k in kinds)


def bool_types() -> tuple[type, ...]:
    """``bool`` and numpy's ``bool_`` (which is not an ``int``, but must not pass as one)."""
    try:
        import numpy

        return (bool, numpy.bool_)
    except ImportError:  # pragma: no cover
        return (bool,)


def scalar_item(value: Any) -> Any:
    """A 0-d numpy array or tensor as its Python number; anything else unchanged."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, str) and tuple(shape) == ():
        item = getattr(value, "item", None)
        if callable(item):
            number = item()
            if isinstance(number, bool | int | float):
                return number
    return value


def option(
    default: Any,
    *,
    kind: Any,
    doc: str,
    valid: Callable[[Any], bool] | None = None,
    expect: str = "",
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """An estimator option.

    Args:
        default: default value.
        kind: accepted Python type(s); ``None`` in a tuple allows None. An int option
            accepts any integral number (numpy ints), a float option any real number;
            both are converted to the Python type.
        doc: one line for ``gradest list``.
        valid: extra check on the value.
        expect: the valid range in words, for error messages.
        parse: how to read the value from a spec string (defaults by ``kind``).
    """

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        owner = getattr(type(instance), "name", type(instance).__name__)
        shape = getattr(value, "shape", None)
        if shape is not None and not isinstance(value, str) and tuple(shape) != ():
            raise InvalidType(
                f"estimator {owner!r}: option {attribute.name} got an array of shape "
                f"{tuple(shape)} ({type(value).__name__}); expected a single "
                f"{_kind_name(kind)}"
                + (f" ({expect})" if expect else "")
                + "; pass one value (sweep over values with one estimator each)"
            )
        if not _accepts(kind, value):
            raise InvalidType(
                f"estimator {owner!r}: option {attribute.name}={value!r} has type "
                f"{type(value).__name__}; expected {_kind_name(kind)}"
                + (f" ({expect})" if expect else "")
            )
        if valid is not None and not valid(value):
            raise InvalidValue(
                f"estimator {owner!r}: option {attribute.name}={value!r} is out of range; "
                f"expected {expect}"
            )

    kinds = kind if isinstance(kind, tuple) else (kind,)

    def convert(value: Any) -> Any:
        # numpy scalars (np.int64 from np.arange sweeps, np.float32) are plain numbers, and
        # so are 0-d arrays and tensors (np.array(4), torch.tensor(0.9)).
        value = scalar_item(value)
        if isinstance(value, bool) or isinstance(value, bool_types()):
            return value
        if int in kinds and isinstance(value, numbers.Integral):
            return int(value)
        if float in kinds and isinstance(value, numbers.Real):
            return float(value)
        return value

    base = kind[0] if isinstance(kind, tuple) else kind
    return attrs.field(
        default=default,
        converter=convert,
        validator=validate,
        metadata={"doc": doc, "expect": expect, "parse": parse or _PARSERS.get(base, str)},
    )


def too_many_steps(estimator: str, what: str, num_steps: int, fix: str) -> InvalidValue:
    """The error for options that need more steps than the sampler has (check_steps)."""
    return InvalidValue(
        f"estimator {estimator!r}: option {what} exceeds the sampler's N={num_steps} steps; {fix}"
    )


def at_most_steps(
    estimator: str, num_steps: int, *, hint: str = "", **options: int | float | None
) -> None:
    """``check_steps`` for options that count steps: raise :func:`too_many_steps` for the
    first of ``options`` (name=value, None skipped) above ``num_steps``."""
    for name, value in options.items():
        if value is not None and value > num_steps:
            fix = f"use {name} <= {num_steps}" + (f" {hint}" if hint else "")
            raise too_many_steps(estimator, f"{name}={value:g}", num_steps, fix)


def int_option(default: int, *, minimum: int, doc: str, expect: str = "") -> Any:
    """An int option ``>= minimum`` (``expect`` overrides the range's description)."""
    return option(
        default,
        kind=int,
        doc=doc,
        valid=lambda value: value >= minimum,
        expect=expect or f"an int >= {minimum}",
    )


def optional_int_option(*, minimum: int, doc: str, expect: str = "") -> Any:
    """An int option ``>= minimum`` that may be None (its default), parsed from ``none``."""
    return option(
        None,
        kind=(int, None),
        doc=doc,
        valid=lambda value: value is None or value >= minimum,
        expect=expect or f"an int >= {minimum}, or None",
        parse=parse_optional_int,
    )


def optional_float_option(*, minimum: float, doc: str, expect: str = "") -> Any:
    """A float option (``> 0`` for ``minimum=0``, else ``>= minimum``) that may be None
    (its default), parsed from ``none``."""

    def valid(value: Any) -> bool:
        return value is None or (value > 0 if minimum == 0 else value >= minimum)

    return option(
        None,
        kind=(float, None),
        doc=doc,
        valid=valid,
        expect=expect or f"a float {'> 0' if minimum == 0 else f'>= {minimum:g}'}, or None",
        parse=lambda text: None if text.strip().lower() == "none" else float(text),
    )


def choice_option(default: str, choices: tuple[str, ...], *, doc: str, expect: str = "") -> Any:
    """A string option that is one of ``choices``."""
    return option(
        default,
        kind=str,
        doc=doc,
        valid=lambda value: value in choices,
        expect=expect or "one of " + ", ".join(repr(choice) for choice in choices),
    )


def bool_option(default: bool, *, doc: str) -> Any:
    return option(default, kind=bool, doc=doc, expect="true or false")


def parse_option_text(cls: type, name: str, text: str) -> Any:
    """Parse the text of ``name=text`` in a spec string for estimator class ``cls``."""
    field = attrs.fields_dict(cls)[name]
    parser = field.metadata.get("parse", str)
    try:
        return parser(text)
    except (TypeError, ValueError) as err:
        expect = field.metadata.get("expect") or "see `gradest list`"
        raise InvalidType(
            f"estimator {getattr(cls, 'name', cls.__name__)!r}: cannot read option "
            f"{name}={text!r} ({err}); expected {expect}"
        ) from err


def describe_options(cls: type) -> list[tuple[str, Any, str]]:
    """``(name, default, doc)`` for each option of an estimator class."""
    return [
        (field.name, field.default, field.metadata.get("doc", "")) for field in attrs.fields(cls)
    ]
