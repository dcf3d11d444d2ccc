"""A run folder belongs to one run: its record, its lock, and the rule every command follows.

Every gradest command that writes a folder (``gradest race``, ``gradest compare``, and the
applications' ``gradest finetune``, ``gradest pretrain`` and recipe runs) opens it with
:func:`claim_run_folder` before it writes anything there. The rule, in one place:

* **Arguments first.** A command checks every argument (names, values, ranges, sizes,
  the files and models they name) before it looks at, locks or creates its folder, so a
  bad argument is refused as itself whether the folder is new or holds another run (and a
  refused command leaves no folder behind). What can only be checked once the run holds
  its folder (a launcher's process state) is refused inside the claim, which then takes
  back everything it made: its ``run.json``, its lock, the folder and the parents it
  created; never what was there before.
* **The folder records its run.** ``run.json`` holds the run's identity: the command
  (``"gradest race"``), the settings that define the run (those a continuation must
  share; the caller decides which) and its lineage (what it continues from, such as a
  checkpoint of another folder). It is written once, when the run starts, and never
  rewritten by another run: it is published with a hard link, which fails when the file is
  already there, so two processes that start at once cannot both write it.
* **Another run's folder is refused.** A folder whose ``run.json`` names another command
  or other settings, or a folder without ``run.json`` that is not empty (another tool's
  files, a run of an older gradest, a run killed before it wrote ``run.json``), is refused
  in one line naming what is there and ``--out NEW``; nothing in it is written, moved or
  removed. A folder is continued only by the same run.
* **One writer at a time.** The run holds the folder's lock
  (:mod:`gradest_lab.storage.process_lock`, ``flock`` on ``.gradest-run.lock``) for its whole
  duration; a second writer is refused naming the holder's pid, host and command. A lock
  left by a killed process is free (the kernel released it) and is taken over. A command
  built for several writers (a tuned race shares its folder between processes, each
  holding a lock per shard) opens the folder ``shared``: the record is checked the same
  way, the folder lock is not taken.
* **Nothing through links.** ``run.json`` and the lock file must not be symbolic links;
  the folder itself may be reached through one (it is the path the user named).

:class:`RunRecord` is the file's schema: reading one that is not JSON, nested deeper than
:data:`~gradest_lab.storage.json_text.MAX_JSON_DEPTH`, not an object, of another schema,
with a missing or mistyped field or a non-finite number is one line naming the file and
the field, and the file is left as it is. The settings are each command's own: a command
states their schema (:data:`SettingsSchema`, such as the race's task settings being an
object), checked when its own folder's record is read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from gradest import InvalidValue
from gradest_lab.storage.file_schema import Refuse, json_object, require_finite_numbers
from gradest_lab.storage.files import (
    OutputError,
    check_output_dir,
    read_text,
    refuse_non_file,
    refuse_symlinks,
)
from gradest_lab.storage.process_lock import HeldLock, describe_holder, read_holder, try_lock

__all__ = [
    "RUN_LOCK",
    "RUN_RECORD",
    "RUN_SCHEMA",
    "FolderInUse",
    "RunFolder",
    "RunRecord",
    "SettingsSchema",
    "claim_run_folder",
    "describe_entries",
    "foreign_entries",
    "lineage_of",
    "read_run_record",
]

RUN_RECORD = "run.json"
RUN_LOCK = ".gradest-run.lock"
RUN_SCHEMA = "gradest.run/1"
# Entries that say nothing about whose folder it is (a desktop's or an editor's droppings).
_IGNORED = frozenset({RUN_LOCK, ".DS_Store", "Thumbs.db", "desktop.ini"})


#: ``schema(settings, refuse)``: a command's check of its run's settings as read back from
#: ``run.json``; ``refuse(field, why)`` names the file and ``settings.<field>``.
SettingsSchema = Callable[[Mapping[str, Any], Refuse], None]


class FolderInUse(OutputError):
    """Another live process holds the run folder's lock (the message names it)."""


