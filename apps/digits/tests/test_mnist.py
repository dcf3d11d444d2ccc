"""The MNIST (28x28) workload: the data split, the shipped checkpoints, the samples' quality
and the ``mnist`` race task (gradest_digits.datasets.MNIST, mnist_race_task)."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest
import torch
from gradest_digits.assets import (
    MNIST_CLASSIFIER_CHECKPOINT,
    MNIST_DIT_CHECKPOINT,
    asset_path,
    load_checkpoint,
    load_digit_classifier,
    load_pretrained_dit,
)
from gradest_digits.datasets import MNIST, NUM_CLASSES
from gradest_digits.mnist_race_task import mnist_reward_task
from gradest_digits.pretrain import sample_digits
from gradest_digits.race_task import PRIOR_WEIGHT
from gradest_lab.race.plain_race import RaceTask, registered_tasks

from gradest.cli import main
from gradest.errors import InvalidValue

ASSETS = (MNIST_DIT_CHECKPOINT, MNIST_CLASSIFIER_CHECKPOINT)
IMAGE_SHAPE = MNIST.image_shape
# Measured at the end of pretraining (assets/README.md): accuracy 0.52 of 200 conditional
# samples; the test draws 50 other samples and asserts well above chance (0.1) with a wide
# margin below the measured accuracy for binomial noise and other CPUs' rounding.
SAMPLE_ACCURACY_FLOOR = 0.3
# The classifier's held-out accuracy (assets/README.md) less a margin.
CLASSIFIER_ACCURACY_FLOOR = 0.93


def test_split_sizes_shapes_range_and_stratification():
    train_x, train_y = MNIST.load("train")
    heldout_x, heldout_y = MNIST.load("heldout")
    assert train_x.shape == (4000, *IMAGE_SHAPE) and heldout_x.shape == (1000, *IMAGE_SHAPE)
    assert train_y.shape == (4000,) and heldout_y.shape == (1000,)
    for images in (train_x, heldout_x):
        assert images.dtype == torch.float32
        assert float(images.min()) == -1.0 and float(images.max()) == 1.0
    assert torch.bincount(train_y, minlength=NUM_CLASSES).tolist() == [400] * NUM_CLASSES
    assert torch.bincount(heldout_y, minlength=NUM_CLASSES).tolist() == [100] * NUM_CLASSES
    # fixed: the same on every call, and the splits are disjoint images
    again, _ = MNIST.load("train")
    assert torch.equal(train_x, again)
    train_rows = {row.tobytes() for row in train_x.flatten(1).numpy()}
    assert not any(row.tobytes() in train_rows for row in heldout_x.flatten(1).numpy())
    with pytest.raises(InvalidValue, match="not an MNIST split"):
        MNIST.load("test")


def test_assets_load_are_small_and_packaged():
    total = sum(asset_path(name).stat().st_size for name in ASSETS)
    assert total <= 5 * 1024 * 1024, f"MNIST assets take {total} bytes, over 5 MB"
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    for name in ASSETS:
        assert any(fnmatch.fnmatch(f"assets/{name}", p) for p in patterns["gradest_digits"])
    dit = load_pretrained_dit(dataset=MNIST)
    assert 0.5e6 < sum(p.numel() for p in dit.parameters()) < 3e6
    assert dit.config.input_size == 28 and dit.config.patch_size == 4
    classifier = load_digit_classifier(dataset=MNIST)
    assert not any(p.requires_grad for p in classifier.parameters())
    info = load_checkpoint(MNIST_CLASSIFIER_CHECKPOINT)["info"]
    assert info["heldout_accuracy"] >= CLASSIFIER_ACCURACY_FLOOR  # measured 0.972


def test_classifier_is_accurate_on_heldout_digits():
    images, labels = MNIST.load("heldout")
    with torch.no_grad():
        predicted = load_digit_classifier(dataset=MNIST)(images[:300]).argmax(dim=1)
    assert float((predicted == labels[:300]).float().mean()) >= CLASSIFIER_ACCURACY_FLOOR


def test_pretrained_dit_samples_are_classified_as_their_label():
    labels = torch.arange(NUM_CLASSES).repeat_interleave(5)
    samples = sample_digits(
        load_pretrained_dit(dataset=MNIST), labels, steps=20, seed=123, dataset=MNIST
    )
    assert samples.shape == (50, *IMAGE_SHAPE) and bool(torch.isfinite(samples).all())
    with torch.no_grad():
        predicted = load_digit_classifier(dataset=MNIST)(samples).argmax(dim=1)
    accuracy = float((predicted == labels).float().mean())
    assert accuracy >= SAMPLE_ACCURACY_FLOOR, f"sample accuracy {accuracy:.2f}"


def test_mnist_task_is_registered_and_its_step_counts_the_prior():
    assert "mnist" in registered_tasks()
    task = mnist_reward_task()
    assert isinstance(task, RaceTask)
    model, sampler = task.pretrained(), task.sampler()
    assert len(sampler.times) == 21  # N = 20 Euler steps
    problem = task.step_problem(model, sampler, torch.Generator().manual_seed(0), 0)
    assert problem.inputs["noise"].shape == (task.batch, *IMAGE_SHAPE)
    assert problem.extra_cost.forwards_with_graph == 1 and problem.extra_cost.param_vjps == 1
    prior = problem.extra_loss(model)
    assert prior.ndim == 0 and float(prior.detach()) > 0
    assert task.settings()["prior_weight"] == PRIOR_WEIGHT
    with pytest.raises(InvalidValue, match="eval-samples"):
        mnist_reward_task(eval_samples=10)


@pytest.mark.slow
def test_gradest_race_mnist_smoke(tmp_path, capsys):
    out = tmp_path / "race"
    argv = ["race", "--model", "mnist", "--estimators", "exact,sdo", "--seeds", "2"]
    argv += ["--budget", "1x", "--fractions", "1", "--out", str(out), "--no-plots", "--quiet"]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["task"] == "mnist"
    assert data["config"]["task_settings"]["sampler_steps"] == 20
    for spec in ("exact", "sdo"):
        rows = data["runs"][spec]
        assert [r["seed"] for r in rows] == [0, 1]
        assert all(r["flops"] <= data["config"]["budget"] for r in rows)
        for row in rows:
            point = row["curve"][-1]
            expected = point["log_p_target"] - PRIOR_WEIGHT * point["heldout_fm"]
            assert point["reward"] == pytest.approx(expected)
    assert [r["steps"] for r in data["runs"]["exact"]] == [1, 1]
