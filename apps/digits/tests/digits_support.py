"""Helpers shared by the digits fine-tuning tests (test_finetune*.py, test_resume.py) and
the scripts they launch under torchrun: the micro DiT, small rewards and a short
``finetune`` call. Pytest fixtures live in conftest.py; this module holds what is needed at
import time or in a subprocess."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from gradest_digits.finetune import finetune
from gradest_digits.finetune_cli import add_finetune_arguments
from torch import Tensor, nn

from gradest.cli import main
from gradest.models.dit import DiT

TARGET, STEPS, BATCH = 1, 4, 4


def tiny_dit(seed: int = 0) -> DiT:
    """The micro DiT (4x4x1, 3 classes) with its adaLN-Zero layers perturbed off zero:
    a fresh DiT outputs exactly zero and only its final layer would get a gradient."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiT.from_config("micro")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer.linear" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model


class LinearClassifierReward(nn.Module):
    """``log softmax(W x)[target]`` for a fixed random ``W``: a differentiable reward."""

    def __init__(self, target: int = TARGET, classes: int = 3, dim: int = 16, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(classes, dim, generator=generator))
        self.target = target
        self.calls = 0

    def forward(self, images: Tensor) -> Tensor:
        self.calls += 1
        logits = images.flatten(1) @ self.weight.T.to(images.dtype)
        return torch.log_softmax(logits, -1)[:, self.target]


class CountingReward:
    """``log softmax(W x)[1]`` for a fixed ``W``; counts its calls (picklable: no module)."""

    def __init__(self) -> None:
        self.weight = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
        self.calls = 0

    def __call__(self, images: Tensor) -> Tensor:
        self.calls += 1
        return torch.log_softmax(images.flatten(1) @ self.weight.T, -1)[:, 1]


def run_finetune(tmp_path=None, **overrides):
    """``(model, finetune(...))``: a 2-step run of the micro DiT with a linear reward;
    ``overrides`` replace the defaults (``model=``, ``reward=`` too)."""
    arguments = {
        "estimator": "exact",
        "mode": "reward",
        "steps": 2,
        "batch_size": BATCH,
        "lr": 1e-2,
        "sampler_steps": STEPS,
        "labels": TARGET,
        "group_size": 2,
        "inner_epochs": 2,
        "progress": False,
    }
    arguments.update(overrides)
    if tmp_path is not None:
        arguments.setdefault("log_path", tmp_path / "log.jsonl")
    model = arguments.pop("model", None) or tiny_dit()
    reward = arguments.pop("reward", None) or LinearClassifierReward()
    return model, finetune(model, reward, **arguments)


def without_timings(record: dict) -> dict:
    return {key: value for key, value in record.items() if not key.endswith("_seconds")}


def first_training_batch(seed: int, dtype=torch.float32):
    """The generator's draws in finetune's order: evaluation noise, then step 0's noise."""
    generator = torch.Generator().manual_seed(seed)
    torch.randn((BATCH, 1, 4, 4), generator=generator, dtype=dtype)
    return torch.randn((BATCH, 1, 4, 4), generator=generator, dtype=dtype), generator


def parse_finetune_args(argv):
    parser = argparse.ArgumentParser()
    add_finetune_arguments(parser)
    return parser.parse_args(argv)


def shipped_assets():
    """gradest_digits.assets, skipping the test when the shipped checkpoints are missing."""
    assets = pytest.importorskip("gradest_digits.assets")
    missing = [
        name
        for name in (assets.DIT_CHECKPOINT, assets.CLASSIFIER_CHECKPOINT)
        if not assets.asset_path(name).is_file()
    ]
    if missing:
        pytest.skip(f"shipped checkpoints missing: {', '.join(missing)}")
    return assets


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``gradest ARGV`` in this process: its exit code and what it wrote to stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def finetune_cli(capsys, *argv: str) -> tuple[int, str]:
    """``gradest finetune ARGV`` in this process (see :func:`run_cli`)."""
    return run_cli(capsys, "finetune", *argv)


def one_line(err: str) -> str:
    """The one line a refusal prints (no traceback, nothing else)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (locks and temporaries included) with its bytes."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }
