"""What a fine-tuning run must save to continue bit for bit, and finding it again.

A checkpoint (``step_XXXXXX.pt``, written atomically by :func:`save_checkpoint`) holds
everything the next step depends on: the model and optimizer state, every rank's training
generator and global torch RNG state (dropout and other layers draw from the latter), the
step counter, the run's configuration, the history of logged records and the initial
reward. :func:`newest_checkpoint` finds the newest one; :func:`check_same_run` refuses to
continue a run with different settings, so two runs are never mixed in one folder.

Reading one back is :func:`load_checkpoint`'s alone (a :class:`Checkpoint`, every field
checked for its type, the generators' states for their shape) and :func:`check_fits`'s
(its model and optimizer states against the model and optimizer they load into); the log
is :func:`read_log`'s (every record checked). A damaged or foreign file is one line naming
it and the field, and is never changed.

A run folder is append-only history. Nothing in it is overwritten, cut or pruned unless it
belongs to the same run (lineage) and is replaced by what that run redoes:

* the newest checkpoint must load: one that does not (damaged, of another format, or with
  a field missing or of another type) is kept as it is and the resume is refused naming
  it (:func:`newest_checkpoint`), because resuming from an older one would write over it;
* resuming from a checkpoint older than others in the folder (a branch) is refused in that
  folder (:func:`check_lineage`): the newer steps are never overwritten; branch into a new
  folder instead;
* the log's records before the resumed step must be the checkpoint's own history
  (:func:`check_lineage`), so that the records cut from it are the run's own redone steps.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from gradest_lab.storage.files import atomic_save
from torch import Tensor

from gradest import InvalidType, InvalidValue
from gradest_digits.file_schema import (
    Refuse,
    describe,
    first_line,
    is_int,
    is_number,
    load_torch_file,
    require,
    require_fields,
    require_json,
    require_state_dict,
)
from gradest_digits.finetune_config import FinetuneConfig
from gradest_digits.finetune_records import LOG_KEYS

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


# The fields of a checkpoint (save_checkpoint's keys). Written by every version of the
# format but one: a checkpoint of an older gradest may lack these (each read as None).
CHECKPOINT_FIELDS = (
    "format",
    "step",
    "model",
    "optimizer",
    "generators",
    "torch_rng",
    "config",
    "history",
    "initial_reward",
)
OPTIONAL_FIELDS = ("checkpoints", "draw_generators", "estimator_state")
# The fields that may hold None (a run without an estimator-draw stream).
NULLABLE_FIELDS = ("draw_generators",)
# The settings in a checkpoint's config besides FinetuneConfig's own.
RUN_FIELDS = ("estimator", "labels", "sample_shape", "world_size")


@attrs.frozen(eq=False)
class Checkpoint(Mapping[str, Any]):
    """A checkpoint read back by :func:`load_checkpoint`, every field checked.

    The fields are typed attributes; the record is also the read-only mapping of the
    file's dict (``checkpoint["model"]``, ``{**checkpoint}``), as ``torch.load`` returns it.

    Attributes:
        path: the file.
        step: the steps done; ``model`` / ``optimizer`` their state dicts.
        generators, torch_rng: each rank's training generator and global RNG state;
            ``draw_generators`` each rank's estimator-draw stream (None: a run without it).
        config: the run's settings (``FinetuneConfig.record`` and the run's own).
        history: the log records of steps ``0 .. step - 1``.
        initial_reward: the evaluation batch's rewards before training.
        checkpoints: every checkpoint of the run so far (None: not recorded).
        estimator_state: a stateful estimator's state (``auto``'s schedule) or None.
    """

    path: Path
    step: int
    model: dict[str, Tensor]
    optimizer: dict[str, Any]
    generators: list[Tensor]
    torch_rng: list[Tensor]
    draw_generators: list[Tensor] | None
    config: dict[str, Any]
    history: list[dict[str, Any]]
    initial_reward: list[float]
    checkpoints: list[str] | None
    estimator_state: dict[str, Any] | None
    state: dict[str, Any] = attrs.field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def refuse(self, field: str, why: str) -> InvalidValue:
        """The one line refusing this checkpoint for ``field`` (it is kept)."""
        return _refusal(self.path)(field, why)


def _refusal(path: Path) -> Refuse:
    def refuse(field: str, why: str) -> InvalidValue:
        subject = "" if field == "the file" else f": {field}"
        return InvalidValue(
            f"checkpoint {str(path)!r}{subject} {why}, so it cannot be resumed; {START_OVER}"
        )

    return refuse


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint written by :func:`save_checkpoint` at ``path``, field by field.

    It is loaded with ``weights_only=True`` (a file that would run code when unpickled is
    refused, its code not run); every field the resumed run uses is checked for its type
    and, for the tensors it can check without the model (the generators' states), its
    shape. Whether the model and optimizer states fit the model is :func:`check_fits`'s.

    Raises:
        InvalidValue: the file does not load, is not a gradest fine-tuning checkpoint of
            this format, or a field is missing or of another type (one line naming the
            file and the field, and the fix; the file is never changed).
    """
    path = Path(path)
    refuse = _refusal(path)
    state = load_torch_file(path, refuse)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise InvalidValue(
            f"checkpoint {str(path)!r} has format {found!r}, not {FORMAT!r} (written by another "
            f"gradest version or another tool), so it cannot be resumed; {START_OVER}"
        )
    require_fields(state, CHECKPOINT_FIELDS, refuse)
    step = state["step"]
    require(is_int(step) and step >= 1, refuse, "step", step, "a step count >= 1")
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != step:
        raise refuse("step", f"is {step}, not the {int(named.group(1))} of its name")
    config = _checked_config(state["config"], refuse)
    world = config["world_size"]
    model = state["model"]
    require(
        isinstance(model, dict)
        and bool(model)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in model.items()),
        refuse,
        "model",
        model,
        "a state dict (names to tensors)",
    )
    _check_optimizer(state["optimizer"], refuse)
    generators = _generator_states(state["generators"], world, refuse, "generators")
    torch_rng = _generator_states(state["torch_rng"], world, refuse, "torch_rng")
    draws = state.get("draw_generators")
    if draws is not None:
        draws = _generator_states(draws, world, refuse, "draw_generators")
    history = state["history"]
    require(isinstance(history, list), refuse, "history", history, "a list of log records")
    for index, record in enumerate(history):
        check_log_record(record, refuse, f"history[{index}]")
    steps = [record["step"] for record in history]
    if steps != list(range(step)):
        raise refuse("history", f"holds the records of steps {_spans(steps)}, not 0..{step - 1}")
    initial = state["initial_reward"]
    batch = config["batch_size"]
    require(
        isinstance(initial, list) and len(initial) == batch and all(map(is_number, initial)),
        refuse,
        "initial_reward",
        initial,
        f"a list of {batch} rewards (the evaluation batch)",
    )
    checkpoints = state.get("checkpoints", [])
    require(
        isinstance(checkpoints, list) and all(isinstance(c, str) for c in checkpoints),
        refuse,
        "checkpoints",
        checkpoints,
        "a list of paths",
    )
    estimator_state = state.get("estimator_state", {})
    require(
        isinstance(estimator_state, dict),
        refuse,
        "estimator_state",
        estimator_state,
        "an estimator's state (a dict)",
    )
    return Checkpoint(
        path=path,
        step=step,
        model=model,
        optimizer=state["optimizer"],
        generators=generators,
        torch_rng=torch_rng,
        draw_generators=draws,
        config=config,
        history=history,
        initial_reward=initial,
        checkpoints=state.get("checkpoints"),
        estimator_state=state.get("estimator_state"),
        state=state,
    )


