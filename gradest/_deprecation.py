"""The one place deprecations are made: a warning naming the replacement, renamed keywords
and renamed module attributes.

Every deprecated name or argument warns with :class:`~gradest.errors.GradestDeprecationWarning`
and keeps working; the message shows the one-line replacement.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gradest.errors import GradestDeprecationWarning, InvalidType

F = TypeVar("F", bound=Callable[..., Any])


def warn_deprecated(message: str, *, stacklevel: int = 2) -> None:
    """Emit a :class:`GradestDeprecationWarning` (``stacklevel`` as for ``warnings.warn``,
    counted from the caller of this function)."""
    warnings.warn(message, GradestDeprecationWarning, stacklevel=stacklevel + 1)


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Decorator: accept ``old=`` as a deprecated keyword spelling of the parameter ``new``.

    Passing ``old=`` warns and forwards the value as ``new``; passing both (as keywords,
    or ``new`` positionally) raises :class:`~gradest.errors.InvalidType` naming both.
    Positional calls are unaffected.
    """

    def decorate(func: F) -> F:
        names = list(inspect.signature(func).parameters)
        position = names.index(new)  # the parameter must exist under its new name
        qualname = func.__qualname__

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs or len(args) > position:
                    raise InvalidType(
                        f"{qualname}() got both {new}= and the deprecated {old}= (the same "
                        f"argument); pass only {new}="
                    )
                warn_deprecated(
                    f"{qualname}(..., {old}=...) is deprecated; pass {new}=... instead",
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


#: ``flow=`` is the old keyword of the sampler argument everywhere in the public API.
sampler_keyword = renamed_keyword("flow", "sampler")


def module_aliases(
    module: str, aliases: Mapping[str, tuple[Callable[[], Any], str]]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving deprecated names: ``{old: (get_new, replacement)}``.

    Looking up ``module.old`` warns (``old is deprecated; use replacement``) and returns
    ``get_new()``; any other unknown name raises ``AttributeError`` as usual.
    """

    def __getattr__(name: str) -> Any:
        if name in aliases:
            get, replacement = aliases[name]
            warn_deprecated(f"{module}.{name} is deprecated; use {replacement}", stacklevel=2)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
