"""``gradest finetune``: the shipped digits DiT, its classifier reward, and the run's files.

The training options are generated from :class:`~gradest_digits.finetune_config.FinetuneConfig`
(one flag per field, same defaults); this module adds only what belongs to the command:
the digit to reward, the conditioning, LoRA, the device, the output folder,
``--tensorboard`` / ``--no-tensorboard``, ``--config`` (a TOML file of any of these
settings; flags on the command line override it), ``--resume`` and ``--quiet``.

Every run records its settings in ``OUT/settings.json`` before any work
(:data:`RUN_SETTINGS`: the :class:`FinetuneConfig` fields with the estimator's spec, and
the target, the labels, the LoRA rank and the device). ``--resume DIR`` takes every
setting from there (from ``run.json`` for a run stopped before it wrote that file,
:func:`recorded_settings`); only the flags given explicitly, on the command line or in a
``--config`` file (:func:`gradest_lab.storage.config_file.explicit_settings`), are compared with the
run's, and a differing one is refused unless it may change (:data:`MAY_CHANGE`).

The folder belongs to one run (:mod:`gradest_lab.storage.run_folder`): a new run claims it with its
``run.json`` (:func:`run_record`: the settings that may not change on resume) and holds
its lock, ``.gradest-run.lock``, until it ends, so a second ``gradest finetune`` writing
the same folder is refused naming the first one's pid. The command's own refusals, which
name what is there and how to go on, come first; the claim is the backstop.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from gradest_lab.storage.config_file import explicit_settings, track_explicit
from gradest_lab.storage.files import (
    atomic_write_text,
    check_output_dir,
    check_output_file,
    check_path_length,
    read_text,
    refuse_symlinks,
    remove_stale_temporaries,
)
from gradest_lab.storage.run_folder import (
    RUN_RECORD,
    RunRecord,
    claim_run_folder,
    describe_entries,
    foreign_entries,
    read_run_record,
)

from gradest import InvalidValue
from gradest.integrations.distributed import launched_world
from gradest.plugin import WholeNumber, check_steps
from gradest_digits.file_schema import (
    Refuse,
    describe,
    is_int,
    is_number,
    json_object,
    require,
    require_fields,
)
from gradest_digits.finetune import (
    check_sizes,
    config_record,
    finetune,
    resolve_estimator,
    sample_shape_of,
)
from gradest_digits.finetune_config import FinetuneConfig, add_config_arguments, config_from_args
from gradest_digits.finetune_run import make_optimizer
from gradest_digits.finetune_tensorboard import use_tensorboard
from gradest_digits.run_state import (
    check_fits,
    check_lineage,
    check_same_run,
    earlier_run,
    newest_checkpoint,
    read_log,
)

# The settings a run records (OUT/settings.json) and a bare --resume takes back: every
# FinetuneConfig field (the estimator as its spec) and the command's own settings.
SETTINGS_FILE = "settings.json"
SETTINGS_FORMAT = "gradest.finetune.settings/1"
RUN_SETTINGS = (*FinetuneConfig.names(), "target", "labels", "lora_rank", "device")
# Settings an explicit flag may change on resume: how far the run goes, how often it saves,
# where it runs. (--out, --quiet, --tensorboard and --config are not settings at all.)
MAY_CHANGE = frozenset({"steps", "checkpoint_every", "device"})
# The command a run folder's run.json names.
COMMAND = "gradest finetune"


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gradest finetune`` options to ``parser``."""
    add_config_arguments(parser)
    parser.add_argument(
        "--lora-rank",
        type=WholeNumber(0),
        default=0,
        help="train LoRA adapters of this rank on the attention layers instead of all "
        "weights (needs peft; default 0: full fine-tuning)",
    )
    parser.add_argument(
        "--target",
        type=WholeNumber(0),  # 0..9: checked with the run (a digit of the reward)
        default=3,
        help="the digit whose classifier log-probability is the reward (default 3)",
    )
    parser.add_argument(
        "--labels",
        default="null",
        choices=("null", "target"),
        help="condition the DiT on the null label (unconditional samples steered to the "
        "target by the reward; the default) or on the target digit itself (the pretrained "
        "model already draws it, so the reward has little room to improve)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder: log.jsonl, result.json, checkpoints/, tensorboard/ (default "
        "runs/finetune; a folder that holds an earlier run is refused: --resume it or pass "
        "a new one)",
    )
    parser.add_argument(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write the log's numbers as TensorBoard scalars in OUT/tensorboard "
        "(default: on when tensorboard is installed; pip install tensorboard). Not a "
        "setting: a run may be resumed with or without it",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR (an earlier --out) from its newest valid checkpoint, "
        "with its settings: flags given as well must equal the run's (--steps may be "
        "larger; --checkpoint-every and --device may change); it ends bitwise as an "
        "uninterrupted run would",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where to train: cpu (default), cuda or cuda:N; under torchrun, cuda means "
        "each rank's own GPU (cuda:LOCAL_RANK)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a TOML file of settings, keys named like these flags without -- (steps = 50, "
        'estimator = "jagg:window=4"); flags given on the command line override it',
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # --resume DIR takes the run's settings for every flag not given explicitly.
    track_explicit(parser)


def resolve_device(name: Any) -> torch.device:
    """``--device`` as a torch.device that exists here; under torchrun ``cuda`` is the
    rank's own GPU (``LOCAL_RANK``)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise InvalidValue(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from err
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InvalidValue(f"--device {name!r}: gradest finetune runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise InvalidValue(
            f"--device {name!r}, but this torch sees no CUDA device "
            f"(torch.cuda.is_available() is False); use --device cpu"
        )
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.index >= torch.cuda.device_count():
        raise InvalidValue(
            f"--device {name!r} (cuda:{device.index}), but only "
            f"{torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return device


def run_finetune_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``gradest finetune`` on the shipped digits DiT and classifier reward.

    Writes ``run.json``, ``settings.json``, ``log.jsonl``, ``result.json`` (the result
    without the history), ``checkpoints/`` and (unless ``--no-tensorboard``)
    ``tensorboard/`` under ``--out`` (or continues the run in ``--resume DIR``) and returns
    the result dict; every output path is checked before any work, and the folder is held
    (:func:`gradest_lab.storage.run_folder.claim_run_folder`) from the first write to the last.
    Under
    ``torchrun`` (``python -m torch.distributed.run --nproc_per_node=2 -m gradest.cli
    finetune ...``) the ranks train data-parallel (see
    :func:`~gradest_digits.finetune.finetune`; ``--batch-size`` is the global batch) and
    only rank 0 claims the folder and writes.
    """
    recorded = None
    # Names the file system cannot take are one line before anything looks at the folder.
    for flag, value in (("--out", args.out), ("--resume", args.resume)):
        if value is not None:
            check_path_length(value, what=flag)
    if args.resume is not None:
        # Before anything is created: a folder that holds no run is an error. Every setting
        # not given explicitly becomes the run's; a given one must equal it.
        if Path(args.resume).is_dir():
            refuse_symlinks(run_entries(Path(args.resume)), what=f"--resume {args.resume!r}")
            check_resumable(Path(args.resume))
        recorded = recorded_settings(args.resume)
        args = resumed_args(args, recorded, args.resume)
    # Validate the cheap things before loading checkpoints.
    config = config_from_args(args)
    # Sizes that could not fit in memory fail here, before --out exists.
    device = resolve_device(args.device)
    check_sizes(config, DIGITS_SHAPE, device, flags=True)
    # Options that need more than --sampler-steps steps fail here, before --out exists.
    check_steps(resolve_estimator(config.estimator), config.sampler_steps)
    if not 0 <= args.target <= 9:
        raise InvalidValue(f"--target must be a digit 0..9, got {args.target}")
    if args.lora_rank < 0:
        raise InvalidValue(f"--lora-rank must be >= 0 (0: full fine-tuning), got {args.lora_rank}")
    tensorboard = use_tensorboard(getattr(args, "tensorboard", None))
    if args.resume is not None and args.out is not None and Path(args.out) != Path(args.resume):
        raise InvalidValue(
            f"--resume {args.resume!r} continues the run in that folder; drop --out "
            f"{args.out!r} or pass the same folder"
        )
    out = Path(args.resume or args.out or "runs/finetune")
    rank, _ = launched_world()
    resuming = args.resume is not None
    settings = run_settings(args)
    # The decision to use the folder comes first, reading only: nothing in it is written,
    # cut or repaired before (a folder of another tool passed as --out keeps every byte).
    # Under torchrun rank 0 decides, claims and writes; the other ranks would otherwise meet
    # the settings.json rank 0 just wrote and take the new run for an earlier one.
    if rank != 0:
        if resuming:
            decide_folder(out, resuming=True)
        else:
            wait_for_claim(out)  # before finetune() creates checkpoints/ in it
        return _train(args, out, config, device, settings, recorded, tensorboard, rank)
    if not resuming:
        decide_folder(out, resuming=False)  # an earlier run of this command, named
    # The claim: run.json written (a new run) or matched (a resume), and the lock held
    # until the run ends; another command's run or another tool's files are refused.
    resume_hint = f"gradest finetune --resume {str(out)}"
    with claim_run_folder(out, run_record(settings), resume=resuming, resume_hint=resume_hint):
        if resuming:
            # Under the lock: a run still writing the folder is refused, naming its pid,
            # before its files are read while they change.
            decide_folder(out, resuming=True)
        return _train(args, out, config, device, settings, recorded, tensorboard, rank)


def _train(
    args: argparse.Namespace,
    out: Path,
    config: FinetuneConfig,
    device: torch.device,
    settings: dict[str, Any],
    recorded: dict[str, Any] | None,
    tensorboard: bool,
    rank: int,
) -> dict[str, Any]:
    """The run in its decided (and, on rank 0, claimed) folder ``out``."""
    out = check_output_dir(out, what="--out")
    # finetune() checks the log and checkpoint folder; result.json is written here.
    check_output_file(out / "result.json", what="--out")
    # Loaded lazily so that this module imports without the shipped checkpoints; read and
    # checked before anything is written (a damaged one is one line naming it).
    from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
    from gradest_digits.rewards import ClassifierReward

    model: torch.nn.Module = load_pretrained_dit(device=device)
    check_lora_rank(model, args.lora_rank)
    if args.lora_rank:
        # After loading: peft renames the targeted weights to *.base_layer.weight.
        from gradest.integrations.peft import add_lora

        model = add_lora(model, args.lora_rank)
    reward = ClassifierReward(load_digit_classifier(device=device), args.target)
    if args.resume is not None:
        # The checkpoint fits this model and its optimizer, before settings.json is
        # rewritten (finetune() checks it again: the API's own rule).
        resumed = newest_checkpoint(out)
        if resumed is not None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            check_fits(resumed, model, make_optimizer(config, trainable))
            # The settings the run was resumed with (its settings.json, or its run.json)
            # are the checkpoint's: a conflict names both files.
            _, world = launched_world()
            record = config_record(
                config,
                resolve_estimator(config.estimator),
                labels=args.target if args.labels == "target" else None,
                shape=sample_shape_of(model),
                world=world,
            )
            settings_file = out / SETTINGS_FILE
            source = settings_file if settings_file.is_file() else out / RUN_RECORD
            check_same_run(resumed.config, record, source=resumed.path, settings=source)
    if rank == 0:  # another rank's cleanup could remove rank 0's file being written
        remove_stale_temporaries(out, names=OWN_FILES)
    # The settings are on disk before any work, except where finetune() still has to
    # accept them: a resumed run that goes less far than recorded (the checkpoint's step),
    # or one stopped before it wrote them (its run.json's settings). Those are written
    # once it ran.
    write_now = recorded is None or (
        (out / SETTINGS_FILE).is_file() and settings["steps"] >= recorded["steps"]
    )
    if rank == 0 and write_now:
        write_settings(out, settings)
    prior_data = None
    if config.prior_weight:
        # Prior preservation on the real digits the model was pretrained on (train split).
        from gradest_digits.datasets import DIGITS

        prior_data, _ = DIGITS.load("train")
        prior_data = prior_data.to(device)
    result = finetune(
        model,
        reward,
        config,
        prior_data=prior_data,
        labels=args.target if args.labels == "target" else None,
        log_path=out / "log.jsonl",
        checkpoint_dir=out / "checkpoints",
        progress=not args.quiet,
        resume=out if args.resume is not None else None,
        tensorboard_dir=out / "tensorboard" if tensorboard else None,
    )
    if result["rank"] == 0:
        summary = {key: value for key, value in result.items() if key not in ("history", "rank")}
        summary["target"] = args.target
        atomic_write_text(out / "result.json", json.dumps(summary, indent=2) + "\n")
        if not write_now:
            write_settings(out, settings)
    return result


# -- the run folder: decided on before anything in it is written --------------------------

# What a run writes at the top of its folder (and only these: stale temporaries of other
# names are another tool's and are left alone).
OWN_FILES = ("log.jsonl", SETTINGS_FILE, "result.json")
# One 8x8 digit, as the shipped DiT samples it.
DIGITS_SHAPE = (1, 8, 8)


def run_entries(out: Path) -> list[Path]:
    """The paths a run writes in ``out``: its files, its folders and its checkpoints."""
    entries = [out / name for name in (RUN_RECORD, *OWN_FILES)]
    entries += [out / "checkpoints", out / "tensorboard"]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        entries += sorted(checkpoints.iterdir())
    return entries


def run_record(settings: dict[str, Any]) -> RunRecord:
    """The run's identity in its folder's ``run.json``: the settings a resume may not
    change (all of :data:`RUN_SETTINGS` but :data:`MAY_CHANGE`). It starts from the shipped
    DiT, so it continues nothing outside its folder (no lineage)."""
    kept = {name: settings[name] for name in RUN_SETTINGS if name not in MAY_CHANGE}
    return RunRecord(command=COMMAND, settings=kept)


def decide_folder(out: Path, *, resuming: bool) -> None:
    """Whether ``out`` may be used, decided reading only: a link among the run's entries is
    refused (never followed for writing), and a new run refuses a folder that holds
    anything of an earlier run of the command (a log with any bytes, checkpoints,
    ``settings.json``, ``result.json``), naming it and ``--resume``. A folder without a
    ``gradest finetune`` ``run.json`` (another tool's, another command's) is refused by the
    claim that follows (:func:`gradest_lab.storage.run_folder.claim_run_folder`). A resumed run's
    newest checkpoint must load and its log must be that checkpoint's history
    (:func:`gradest_digits.run_state.check_lineage`).
    """
    if out.exists() and not out.is_dir():
        return  # check_output_dir says it is a file
    if not out.is_dir():
        return  # nothing there yet: a new folder
    refuse_symlinks(run_entries(out), what=f"--out {str(out)!r}")
    if not resuming:
        record = out / RUN_RECORD
        if not record.is_file() or read_run_record(record).command != COMMAND:
            return  # not this command's run: the claim names what is there
        found = earlier_run(
            out / "log.jsonl", out / "checkpoints", (out / SETTINGS_FILE, out / "result.json")
        )
        if found is not None:
            raise InvalidValue(
                f"--out {str(out)!r} holds an earlier run ({found}); continue it with "
                f"--resume {str(out)}, or pass a new --out"
            )
        return
    state = newest_checkpoint(out)  # one that does not load is refused, by name
    if state is not None:
        check_lineage(state, out / "log.jsonl", out / "checkpoints")
    else:
        read_log(out / "log.jsonl")  # a damaged log is one line, before any write


def check_resumable(folder: Path) -> None:
    """Refuse, reading only, to ``--resume`` a folder that holds no ``gradest finetune``
    run but other files: another command's run (its ``run.json`` names it), or files
    without a ``run.json`` (another tool's, a run of an older gradest). An empty folder is
    left to :func:`recorded_settings` (it holds no run)."""
    shown = f"--resume {str(folder)!r}"
    record = folder / RUN_RECORD
    if record.is_file():
        saved = read_run_record(record)  # one that does not read is one line naming it
        if saved.command != COMMAND:
            raise InvalidValue(
                f"{shown} holds a {saved.command!r} run, not a {COMMAND!r} run; pass the "
                f"--out folder of the run to continue"
            )
        return
    found = foreign_entries(folder)
    if found:
        listed = describe_entries(found)
        raise InvalidValue(
            f"{shown} holds files that are not a gradest run's ({listed}; no {RUN_RECORD}), "
            f"so it cannot be continued; nothing in it is changed: start a new run with "
            f"--out NEW"
        )


# How long a rank other than 0 waits for rank 0 to claim a new run's folder.
CLAIM_WAIT_S = 600.0


def wait_for_claim(out: Path, *, timeout: float = CLAIM_WAIT_S) -> None:
    """Under torchrun, a rank other than 0 waits until rank 0 has claimed the new run's
    folder (its ``run.json`` is there) before :func:`finetune` creates ``checkpoints/``
    in it: the claim refuses a folder holding files of no recorded run. A rank 0 that is
    refused stops the launch (torchrun ends every rank when one fails)."""
    deadline = time.monotonic() + timeout
    while not (out / RUN_RECORD).is_file():
        if time.monotonic() > deadline:
            raise InvalidValue(
                f"--out {str(out)!r}: rank 0 did not claim the folder (write "
                f"{RUN_RECORD}) within {timeout:.0f} s; see rank 0's error"
            )
        time.sleep(0.05)


def check_lora_rank(model: torch.nn.Module, rank: int) -> None:
    """A LoRA rank at most the width of the layers it adapts (beyond it a LoRA is not
    low-rank and only costs memory), checked before the adapters are allocated."""
    if not rank:
        return
    width = getattr(getattr(model, "config", None), "hidden", None)
    if isinstance(width, int) and rank > width:
        raise InvalidValue(
            f"--lora-rank {rank} is larger than the DiT's layers ({width} wide): a LoRA of "
            f"that rank is not low-rank; use --lora-rank 1..{width}, or 0 to train all weights"
        )


# -- the run's settings, recorded and taken back by --resume ------------------------------


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of the run ``args`` describe, as ``settings.json`` records them."""
    return {name: getattr(args, name) for name in RUN_SETTINGS}


def write_settings(out: Path, settings: dict[str, Any]) -> None:
    text = json.dumps({"format": SETTINGS_FORMAT, "settings": settings}, indent=2) + "\n"
    atomic_write_text(out / SETTINGS_FILE, text)


def recorded_settings(resume: Any) -> dict[str, Any]:
    """The settings of the run in the folder ``resume``: ``settings.json``, or for a run
    stopped before it wrote that file, its ``run.json`` (every setting but
    :data:`MAY_CHANGE`: ``resumed_args`` then asks for ``--steps``).

    Raises (one line, naming the folder) when it is not a folder or holds no run.
    """
    folder = Path(resume)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise InvalidValue(
            f"--resume {str(folder)!r}: the folder {what}; pass the --out folder of the run "
            f"to continue"
        )
    path, record = folder / SETTINGS_FILE, folder / RUN_RECORD
    if path.is_symlink() or path.exists():
        settings = read_settings(path).settings
        if record.is_file():
            _check_agrees(path, settings, record)
        return settings
    if not record.is_file():
        raise InvalidValue(
            f"--resume {str(folder)!r}: the folder holds no run (no {RUN_RECORD}, no "
            f"{SETTINGS_FILE}); pass the --out folder of the run to continue"
        )
    saved = read_run_record(record)
    wanted = [name for name in RUN_SETTINGS if name not in MAY_CHANGE]
    missing = sorted(set(wanted) - set(saved.settings))
    if saved.command != COMMAND or missing:
        why = f"lacks {', '.join(missing)}" if missing else f"names {saved.command!r}"
        raise InvalidValue(
            f"--resume {str(folder)!r}: {str(record)!r} is not the record of a {COMMAND!r} "
            f"run (it {why}); it cannot be resumed"
        )
    recorded = {name: saved.settings[name] for name in wanted}

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"--resume {str(folder)!r}: {str(record)!r}: {field} {why}; it is not the record of "
            f"a {COMMAND!r} run and is kept as it is: start a new run with --out NEW"
        )

    check_settings(recorded, refuse)
    return recorded


def _check_agrees(path: Path, settings: dict[str, Any], record_path: Path) -> None:
    """``settings.json`` and ``run.json`` were written by one run: the settings a resume may
    not change are in both and the same (else one was changed, or copied from elsewhere)."""
    record = read_run_record(record_path)
    if record.command != COMMAND:
        return  # another command's run: check_resumable names it
    for name in RUN_SETTINGS:
        if name in MAY_CHANGE:
            continue
        here = settings[name]
        if name not in record.settings:
            raise InvalidValue(
                f"{str(record_path)!r}: settings.{name} is missing (it is {describe(here)} in "
                f"{str(path)!r}): the record is not of this run; both files are kept as they "
                f"are: start a new run with --out NEW"
            )
        there = record.settings[name]
        if json.dumps(there, sort_keys=True) != json.dumps(here, sort_keys=True):
            raise InvalidValue(
                f"{str(path)!r}: settings.{name} is {describe(here)}, but {str(record_path)!r} "
                f"records {describe(there)}: the two files are not of one run (one was "
                f"changed); both are kept as they are: start a new run with --out NEW"
            )


# -- the files a run writes and commands read back: one reader each -----------------------


@attrs.frozen
class RunSettings:
    """A run's ``settings.json`` read back (:func:`read_settings`).

    Attributes:
        path: the file.
        settings: every one of :data:`RUN_SETTINGS`, each of its type.
    """

    path: Path
    settings: dict[str, Any]


# The command's own settings beside FinetuneConfig's: (check, what it must be).
_COMMAND_SETTINGS: dict[str, tuple[Any, str]] = {
    "target": (is_int, "an integer (a digit)"),
    "labels": (lambda v: isinstance(v, str), "a string ('null' or 'target')"),
    "lora_rank": (is_int, "an integer (a LoRA rank)"),
    "device": (lambda v: isinstance(v, str), "a string (a device such as 'cpu')"),
}


def check_settings(settings: dict[str, Any], refuse: Refuse) -> None:
    """Each of ``settings`` (some of :data:`RUN_SETTINGS`) of its type: an integer setting
    an integer, a number a number (or null where the default is none), a string a string.

    Only types: whatever the command wrote reads back as it was (a value it would refuse,
    out of range or not a choice, is refused by the run's own checks, naming the flag).
    """
    fields = {field.name: field for field in attrs.fields(FinetuneConfig)}
    for name, value in settings.items():
        if name in _COMMAND_SETTINGS:
            check, wanted = _COMMAND_SETTINGS[name]
            ok = bool(check(value))
        elif fields[name].metadata["kind"] is int:
            ok, wanted = is_int(value), "an integer"
        elif fields[name].metadata["kind"] is float:
            nullable = fields[name].default is None
            ok = is_number(value) or (nullable and value is None)
            wanted = "a number" + (" or null" if nullable else "")
        else:  # the estimator's spec, a choice
            ok, wanted = isinstance(value, str), "a string"
        require(ok, refuse, f"settings.{name}", value, wanted)


def read_settings(path: str | Path) -> RunSettings:
    """The ``settings.json`` a run wrote (:func:`write_settings`), every setting checked.

    Raises:
        InvalidValue: the file is a link or not a regular file, not UTF-8 JSON, not of
            :data:`SETTINGS_FORMAT`, or a setting is missing or of another type or range:
            one line naming the file and the field; the file is left as it is.
    """
    path = Path(path)

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{str(path)!r}: {field} {why}; it is not the settings file of a gradest finetune "
            f"run ({SETTINGS_FORMAT}), so the run cannot be resumed from it; it is kept as it "
            f"is: start a new run with --out NEW"
        )

    if path.is_symlink():
        raise refuse("the file", "is a symbolic link; a run reads only its own files")
    data = json_object(read_text(path, what="the settings file"), refuse)
    if data.get("format") != SETTINGS_FORMAT:
        raise refuse("format", f"is {describe(data.get('format'))}, not {SETTINGS_FORMAT!r}")
    settings = data.get("settings")
    if not isinstance(settings, dict):
        raise refuse("settings", f"is {describe(settings)}, not an object of settings")
    require_fields(settings, RUN_SETTINGS, refuse, "settings.")
    recorded = {name: settings[name] for name in RUN_SETTINGS}
    check_settings(recorded, refuse)
    return RunSettings(path=path, settings=recorded)


@attrs.frozen
class RunResult:
    """A run's ``result.json`` read back (:func:`read_result`): what :func:`finetune`
    returned, without the history, and the target digit."""

    path: Path
    initial_reward: float
    final_reward: float
    final_reward_std: float
    checkpoints: list[str]
    log_path: str
    config: dict[str, Any]
    world_size: int
    ranks_in_sync: bool | None
    target: int


def read_result(path: str | Path) -> RunResult:
    """The ``result.json`` a finished ``gradest finetune`` wrote, every field checked.

    Raises:
        InvalidValue: the file is a link, not UTF-8 JSON, or a field is missing or of
            another type: one line naming the file and the field; it is left as it is.
    """
    path = Path(path)

    def refuse(field: str, why: str) -> InvalidValue:
        return InvalidValue(
            f"{str(path)!r}: {field} {why}; it is not the result of a finished gradest "
            f"finetune run and is kept as it is: rerun the run into a new --out"
        )

    if path.is_symlink():
        raise refuse("the file", "is a symbolic link; a run reads only its own files")
    data = json_object(read_text(path, what="the result file"), refuse)
    fields = [f.name for f in attrs.fields(RunResult) if f.name != "path"]
    require_fields(data, fields, refuse)
    for name in ("initial_reward", "final_reward", "final_reward_std"):
        require(is_number(data[name]), refuse, name, data[name], "a number")
    checkpoints, log_path = data["checkpoints"], data["log_path"]
    require(
        isinstance(checkpoints, list)
        and bool(checkpoints)
        and all(isinstance(c, str) for c in checkpoints),
        refuse,
        "checkpoints",
        checkpoints,
        "a list of checkpoint paths",
    )
    require(isinstance(log_path, str), refuse, "log_path", log_path, "a path")
    require(isinstance(data["config"], dict), refuse, "config", data["config"], "an object")
    world, in_sync, target = data["world_size"], data["ranks_in_sync"], data["target"]
    require(is_int(world) and world >= 1, refuse, "world_size", world, "a rank count >= 1")
    # None for one process, else whether the replicas ended equal.
    ok = in_sync is None if world == 1 else isinstance(in_sync, bool)
    wanted = "null (one process)" if world == 1 else "true or false"
    require(ok, refuse, "ranks_in_sync", in_sync, wanted)
    require(is_int(target) and 0 <= target <= 9, refuse, "target", target, "a digit 0..9")
    return RunResult(path=path, **{name: data[name] for name in fields})


def _same(name: str, recorded: Any, given: Any) -> bool:
    if name == "estimator":
        try:
            return repr(resolve_estimator(recorded)) == repr(resolve_estimator(given))
        except Exception:  # an invalid spec: compared as text (the usual checks refuse it)
            return bool(recorded == given)
    return bool(recorded == given)  # 0.01 == 0.01 whether JSON or the flag parsed it


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resumed_args(
    args: argparse.Namespace, recorded: dict[str, Any], resume: Any
) -> argparse.Namespace:
    """``args`` with the run's setting for every flag not given explicitly.

    A given flag equal to the run's keeps the run's spelling (``sdo`` given for
    ``sdo:samples=1``), so that the run's record stays the same.

    Raises (one line): a given flag differs from the run's value (except
    :data:`MAY_CHANGE`), naming each with both values; or the run does not record a
    setting (``--steps`` of a run stopped before it wrote ``settings.json``) and it was
    not given.
    """
    given = explicit_settings(args)
    if given is None:  # not parsed by add_finetune_arguments' parser: all count as given
        given = frozenset(RUN_SETTINGS)
    differ = [
        f"{_flag(name)} {recorded[name]!r} (given {getattr(args, name)!r})"
        for name in RUN_SETTINGS
        if name in given
        and name in recorded
        and name not in MAY_CHANGE
        and not _same(name, recorded[name], getattr(args, name))
    ]
    if differ:
        raise InvalidValue(
            f"--resume {str(resume)!r}: the run was started with other settings: "
            f"{'; '.join(differ)}; drop these flags to continue it with its own settings "
            f"(only --steps, --checkpoint-every and --device may change), or start a new "
            f"run with another --out"
        )
    # --checkpoint-every and --device have defaults that fit any run; how far it goes does not.
    unknown = [
        name
        for name in RUN_SETTINGS
        if name not in recorded and name not in given and name not in _ANY_DEFAULT
    ]
    if unknown:
        flags = ", ".join(_flag(name) for name in unknown)
        raise InvalidValue(
            f"--resume {str(resume)!r}: the run does not record {flags} (it stopped before it "
            f"wrote {SETTINGS_FILE}); pass {flags}"
        )
    merged = argparse.Namespace(**vars(args))
    for name, value in recorded.items():
        if name not in given or name not in MAY_CHANGE:
            setattr(merged, name, value)
    return merged


_ANY_DEFAULT = frozenset({"checkpoint_every", "device"})
