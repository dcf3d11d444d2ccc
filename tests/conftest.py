"""Shared test configuration: gradient tests run in float64 against gradest.reference."""

from __future__ import annotations

from gradest.testing.fixtures import deterministic_torch  # noqa: F401  (autouse)
