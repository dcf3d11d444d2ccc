"""A compare's report folder: ``report.md``, ``report.json`` and the plots, written at once.

:func:`gradest.harness.compare` returns a :class:`gradest.Report`, whose texts the library
builds (:meth:`~gradest.Report.to_markdown`, :meth:`~gradest.Report.to_json`); writing
them into a folder, with the plots, is the lab's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

from gradest import Report
from gradest_lab.storage.files import OutputError, atomic_write_text, check_output_dir

__all__ = ["write_report"]


def write_report(report: Report, out: str | os.PathLike[str], *, plots: bool = True) -> Path:
    """Write ``report.md``, ``report.json`` and the plots of ``report`` to ``out`` atomically.

    Everything is written (and fsynced) into a temporary folder beside ``out`` and moved
    into place at the end, each file with ``os.replace``, so an interrupted run never
    leaves a half-written report, and a failed write (disk full, read-only) raises
    :class:`~gradest_lab.storage.files.OutputError` naming the path. Without matplotlib
    the plots are skipped with a warning that says why, and the report and its JSON are
    written all the same.

    Returns:
        The folder.
    """
    from gradest_lab.plots import plots_unavailable

    missing = plots_unavailable() if plots else None
    if missing is not None:
        warnings.warn(f"gradest compare: plots skipped: {missing}", stacklevel=2)
        plots = False
    # Checked before writing, but created only when the report moves in, so an
    # interrupted write leaves no (empty) report folder behind.
    target = check_output_dir(out, what="--out", create=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as err:
        raise OutputError(f"cannot write a report next to {str(target)!r}: {err}") from None
    try:
        atomic_write_text(staging / "report.md", report.to_markdown())
        atomic_write_text(staging / "report.json", report.to_json())
        if plots:
            from gradest_lab.plots import plot_report

            plot_report(report, staging)
        target.mkdir(exist_ok=True)
        for item in staging.iterdir():
            try:
                os.replace(item, target / item.name)
            except OSError as err:
                raise OutputError(f"cannot write {str(target / item.name)!r}: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
