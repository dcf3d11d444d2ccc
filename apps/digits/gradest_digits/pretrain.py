"""Pretraining of the workload, on either dataset: a class-conditional rectified-flow DiT and
the classifier.

The DiT learns the velocity of the rectified flow between the digits and noise by flow
matching (the interpolant of docs/design.md#notation)::

    z_t = (1 - t) x + t eps,    target u = eps - x,    loss = |v_theta(z_t, t, y) - u|^2

with ``t`` drawn logit-normally (``sigmoid(N(0, 1))``, as in Stable Diffusion 3: the
middle of the path, where the velocity is hardest to predict, gets the most samples)
and the label replaced by the null class ``num_classes`` with probability 10%, so one
model samples both conditionally (``y = label``) and unconditionally (``y = None``).
An exponential moving average of the weights is what gets evaluated and shipped: it
smooths the last few hundred steps' noise out of the weights at no training cost.

``python -m gradest_digits.pretrain --what dit \
--out apps/digits/gradest_digits/assets/digits_dit.pt``
regenerates the shipped 8x8 checkpoint (``--what classifier`` the classifier; both are
:func:`pretrain`), and ``python -m gradest_digits.mnist_pretrain`` the two MNIST ones
(:func:`pretrain_assets`); see ``apps/digits/gradest_digits/assets/README.md``.

The file ``--out`` belongs to one run, in the spirit of :mod:`gradest_lab.storage.run_folder`
(:func:`claim_output_file`): the run holds a lock beside it, ``.<name>.lock``, from before
training until the file is written, so a second pretrain to the same file is refused
naming the first one's pid; and an existing file is replaced only when it is a pretrained
checkpoint of the same kind (the shipped asset being regenerated), never another file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gradest_lab.storage.files import OutputError, atomic_save, check_output_dir, check_output_file
from gradest_lab.storage.process_lock import describe_holder, read_holder, try_lock
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradest import GradestError, InvalidValue, RectifiedFlow, rollout
from gradest.models import DiT
from gradest.plugin import WholeNumber
from gradest_digits.assets import (
    asset_path,
    build_model,
    classifier_checkpoint,
    dit_checkpoint,
    load_digit_classifier,
    read_asset,
)
from gradest_digits.classifier import (
    DigitClassifier,
    accuracy,
    per_class_accuracy,
    train_classifier,
    training_threads,
)
from gradest_digits.datasets import DIGITS, NUM_CLASSES, Dataset

TIME_SAMPLINGS = ("logit_normal", "uniform")


def _sample_times(
    batch: int, time_sampling: str, generator: torch.Generator, dtype: torch.dtype
) -> Tensor:
    normal = torch.randn(batch, generator=generator, dtype=dtype)
    if time_sampling == "logit_normal":
        return torch.sigmoid(normal)
    return torch.rand(batch, generator=generator, dtype=dtype)


def pretrain_dit(
    steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    *,
    dataset: Dataset = DIGITS,
    config: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    label_dropout: float = 0.1,
    time_sampling: str = "logit_normal",
    ema_decay: float = 0.999,
    warmup: int | None = None,
    weight_decay: float = 0.0,
    threads: int = 1,
    progress: bool = True,
) -> tuple[DiT, dict[str, Any]]:
    """Train a class-conditional DiT on ``dataset``'s train split by rectified-flow matching.

    ``steps``, ``batch_size``, ``lr``, ``config`` and ``warmup`` left as None are the
    dataset's (:class:`~gradest_digits.datasets.Dataset`'s ``dit_*``: the shipped DiT's).

    Args:
        steps: optimiser steps (each on ``batch_size`` digits drawn with replacement).
        batch_size: digits per step.
        lr: peak AdamW learning rate (linear warm-up over ``warmup`` steps, then cosine
            decay to 10% of the peak).
        seed: seeds the initialisation, batches, times, noise and label dropout.
        dataset: :data:`~gradest_digits.datasets.DIGITS` or
            :data:`~gradest_digits.datasets.MNIST`.
        config: a name in :data:`gradest.models.dit.DIT_CONFIGS`; ``overrides`` change
            its fields (``num_classes`` is always 10, ``input_size`` and ``in_channels``
            those of the dataset's images).
        label_dropout: probability of training on the null label (unconditional).
        time_sampling: ``"logit_normal"`` (``t = sigmoid(N(0, 1))``) or ``"uniform"``.
        ema_decay: decay of the weight average that is returned (0 returns the raw weights).
        warmup: warm-up steps of the learning rate and of the EMA.
        weight_decay: AdamW weight decay.
        threads: ``torch.set_num_threads`` during training (restored afterwards);
            one thread is fastest for a model this small on a shared CPU.
        progress: show a tqdm progress bar.

    Returns:
        ``(model, info)``: the EMA model in eval mode, and ``info`` with the settings,
        the parameter count, the final training loss and the seconds taken.
    """
    steps = dataset.dit_steps if steps is None else steps
    batch_size = dataset.dit_batch_size if batch_size is None else batch_size
    lr = dataset.dit_lr if lr is None else lr
    config = dataset.dit_config if config is None else config
    warmup = dataset.dit_warmup if warmup is None else warmup
    if steps < 1 or batch_size < 1:
        raise InvalidValue(
            f"pretrain_dit needs steps >= 1 and batch_size >= 1, got steps={steps}, "
            f"batch_size={batch_size}"
        )
    if time_sampling not in TIME_SAMPLINGS:
        raise InvalidValue(
            f"time_sampling={time_sampling!r} is not one of {', '.join(TIME_SAMPLINGS)}"
        )
    if not 0.0 <= label_dropout < 1.0:
        raise InvalidValue(f"label_dropout must be in [0, 1), got {label_dropout}")
    if not 0.0 <= ema_decay < 1.0:
        raise InvalidValue(f"ema_decay must be in [0, 1) (0: no averaging), got {ema_decay}")
    fixed = {
        "num_classes": NUM_CLASSES,
        "input_size": dataset.image_shape[1],
        "in_channels": dataset.image_shape[0],
    }
    with training_threads(threads):
        start = time.perf_counter()
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        model = DiT.from_config(config, **{**dict(overrides or {}), **fixed})
        ema = copy.deepcopy(model).requires_grad_(False)
        images, labels = dataset.load("train")
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

        def learning_rate_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress_fraction = (step - warmup) / max(1, steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress_fraction))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor)
        model.train()
        running = 0.0
        description = f"{dataset.name} DiT flow matching"
        bar = tqdm(range(steps), desc=description, unit="step", disable=not progress)
        for step in bar:
            index = torch.randint(0, len(images), (batch_size,), generator=generator)
            x, y = images[index], labels[index]
            drop = torch.rand(batch_size, generator=generator) < label_dropout
            y = torch.where(drop, torch.full_like(y, NUM_CLASSES), y)
            t = _sample_times(batch_size, time_sampling, generator, x.dtype)
            eps = torch.randn(x.shape, generator=generator, dtype=x.dtype)
            tb = t[:, None, None, None]
            z_t = (1 - tb) * x + tb * eps
            loss = F.mse_loss(model(z_t, t, y), eps - x)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            # EMA with a warm-up (decay grows from 0): early averages are not dominated
            # by the zero-output initialisation.
            decay = min(ema_decay, step / (step + 10.0))
            with torch.no_grad():
                for averaged, current in zip(ema.parameters(), model.parameters(), strict=True):
                    averaged.lerp_(current, 1.0 - decay)
            running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
            if step % 50 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{running:.4f}")
        result = ema if ema_decay > 0 else model
        result.eval()
        info = {
            "config": config,
            "overrides": dict(overrides or {}),
            "parameters": sum(p.numel() for p in result.parameters()),
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "seed": seed,
            "label_dropout": label_dropout,
            "time_sampling": time_sampling,
            "ema_decay": ema_decay,
            "warmup": warmup,
            "weight_decay": weight_decay,
            "final_loss": running,
            "seconds": time.perf_counter() - start,
        }
    return result, info


@torch.no_grad()
def sample_digits(
    model: nn.Module,
    labels: Tensor | None,
    *,
    num_samples: int | None = None,
    steps: int = 20,
    seed: int = 0,
    dataset: Dataset = DIGITS,
) -> Tensor:
    """Sample digits with the Euler sampler ``gradest.RectifiedFlow(steps)``.

    Args:
        model: a class-conditional DiT (e.g. :func:`gradest_digits.assets.load_pretrained_dit`).
        labels: ``[B]`` class labels to condition on, or None for unconditional samples
            (then give ``num_samples``).
        num_samples: the batch size when ``labels`` is None.
        steps: Euler steps from noise (t=1) to data (t=0).
        seed: seeds the initial noise.
        dataset: whose images the model makes (their shape).

    Returns:
        ``[B, *dataset.image_shape]`` samples (roughly in [-1, 1]; not clipped).
    """
    parameter = next(model.parameters())
    if labels is None:
        if num_samples is None or num_samples < 1:
            raise InvalidValue("sample_digits needs labels=... or num_samples >= 1")
        batch, cond = num_samples, None
    else:
        batch, cond = labels.shape[0], {"y": labels.to(parameter.device)}
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, *dataset.image_shape)
    noise = torch.randn(shape, generator=generator, dtype=parameter.dtype)
    trajectory = rollout(model, RectifiedFlow(steps=steps), noise.to(parameter.device), cond=cond)
    return trajectory.states[-1]


@torch.no_grad()
def evaluate_dit(
    model: nn.Module,
    classifier: nn.Module,
    *,
    dataset: Dataset = DIGITS,
    samples_per_class: int = 20,
    steps: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """How recognisable (and, on the 8x8 digits, how realistic) the DiT's conditional
    samples are.

    Draws ``samples_per_class`` samples of every digit and reports the classifier's
    accuracy on them (``accuracy``: the label it was conditioned on; chance is 0.1),
    overall and per class. On the 8x8 digits also FID/KID (classifier features,
    :mod:`gradest_digits.metrics`, which reads 8x8 images) against the held-out digits,
    next to the same metrics for pure Gaussian noise clipped to the image range
    (``noise_fid``, ``noise_kid_mean``).
    """
    labels = torch.arange(NUM_CLASSES).repeat_interleave(samples_per_class)
    samples = sample_digits(model, labels, steps=steps, seed=seed, dataset=dataset)
    reference = next(classifier.parameters())
    samples = samples.to(device=reference.device, dtype=reference.dtype)
    result: dict[str, Any] = {
        "accuracy": accuracy(classifier, samples, labels),
        "accuracy_per_class": per_class_accuracy(classifier, samples, labels),
        "samples": float(samples.shape[0]),
        "sampler_steps": float(steps),
        "seed": seed,
    }
    if dataset is not DIGITS:
        return result
    # torch-fidelity is an optional dependency (the "workload" extra): training alone
    # does not need it.
    from gradest_digits.metrics import fid_kid

    heldout, _ = dataset.load("heldout")
    generated = fid_kid(samples, heldout, classifier=classifier, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(samples.shape, generator=generator, dtype=samples.dtype).to(samples.device)
    baseline = fid_kid(noise, heldout, classifier=classifier, seed=seed)
    return {
        **result,
        "fid": generated["fid"],
        "kid_mean": generated["kid_mean"],
        "kid_std": generated["kid_std"],
        "noise_fid": baseline["fid"],
        "noise_kid_mean": baseline["kid_mean"],
    }


WHATS = ("dit", "classifier")


def lock_path(path: str | Path) -> Path:
    """The lock a run writing the file ``path`` holds: ``.<name>.lock`` beside it."""
    target = Path(path)
    return target.parent / f".{target.name}.lock"


def replaceable_or_refuse(
    path: Path, kind: str, *, what: str = "out", flag: str = "--out", remake: str
) -> None:
    """Refuse, reading only, to replace the existing file ``path`` unless it is a
    checkpoint of ``kind`` (``torch.load(weights_only=True)``: loading runs no code).

    Args:
        what: how the messages name the file (``"out"``, as :func:`pretrain` does).
        flag: the option that names another file (``"--out"``), for the fix.
        remake: the command that writes ``kind`` (for the message).

    Raises:
        InvalidValue: one line naming the file, what it holds and the fix; it is kept.
    """
    if not path.is_file():
        return  # nothing there (check_output_file refused what is not a file)
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch raises many kinds (and long texts) for a file not its own
        held = "a file that does not load as a torch checkpoint"
    else:
        if isinstance(found, dict) and found.get("kind") == kind:
            return
        from gradest_digits.run_state import FORMAT as FINETUNE_FORMAT

        if isinstance(found, dict) and found.get("format") == FINETUNE_FORMAT:
            held = "a gradest finetune checkpoint"
        elif isinstance(found, dict) and isinstance(found.get("kind"), str):
            held = f"a {found['kind']!r} checkpoint"
        else:
            held = f"a torch file of another tool ({type(found).__name__})"
    raise InvalidValue(
        f"{what} {str(path)!r} holds {held}, not a {kind!r} checkpoint of {remake}: it is not "
        f"replaced; pass another {flag}, or remove the file first to replace it"
    )


@contextlib.contextmanager
def claim_output_file(
    path: str | Path,
    kind: str,
    *,
    what: str = "out",
    flag: str = "--out",
    command: str = "gradest pretrain",
) -> Iterator[Path]:
    """Hold the file ``path`` for one run writing a ``kind`` checkpoint there.

    The lock beside it (:func:`lock_path`, :func:`gradest_lab.storage.process_lock.try_lock`) is
    held
    for the body; an existing file must be a checkpoint of ``kind``
    (:func:`replaceable_or_refuse`), checked now and again before the body's
    :func:`write_claimed` writes it. A lock left by a killed process is taken over.

    Raises:
        OutputError: another live process holds the file (naming its pid), or the path
            cannot be written.
        InvalidValue: the file there is not a checkpoint of ``kind``.
    """
    target = check_output_file(path, what=what)
    lock_file = lock_path(target)
    lock = try_lock(lock_file, command=command)
    if lock is None:
        holder = read_holder(lock_file)
        raise OutputError(
            f"{what} {str(target)!r} is being written by {describe_holder(holder or {})}: one "
            f"run writes a file at a time; wait for it to finish, or pass another {flag}"
        )
    try:
        replaceable_or_refuse(target, kind, what=what, flag=flag, remake=command)
        yield target
    finally:
        lock.release()


def write_claimed(
    checkpoint: Mapping[str, Any],
    path: Path,
    *,
    what: str = "out",
    flag: str = "--out",
    command: str,
) -> None:
    """Save ``checkpoint`` to the file ``path`` held by :func:`claim_output_file`,
    checking again that what is there (a file that appeared while the run trained) is a
    checkpoint of the same kind."""
    replaceable_or_refuse(path, str(checkpoint["kind"]), what=what, flag=flag, remake=command)
    atomic_save(dict(checkpoint), path)


def train_checkpoint(
    what: str,
    dataset: Dataset,
    *,
    seed: int,
    progress: bool,
    settings: Mapping[str, Any],
    judge: nn.Module | None = None,
) -> tuple[dict[str, Any], nn.Module]:
    """Train ``dataset``'s ``what`` (``"dit"`` or ``"classifier"``) with the training
    function's ``settings`` and return ``(its checkpoint dict, the model)``; a DiT's
    ``info["evaluation"]`` is :func:`evaluate_dit` with the classifier ``judge`` (None:
    no evaluation)."""
    if what == "classifier":
        model, info = train_classifier(seed=seed, progress=progress, dataset=dataset, **settings)
        return classifier_checkpoint(model, info, dataset), model
    dit, info = pretrain_dit(seed=seed, progress=progress, dataset=dataset, **settings)
    if judge is not None:
        info["evaluation"] = evaluate_dit(dit, judge, dataset=dataset, seed=seed)
    return dit_checkpoint(dit, info, dataset), dit


def pretrain(
    what: str,
    out: str | Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    evaluate: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the 8x8 digits' ``what`` (``"dit"`` or ``"classifier"``) and save its
    checkpoint to ``out`` (``gradest pretrain``).

    The DiT's evaluation (``evaluate=True``) needs the digit classifier: the shipped one,
    so regenerate the classifier first if both are rebuilt.

    Returns:
        The checkpoint's ``info`` dict (settings, timings, accuracy; for the DiT also
        the :func:`evaluate_dit` numbers under ``"evaluation"``) plus ``"out"`` and ``"bytes"``.
    """
    if what not in WHATS:
        raise InvalidValue(f"what={what!r} is not one of {', '.join(WHATS)}")
    if what == "classifier" and steps is not None:
        raise InvalidValue("the classifier trains for --epochs, not --steps")
    if what == "dit" and epochs is not None:
        raise InvalidValue("the DiT trains for --steps, not --epochs")
    # Options left as None keep the training function's own defaults.
    options = (("batch_size", batch_size), ("lr", lr), ("epochs", epochs), ("steps", steps))
    settings = {key: value for key, value in options if value is not None}
    command = f"gradest pretrain --what {what}"
    kind = DIGITS.classifier_kind if what == "classifier" else DIGITS.dit_kind
    # Checked and held before training, so a bad path, a file of another kind or a second
    # writer costs seconds, not the trained model.
    with claim_output_file(out, kind, command=command) as target:
        judge = load_digit_classifier() if what == "dit" and evaluate else None
        checkpoint, _ = train_checkpoint(
            what, DIGITS, seed=seed, progress=progress, settings=settings, judge=judge
        )
        write_claimed(checkpoint, target, command=command)
    return {**checkpoint["info"], "out": str(target), "bytes": target.stat().st_size}


ASSET_WHATS = ("all", "classifier", "dit")


def pretrain_assets(
    dataset: Dataset,
    out_dir: str | Path | None = None,
    *,
    what: str = "all",
    seed: int = 0,
    dit_steps: int | None = None,
    classifier_epochs: int | None = None,
    progress: bool = True,
    command: str,
) -> dict[str, Any]:
    """Train and save ``dataset``'s classifier and/or DiT under their shipped names in
    ``out_dir`` (default: the package assets); returns their ``info`` dicts.

    The DiT is evaluated with the classifier: the one just trained, or (``what="dit"``)
    the one already in ``out_dir``. Both files are held (:func:`claim_output_file`, the
    locks naming ``command``) and checked before either is trained.
    """
    if what not in ASSET_WHATS:
        raise InvalidValue(f"what={what!r} is not one of {', '.join(ASSET_WHATS)}")
    folder = Path(out_dir) if out_dir is not None else asset_path("")
    folder = check_output_dir(folder, what="--out-dir") if out_dir is not None else folder
    files = {
        "classifier": (dataset.classifier_asset, dataset.classifier_kind),
        "dit": (dataset.dit_asset, dataset.dit_kind),
    }
    wanted = ("classifier", "dit") if what == "all" else (what,)
    held = {"what": "the checkpoint", "flag": "--out-dir", "command": command}
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for part in wanted:
            name, kind = files[part]
            stack.enter_context(claim_output_file(folder / name, kind, **held))
        judge: nn.Module | None = None
        if "classifier" not in wanted:
            path = folder / dataset.classifier_asset
            if not path.is_file():
                raise InvalidValue(f"--what dit evaluates with {path}; train the classifier first")
            # The one reader of the format: a damaged file is one line naming it.
            judge = build_model(read_asset(dataset.classifier_asset, folder))
            assert isinstance(judge, DigitClassifier)
        for part in wanted:
            settings = (
                {"epochs": classifier_epochs} if part == "classifier" else {"steps": dit_steps}
            )
            checkpoint, model = train_checkpoint(
                part,
                dataset,
                seed=seed,
                progress=progress,
                settings=settings,
                judge=None if judge is None else judge.requires_grad_(False),
            )
            write_claimed(checkpoint, folder / files[part][0], **held)
            result[part] = checkpoint["info"]
            judge = model if part == "classifier" else judge
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of :func:`pretrain` (for ``python -m`` and the ``gradest`` CLI)."""
    parser.add_argument("--what", choices=WHATS, required=True, help="model to train")
    parser.add_argument("--out", required=True, help="checkpoint path to write (.pt)")
    # Integer flags: gradest's one rule (gradest.integers), counts >= 1, the seed >= 0.
    parser.add_argument("--seed", type=WholeNumber(0), default=0, help="seed (default 0)")
    parser.add_argument("--steps", type=WholeNumber(1), default=None, help="DiT optimiser steps")
    parser.add_argument("--epochs", type=WholeNumber(1), default=None, help="classifier epochs")
    parser.add_argument("--batch-size", type=WholeNumber(1), default=None, help="batch size")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument(
        "--no-evaluate", dest="evaluate", action="store_false", help="skip the DiT evaluation"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`pretrain` from parsed :func:`add_arguments` options."""
    return pretrain(
        args.what,
        args.out,
        seed=args.seed,
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        evaluate=args.evaluate,
        progress=not args.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradest_digits.pretrain",
        description="Pretrain the digits workload's DiT or classifier and save a checkpoint.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except GradestError as err:
        print(f"pretrain: error: {err}", file=sys.stderr)
        return 2
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
