"""A lock file held by one process: taken with ``flock``, released by the kernel on death.

A run folder (:mod:`gradest_lab.storage.run_folder`) and a tuned race's shard
(:mod:`gradest_lab.race.shards`) each have a lock file that one process holds while it
writes. The lock is the kernel's ``flock`` on that file, not the file's existence, so:

* a process killed by anything (``kill -9``, an out-of-memory kill, a power cut on a local
  disk) releases it without having to clean up; the next process takes it over at once,
  with no timeout to wait out and no guess from a pid that may have been reused;
* two processes that race for a free lock cannot both win: ``flock`` decides.

The file's text names the holder (pid, host, command, start time), for the message that
refuses a second writer. It is written after the lock is taken; a reader that finds a
locked file whose text is not (yet) readable says the holder is unknown.

The file is removed on release. Removing a file another process may be about to lock is
safe because a process that took the lock checks afterwards that the path still names the
file it locked, and starts over when it does not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from gradest_lab.storage.files import OutputError
from gradest_lab.storage.json_text import parse_json

__all__ = ["HeldLock", "describe_holder", "read_holder", "try_lock"]


@attrs.define(eq=False)
class HeldLock:
    """A lock this process holds; :meth:`release` (or the process's end) frees it."""

    path: Path
    fd: int | None

    def release(self) -> None:
        """Remove the lock file and free the lock (idempotent)."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)  # closing the last descriptor frees the flock
        self.fd = None

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def try_lock(path: str | os.PathLike[str], *, command: str) -> HeldLock | None:
    """Take the lock at ``path`` (creating the file), or return None when a live process
    holds it. The holder's text records this process (pid, host, ``command``, time).

    Raises:
        OutputError: the lock file cannot be created or is not a regular file.
    """
    lock = Path(path)
    for _ in range(100):
        try:
            # O_NONBLOCK: a FIFO put where the lock goes must not hang the open.
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            why = (
                "it is a symbolic link"
                if err.errno == errno.ELOOP
                else err.strerror or type(err).__name__
            )
            raise OutputError(f"cannot open the lock file {str(lock)!r}: {why}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(
                f"the lock file {str(lock)!r} is not a regular file; remove what is there or "
                f"pass another folder"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as err:  # a file system without flock
            os.close(fd)
            raise OutputError(
                f"cannot lock {str(lock)!r} ({err.strerror}): the file system does not "
                f"support flock; run in a folder on a local disk"
            ) from None
        if not _same_file(fd, lock):
            os.close(fd)  # the file was released and removed while this process waited
            continue
        text = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": command,
                "since": time.time(),
                "argv": sys.argv[:8],
            }
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        return HeldLock(lock, fd)
    raise OutputError(f"cannot take the lock {str(lock)!r}: it keeps being replaced")


def read_holder(path: str | os.PathLike[str]) -> Mapping[str, Any] | None:
    """The holder's record of the lock at ``path`` when a live process holds it (``{}``
    when its text is not readable yet), or None when nobody does."""
    lock = Path(path)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held
        except OSError:
            return None
        else:
            return None  # free: nobody holds it
        try:
            info = parse_json(os.pread(fd, 65536, 0))
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}
    finally:
        os.close(fd)


def describe_holder(info: Mapping[str, Any]) -> str:
    """``pid 123 on HOST (gradest race, since 2026-12-01 23:05)``, from :func:`read_holder`."""
    if not info:
        return "another process (its record is being written)"
    since = info.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M", time.localtime(since))
        if isinstance(since, int | float)
        else "?"
    )
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('command')}, since {when})"
