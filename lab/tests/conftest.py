"""Shared test configuration of the lab's tests: gradient tests run in float64 against
gradest.reference, single-threaded (the repository's conftest.py gives each test an empty
working folder)."""

from __future__ import annotations

from gradest.testing.fixtures import deterministic_torch  # noqa: F401  (autouse)
