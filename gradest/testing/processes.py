"""Child processes for the tests that send a real signal (the library's and each
application's Ctrl-C tests): a command started as a terminal would start it."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

__all__ = ["start_with_sigint_at_default"]


def start_with_sigint_at_default(command: list[str], **popen_args: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen_args)`` with SIGINT at its default in the child,
    so Python there turns a SIGINT into ``KeyboardInterrupt`` as it does under a terminal.

    A shell starts background jobs (a CI runner's, a ``nohup``) with SIGINT ignored, and an
    ignored signal stays ignored across exec, while a handled one is reset to the default.
    So the handler is set here, in the parent, for the moment of the fork. A
    ``preexec_fn`` would instead run Python code in a fork of a multi-threaded process
    (pytest with torch's threads), which Python documents can deadlock before the exec.
    Call it from the main thread (where ``signal.signal`` is allowed).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, **popen_args)
    finally:
        if previous is not None:  # None: a handler not set from Python, left alone
            signal.signal(signal.SIGINT, previous)
