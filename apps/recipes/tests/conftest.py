"""Shared test configuration and fixtures of the recipe tests (plain helpers are in
recipe_support.py)."""

from __future__ import annotations

import pytest

from gradest.testing.fixtures import deterministic_torch  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts and ends without accelerate state (accelerate keeps one global
    state per process, whose settings cannot change once set; runs with other mixed
    precision reset it in between). Nothing to do without accelerate."""
    try:
        from recipe_support import reset_accelerate

        reset_accelerate()
    except ImportError:
        yield
        return
    yield
    reset_accelerate()
