"""pytest fixtures shared by gradest's test suites (the library's and each application's).

A ``conftest.py`` activates one by importing it (``from gradest.testing.fixtures import
deterministic_torch``). This module imports pytest, so ``gradest.testing`` does not import
it: a plain install without pytest keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def deterministic_torch() -> Iterator[None]:
    """Single-threaded torch for each test: gradient comparisons run in float64 against
    ``gradest.reference``, and one thread keeps reductions reproducible."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
