"""Loading what installed packages register under gradest's entry-point groups.

gradest reads two groups itself, and a command may define its own (the lab's
``gradest.problems`` and ``gradest.race_tasks``), all with one loader:

* ``gradest.estimators``: estimator classes (gradest's own built-ins are registered in its
  ``pyproject.toml`` exactly like third-party plugins; :mod:`gradest.registry`);
* ``gradest.commands``: subcommands of the ``gradest`` command line that another
  distribution adds (``gradest compare`` from ``gradest-lab``; :mod:`gradest.commands`).

gradest's own distribution is loaded first, so a plugin cannot silently shadow a
built-in. A plugin that fails to load in any way (an exception, even ``SystemExit``;
only ``KeyboardInterrupt`` propagates) or that is not what the group expects warns,
naming the entry point and its distribution, and is skipped: a broken plugin never
breaks ``import gradest`` or the command line. ``GRADEST_DISABLE_PLUGINS=1`` loads
gradest's own entries only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs

DISABLE_ENV = "GRADEST_DISABLE_PLUGINS"
OWN_DISTRIBUTION = "gradest"


@attrs.frozen
class Loaded:
    """What one group holds: name -> object, and name -> the distribution that gave it."""

    objects: dict[str, Any]
    sources: dict[str, str]


def distribution_of(entry: EntryPoint) -> str:
    """The name of the distribution that registers ``entry``."""
    dist = getattr(entry, "dist", None)
    return getattr(dist, "name", None) or "<unknown distribution>"


def plugins_disabled() -> bool:
    """Whether ``GRADEST_DISABLE_PLUGINS`` asks for gradest's own entries only."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def load_group(
    group: str,
    *,
    what: str,
    check: Callable[[Any], str | None],
    plugins_enabled: bool = True,
    stacklevel: int = 3,
) -> Loaded:
    """Load every entry point of ``group``, skipping (with a warning) the unusable ones.

    Args:
        group: the entry-point group, e.g. ``"gradest.estimators"``.
        what: how a warning names one entry (``"estimator plugin"``).
        check: returns None when a loaded object is usable, else why it is not.
        plugins_enabled: False keeps gradest's own entries only.
        stacklevel: of the warnings, counted from here (3: the caller of the caller).
    """
    # gradest's own entries first (False sorts before True).
    entries = sorted(
        entry_points(group=group), key=lambda e: distribution_of(e) != OWN_DISTRIBUTION
    )
    objects: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for entry in entries:
        source = distribution_of(entry)
        if not plugins_enabled and source != OWN_DISTRIBUTION:
            continue
        if entry.name in objects:
            warnings.warn(
                f"gradest: {what} {entry.name!r} from {source} is a duplicate of the one "
                f"from {sources[entry.name]}; keeping the first",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            continue
        try:
            loaded = entry.load()
            problem = check(loaded)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a broken plugin (even sys.exit()) never breaks gradest
            warnings.warn(
                f"gradest: skipping {what} {entry.name!r} from {source} "
                f"({entry.value}): {type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            continue
        if problem is not None:
            warnings.warn(
                f"gradest: skipping {what} {entry.name!r} from {source}: {entry.value} {problem}",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            continue
        objects[entry.name] = loaded
        sources[entry.name] = source
    return Loaded(objects, sources)


def callable_entry(candidate: Any) -> str | None:
    """The ``check`` of a group of factories: None when ``candidate`` is callable."""
    return None if callable(candidate) else "is not callable"


def load_entry_points(
    group: str, *, what: str, check: Callable[[Any], str | None]
) -> dict[str, Any]:
    """Name -> object of ``group`` as installed now: :func:`load_group` with plugins
    enabled unless ``GRADEST_DISABLE_PLUGINS`` says otherwise (the one switch every group
    obeys). Warnings name the caller of this function's caller, as :func:`load_group`'s do.
    """
    return load_group(
        group,
        what=what,
        check=check,
        plugins_enabled=not plugins_disabled(),
        stacklevel=4,
    ).objects
