"""The JSON records a resumed recipe run reads back, each read by one reader into a
typed record (:mod:`gradest_recipes.file_schema` lists every format and its reader).

* ``checkpoints/step_XXXXXX/recipe_state.json``: :class:`RecipeState`
  (:func:`read_recipe_state`; :func:`find_checkpoint` finds the newest one);
* ``done.json``, written after the final LoRA export: :class:`DoneRecord`
  (:func:`read_done`);
* ``log.jsonl``: gradest's :class:`~gradest_lab.storage.files.JsonLog`, each record's ``step``
  checked (:func:`read_log`, :func:`log_step`): the training records from step 1 on, and
  with ``eval_every`` a record of step 0 holding only the evaluation before training.

Each failure is one :class:`~gradest.errors.InvalidValue` line naming the file and the
field, and the file is left as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from gradest_lab.storage.files import JsonLog, read_text

from gradest import InvalidValue
from gradest_recipes.checkpoints import FORMAT, STATE_FILE, checkpoint_dirs, checkpoint_number
from gradest_recipes.config import (
    FAMILIES,
    NOT_SAVED,
    RecipeConfigError,
    load_config,
    saved_setting_problem,
)
from gradest_recipes.file_schema import describe, is_int, json_object

__all__ = [
    "DONE_FILE",
    "DONE_FIELDS",
    "LOG_FILE",
    "STATE_FIELDS",
    "DoneRecord",
    "RecipeState",
    "find_checkpoint",
    "log_step",
    "read_done",
    "read_log",
    "read_recipe_state",
]

#: The fields of ``recipe_state.json`` and whether each must be there: a checkpoint
#: written before the lineage was saved has none (it continues nothing).
STATE_FIELDS = {"format": True, "step": True, "family": True, "config": True, "lineage": False}

DONE_FILE = "done.json"
#: Every field of ``done.json`` (all required).
DONE_FIELDS = ("step", "out", "processes", "parallel")
#: How a run's model was data parallel (``done.json``'s ``parallel``).
PARALLEL = ("fsdp2", "ddp", "fsdp1", "none")
LOG_FILE = "log.jsonl"


@attrs.frozen
class RecipeState:
    """A checkpoint's ``recipe_state.json``: what a resume continues.

    Attributes:
        folder: the checkpoint folder (``checkpoints/step_XXXXXX``).
        step: the optimizer steps done.
        family: the recipe (``sd3``, ``flux``, ``sd_unet``).
        config: every saved setting (JSON values, as :meth:`RecipeConfig.to_dict` writes
            them; ``resume`` is never saved).
        lineage: the checkpoints of other folders the run continued from, in order.
    """

    folder: Path
    step: int
    family: str
    config: Mapping[str, Any]
    lineage: tuple[str, ...] = ()


def read_recipe_state(path: str | Path) -> RecipeState:
    """The :class:`RecipeState` in ``path`` (a checkpoint's ``recipe_state.json``).

    Every field is checked: the format, the step (an integer; the folder's number when
    it is named ``step_XXXXXX``), the family, every saved setting (a setting of this
    version, of the JSON kind its type is written as, and together a config the recipe
    accepts) and the lineage (a list of paths, when there).

    Raises:
        InvalidValue / MissingFile: one line naming the file and the field; the file is
            left as it is.
    """
    source = Path(path)

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"checkpoint state {str(source)!r}: {field} {why}; it is not a gradest recipe "
            f"checkpoint's (the file is left as it is): resume another checkpoint, or pass "
            f"the out folder of a recipe run"
        )

    data = json_object(read_text(source, what="checkpoint state"), refuse)
    for name, required in STATE_FIELDS.items():
        if required and name not in data:
            raise refuse(name, "is missing")
    if data["format"] != FORMAT:
        raise refuse("format", f"is {describe(data['format'])}, expected {FORMAT!r}")
    step, family, config = data["step"], data["family"], data["config"]
    if not is_int(step) or step < 0:
        raise refuse("step", f"is {describe(step)}, not a step count")
    number = checkpoint_number(source.parent)
    if number is not None and number != step:
        raise refuse("step", f"is {step}, but the checkpoint folder is {source.parent.name}")
    if not isinstance(family, str) or family not in FAMILIES:
        raise refuse("family", f"is {describe(family)}, not one of {list(FAMILIES)}")
    if not isinstance(config, dict):
        raise refuse("config", f"is {describe(config)}, not an object of settings")
    for key, value in config.items():
        problem = saved_setting_problem(key, value)
        if problem is not None:
            raise refuse(f"config.{key}", problem)
    try:
        load_config(family, saved=config)
    except RecipeConfigError as err:
        raise refuse("config", f"is not a config the recipe runs ({err})") from None
    lineage = data.get("lineage", [])
    if not isinstance(lineage, list) or not all(isinstance(item, str) for item in lineage):
        raise refuse("lineage", f"is {describe(lineage)}, not a list of checkpoint paths")
    saved = {key: value for key, value in config.items() if key not in NOT_SAVED}
    return RecipeState(
        folder=source.parent, step=step, family=family, config=saved, lineage=tuple(lineage)
    )


def find_checkpoint(location: str | Path) -> RecipeState:
    """The newest complete checkpoint at ``location`` (a run folder or a checkpoint
    folder), read by :func:`read_recipe_state`."""
    path = Path(location)
    if (path / STATE_FILE).is_file():
        candidates = [path]
    else:
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        candidates = [p for _, p in checkpoint_dirs(folder)]
    if not candidates:
        raise InvalidValue(
            f"setting resume={str(location)!r}: no checkpoint there (a run's out folder holds "
            f"checkpoints/step_XXXXXX/{STATE_FILE}); pass the out folder of a recipe run"
        )
    return read_recipe_state(candidates[0] / STATE_FILE)


@attrs.frozen
class DoneRecord:
    """``done.json``: written last, after the final LoRA export of a run at ``step``.

    Attributes:
        step: the step the run finished at (its export is complete).
        out: the run's folder when it wrote the record.
        processes: how many processes trained.
        parallel: how the model was data parallel (:data:`PARALLEL`).
    """

    step: int
    out: str
    processes: int
    parallel: str

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self)) + "\n"


def read_done(path: str | Path) -> DoneRecord | None:
    """The :class:`DoneRecord` in ``path``, or None when there is none.

    Raises:
        InvalidValue: one line naming the file and the field; the file is left as it is.
    """
    source = Path(path)
    if not source.exists() and not source.is_symlink():
        return None

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{str(source)!r}: {field} {why}; it is not the record a recipe run writes when "
            f"it is done (the file is left as it is): move it out of the run's folder to "
            f"continue the run"
        )

    data = json_object(read_text(source, what="the done record"), refuse)
    for name in DONE_FIELDS:
        if name not in data:
            raise refuse(name, "is missing")
    step, out, processes, parallel = (data[name] for name in DONE_FIELDS)
    if not is_int(step) or step < 0:
        raise refuse("step", f"is {describe(step)}, not a step count")
    if not isinstance(out, str):
        raise refuse("out", f"is {describe(out)}, not a folder path")
    if not is_int(processes) or processes < 1:
        raise refuse("processes", f"is {describe(processes)}, not a process count")
    if parallel not in PARALLEL:
        raise refuse("parallel", f"is {describe(parallel)}, not one of {list(PARALLEL)}")
    return DoneRecord(step=step, out=out, processes=processes, parallel=parallel)


def log_step(record: Mapping[str, Any], path: Path, number: int | None = None) -> int:
    """The ``step`` of one record of the log ``path`` (``number``: its place, 1 first):
    a step number from 1, or 0 for the evaluation before the first step (``eval_every``).

    Raises:
        InvalidValue: it has none, or not a step number; the log is left as it is.
    """
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        place = f"record {number}" if number is not None else "a record"
        raise InvalidValue(
            f"{str(path)!r}: {place}'s step is {describe(step)}, not a step number; the log "
            f"is damaged or is not a recipe's log: it is left as it is; start a new run in "
            f"another folder"
        )
    return step


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a recipe run's ``log.jsonl`` (gradest's :class:`JsonLog`: whole
    JSON objects, a partial last line left out), each with a step (:func:`log_step`).

    Raises:
        JsonLogError / InvalidValue: one line naming the file; it is left as it is.
    """
    source = Path(path)
    records = JsonLog(source).records()
    for number, record in enumerate(records, 1):
        log_step(record, source, number)
    return records
