"""What a fine-tuning run must save to continue bit for bit, and finding it again.

A checkpoint (``step_XXXXXX.pt``, written atomically by :func:`save_checkpoint`) holds
everything the next step depends on: the model and optimizer state, every rank's training
generator and global torch RNG state (dropout and other layers draw from the latter), the
step counter, the run's configuration, the history of logged records and the initial
reward. :func:`newest_checkpoint` finds the newest one; :func:`check_same_run` refuses to
continue a run with different settings, so two runs are never mixed in one folder.

A run folder is append-only history. Nothing in it is overwritten, cut or pruned unless it
belongs to the same run (lineage) and is replaced by what that run redoes:

* the newest checkpoint must load: one that does not (damaged, or of another format) is
  kept as it is and the resume is refused naming it (:func:`newest_checkpoint`), because
  resuming from an older one would write over it;
* resuming from a checkpoint older than others in the folder (a branch) is refused in that
  folder (:func:`check_lineage`): the newer steps are never overwritten; branch into a new
  folder instead;
* the log's records before the resumed step must be the checkpoint's own history
  (:func:`check_lineage`), so that the records cut from it are the run's own redone steps.
"""

from __future__ import annotations

import re
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


# What a refused checkpoint is told to do: it is kept, the run starts over elsewhere.
START_OVER = "it is kept as it is; to start over, run again into a new folder with --out NEW"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint` (``weights_only`` loading).

    Raises:
        ValueError: the file does not load, or is not a gradest fine-tuning checkpoint of
            this format (one line naming the file, its format and the fix; the file is
            never changed).
    """
    path = Path(path)
    if path.is_symlink():
        raise InvalidValue(
            f"checkpoint {str(path)!r} is a symbolic link; a run folder holds its own files: "
            f"{START_OVER}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a damaged zip or pickle
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InvalidValue(
            f"checkpoint {str(path)!r} does not load (format unreadable: {first[:200]}); "
            f"{START_OVER}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise InvalidValue(
            f"checkpoint {str(path)!r} has format {found!r}, not {FORMAT!r} (written by another "
            f"gradest version or another tool), so it cannot be resumed; {START_OVER}"
        )
    return state


def newest_checkpoint(location: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint, from a file or a folder of ``step_*.pt``.

    A folder that holds a ``checkpoints/`` subfolder (a ``gradest finetune --out`` folder)
    is searched there. The newest ``step_*.pt`` must load: one that does not (a damaged
    file under a final name cannot come from gradest's atomic writes, but could be copied
    in; or a checkpoint of another format) is refused, never skipped, since continuing from
    an older one would overwrite it.

    Returns:
        The checkpoint, or None when the folder holds none (a run killed before its first
        checkpoint: it starts over).

    Raises:
        ValueError: ``location`` does not exist, or the checkpoint does not load (naming
            the file and its format; the file is kept).
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
    found = checkpoints_in(place)
    if not found:
        return None
    return load_checkpoint(found[0][1])


def earlier_run(
    log_path: Path | None, checkpoint_dir: Path | None, others: tuple[Path, ...] = ()
) -> str | None:
    """What an earlier run (or another tool) left in these places, or None. Reads only.

    A log counts when it holds anything at all (records, a torn line, text that is not a
    log), checkpoints when there are any, and each of ``others`` (a run's
    ``settings.json``, ``result.json``) when it exists.
    """
    from gradest.files import JsonLog

    found = []
    if log_path is not None and (log_path.is_symlink() or log_path.exists()):
        if log_path.is_symlink() or not log_path.is_file():
            found.append(f"{str(log_path)!r} exists and is not a plain file")
        elif log_path.stat().st_size:
            try:
                records = len(JsonLog(log_path).records())
                what = f"{records} log records" if records else "a partial log line"
            except ValueError:
                what = "lines that are not log records"
            found.append(f"{str(log_path)!r} holds {what}")
    if checkpoint_dir is not None:
        count = len(checkpoints_in(checkpoint_dir))
        if count:
            found.append(f"{str(checkpoint_dir)!r} holds {count} checkpoint(s)")
    for other in others:
        if other.is_symlink() or other.exists():
            found.append(f"{str(other)!r} exists")
    return "; ".join(found) or None


def check_lineage(
    resumed: dict[str, Any], log_path: Path | None, checkpoint_dir: Path | None
) -> None:
    """Refuse a resume that would overwrite or cut history of another run or branch.

    * ``checkpoint_dir`` must hold no checkpoint newer than the resumed one: resuming from
      an older checkpoint in place would overwrite the newer steps (a branch goes into a
      new folder, whose checkpoints and log start from the resumed step).
    * the log's records before the resumed step, when it has any, must be the
      checkpoint's history, record for record: only then are the records it cuts the
      run's own steps, which it redoes.

    Raises:
        ValueError: one line naming what would be lost and how to branch instead.
    """
    from gradest.files import JsonLog

    step = int(resumed["step"])
    if checkpoint_dir is not None:
        newer = [path for found, path in checkpoints_in(checkpoint_dir) if found > step]
        if newer:
            names = ", ".join(path.name for path in sorted(newer))
            raise InvalidValue(
                f"cannot resume from step {step}: {str(checkpoint_dir)!r} holds newer "
                f"checkpoints ({names}) that continuing here would overwrite; resume from the "
                f"newest, or branch from step {step} into a new folder (new checkpoint_dir "
                f"and log_path; gradest finetune: --out NEW)"
            )
    if log_path is None or not log_path.is_file():
        return
    import json

    logged = [r for r in JsonLog(log_path).records() if r.get("step", step) < step]
    history = list(resumed.get("history", []))
    if logged and [json.dumps(r) for r in logged] != [json.dumps(r) for r in history]:
        raise InvalidValue(
            f"cannot resume from step {step}: {str(log_path)!r} holds records before step "
            f"{step} that are not the checkpoint's history (another run or branch wrote it); "
            f"it is kept as it is; resume into a new folder (new log_path; gradest finetune: "
            f"--out NEW)"
        )


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
