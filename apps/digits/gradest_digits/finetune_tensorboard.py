"""TensorBoard beside ``log.jsonl``: every logged record's numbers as scalars.

:class:`TensorBoardLog` writes each record the fine-tuning loop appends to its JSON log
as TensorBoard scalars at ``global_step = record["step"]``: tag ``train/<key>`` per
number, nested dicts flattened (``train/cost/model_units``,
``train/info/fallback_fraction``); booleans, strings, lists and None are left out. It
is flushed after every record, so a killed run's TensorBoard holds what its log holds.

A resumed run redoes the steps after its checkpoint and its log is cut back to them;
the writer is opened with ``purge_step`` = the first step it redoes, so TensorBoard hides
the earlier run's events from that step on and no step appears twice.

tensorboard is an optional dependency (``pip install tensorboard``, or gradest's
``recipes`` extra); :func:`use_tensorboard` turns the ``--tensorboard`` /
``--no-tensorboard`` flag (unset: on when it is installed) into a yes or no.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gradest_lab.storage.files import check_output_dir

from gradest import MissingDependency

INSTALL = "pip install tensorboard (or pip install './apps/digits[tensorboard]')"


def summary_writer_class(what: str, otherwise: str = "") -> Any:
    """``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        MissingDependency: tensorboard is not installed; the message says that ``what``
            needs it, how to install it, and ``otherwise`` (another way out) if given.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise MissingDependency(
            f"{what} needs tensorboard, which is not installed: {INSTALL}{otherwise}"
        ) from err
    return SummaryWriter


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` imports here."""
    try:
        summary_writer_class("TensorBoard logging")
    except MissingDependency:
        return False
    return True


def use_tensorboard(flag: bool | None) -> bool:
    """``--tensorboard`` (True), ``--no-tensorboard`` (False) or neither (None: on when
    tensorboard is installed).

    Raises:
        MissingDependency: ``--tensorboard`` was asked for and tensorboard is not
            installed.
    """
    if flag is None:
        return tensorboard_available()
    if flag:
        summary_writer_class("--tensorboard", "; or drop --tensorboard")
    return bool(flag)


def scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` of every number in a log record but its ``step``: ``train/<key>``,
    nested dicts flattened into ``train/<key>/<subkey>``."""
    return _numbers({key: value for key, value in record.items() if key != "step"}, "train/")


def _numbers(values: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)


def check_tensorboard_dir(folder: str | Path, *, what: str) -> Path:
    """Before any work: tensorboard imports and ``folder`` can be created and written
    (nothing is created yet).

    Raises:
        MissingDependency: tensorboard is not installed.
        OutputError: ``folder`` cannot be written.
    """
    summary_writer_class(what)
    return check_output_dir(folder, what=what, create=False)


class TensorBoardLog:
    """A TensorBoard event folder that takes the fine-tuning log's records.

    Args:
        folder: the event folder (``OUT/tensorboard``); created if missing. Each writer
            adds an event file of its own, so a resumed run's events join the earlier ones.
        purge_step: the first step this run writes: TensorBoard hides earlier events at
            this step or later (a resumed run's redone steps). None purges nothing.

    Raises:
        MissingDependency: tensorboard is not installed.
    """

    def __init__(self, folder: str | Path, *, purge_step: int | None = None):
        writer_class = summary_writer_class("TensorBoardLog")
        self.folder = Path(folder)
        self._writer = writer_class(str(self.folder), purge_step=purge_step)

    def append(self, record: Mapping[str, Any]) -> None:
        """Every number in ``record`` at ``global_step = record["step"]``, then flush."""
        step = int(record["step"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
