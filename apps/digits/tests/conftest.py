"""Shared test configuration: gradient tests run in float64 against gradest.reference."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    # Gradient comparisons are in float64; single-threaded keeps reductions reproducible.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
