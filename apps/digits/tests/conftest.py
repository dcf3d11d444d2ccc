"""Shared test configuration and fixtures of the digits tests (helpers needed at import
time or by launched scripts are in digits_support.py)."""

from __future__ import annotations

import pytest
from digits_support import LinearClassifierReward, tiny_dit

from gradest.testing.fixtures import deterministic_torch  # noqa: F401  (autouse)


@pytest.fixture
def tiny_digits_assets(monkeypatch):
    """The CLI loads the micro DiT and a linear reward instead of the shipped digits model
    (the real loaders take the device: gradest finetune --device).

    The loaders are replaced on the real modules (the CLI imports them where it uses
    them), so modules importing other names from them (pretrain) still import."""
    from gradest_digits import assets, rewards

    monkeypatch.setattr(assets, "load_pretrained_dit", lambda device="cpu": tiny_dit().to(device))
    monkeypatch.setattr(assets, "load_digit_classifier", lambda device="cpu": "classifier")
    monkeypatch.setattr(
        rewards, "ClassifierReward", lambda classifier, target: LinearClassifierReward(target)
    )