def _spans(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:6]))
    return f"[{shown}{', ...' if len(steps) > 6 else ''}]"


def _checked_config(config: Any, refuse: Refuse) -> dict[str, Any]:
    """The run's settings in a checkpoint: :meth:`FinetuneConfig.record`'s fields (those
    added later may be missing) and the run's own, each of its type."""
    require(isinstance(config, dict), refuse, "config", config, "a dict of settings")
    fields = [
        f
        for f in attrs.fields(FinetuneConfig)
        if f.name not in ("estimator", "checkpoint_every")
        and (config.get("mode") == "grpo" or not f.metadata["grpo"])
    ]
    required = [f.name for f in fields if f.name not in ADDED_SETTINGS]
    require_fields(config, required, refuse, "config.")
    require_fields(config, RUN_FIELDS, refuse, "config.")
    given = {f.name: config[f.name] for f in fields if f.name in config}
    for name, value in given.items():
        try:
            FinetuneConfig(**{name: value})
        except (InvalidValue, InvalidType) as err:
            raise refuse(f"config.{name}", f"is {describe(value)} ({first_line(err)})") from None
    try:
        FinetuneConfig(**given)
    except (InvalidValue, InvalidType) as err:
        raise refuse("config", f"does not hold one run's settings ({first_line(err)})") from None
    estimator, labels = config["estimator"], config["labels"]
    shape, world = config["sample_shape"], config["world_size"]
    wanted = "an estimator's name"
    require(
        isinstance(estimator, str) and bool(estimator),
        refuse,
        "config.estimator",
        estimator,
        wanted,
    )
    require(
        labels is None or is_int(labels) or (isinstance(labels, list) and all(map(is_int, labels))),
        refuse,
        "config.labels",
        labels,
        "null, a class or a list of classes",
    )
    require(
        isinstance(shape, list) and bool(shape) and all(is_int(s) and s >= 1 for s in shape),
        refuse,
        "config.sample_shape",
        shape,
        "a list of sizes",
    )
    require(is_int(world) and world >= 1, refuse, "config.world_size", world, "a rank count >= 1")
    require_json(config, refuse, "config")
    return config


