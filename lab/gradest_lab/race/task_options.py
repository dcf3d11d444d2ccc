"""A race task's own settings from the command line: ``--task-option KEY=VALUE``.

A task factory (registered under ``gradest.race_tasks``) states its settings as keyword
parameters with defaults (``lr``, ``batch``, ``prior_weight``, ...). The command line has
no flag per task, so ``gradest race --task-option lr=1e-4`` hands ``lr`` to the factory.
The factory's signature is the whole contract: a key it does not take, or a value that is
not of its default's type, is refused here, naming the task's options and their defaults,
before any model is loaded. Bounds (``lr > 0``) are the task's to check: only it knows them;
an integer must fit int64 whatever the task (:mod:`gradest.integers`).

``eval_samples`` and ``device`` have flags of their own and are not task options.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from gradest import InvalidValue
from gradest.plugin import parse_bool, whole_number_problem

# Set through gradest race's own flags (--eval-samples, --device), never as task options.
COMMON_PARAMETERS = ("eval_samples", "device")


def _parameters(factory: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return []


def task_options(factory: Callable[..., Any]) -> dict[str, Any]:
    """The settings a task factory takes, with their defaults (``inspect.Parameter.empty``
    where it has none), in the factory's order, without the common ones."""
    return {
        p.name: p.default
        for p in _parameters(factory)
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in COMMON_PARAMETERS
    }


def _takes_any_keyword(factory: Callable[..., Any]) -> bool:
    """Whether the factory has ``**kwargs`` (then any key goes through to the task)."""
    return any(p.kind is p.VAR_KEYWORD for p in _parameters(factory))


def describe_task_options(factory: Callable[..., Any]) -> str:
    """``lr=0.0001, batch=16, ...``: a task's options for help texts and error messages."""
    options = task_options(factory)
    if not options:
        return "none"
    return ", ".join(
        name if default is inspect.Parameter.empty else f"{name}={default!r}"
        for name, default in options.items()
    )


def _parse_number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _within_int64(where: str, key: str, number: int | float, fix: str) -> int | float:
    """An integer the command line gives fits int64 (gradest.integers: the one rule for
    every integer a user types), whatever its sign: a 20-digit batch would otherwise
    reach torch as an overflow traceback. Signs and zero are the task's to check."""
    if isinstance(number, int):
        problem = whole_number_problem(number, minimum=None)
        if problem is not None:
            raise InvalidValue(f"{where}: {key} {problem}; {fix}")
    return number


def _coerce(key: str, text: str, default: Any, model: str) -> Any:
    """``text`` as a value of ``default``'s type (a string where the default gives none)."""
    where = f"--task-option {key}={text!r} (task {model!r})"
    if isinstance(default, bool):
        try:
            return parse_bool(text)
        except InvalidValue:
            raise InvalidValue(f"{where}: {key} is true or false") from None
    if isinstance(default, int):
        number = _parse_number(text)
        if not isinstance(number, int):
            raise InvalidValue(f"{where}: {key} is a whole number, e.g. {key}={default}")
        return _within_int64(where, key, number, f"e.g. {key}={default}")
    if isinstance(default, float):
        number = _parse_number(text)
        if number is None or not math.isfinite(number):
            raise InvalidValue(f"{where}: {key} is a finite number, e.g. {key}={default!r}")
        return float(number)
    if isinstance(default, str) or default is None or default is inspect.Parameter.empty:
        # Without a typed default the text is given as written; a number-like text is the
        # number (the task checks it, as it would a Python caller's value).
        number = _parse_number(text)
        if number is None or isinstance(default, str):
            return text
        return _within_int64(where, key, number, "the task checks its own range")
    raise InvalidValue(
        f"{where}: {key} takes a {type(default).__name__}, which the command line cannot "
        f"give; call gradest_lab.race.plain_race.race with the task built in Python"
    )


def parse_key_values(texts: Sequence[str], *, what: str, fix: str) -> dict[str, str]:
    """``["lr=1e-4", "batch=32"]`` as ``{"lr": "1e-4", "batch": "32"}``: the lab's one
    reader of ``key=value`` option lists (``--task-option``, a ``race-quote`` block's
    options), keys and values stripped, the value everything after the first ``=``.

    Each key is given once: a repeated key is refused rather than read as its last value,
    as gradest's estimator specs refuse ``jagg:window=2,window=4``.

    Args:
        texts: the options, one ``key=value`` each.
        what: how the caller names the list in messages (``"--task-option"``).
        fix: what a malformed option is told to write instead.

    Raises:
        InvalidValue: an option without ``=``, key or value, or a key given twice (one
            line naming ``what``, the option and the fix).
    """
    parsed: dict[str, str] = {}
    for text in texts:
        key, sep, value = (part.strip() for part in text.partition("="))
        if not sep or not key or not value:
            raise InvalidValue(f"{what} {text!r} is not KEY=VALUE; {fix}")
        if key in parsed:
            raise InvalidValue(
                f"{what} {key} is given twice ({key}={parsed[key]} and {key}={value}); give "
                f"each option once"
            )
        parsed[key] = value
    return parsed


def parse_task_options(
    factory: Callable[..., Any], texts: Sequence[str], *, model: str
) -> dict[str, Any]:
    """``["lr=1e-4", "batch=32"]`` as keyword arguments for ``factory``, checked against its
    signature (module docstring)."""
    options = task_options(factory)
    known = describe_task_options(factory)
    open_ended = _takes_any_keyword(factory)
    given = parse_key_values(texts, what="--task-option", fix=f"task {model!r} takes: {known}")
    parsed: dict[str, Any] = {}
    for key, value in given.items():
        if key in COMMON_PARAMETERS:
            flag = "--" + key.replace("_", "-")
            raise InvalidValue(f"--task-option {key}: set it with {flag} instead")
        if key not in options and not open_ended:
            raise InvalidValue(
                f"--task-option {key}: task {model!r} has no option {key!r}; it takes: {known}"
            )
        default = options.get(key, inspect.Parameter.empty)
        parsed[key] = _coerce(key, value, default, model)
    required = [k for k, d in options.items() if d is inspect.Parameter.empty and k not in parsed]
    if required:
        raise InvalidValue(
            f"task {model!r} needs {', '.join(required)}: give "
            + " ".join(f"--task-option {k}=VALUE" for k in required)
        )
    return parsed