@attrs.frozen
class RunRecord:
    """Who a run folder belongs to (``run.json``).

    Attributes:
        command: the command that writes the folder, e.g. ``"gradest race"``.
        settings: what defines the run, JSON values only: a continuation must have the
            same. Settings that may change on a continuation (a larger step count) are
            left out by the caller.
        lineage: what the run continues from outside its folder (a checkpoint path), in
            order; empty for a run started from scratch.
    """

    command: str
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    lineage: tuple[str, ...] = ()

    def to_json(self) -> str:
        data = {
            "schema": RUN_SCHEMA,
            "command": self.command,
            "settings": dict(self.settings),
            "lineage": list(self.lineage),
        }
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"

    def differences(self, other: RunRecord) -> list[str]:
        """``key: A there, B now`` for each setting (and the lineage) that differs, with
        ``self`` the folder's record and ``other`` the new run's."""
        found = []
        for key in sorted(set(self.settings) | set(other.settings)):
            mine, theirs = self.settings.get(key), other.settings.get(key)
            if _canonical(mine) != _canonical(theirs):
                found.append(f"{key}: {mine!r} there, {theirs!r} now")
        if self.lineage != other.lineage:
            found.append(f"lineage: {list(self.lineage)!r} there, {list(other.lineage)!r} now")
        return found


def _canonical(value: Any) -> str:
    """A setting as JSON text, so that a tuple and the list it was read back as are equal."""
    return json.dumps(value, sort_keys=True, allow_nan=True, default=repr)


def read_run_record(
    path: str | os.PathLike[str], *, schemas: Mapping[str, SettingsSchema] | None = None
) -> RunRecord:
    """The :class:`RunRecord` in the file ``path`` (a folder's ``run.json``).

    Args:
        path: the file.
        schemas: per command, the schema of its settings: a record of one of these
            commands has its settings checked by it (another command's are JSON values).

    Raises:
        InvalidValue / MissingFile: the file is missing, a link, not UTF-8 JSON, nested
            too deep, holds a non-finite number, or lacks or mistypes a field of the schema
            (naming the file and the field); it is left as it is.
    """
    source = Path(path)
    refuse_symlinks([source], what=f"the run record {str(source)!r}")
    text = read_text(source, what="the run record")

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{str(source)!r}: {field} {why}; the file is not a gradest run record (it is "
            f"left as it is): pass a new --out"
        )

    data = json_object(text, refuse)
    if data.get("schema") != RUN_SCHEMA:
        raise refuse("schema", f"is {data.get('schema')!r}, expected {RUN_SCHEMA!r}")
    command, settings, lineage = data.get("command"), data.get("settings"), data.get("lineage")
    if not isinstance(command, str) or not command:
        raise refuse("command", f"is {command!r}, not a command name")
    if not isinstance(settings, dict):
        raise refuse("settings", f"is {type(settings).__name__}, not an object")
    if not isinstance(lineage, list) or not all(isinstance(item, str) for item in lineage):
        raise refuse("lineage", f"is {lineage!r}, not a list of paths")
    # Written with allow_nan=False: a NaN or Infinity is not what gradest wrote.
    require_finite_numbers(data, refuse)
    schema = (schemas or {}).get(command)
    if schema is not None:
        schema(settings, lambda field, why: refuse(f"settings.{field}", why))
    return RunRecord(command=command, settings=settings, lineage=tuple(lineage))


@attrs.define(eq=False)
class RunFolder:
    """A run folder this process has claimed (from :func:`claim_run_folder`).

    Attributes:
        path: the folder.
        record: its run's record.
        continued: True when the folder already held this run (a resume), False when the
            run starts here.
    """

    path: Path
    record: RunRecord
    continued: bool
    lock: HeldLock | None = None


