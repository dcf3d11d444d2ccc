"""What a fine-tuning run must save to continue bit for bit, and finding it again.

A checkpoint (``step_XXXXXX.pt``, written atomically by :func:`save_checkpoint`) holds
everything the next step depends on: the model and optimizer state, every rank's training
generator and global torch RNG state (dropout and other layers draw from the latter), the
step counter, the run's configuration, the history of logged records and the initial
reward. :func:`newest_checkpoint` finds the newest one that loads (a file that does not is
skipped with a warning, never trusted); :func:`check_same_run` refuses to continue a run
with different settings, so two runs are never mixed in one folder.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from gradest.errors import InvalidValue
from gradest.files import atomic_save

FORMAT = "gradest.finetune/2"
_NAME = re.compile(r"^step_(\d{6,})\.pt$")
# Settings a resumed run may change: only how far it goes.
_MAY_CHANGE = frozenset({"steps"})


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:06d}.pt"


def checkpoints_in(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ``step_*.pt`` files in ``directory``, newest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = []
    for item in folder.iterdir():
        match = _NAME.match(item.name)
        if match and item.is_file():
            found.append((int(match.group(1)), item))
    return sorted(found, reverse=True)


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> str:
    """Write ``state`` (with ``format`` and ``step``) as ``step_XXXXXX.pt``, atomically."""
    path = checkpoint_path(directory, step)
    atomic_save({"format": FORMAT, "step": step, **state}, path)
    return str(path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint` (``weights_only`` loading).

    Raises:
        ValueError: the file does not load, or is not a gradest fine-tuning checkpoint.
    """
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a damaged zip or pickle
        raise InvalidValue(f"checkpoint {str(path)!r} does not load: {err}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InvalidValue(
            f"{str(path)!r} is not a resumable gradest fine-tuning checkpoint (format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}, "
            f"expected {FORMAT!r}); checkpoints of older gradest versions cannot be resumed"
        )
    return state


def newest_checkpoint(location: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint that loads, from a file or a folder of ``step_*.pt``.

    A folder that holds a ``checkpoints/`` subfolder (a ``gradest finetune --out`` folder)
    is searched there. Checkpoints that do not load (a damaged file under a final name
    cannot come from gradest's atomic writes, but could be copied in) are skipped with a
    warning.

    Returns:
        The checkpoint, or None when the folder holds none that loads (a run killed
        before its first checkpoint: it starts over).

    Raises:
        ValueError: ``location`` does not exist, or is a file that does not load.
    """
    place = Path(location)
    if place.is_file():
        return load_checkpoint(place)
    if not place.is_dir():
        raise InvalidValue(
            f"nothing to resume at {str(location)!r}: no such file or folder; pass the folder "
            f"of the run to continue (gradest finetune --out DIR writes DIR/checkpoints)"
        )
    if (place / "checkpoints").is_dir():
        place = place / "checkpoints"
    for _, path in checkpoints_in(place):
        try:
            return load_checkpoint(path)
        except ValueError as err:
            warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=2)
    return None


def earlier_run(log_path: Path | None, checkpoint_dir: Path | None) -> str | None:
    """What an earlier run left in these places (records, checkpoints), or None."""
    from gradest.files import JsonLog

    found = []
    if log_path is not None and log_path.is_file():
        records = len(JsonLog(log_path).records())
        if records:
            found.append(f"{str(log_path)!r} holds {records} log records")
    if checkpoint_dir is not None:
        count = len(checkpoints_in(checkpoint_dir))
        if count:
            found.append(f"{str(checkpoint_dir)!r} holds {count} checkpoint(s)")
    return "; ".join(found) or None


# Settings added to FinetuneConfig after checkpoints of the same format were written, with
# the value those runs had: resuming such a checkpoint with the default is the same run.
ADDED_SETTINGS: dict[str, Any] = {"prior_weight": 0.0, "kl_weight": 0.0}


def check_same_run(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume with other settings than the checkpoint's (``steps`` may grow).

    Raises:
        ValueError: naming every setting that differs, with both values.
    """
    keys = (set(saved) | set(current)) - _MAY_CHANGE
    # A setting added after the checkpoint was written ran at its default then.
    saved = {**ADDED_SETTINGS, **saved}
    differ = sorted(key for key in keys if saved.get(key) != current.get(key))
    if differ:
        detail = "; ".join(
            f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}" for key in differ
        )
        raise InvalidValue(
            f"cannot resume: the run was started with other settings ({detail}); resume with "
            f"the same settings (only the number of steps may change), or start a new run in "
            f"another folder"
        )