def _check_optimizer(optimizer: Any, refuse: Refuse) -> None:
    """An optimizer's state dict: ``state`` (parameter index to its tensors and numbers)
    and ``param_groups`` (each with the ``params`` indices)."""
    require(
        isinstance(optimizer, dict), refuse, "optimizer", optimizer, "an optimizer's state dict"
    )
    require_fields(optimizer, ("state", "param_groups"), refuse, "optimizer.")
    state, groups = optimizer["state"], optimizer["param_groups"]
    require(isinstance(state, dict), refuse, "optimizer.state", state, "a dict")
    for index, entry in state.items():
        field = f"optimizer.state[{index!r}]"
        require(is_int(index), refuse, field, index, "a parameter index")
        require(isinstance(entry, dict), refuse, field, entry, "a dict of tensors")
        for key, value in entry.items():
            ok = isinstance(key, str) and isinstance(value, Tensor)
            require(ok, refuse, f"{field}[{key!r}]", value, "a tensor")
    require(
        isinstance(groups, list) and bool(groups) and all(isinstance(g, dict) for g in groups),
        refuse,
        "optimizer.param_groups",
        groups,
        "a list of parameter groups",
    )
    for number, group in enumerate(groups):
        params = group.get("params")
        require(
            isinstance(params, list) and all(map(is_int, params)),
            refuse,
            f"optimizer.param_groups[{number}].params",
            params,
            "a list of parameter indices",
        )


def _generator_states(states: Any, world: int, refuse: Refuse, field: str) -> list[Tensor]:
    """One CPU generator state per rank, each one a generator accepts."""
    require(
        isinstance(states, list) and len(states) == world,
        refuse,
        field,
        states,
        f"a list of {world} generator state(s) (one per rank)",
    )
    scratch = torch.Generator()
    wanted = scratch.get_state()
    for rank, tensor in enumerate(states):
        name = f"{field}[{rank}]"
        fits = isinstance(tensor, Tensor) and tensor.dtype == wanted.dtype
        fits = fits and tensor.shape == wanted.shape
        require(fits, refuse, name, tensor, f"a uint8 tensor {tuple(wanted.shape)}")
        try:
            scratch.set_state(tensor)
        except RuntimeError as err:
            raise refuse(name, f"is not a generator's state ({first_line(err)})") from None
    return states


