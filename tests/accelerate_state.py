"""accelerate keeps one global state per process (its settings cannot change once set):
tests that build an ``Accelerator`` in-process reset it before and after each test."""

from __future__ import annotations

import pytest


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts without accelerate state (runs with other mixed precision reset
    it in between). Import it into a test module to apply it there."""
    reset_accelerate()
    yield
    reset_accelerate()
