"""The digits workload's data, classifier, pretrained DiT, checkpoints and reward."""

from __future__ import annotations

import math

import pytest
import torch
from gradest_digits import assets
from gradest_digits.assets import (
    classifier_checkpoint,
    classifier_from_checkpoint,
    dit_checkpoint,
    dit_from_checkpoint,
)
from gradest_digits.classifier import DigitClassifier, accuracy, train_classifier
from gradest_digits.datasets import DIGITS, NUM_CLASSES
from gradest_digits.pretrain import pretrain, pretrain_dit, sample_digits
from gradest_digits.rewards import ClassifierReward

import gradest

# ----------------------------------------------------------------------------- data


def test_splits_have_the_documented_shapes_range_and_labels():
    train_x, train_y = DIGITS.load("train")
    heldout_x, heldout_y = DIGITS.load("heldout")
    assert train_x.shape == (1437, 1, 8, 8) and heldout_x.shape == (360, 1, 8, 8)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.long
    for images in (train_x, heldout_x):
        assert images.min() == -1.0 and images.max() == 1.0
    # Stratified: every class is 20% +- one image of its total in the held-out split.
    train_counts = torch.bincount(train_y, minlength=NUM_CLASSES)
    heldout_counts = torch.bincount(heldout_y, minlength=NUM_CLASSES)
    totals = train_counts + heldout_counts
    assert torch.all((heldout_counts - 0.2 * totals).abs() <= 1)


def test_splits_are_disjoint_and_cover_the_dataset():
    from sklearn.datasets import load_digits

    train_x, _ = DIGITS.load("train")
    heldout_x, _ = DIGITS.load("heldout")
    # load_digits holds no duplicate images, so rows identify samples.
    train_rows = {tuple(row.tolist()) for row in train_x.flatten(1)}
    heldout_rows = {tuple(row.tolist()) for row in heldout_x.flatten(1)}
    assert not train_rows & heldout_rows
    everything = torch.tensor(load_digits().images, dtype=torch.float32) / 8 - 1
    assert train_rows | heldout_rows == {tuple(row.tolist()) for row in everything.flatten(1)}


def test_loading_is_deterministic_and_returns_fresh_tensors():
    first_x, first_y = DIGITS.load("train")
    first_x.zero_()  # a caller's in-place edit must not leak into the next call
    second_x, second_y = DIGITS.load("train")
    third_x, third_y = DIGITS.load("train")
    assert torch.equal(second_x, third_x) and torch.equal(first_y, third_y)
    assert second_x.abs().sum() > 0


def test_bad_split_name_is_a_clear_error():
    with pytest.raises(ValueError, match="split='test'.*'train', 'heldout'"):
        DIGITS.load("test")


# ----------------------------------------------------------------------------- classifier


def test_shipped_classifier_loads_frozen_and_is_accurate():
    path = assets.asset_path(assets.CLASSIFIER_CHECKPOINT)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["kind"] == "digit_classifier"
    classifier = assets.load_digit_classifier()
    assert not classifier.training
    assert all(not p.requires_grad for p in classifier.parameters())
    heldout_x, heldout_y = DIGITS.load("heldout")
    # Measured: 0.983 (354 of 360) for the shipped checkpoint.
    assert accuracy(classifier, heldout_x, heldout_y) >= 0.95
    assert classifier.features(heldout_x).shape == (360, 64)


def test_classifier_checkpoint_round_trip(tmp_path):
    model = DigitClassifier()
    path = tmp_path / "clf.pt"
    torch.save(classifier_checkpoint(model, {"note": "untrained"}), path)
    loaded = classifier_from_checkpoint(torch.load(path, weights_only=True))
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(loaded(x), model(x))
    with pytest.raises(ValueError, match="not a digit-classifier checkpoint"):
        classifier_from_checkpoint({"kind": "digits_dit"})


def test_classifier_rejects_wrong_image_shape():
    with pytest.raises(ValueError, match=r"\[B, 1, 8, 8\]"):
        DigitClassifier()(torch.zeros(2, 64))


def test_short_classifier_training_learns():
    # Two epochs (46 AdamW steps) already separate the classes: measured 0.83 (seed 3).
    classifier, info = train_classifier(seed=3, epochs=2, progress=False)
    assert info["heldout_accuracy"] >= 0.7
    heldout_x, heldout_y = DIGITS.load("heldout")
    assert math.isclose(accuracy(classifier, heldout_x, heldout_y), info["heldout_accuracy"])


def test_missing_checkpoint_names_the_regenerate_command(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "asset_path", lambda name: tmp_path / name)
    regenerate = "--what dit --out apps/digits/gradest_digits/assets/digits_dit.pt"
    with pytest.raises(FileNotFoundError, match=regenerate):
        assets.load_pretrained_dit()
    with pytest.raises(FileNotFoundError, match="--what classifier"):
        assets.load_digit_classifier()


# ----------------------------------------------------------------------------- DiT


