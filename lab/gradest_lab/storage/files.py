"""Files gradest writes: checked before the work, replaced atomically, never half-written.

Three rules, for every file gradest writes (checkpoints, logs, reports, pretrained assets):

* **Check first.** :func:`check_output_dir` / :func:`check_output_file` run before any work
  starts: a path under a file, a read-only folder or a folder that cannot be created
  fails in seconds with one line, not after an hour of training.
* **Replace atomically.** :func:`atomic_write` writes a temporary file in the same folder,
  flushes and fsyncs it, then ``os.replace``-s it over the final name (and fsyncs the
  folder). A process killed at any moment leaves either the previous file or the new
  one under the final name, never a truncated one; a full disk or a read-only folder
  raises :class:`OutputError` naming the path, with the previous file intact and the
  temporary removed.
* **Append whole records.** :class:`JsonLog` (``log.jsonl``) appends one JSON line per
  ``os.write`` call and fsyncs it: a record is in the file whole or not at all. A short
  write (disk full) is cut back before the error is raised, and a partial last line left
  by anything else is ignored when the log is read and cut off just before the next
  append: opening or reading a log never changes it, so a caller can look at a folder
  and refuse it without having touched it.
* **Never through a link.** :class:`JsonLog` refuses to append to or rewrite a log that
  is a symbolic link (its target may lie outside the run's folder);
  :func:`refuse_symlinks` checks the entries a run will write, before it writes any.
* **Only onto files.** A path gradest writes that exists and is not a regular file (a
  character device such as ``/dev/null``, a FIFO, a socket, a block device, a folder;
  through a symbolic link too) is refused in one line naming it, never replaced:
  :func:`atomic_write` would otherwise put a regular file where the device node or pipe
  was, and an append to a FIFO waits for a reader forever. :func:`refuse_non_file` is
  the rule; :func:`check_output_file`, :func:`atomic_write` and :class:`JsonLog` apply
  it, and so does :func:`read_text` to what gradest reads back (a config file).

Temporary files are named ``.<name>.<random>.tmp`` beside their target;
:func:`remove_stale_temporaries` clears those a killed process left behind.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from gradest import GradestError, InvalidValue
from gradest_lab.errors import MissingFile
from gradest_lab.storage.json_text import parse_json

_TMP_SUFFIX = ".tmp"


def check_path_length(path: Any, *, what: str) -> None:
    """A path whose parts the file system cannot name fails with one line, before work:
    each component at most the file system's name limit (255 bytes on Linux, macOS and
    Windows), the whole path at most its path limit."""
    text = os.fspath(path)
    encoded = os.fsencode(text)
    name_max, path_max = 255, 4096
    with contextlib.suppress(OSError, ValueError, AttributeError):
        # abspath, not resolve(): resolving follows links, and a loop of links would raise
        # (RuntimeError before Python 3.13) where only the anchor is wanted.
        anchor = Path(os.path.abspath(text)).anchor or "/"
        name_max = os.pathconf(anchor, "PC_NAME_MAX")
        path_max = os.pathconf(anchor, "PC_PATH_MAX")
    for part in encoded.split(os.fsencode(os.sep)):
        if len(part) > name_max:
            shown = os.fsdecode(part)
            raise InvalidValue(
                f"{what} has a path component of {len(part)} bytes ({shown[:24]!r}...), "
                f"longer than the file system allows ({name_max}); use a shorter folder name"
            )
    if len(encoded) > path_max:
        raise InvalidValue(
            f"{what} is {len(encoded)} bytes long, longer than the file system allows "
            f"({path_max}); use a shorter path"
        )


class OutputError(GradestError, ValueError):
    """A file or folder gradest must write cannot be written (the message names it)."""


def _reason(err: OSError) -> str:
    hints = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file is larger than allowed (disk quota or file-size limit)",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "a part of the path is a file, not a folder",
        errno.EISDIR: "it is a folder",
        errno.ELOOP: "the path goes through a loop of symbolic links",
        errno.ENAMETOOLONG: "a name in the path is longer than the file system allows",
    }
    return hints.get(err.errno or 0, err.strerror or type(err).__name__)


# What stands at a path, by the file-type bits of its mode (the message names it).
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _existing_kind(path: Path, what: str, *, error: type[GradestError] | None = None) -> str | None:
    """What is at ``path`` if it is not a regular file (``"a character device"``, ...);
    None for a regular file or nothing at all (a dangling link is nothing: writing
    replaces the link). A path that cannot even be looked at (a loop of links, a name too
    long) is refused here, so that no caller meets a raw ``OSError``."""
    try:
        mode = os.stat(path).st_mode  # follows links: a link to /dev/null is a device
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise (error or OutputError)(
            f"{what} {str(path)!r} cannot be used: {_reason(err)}; pass another path"
        ) from None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def refuse_non_file(path: str | os.PathLike[str], *, what: str) -> None:
    """Refuse a path that exists and is not a regular file, before anything is written.

    gradest writes only regular files. A character device (``/dev/null``), a FIFO, a
    socket or a block device at an output path would be *replaced* by the atomic write
    (``os.replace`` puts the new file where the node was: as root, ``--json /dev/null``
    would remove the device), or block (a FIFO without a reader); a folder cannot hold a
    file's content. So each is one line naming the path and the fix. Nothing is written,
    opened or followed for writing here.

    Raises:
        OutputError: naming ``what``, the path, what is there and the fix.
    """
    target = Path(path)
    kind = _existing_kind(target, what)
    if kind is None:
        return
    if kind == "a folder":
        raise OutputError(f"{what} {str(target)!r} is a folder; pass a file path such as model.pt")
    raise OutputError(
        f"{what} {str(target)!r} is {kind}, not a regular file; gradest writes only regular "
        f"files and never replaces a device, pipe or socket: pass a file path such as "
        f"results.json"
    )


def read_text(path: str | os.PathLike[str], *, what: str) -> str:
    """The UTF-8 text of a file gradest reads back (a config, settings), or one line.

    The same rule as for writing: the path must be a regular file (reading a FIFO waits
    for a writer forever, a device is not a config), and its bytes UTF-8 (what every
    writer of gradest writes; TOML requires it).

    Raises:
        MissingFile: nothing is there.
        InvalidValue: a folder, a device, a pipe, a socket; or bytes that are not UTF-8
            (naming the first bad byte's offset).
    """
    source = Path(path)
    kind = _existing_kind(source, what, error=InvalidValue)  # a read: not an OutputError
    if kind is not None:
        raise InvalidValue(
            f"{what} {str(source)!r} is {kind}, not a regular file; pass the path of a file"
        )
    if not source.exists():
        raise MissingFile(f"{what} {str(source)!r}: no such file")
    try:
        data = source.read_bytes()
    except OSError as err:
        raise InvalidValue(f"{what} {str(source)!r} cannot be read: {_reason(err)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidValue(
            f"{what} {str(source)!r} is not UTF-8 text (byte {data[err.start]:#04x} at offset "
            f"{err.start}); save it as UTF-8"
        ) from None


def read_json(path: str | os.PathLike[str], *, what: str) -> Any:
    """The JSON value in a file gradest reads (a config), or one line naming it: the file
    rule of :func:`read_text` (a regular file of UTF-8 text), then JSON, nested at most
    :data:`~gradest_lab.storage.json_text.MAX_JSON_DEPTH` levels.

    Raises:
        MissingFile: nothing is there.
        InvalidValue: not a regular file, not UTF-8, not JSON (with the parser's
            position), or nested deeper than the bound.
    """
    text = read_text(path, what=what)
    try:
        return parse_json(text)
    except ValueError as err:
        raise InvalidValue(f"{what} {str(path)!r} is not JSON: {err}") from None


def check_output_dir(path: str | os.PathLike[str], *, what: str, create: bool = True) -> Path:
    """Prove the folder ``path`` writable (creating it and its parents), before any work.

    Args:
        path: the folder.
        what: how the caller names it in messages (``"--out"``, ``"checkpoint_dir"``).
        create: False checks without creating anything: the nearest existing folder on
            the way must be writable (so that a failed run leaves no empty folder behind).

    Raises:
        OutputError: it is a file, lies under a file, or cannot be created or written.
    """
    folder = Path(path)
    check_path_length(folder, what=what)
    kind = _existing_kind(folder, what)  # a loop of links is refused here, in one line
    # ``kind`` is None for a regular file and for nothing; whether a file stands there is
    # asked again, not read from "exists now": another process (a data-parallel rank) may
    # create the folder in between, and that folder is not a file.
    if kind is not None and kind != "a folder":
        raise OutputError(f"{what} {str(folder)!r} is {kind}; pass a folder path")
    if kind is None and folder.is_file():
        raise OutputError(f"{what} {str(folder)!r} is a file; pass a folder path")
    probe_in = folder
    if not create:
        while not probe_in.exists() and probe_in.parent != probe_in:
            probe_in = probe_in.parent
        if not probe_in.is_dir():
            raise OutputError(
                f"{what} {str(folder)!r} cannot be written: a part of the path is a file, not "
                f"a folder; pass a folder you can write to"
            )
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".gradest-probe.", suffix=_TMP_SUFFIX, dir=probe_in)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise OutputError(
            f"{what} {str(folder)!r} cannot be written: {_reason(err)}; pass a folder you "
            f"can write to"
        ) from None
    return folder


def check_output_file(path: str | os.PathLike[str], *, what: str) -> Path:
    """Check that the file ``path`` can be (re)written: its folder exists or can be made and
    is writable, and ``path`` is nothing or a regular file (:func:`refuse_non_file`: not
    a folder, a device, a FIFO or a socket). Before any work; nothing is written."""
    target = Path(path)
    check_path_length(target, what=what)
    refuse_non_file(target, what=what)
    try:
        check_output_dir(target.parent, what="its folder")
    except OutputError as err:
        raise OutputError(f"{what} {str(target)!r} cannot be written: {err}") from None
    return target


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform can open a folder.
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _mode_for(target: Path) -> int:
    """The existing file's permissions, or what ``open()`` would create under the umask."""
    with contextlib.suppress(OSError):
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(binary_file)`` atomically (temporary file + replace).

    Raises:
        OutputError: ``path`` is not a regular file (:func:`refuse_non_file`: checked
            before the temporary is made and again just before the replace, which would
            put a file where a device or pipe was); or the temporary could not be written
            or moved (disk full, read-only, file-size limit); ``path`` keeps its previous
            content.
    """
    target = Path(path)
    folder = target.parent
    refuse_non_file(target, what="output file")
    try:
        handle, temporary = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=_TMP_SUFFIX, dir=folder
        )
    except OSError as err:
        raise OutputError(f"cannot write {str(target)!r}: {_reason(err)}") from None
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        os.chmod(temporary, _mode_for(target))
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        # Again: a slow writer leaves time for a pipe or device to appear at the path.
        refuse_non_file(target, what="output file")
        os.replace(temporary, target)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        kept = "the previous file is unchanged" if target.exists() else "nothing was written"
        raise OutputError(f"cannot write {str(target)!r}: {_reason(err)}; {kept}") from None
    except BaseException:  # OutputError of the second check included
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_dir(folder)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda file: file.write(text.encode("utf-8")))


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)``, atomically.

    Serialized in memory first: torch's zip writer turns a failed ``write`` (disk full)
    into a bare ``RuntimeError``, so the bytes are written by :func:`atomic_write`, where
    an ``OSError`` is an ``OSError``. (The checkpoint is held twice in host memory while
    it is written: fine for the fine-tuning checkpoints gradest writes.)
    """
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write(path, lambda file: file.write(buffer.getbuffer()))


def remove_stale_temporaries(
    folder: str | os.PathLike[str], names: Iterable[str] | None = None
) -> list[Path]:
    """Delete the ``.<name>.*.tmp`` files a killed writer left in ``folder``.

    Args:
        names: only the temporaries of these target names (``["result.json"]``), so that
            a folder shared with other tools keeps theirs; None (the default): every
            ``.*.tmp`` file.
    """
    removed: list[Path] = []
    directory = Path(folder)
    if not directory.is_dir() or directory.is_symlink():
        return removed
    patterns = [f".*{_TMP_SUFFIX}"] if names is None else [f".{n}.*{_TMP_SUFFIX}" for n in names]
    for item in sorted({found for pattern in patterns for found in directory.glob(pattern)}):
        if item.is_symlink() or not item.is_file():
            continue
        with contextlib.suppress(OSError):
            item.unlink()
            removed.append(item)
    return removed


def refuse_symlinks(paths: Iterable[str | os.PathLike[str]], *, what: str) -> None:
    """Refuse, before any write, an entry of a run's folder that is a symbolic link.

    A run writes its own files under its folder; a link among them (``log.jsonl`` pointing
    at another tool's log, ``checkpoints`` at another folder) would make it write, cut or
    replace something outside. Nothing is followed or changed here.

    Args:
        paths: the files and folders the run will write (need not exist).
        what: how the caller names the folder in the message (``"--out 'runs/ft'"``).

    Raises:
        OutputError: naming the first link and where it points.
    """
    for entry in paths:
        path = Path(entry)
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_link = False
        except OSError as err:  # a name too long, a loop on the way: one line, not a raw OSError
            raise OutputError(
                f"{what}: {str(path)!r} cannot be used: {_reason(err)}; pass another path"
            ) from None
        if is_link:
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise OutputError(
                f"{what}: {str(path)!r} is a symbolic link (to {target!r}); a run never writes "
                f"through a link, which may lead out of its folder: replace the link by the "
                f"file itself or pass a new folder"
            )


class JsonLogError(GradestError, ValueError):
    """A JSON-lines log holds a line that is not a JSON record (the message names it)."""


class JsonLog:
    """An append-only JSON-lines log in which every record is whole.

    Args:
        path: the ``.jsonl`` file; created by the first :meth:`append`. A partial last
            line (a writer killed mid-record by something other than gradest's own
            checks) is ignored by :meth:`records` and cut off by the next :meth:`append`
            or :meth:`keep`; opening the log and reading it never change the file.

    A log that is a symbolic link is refused by :meth:`append` and :meth:`keep`
    (:class:`OutputError`), never written through.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def _refuse_link(self) -> None:
        refuse_symlinks([self.path], what="the log")
        refuse_non_file(self.path, what="the log")

    def _drop_partial_tail(self) -> None:
        """Cut a partial last line off (only when about to write)."""
        self._refuse_link()
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            handle = os.open(self.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.ftruncate(handle, keep)
                os.fsync(handle)
            finally:
                os.close(handle)

    def records(self) -> list[dict[str, Any]]:
        """Every whole record, in order (a partial last line is left out).

        Raises:
            JsonLogError: a whole line is not a JSON object, naming the file and the line
                (the file is left as it is).
        """
        # Reading a FIFO would wait for a writer forever: the same rule as for writing.
        refuse_non_file(self.path, what="the log")
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        lines.pop()  # the partial last line, or b"" after the final newline
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = parse_json(line)
            except ValueError as err:  # a UnicodeDecodeError too
                raise JsonLogError(
                    f"{str(self.path)!r} line {number} is not a JSON record ({err}); the log "
                    f"is damaged or is not a gradest log: it is left as it is; start a new "
                    f"run in another folder"
                ) from None
            if not isinstance(record, dict):
                raise JsonLogError(
                    f"{str(self.path)!r} line {number} is not a JSON record (a "
                    f"{type(record).__name__}); the log is damaged or is not a gradest log: it "
                    f"is left as it is; start a new run in another folder"
                )
            records.append(record)
        return records

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records())

    def append(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line with one ``os.write``, then fsync.

        Raises:
            OutputError: the write failed or was short (disk full); the log is cut back
                to its previous whole records first.
        """
        line = (json.dumps(record) + "\n").encode("utf-8")
        self._drop_partial_tail()
        # O_NONBLOCK: a FIFO put at the path since the check fails to open (no reader)
        # instead of blocking; the fstat below then refuses anything but a regular file.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        flags |= getattr(os, "O_NONBLOCK", 0)
        try:
            handle = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise OutputError(f"cannot append to {str(self.path)!r}: {_reason(err)}") from None
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            os.close(handle)
            refuse_non_file(self.path, what="the log")
            raise OutputError(f"cannot append to {str(self.path)!r}: not a regular file")
        try:
            before = os.fstat(handle).st_size
            try:
                written = os.write(handle, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(handle)
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.ftruncate(handle, before)
                raise OutputError(
                    f"cannot append to {str(self.path)!r}: {_reason(err)}; its previous "
                    f"records are intact"
                ) from None
        finally:
            os.close(handle)

    def keep(self, predicate: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the log (atomically) with only the records for which ``predicate`` holds."""
        self._refuse_link()
        kept = [record for record in self.records() if predicate(record)]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
