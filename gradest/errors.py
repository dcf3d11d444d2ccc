"""The errors gradest raises on purpose; anything else is a bug.

Every error gradest raises about its *input* (an argument, an option, a file it must
write, a non-finite value) derives from :class:`GradestError` and from the built-in type
a caller would expect (``ValueError``, ``TypeError``, ...), so ``except ValueError`` keeps
working. The command line prints a :class:`GradestError` as one line and exits 2; any
other exception is an internal bug and keeps its traceback.
"""

from __future__ import annotations


class GradestError(Exception):
    """Base of gradest's documented errors (messages name the argument and the fix)."""


class InvalidValue(GradestError, ValueError):
    """An argument, option or file content has a value gradest cannot use."""


class InvalidType(GradestError, TypeError):
    """An argument or option has the wrong type."""


class NoNoiseGradient(InvalidValue):
    """``noise_grad=True`` was asked of an estimator that gives no noise gradient (its
    ``_terminal`` returns None for it): refused, never a silent None."""


class MissingDependency(GradestError, ImportError):
    """An optional dependency (an extra of ``pip install gradest[...]``) is not installed."""


class SurrogateOutdated(GradestError, RuntimeError):
    """A surrogate loss was backpropagated after its model changed.

    Raised at the start of the loss's backward, before any gradient is computed, when a
    parameter, buffer or submodule was replaced or modified in place, or a module switched
    between train and eval mode, since ``est.surrogate(...)`` built the loss
    (:mod:`gradest.model_state`). A ``RuntimeError``: torch's own errors in a backward are.
    """