def test_shipped_dit_is_small_and_its_conditional_samples_are_recognised():
    checkpoint = torch.load(assets.asset_path(assets.DIT_CHECKPOINT), weights_only=True)
    assert checkpoint["kind"] == "digits_dit"
    model = assets.load_pretrained_dit()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.num_classes == NUM_CLASSES and not model.training
    classifier = assets.load_digit_classifier()
    labels = torch.arange(NUM_CLASSES).repeat_interleave(20)
    samples = sample_digits(model, labels, steps=20, seed=0)
    assert samples.shape == (200, 1, 8, 8)
    # Measured: 0.91 of 200 samples (20 per class, RectifiedFlow(steps=20), seed 0;
    # 0.925, 0.92, 0.915 with seeds 1-3);
    # chance is 0.1. 0.75 is 8 binomial standard errors (0.02) below the measurement.
    assert accuracy(classifier, samples, labels) >= 0.75


def test_shipped_dit_samples_unconditionally_with_the_null_label():
    model = assets.load_pretrained_dit()
    classifier = assets.load_digit_classifier()
    samples = sample_digits(model, None, num_samples=200, steps=20, seed=1)
    predicted = classifier(samples).argmax(dim=1)
    # The null label (10% label dropout in training) gives a mixture of all digits:
    # measured 10 of 10 classes present in 200 samples (4 to 52 per class).
    assert torch.unique(predicted).numel() >= 8


def test_pretrain_dit_smoke_and_checkpoint_round_trip(tmp_path):
    model, info = pretrain_dit(steps=3, batch_size=8, seed=0, progress=False)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert math.isfinite(info["final_loss"])
    path = tmp_path / "dit.pt"
    torch.save(dit_checkpoint(model, info), path)
    loaded = dit_from_checkpoint(torch.load(path, weights_only=True))
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 10])
    torch.testing.assert_close(loaded(x, t, y), model(x, t, y))


def test_pretrain_entry_point_writes_a_weights_only_checkpoint(tmp_path):
    out = tmp_path / "sub" / "dit.pt"
    result = pretrain("dit", out, steps=2, batch_size=4, evaluate=False, progress=False)
    assert result["bytes"] == out.stat().st_size
    assert torch.load(out, weights_only=True)["info"]["steps"] == 2
    with pytest.raises(ValueError, match="what='vae'"):
        pretrain("vae", out)
    with pytest.raises(ValueError, match="--epochs"):
        pretrain("classifier", out, steps=5)
    with pytest.raises(ValueError, match="time_sampling='beta'"):
        pretrain_dit(steps=1, time_sampling="beta")


# ----------------------------------------------------------------------------- reward


@pytest.fixture
def classifier64():
    return assets.load_digit_classifier(dtype=torch.float64)


def test_reward_is_the_target_log_probability(classifier64):
    images, labels = DIGITS.load("heldout", dtype=torch.float64)
    reward = ClassifierReward(classifier64, target=3)
    values = reward.reward(images[:16])
    expected = torch.log_softmax(classifier64(images[:16]), dim=1)[:, 3]
    torch.testing.assert_close(values, expected)
    assert values.shape == (16,) and bool((values <= 0).all())
    torch.testing.assert_close(reward.loss(images[:16]), -expected.mean())
    per_sample = ClassifierReward(classifier64, target=labels[:16])
    # Real digits under their own labels: the classifier is confident (reward near 0).
    assert per_sample.reward(images[:16]).mean() > -0.5


def test_reward_gradient_matches_finite_differences_and_classifier_stays_frozen():
    classifier = DigitClassifier().double()  # trainable before the reward freezes it
    reward = ClassifierReward(classifier, target=torch.tensor([0, 7]))
    assert all(not p.requires_grad for p in classifier.parameters()) and not classifier.training
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(reward.reward, (x,))
    reward.loss(x).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in classifier.parameters())


def test_reward_drives_a_terminal_objective(classifier64):
    reward = ClassifierReward(classifier64, target=5)
    objective = gradest.TerminalObjective(reward.loss)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    loss, adjoint = objective.terminal_adjoint(x)
    leaf = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(reward.loss(leaf), leaf)
    torch.testing.assert_close(adjoint, expected)
    torch.testing.assert_close(loss, reward.loss(x))


def test_reward_validates_targets(classifier64):
    with pytest.raises(ValueError, match="target class 10 is out of range.*\\[0, 9\\]"):
        ClassifierReward(classifier64, target=10)
    with pytest.raises(ValueError, match="target class -1"):
        ClassifierReward(classifier64, target=torch.tensor([1, -1]))
    with pytest.raises(TypeError, match="integer tensor"):
        ClassifierReward(classifier64, target=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="nn.Module"):
        ClassifierReward(lambda x: x, target=1)
    reward = ClassifierReward(classifier64, target=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="3 labels but x has batch size 2"):
        reward.reward(torch.zeros(2, 1, 8, 8, dtype=torch.float64))
