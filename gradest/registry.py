"""Estimators by name, discovered through the ``gradest.estimators`` entry-point group.

Built-ins are registered in gradest's own ``pyproject.toml`` exactly like third-party
plugins, and read from there only: one mechanism, one list. Discovery is cached;
loading and the rules for broken plugins are :mod:`gradest.entry_points`'
(``GRADEST_DISABLE_PLUGINS=1`` loads gradest's own estimators only).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import attrs

from gradest import entry_points
from gradest.errors import GradestError, InvalidType, InvalidValue
from gradest.options import describe_options, parse_bool, parse_option_text
from gradest.protocol import TrajectoryGradientEstimator, is_estimator, missing_verbs
from gradest.specs import split_options, strip_group, top_level_pieces

GROUP = "gradest.estimators"
DISABLE_ENV = entry_points.DISABLE_ENV
_lock = threading.Lock()


# Built-ins come from gradest's own entry points: none at all means gradest itself is not
# installed (a bare source checkout on sys.path).
_NOTHING_INSTALLED = (
    "none; gradest is not installed, so its entry points are missing: pip install -e ."
)


class UnknownEstimatorError(GradestError, ValueError):
    """An estimator name that no installed package registers."""


class PluginError(GradestError, RuntimeError):
    """A plugin estimator failed inside gradest: it raised, or called ``sys.exit()``, in its
    constructor or ``estimate()`` (the message names it; the original is the cause)."""


class PluginInterrupt(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` raised inside a plugin estimator (the message names it)."""


def is_builtin(est: Any) -> bool:
    """Whether ``est`` (an estimator or its class) is one of gradest's own."""
    cls = est if isinstance(est, type) else type(est)
    return cls.__module__ == "gradest" or cls.__module__.startswith("gradest.")


@contextlib.contextmanager
def plugin_calls(est: Any, action: str) -> Iterator[None]:
    """Code run on behalf of estimator ``est`` (``action`` says what: ``"estimate()"``), so
    that a plugin never ends gradest silently or with a foreign traceback: any exception
    it raises (even ``SystemExit``) becomes a :class:`PluginError` naming it, a
    ``KeyboardInterrupt`` a :class:`PluginInterrupt`; gradest's own documented errors pass
    unchanged. Built-in estimators run as they are (their exceptions are gradest's)."""
    if is_builtin(est):
        yield
        return
    try:
        yield
    except GradestError:
        raise
    except KeyboardInterrupt as err:
        raise PluginInterrupt(f"interrupted inside {_label(est)} {action}") from err
    except BaseException as err:  # SystemExit / GeneratorExit from a plugin, too
        text = str(err)
        raise PluginError(
            f"{_label(est)} failed in {action}: {type(err).__name__}"
            f"{f': {text}' if text else ''}; this is the plugin's error (fix or uninstall "
            f"it, or leave it out of the estimators)"
        ) from err