def check_fits(
    checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Refuse, before anything is loaded, a checkpoint whose model or optimizer state does
    not fit ``model`` and its new ``optimizer`` (another model, a LoRA of another rank,
    another optimizer): the same tensors of the same shapes and dtypes, one line naming the
    checkpoint and the first that differs."""
    refuse = checkpoint.refuse
    require_state_dict(checkpoint.model, model.state_dict(), refuse, "model")
    fresh = optimizer.state_dict()
    groups = checkpoint.optimizer["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    wanted = [len(g["params"]) for g in fresh["param_groups"]]
    if sizes != wanted:
        raise refuse(
            "optimizer.param_groups",
            f"hold {sizes} parameters, not the {wanted} trainable ones of the model",
        )
    parameters: dict[int, Tensor] = {}
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        parameters.update(zip(saved["params"], group["params"], strict=True))
    for number, (saved, new) in enumerate(zip(groups, fresh["param_groups"], strict=True)):
        # The hyperparameters (numbers: lr, betas, ...) must be there; a flag (True, False,
        # None) an older torch did not write takes its default when loaded.
        for key, value in new.items():
            if key not in saved and key != "params" and not is_optimizer_flag(value):
                raise refuse(f"optimizer.param_groups[{number}][{key!r}]", "is missing")
        for key, value in new.items():
            if key != "params" and key in saved and not _same_kind(saved[key], value):
                field = f"optimizer.param_groups[{number}][{key!r}]"
                raise refuse(field, f"is {describe(saved[key])}, not of {describe(value)}'s kind")
    for index, entry in checkpoint.optimizer["state"].items():
        parameter = parameters.get(index)
        if parameter is None:
            raise refuse(f"optimizer.state[{index}]", "is not a parameter of the model")
        for key, value in entry.items():
            field = f"optimizer.state[{index}][{key!r}]"
            if value.ndim == 0:  # a count (AdamW's step): a float scalar
                require(value.is_floating_point(), refuse, field, value, "a float scalar")
                continue
            dtype = str(parameter.dtype).removeprefix("torch.")
            fits = value.shape == parameter.shape and value.dtype == parameter.dtype
            require(fits, refuse, field, value, f"a {dtype} tensor {tuple(parameter.shape)}")


def is_optimizer_flag(value: Any) -> bool:
    """A flag of an optimizer's parameter group (``amsgrad``, ``foreach``: True, False or
    None), which torch sets to its default when a state dict of an older torch lacks it;
    the other hyperparameters (numbers: ``lr``, ``betas``) must be in a checkpoint."""
    return value is None or isinstance(value, bool)


def _same_kind(saved: Any, new: Any) -> bool:
    """A saved optimizer hyperparameter of the new one's kind: a number for a number (or
    a tensor: a capturable lr), a flag for a flag, as many numbers for a tuple (betas)."""
    if new is None:  # a flag torch decides (foreach, fused): None or a bool
        return saved is None or isinstance(saved, bool)
    if saved is None:
        return False
    if isinstance(new, bool):
        return isinstance(saved, bool)
    if is_number(new):
        return is_number(saved) or isinstance(saved, Tensor)
    if isinstance(new, tuple | list):
        return (
            isinstance(saved, tuple | list)
            and len(saved) == len(new)
            and all(is_number(item) or isinstance(item, Tensor) for item in saved)
        )
    return True


def check_log_record(record: Any, refuse: Refuse, field: str, sep: str = ".") -> None:
    """One step's log record (:data:`gradest_digits.finetune_records.LOG_KEYS`), named
    ``field`` (its keys ``field + sep + key``) in messages."""
    require(isinstance(record, dict), refuse, field, record, "a log record (a dict)")
    require_fields(record, LOG_KEYS, refuse, f"{field}{sep}")
    step = record["step"]
    require(is_int(step) and step >= 0, refuse, f"{field}{sep}step", step, "a step number")
    numbers = (
        "reward_mean",
        "reward_std",
        "grad_norm",
        *(k for k in LOG_KEYS if k.endswith("_seconds")),
    )
    for key in numbers:
        require(is_number(record[key]), refuse, f"{field}{sep}{key}", record[key], "a number")
    loss = record["loss"]
    require(loss is None or is_number(loss), refuse, f"{field}{sep}loss", loss, "a number or null")
    cost = record["cost"]
    require(
        isinstance(cost, dict) and all(is_number(v) for v in cost.values()),
        refuse,
        f"{field}{sep}cost",
        cost,
        "a dict of counts",
    )
    for key in ("model_units", "objective_model_units"):
        require(
            is_number(cost.get(key)), refuse, f"{field}{sep}cost.{key}", cost.get(key), "a number"
        )
    require(isinstance(record["info"], dict), refuse, f"{field}{sep}info", record["info"], "a dict")
    require_json(record, refuse, field)


def _starts_a_record(tail: bytes) -> bool:
    """Whether ``tail`` (a last line without its newline) is UTF-8 text that starts a JSON
    object, as a record cut short by a killed writer is."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(tail, final=False)
    except UnicodeDecodeError:
        return False
    return text.lstrip().startswith("{") or not text.strip()


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``log.jsonl`` (:class:`gradest_lab.storage.files.JsonLog`), each
    checked
    to be a step's record (:func:`check_log_record`) in step order; a missing log has none.

    Raises:
        InvalidValue: a line that is not a record of the run's log (not JSON, a partial
            last line that is not the start of a record, a missing or mistyped field, a
            step out of order): one line naming the file and the record; the log is left
            as it is.
    """
    from gradest_lab.storage.files import JsonLog, JsonLogError

    path = Path(path)

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{str(path)!r}: {field} {why}; the log is damaged or is not a gradest finetune "
            f"log: it is left as it is; start a new run in another folder (--out NEW)"
        )

    try:
        records = JsonLog(path).records()
    except JsonLogError as err:  # a line that is not JSON: its message names the line
        raise InvalidValue(str(err)) from None

    data = path.read_bytes() if path.is_file() else b""
    *whole, tail = data.split(b"\n")
    if tail and not _starts_a_record(tail):
        # JsonLog leaves out a partial last line (a writer killed mid-record): it must be
        # the start of a record, not bytes of another kind.
        raise refuse("its last line", "is not the start of a JSON record (nor a whole one)")
    # The line of each record (JsonLog skips blank lines).
    lines = [number for number, line in enumerate(whole, 1) if line.strip()]
    previous = -1
    for line, record in zip(lines, records, strict=True):
        check_log_record(record, refuse, f"line {line}", sep=": ")
        if record["step"] <= previous:
            raise refuse(f"line {line}", f"is of step {record['step']}, after step {previous}")
        previous = record["step"]
    return records


def newest_checkpoint(location: str | Path) -> Checkpoint | None:
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
    from gradest_lab.storage.files import JsonLog

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


def check_lineage(resumed: Checkpoint, log_path: Path | None, checkpoint_dir: Path | None) -> None:
    """Refuse a resume that would overwrite or cut history of another run or branch.

    * ``checkpoint_dir`` must hold no checkpoint newer than the resumed one: resuming from
      an older checkpoint in place would overwrite the newer steps (a branch goes into a
      new folder, whose checkpoints and log start from the resumed step).
    * the log must read (:func:`read_log`), and its records before the resumed step, when
      it has any, must be the checkpoint's history, record for record: only then are the
      records it cuts the run's own steps, which it redoes.

    Raises:
        ValueError: one line naming what would be lost and how to branch instead.
    """
    step = resumed.step
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
    if log_path is None or not (log_path.is_symlink() or log_path.exists()):
        return
    logged = [r for r in read_log(log_path) if r["step"] < step]
    history = resumed.history
    if logged and [json.dumps(r) for r in logged] != [json.dumps(r) for r in history]:
        raise InvalidValue(
            f"cannot resume from step {step}: {str(log_path)!r} holds records before step "
            f"{step} that are not the checkpoint's history (checkpoint {str(resumed.path)!r}; "
            f"another run or branch wrote the log, or one of the two was changed); both are "
            f"kept as they are; resume into a new folder (new log_path; gradest finetune: "
            f"--out NEW)"
        )


# Settings added to FinetuneConfig after checkpoints of the same format were written, with
# the value those runs had: resuming such a checkpoint with the default is the same run.
ADDED_SETTINGS: dict[str, Any] = {"prior_weight": 0.0, "kl_weight": 0.0}


def check_same_run(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    source: Path | None = None,
    settings: Path | None = None,
) -> None:
    """Refuse to resume with other settings than the checkpoint's (``steps`` may grow).

    Args:
        source: the checkpoint ``saved`` was read from, named in the message.
        settings: the file ``current`` was read from (a run's ``settings.json``), named too.

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
        where = "" if source is None else f" (checkpoint {str(source)!r}, kept as it is)"
        if settings is not None:
            where += f" (the settings of {str(settings)!r}, kept as it is)"
        raise InvalidValue(
            f"cannot resume: the run was started with other settings ({detail}){where}; resume "
            f"with the same settings (only the number of steps may change), or start a new run "
            f"in another folder"
        )
