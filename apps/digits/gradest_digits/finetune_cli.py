"""``gradest finetune``: the shipped digits DiT, its classifier reward, and the run's files.

The training options are generated from :class:`~gradest_digits.finetune_config.FinetuneConfig`
(one flag per field, same defaults); this module adds only what belongs to the command:
the digit to reward, the conditioning, LoRA, the device, the output folder,
``--tensorboard`` / ``--no-tensorboard``, ``--config`` (a TOML file of any of these
settings; flags on the command line override it), ``--resume`` and ``--quiet``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from gradest.errors import InvalidValue
from gradest.files import (
    atomic_write_text,
    check_output_dir,
    check_output_file,
    remove_stale_temporaries,
)
from gradest.protocol import check_steps
from gradest_digits.finetune import finetune, resolve_estimator
from gradest_digits.finetune_config import add_config_arguments, config_from_args
from gradest_digits.finetune_tensorboard import use_tensorboard
from gradest_digits.run_state import earlier_run


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gradest finetune`` options to ``parser``."""
    add_config_arguments(parser)
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on the attention layers instead of all "
        "weights (needs peft; default 0: full fine-tuning)",
    )
    parser.add_argument(
        "--target",
        type=int,
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
        "with the same settings (--steps may be larger); it ends bitwise as an "
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

    Writes ``log.jsonl``, ``result.json`` (the result without the history),
    ``checkpoints/`` and (unless ``--no-tensorboard``) ``tensorboard/`` under ``--out``
    (or continues the run in ``--resume DIR``) and returns the result dict; every output
    path is checked before any work. Under ``torchrun``
    (``python -m torch.distributed.run --nproc_per_node=2 -m gradest.cli finetune ...``)
    the ranks train data-parallel (see :func:`~gradest_digits.finetune.finetune`;
    ``--batch-size`` is the global batch) and only rank 0 writes.
    """
    # Validate the cheap things before loading checkpoints.
    config = config_from_args(args)
    # Options that need more than --sampler-steps steps fail here, before --out exists.
    check_steps(resolve_estimator(config.estimator), config.sampler_steps)
    if not 0 <= args.target <= 9:
        raise InvalidValue(f"--target must be a digit 0..9, got {args.target}")
    device = resolve_device(args.device)
    if args.lora_rank < 0:
        raise InvalidValue(f"--lora-rank must be >= 0 (0: full fine-tuning), got {args.lora_rank}")
    tensorboard = use_tensorboard(getattr(args, "tensorboard", None))
    if args.resume is not None and args.out is not None and Path(args.out) != Path(args.resume):
        raise InvalidValue(
            f"--resume {args.resume!r} continues the run in that folder; drop --out "
            f"{args.out!r} or pass the same folder"
        )
    out = check_output_dir(args.resume or args.out or "runs/finetune", what="--out")
    # finetune() checks the log and checkpoint folder; result.json is written here.
    check_output_file(out / "result.json", what="--out")
    if args.resume is None:
        found = earlier_run(out / "log.jsonl", out / "checkpoints")
        if found is not None:
            raise InvalidValue(
                f"--out {str(out)!r} holds an earlier run ({found}); continue it with "
                f"--resume {str(out)}, or pass a new --out"
            )
    remove_stale_temporaries(out)
    # Loaded lazily so that this module imports without the shipped checkpoints.
    from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
    from gradest_digits.rewards import ClassifierReward

    model: torch.nn.Module = load_pretrained_dit(device=device)
    if args.lora_rank:
        # After loading: peft renames the targeted weights to *.base_layer.weight.
        from gradest.integrations.peft import add_lora

        model = add_lora(model, args.lora_rank)
    prior_data = None
    if config.prior_weight:
        # Prior preservation on the real digits the model was pretrained on (train split).
        from gradest_digits.digits import load_digits_dataset

        prior_data, _ = load_digits_dataset("train")
        prior_data = prior_data.to(device)
    result = finetune(
        model,
        ClassifierReward(load_digit_classifier(device=device), args.target),
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
    return result