def call_plugin(est: Any, action: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` inside :func:`plugin_calls` ``(est, action)``."""
    with plugin_calls(est, action):
        return function(*args, **kwargs)


def _label(est: Any) -> str:
    from gradest._checks import estimator_label

    return estimator_label(est)


def _estimator_problem(candidate: Any) -> str | None:
    """Why ``candidate`` is not an estimator the protocol accepts: both verbs, as
    :class:`~gradest.protocol.TrajectoryGradientEstimator` declares them."""
    missing = missing_verbs(candidate)
    if not missing:
        return None
    methods = " and ".join(f"{verb}()" for verb in missing)
    fix = (
        "subclass gradest.plugin.EstimatorBase, or add surrogate() as "
        "gradest.plugin.estimated_surrogate(self, model, sampler, objective, **inputs)"
        if missing == ("surrogate",)
        else "subclass gradest.plugin.EstimatorBase (it gives both verbs from _terminal / "
        "_stepwise)"
    )
    return f"has no {methods} method: the protocol has two verbs; {fix}"


@functools.cache
def _load_registry(plugins_enabled: bool) -> entry_points.Loaded:
    return entry_points.load_group(
        GROUP, what="estimator plugin", check=_estimator_problem, plugins_enabled=plugins_enabled
    )


def _loaded() -> entry_points.Loaded:
    with _lock:
        return _load_registry(not entry_points.plugins_disabled())


def available_estimators() -> dict[str, type]:
    """Name -> estimator class for the built-ins and every installed plugin."""
    return dict(_loaded().objects)


def builtin_estimators() -> dict[str, type]:
    """Name -> class of gradest's own estimators (its entry points; no plugins)."""
    loaded = _loaded()
    return {
        name: cls
        for name, cls in loaded.objects.items()
        if loaded.sources[name] == entry_points.OWN_DISTRIBUTION
    }


# Which class attribute holds an estimator's entries in each command's default line-up,
# and whether plugins' entries join it: ``gradest check`` checks every installed estimator
# (a plugin's pinned configurations too), ``compare`` and ``cost`` show gradest's own.
LINE_UPS: dict[str, tuple[str, bool]] = {
    "check": ("check_specs", True),
    "compare": ("compare_specs", False),
    "cost": ("cost_specs", False),
}


def line_up(command: str) -> list[str]:
    """The spec strings of ``command``'s default line-up (``"check"``, ``"compare"``,
    ``"cost"``), asked of the estimators themselves: each class's ``check_specs`` /
    ``compare_specs`` / ``cost_specs`` (:class:`~gradest.base.EstimatorBase`; its own,
    not inherited), in the
    registry's order (estimators whose every estimate is exact first, the reference, then
    by name). No command keeps a list of its own, so a new estimator joins every line-up
    from its class alone. ``check_specs`` may hold ``{N}``, the check's step count."""
    if command not in LINE_UPS:
        raise InvalidValue(f"line_up command must be one of {sorted(LINE_UPS)}, got {command!r}")
    attribute, with_plugins = LINE_UPS[command]
    classes = available_estimators() if with_plugins else builtin_estimators()
    ordered = sorted(
        classes.items(), key=lambda item: (not getattr(item[1], "always_exact", False), item[0])
    )
    # A class's own entries only: a subclass (drtune of sdo, a plugin of a built-in) is
    # another estimator, and does not repeat its base's.
    return [spec for _, cls in ordered for spec in vars(cls).get(attribute, ())]


def clear_cache() -> None:
    """Forget discovered plugins (after installing one in a running process)."""
    with _lock:
        _load_registry.cache_clear()


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"jagg:window=4,tau=0.995"`` -> ``("jagg", {"window": "4", "tau": "0.995"})``.

    Options are split with :mod:`gradest.specs` (the one list syntax): commas inside
    parentheses do not separate options, and a parenthesised value is given without its
    parentheses (``"auto:candidates=(exact,sdo:samples=4)"`` -> ``("auto",
    {"candidates": "exact,sdo:samples=4"})``).
    """
    if not isinstance(spec, str):
        raise InvalidType(
            f"estimator spec must be a string like 'jagg:window=4' (or pass an estimator "
            f"object), got {type(spec).__name__} {spec!r}"
        )
    if not spec.strip():
        raise InvalidValue(
            f"estimator spec must be a non-empty string like 'jagg:window=4', got {spec!r}"
        )
    top_level_pieces(spec, "estimator spec")  # balanced parentheses (positions in spec)
    name, _, rest = spec.strip().partition(":")
    if len(top_level_pieces(rest, "estimator spec", ":")) > 1:
        raise InvalidValue(
            f"estimator spec {spec!r} has more than one ':'; separate options with commas, "
            f"e.g. '{name.strip()}:window=4,tau=0.9', and wrap a list of specs in "
            f"parentheses, e.g. 'auto:candidates=(exact,jagg:window=4)'"
        )
    options: dict[str, str] = {}
    for item in split_options(rest):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or "(" in key:
            raise InvalidValue(
                f"estimator spec {spec!r}: option {item!r} is not key=value; "
                f"write e.g. '{name}:key=value,other=value' (a list value in parentheses: "
                f"key=(a,b))"
            )
        if key.strip() in options:
            raise InvalidValue(
                f"estimator spec {spec!r} sets option {key.strip()!r} twice; give each option once"
            )
        options[key.strip()] = strip_group(value)
    return name.strip(), options


def estimator(spec: Any, **options: Any) -> TrajectoryGradientEstimator:
    """Build an estimator by name or spec string.

    ``gradest.estimator("jagg", window=4)`` and ``gradest.estimator("jagg:window=4")``
    are the same; keyword options override options in the string. An estimator instance
    is returned as it is (with ``options``, an ``attrs.evolve``-d copy); an estimator
    class is refused with a message saying to pass an instance or its name.

    Raises:
        UnknownEstimatorError: the name is not registered (the message lists valid names).
        TypeError: an option is misspelled (the message lists valid options) or has the
            wrong type.
        ValueError: an option is out of range.
    """
    if isinstance(spec, type) and is_estimator(spec):
        shown = getattr(spec, "name", None)
        by_name = f" or its name {shown!r}" if isinstance(shown, str) else ""
        raise InvalidType(
            f"estimator spec must be a name, a spec string like 'jagg:window=4' or an "
            f"estimator instance, got the class {spec.__name__}; pass an instance, "
            f"{spec.__name__}(...),{by_name}"
        )
    if not isinstance(spec, str) and is_estimator(spec):
        return _with_options(spec, options)
    name, text_options = parse_spec(spec)
    registry = available_estimators()
    if name not in registry:
        close = difflib.get_close_matches(name.lower(), list(registry), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownEstimatorError(
            f"unknown estimator {name!r}; {hint}available: "
            f"{', '.join(sorted(registry)) or _NOTHING_INSTALLED} "
            f"(plugins register under the {GROUP!r} entry-point group)"
        )
    cls = registry[name]
    valid = option_names(cls)
    values: dict[str, Any] = {}
    for key, text in text_options.items():
        _check_option_name(name, key, valid)
        values[key] = (
            parse_option_text(cls, key, text)
            if attrs.has(cls)
            else _parse_by_default(cls, key, text)
        )
    for key in options:
        _check_option_name(name, key, valid)
    values.update(options)
    return call_plugin(cls, "its constructor", cls, **values)  # type: ignore[no-any-return]


def _with_options(est: Any, options: dict[str, Any]) -> Any:
    """An estimator instance given to :func:`estimator`: itself, or a copy with ``options``
    changed (``attrs.evolve``) where it is an attrs class."""
    if not options:
        return est
    name = getattr(type(est), "name", type(est).__name__)
    if not attrs.has(type(est)):
        raise InvalidType(
            f"estimator {name!r} was given as an instance, which takes no options "
            f"({', '.join(sorted(options))}); construct it with them instead"
        )
    valid = option_names(type(est))
    for key in options:
        _check_option_name(str(name), key, valid)
    return attrs.evolve(est, **options)


def option_names(cls: type) -> list[str] | None:
    """An estimator's option names: its attrs fields, or its constructor's keyword
    parameters (a plugin without attrs); None when it takes ``**kwargs`` (anything goes)."""
    if attrs.has(cls):
        return [field.name for field in attrs.fields(cls)]
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in keyword]


def _parse_by_default(cls: type, key: str, text: str) -> Any:
    """A spec-string value for a non-attrs plugin, read like its constructor default's type."""
    try:
        default = inspect.signature(cls).parameters[key].default
    except (KeyError, TypeError, ValueError):
        return text
    for kind in (bool, int, float):  # bool before int: bool is an int
        if isinstance(default, kind):
            try:
                return parse_bool(text) if kind is bool else kind(text)
            except ValueError as err:
                raise InvalidType(
                    f"estimator {getattr(cls, 'name', cls.__name__)!r}: cannot read option "
                    f"{key}={text!r} as {kind.__name__} ({err})"
                ) from None
    return text


def _check_option_name(name: str, key: str, valid: list[str] | None) -> None:
    if valid is not None and key not in valid:
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise InvalidType(
            f"estimator {name!r} has no option {key!r}; {hint}valid options: "
            f"{', '.join(valid) if valid else 'none'}"
        )


def describe(name: str) -> list[tuple[str, Any, str]]:
    """``(option, default, doc)`` rows for ``gradest list``."""
    cls = available_estimators()[name]
    if attrs.has(cls):
        return describe_options(cls)
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [(p.name, p.default, "") for p in parameters if p.default is not inspect.Parameter.empty]
