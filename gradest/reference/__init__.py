"""Dense-Jacobian ground truth for small models, independent of the VJP engine."""

from gradest.reference.dense import (
    DenseChain,
    dense_chain,
    exact_cotangents,
    exact_gradient,
    relative_error,
    terminal_adjoints,
)

__all__ = [
    "DenseChain",
    "dense_chain",
    "exact_cotangents",
    "exact_gradient",
    "relative_error",
    "terminal_adjoints",
]
