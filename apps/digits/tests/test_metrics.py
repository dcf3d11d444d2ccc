"""FID/KID through torch-fidelity on the digit classifier's features, fully offline."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.hub
from gradest_digits import assets
from gradest_digits.classifier import DigitClassifier
from gradest_digits.datasets import DIGITS
from gradest_digits.metrics import (
    EXTRACTOR_NAME,
    DigitFeatureExtractor,
    fid_kid,
    from_uint8,
    to_uint8,
)
from gradest_digits.pretrain import sample_digits
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """Any attempt to open a connection or fetch weights fails the test; TORCH_HOME is empty."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted during a metrics test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    yield
    # No cache, no downloaded weights: torch-fidelity wrote nothing under TORCH_HOME.
    assert not (tmp_path / "torch_home").exists()


@pytest.fixture(scope="module")
def digits():
    train, _ = DIGITS.load("train")
    heldout, _ = DIGITS.load("heldout")
    noise = torch.randn(heldout.shape, generator=torch.Generator().manual_seed(0))
    return train, heldout, noise


def test_the_registered_extractor_is_the_digit_classifier():
    assert FEATURE_EXTRACTORS_REGISTRY[EXTRACTOR_NAME] is DigitFeatureExtractor
    extractor = DigitFeatureExtractor(EXTRACTOR_NAME, ["penultimate"])
    images = DIGITS.load("heldout")[0][:5]
    (features,) = extractor(to_uint8(images))
    expected = assets.load_digit_classifier(dtype=torch.float64).features(
        from_uint8(to_uint8(images))
    )
    torch.testing.assert_close(features, expected)
    with pytest.raises(TypeError, match="expects uint8"):
        extractor(images)


def test_real_digits_are_close_and_noise_is_far(digits):
    train, heldout, noise = digits
    real = fid_kid(heldout, train)
    fake = fid_kid(noise, heldout)
    # Measured: FID 12.2 (held-out vs train) vs 433 (noise vs held-out); KID -30 +- 67
    # (subset std) vs 2483 +- 186.
    assert real["fid"] < 0.1 * fake["fid"]
    # KID of two samples of one distribution is 0 in expectation: within a few subset
    # standard deviations of 0, far below noise's KID, which is many deviations from 0.
    assert abs(real["kid_mean"]) < 4 * real["kid_std"] + 1e-3 * fake["kid_mean"]
    assert fake["kid_mean"] > 10 * fake["kid_std"]
    assert real["kid_mean"] < 0.1 * fake["kid_mean"]


def test_a_set_against_itself_has_zero_fid(digits):
    _, heldout, noise = digits
    fake = fid_kid(noise, heldout)
    same = fid_kid(heldout, heldout)
    assert abs(same["fid"]) < 1e-9 * fake["fid"]


def test_pretrained_dit_samples_beat_noise(digits):
    _, heldout, noise = digits
    model = assets.load_pretrained_dit()
    labels = torch.arange(10).repeat_interleave(20)
    samples = sample_digits(model, labels, steps=20, seed=0)
    generated = fid_kid(samples, heldout)
    baseline = fid_kid(noise, heldout)
    # Measured: FID 52.8 and KID 88 for 200 samples vs FID 433 and KID 2483 for noise.
    assert generated["fid"] < 0.3 * baseline["fid"]
    assert generated["kid_mean"] < 0.3 * baseline["kid_mean"]


def test_kid_subset_size_follows_the_sample_count(digits):
    _, heldout, noise = digits
    small = fid_kid(noise[:10], heldout[:12])  # default subset: 5 of each
    assert small["fid"] > 0
    with pytest.raises(ValueError, match="kid_subset_size=11 .*smaller set's size \\(10\\)"):
        fid_kid(noise[:10], heldout, kid_subset_size=11)
    with pytest.raises(ValueError, match="at least 2 images"):
        fid_kid(noise[:1], heldout)
    with pytest.raises(ValueError, match=r"shape \[n, 1, 8, 8\]"):
        fid_kid(noise.flatten(1), heldout)


def test_a_custom_classifier_is_used_and_left_untouched(digits):
    _, heldout, noise = digits
    classifier = DigitClassifier().train()  # trainable: torch-fidelity must work on a copy
    custom = fid_kid(noise[:50], heldout[:50], classifier=classifier)
    shipped = fid_kid(noise[:50], heldout[:50])
    assert custom["fid"] != pytest.approx(shipped["fid"])
    assert classifier.training and all(p.requires_grad for p in classifier.parameters())


def test_quantisation_round_trip():
    x = torch.linspace(-1.5, 1.5, 101).reshape(1, 1, 1, 101)
    u = to_uint8(x)
    assert u.dtype == torch.uint8 and u.min() == 0 and u.max() == 255
    back = from_uint8(u)
    assert (back - x.clamp(-1, 1)).abs().max() <= 0.5 / 127.5 + 1e-12