def _entries(folder: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(name for name in os.listdir(folder) if name not in _IGNORED)
    return []


def foreign_entries(folder: str | os.PathLike[str]) -> list[str]:
    """The entries of ``folder`` that say whose it is: all but the lock, a temporary of
    ``run.json`` a killed process left, and a desktop's droppings (``.DS_Store``), sorted.
    A folder without ``run.json`` that has any is not a gradest run's."""
    return [name for name in _entries(Path(folder)) if not _own_temporary(name)]


def describe_entries(names: Sequence[str]) -> str:
    """``a, b, c, d, e and 3 more``: the first few of ``names`` for a message."""
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


def _publish(folder: Path, record: RunRecord) -> bool:
    """Write ``run.json`` only if it is not there (a hard link of a complete temporary
    cannot replace an existing file); False when another process wrote it first."""
    handle, temporary = tempfile.mkstemp(prefix=f".{RUN_RECORD}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(record.to_json())
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, folder / RUN_RECORD)
        except FileExistsError:
            return False
        except OSError as err:
            raise OutputError(
                f"cannot write {str(folder / RUN_RECORD)!r}: {err.strerror}; nothing was written"
            ) from None
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def _describe(record: RunRecord) -> str:
    return f"a {record.command!r} run"


@contextlib.contextmanager
def claim_run_folder(
    path: str | os.PathLike[str],
    record: RunRecord,
    *,
    what: str = "--out",
    resume: bool | None = None,
    resume_hint: str | None = None,
    shared: bool = False,
    schema: SettingsSchema | None = None,
) -> Iterator[RunFolder]:
    """Open the run folder ``path`` for ``record``'s run, by the module's rule.

    Call it before writing anything in the folder; the body writes the run. The folder is
    created if it does not exist. A start refused here, or a body that fails before
    anything but ``run.json`` is in the folder (a setting refused once the run holds its
    folder), leaves nothing: the ``run.json`` this call published, the lock, and the
    folder and the parents this call created are removed (never a folder that was there
    before, nor the record of a run it continued).

    Args:
        path: the folder.
        record: the run's identity.
        what: how the command names the folder in messages (``"--out"``).
        resume: True when the command was asked to continue a run (the folder must hold
            it), False when it starts a new one (the folder must hold none), None when a
            rerun continues its own run and otherwise starts one (``gradest race``).
        resume_hint: how to continue the run a ``resume=False`` call found
            (``"gradest finetune --resume runs/ft"``), for the message.
        shared: several processes write this run at once (each locks its own pieces):
            the folder lock is not taken.
        schema: the schema of the settings of ``record.command``'s runs, checked on the
            folder's ``run.json`` when it is of that command (:func:`read_run_record`).

    Raises:
        FolderInUse: a live process holds the folder (naming it).
        InvalidValue: the folder holds another run or other files (naming them and
            ``--out NEW``), holds no run where ``resume`` is True, or its ``run.json``
            does not read.
        OutputError: the folder cannot be created or written, or ``run.json`` / the lock
            is a link or not a regular file.
    """
    folder = check_output_dir(path, what=what, create=False)
    shown = f"{what} {str(folder)!r}"
    record_path, lock_path = folder / RUN_RECORD, folder / RUN_LOCK
    refuse_symlinks([record_path, lock_path], what=shown)
    refuse_non_file(record_path, what=f"{shown}: {RUN_RECORD}")
    if resume is True and not record_path.is_file():
        found = _entries(folder)
        held = f" (it holds {', '.join(found[:5])}, but no {RUN_RECORD})" if found else ""
        start = (
            "start a new run in a new folder" if found else "start the run there without resuming"
        )
        raise InvalidValue(
            f"{shown} holds no gradest run to continue{held}; {start}, or pass the folder of "
            f"the run to continue"
        )
    # What this start creates (the folder and the parents it lacks) is this start's to take
    # back when it is refused: nothing that was there before is ever removed.
    first_created = _first_missing(folder)
    lock = None
    try:
        check_output_dir(folder, what=what)  # creates it
        if not shared:
            lock = try_lock(lock_path, command=record.command)
            if lock is None:
                holder = read_holder(lock_path)
                raise FolderInUse(
                    f"{shown} is in use by {describe_holder(holder or {})}: one run writes a "
                    f"folder at a time; wait for it to finish, or pass a new --out"
                )
    except BaseException:
        _remove_created(folder, first_created)
        raise
    published, failed = False, False
    try:
        schemas = {} if schema is None else {record.command: schema}
        continued = _check_owner(
            folder, record, shown, resume=resume, resume_hint=resume_hint, schemas=schemas
        )
        published = not continued
        yield RunFolder(path=folder, record=record, continued=continued, lock=lock)
    except BaseException:
        failed = True
        raise
    finally:
        # A start refused or failing before the run wrote anything leaves nothing: not the
        # record it published (removed while the lock is held), and not the folders it
        # created. "Nothing written" is judged by what is there, not by who removed what:
        # a caller may have taken its record back itself. A shared folder is left as it
        # is: another process may have joined the run on its record.
        untouched = failed and not shared and set(_entries(folder)) <= {RUN_RECORD}
        if untouched and published:
            with contextlib.suppress(OSError):
                (folder / RUN_RECORD).unlink()
        if lock is not None:
            lock.release()
        if untouched:
            _remove_created(folder, first_created)


def _first_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist (what creating
    ``folder`` creates first), or None when ``folder`` exists."""
    return next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)


def _remove_created(folder: Path, first_created: Path | None) -> None:
    """Remove ``folder`` and its parents up to ``first_created`` (those this start
    created), innermost first, each only while empty: a folder something else has written
    to since (another process, the user) is kept, and so is everything above it."""
    if first_created is None:
        return
    for created in [folder, *folder.parents]:
        try:
            created.rmdir()
        except OSError:
            return  # not empty (or already gone): something else is there now
        if created == first_created:
            return


def _check_owner(
    folder: Path,
    record: RunRecord,
    shown: str,
    *,
    resume: bool | None,
    resume_hint: str | None,
    schemas: Mapping[str, SettingsSchema],
) -> bool:
    """Whether ``folder`` already holds ``record``'s run (True) or is new to it (False,
    after writing ``run.json``); refuses anything else."""
    for _ in range(2):
        record_path = folder / RUN_RECORD
        if record_path.is_file():
            saved = read_run_record(record_path, schemas=schemas)
            if saved.command != record.command:
                raise InvalidValue(
                    f"{shown} holds {_describe(saved)}, not a {record.command!r} run; a "
                    f"folder holds one run: pass a new --out"
                )
            differing = saved.differences(record)
            if differing:
                how = (
                    "it continues another checkpoint"
                    if all(d.startswith("lineage:") for d in differing)
                    else "rerun with its settings to continue it"
                )
                raise InvalidValue(
                    f"{shown} holds another {record.command!r} run ({'; '.join(differing)}); "
                    f"{how}, or pass a new --out"
                )
            if resume is False:
                how = f"continue it with {resume_hint}" if resume_hint else "continue it"
                raise InvalidValue(f"{shown} holds an earlier run; {how}, or pass a new --out")
            return True
        found = foreign_entries(folder)
        if found:
            raise InvalidValue(
                f"{shown} holds files that are not a gradest run's ({describe_entries(found)}; "
                f"no {RUN_RECORD}): "
                f"a run starts only in a new or empty folder, so nothing there is overwritten; "
                f"pass a new --out"
            )
        if _publish(folder, record):
            return False
        # Another process of a shared run published it first: check it as ours.
    raise InvalidValue(f"{shown}: {RUN_RECORD} keeps changing; pass a new --out")


def _own_temporary(name: str) -> bool:
    """A temporary of ``run.json`` that a killed process left."""
    return name.startswith(f".{RUN_RECORD}.") and name.endswith(".tmp")


def lineage_of(paths: Sequence[str | os.PathLike[str]]) -> tuple[str, ...]:
    """Paths as a lineage: absolute and resolved, so that two spellings of one checkpoint
    are one lineage."""
    return tuple(str(Path(p).resolve()) for p in paths)
