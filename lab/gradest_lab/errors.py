"""The lab's own errors, beside gradest's (each a :class:`gradest.GradestError`)."""

from __future__ import annotations

from gradest import GradestError

__all__ = ["Diverged", "MissingFile"]


class MissingFile(GradestError, FileNotFoundError):
    """A file the lab needs to read (a shipped checkpoint, a dataset, a config) is not there."""


class Diverged(GradestError, FloatingPointError):
    """A training run produced NaN or Inf (rewards, gradient norms)."""
