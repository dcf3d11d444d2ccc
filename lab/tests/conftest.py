"""Shared test configuration of the lab's tests: gradient tests run in float64 against
gradest.reference, single-threaded (the repository's conftest.py gives each test an empty
working folder)."""

from __future__ import annotations

import pytest
from gradest_lab.race import plain_race as race_module

from gradest.testing.fixtures import deterministic_torch  # noqa: F401  (autouse)


@pytest.fixture
def counted_runs(monkeypatch):
    """The (spec, lr, seed) of every run the race starts (a resumed one counts too)."""
    started: list[tuple[str, float | None, int]] = []
    original = race_module._Race.new_run

    def new_run(self, spec, seed, pretrained, *, lr=None):
        started.append((spec, lr, seed))
        return original(self, spec, seed, pretrained, lr=lr)

    monkeypatch.setattr(race_module._Race, "new_run", new_run)
    return started
