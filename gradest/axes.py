"""What an estimator is, in three lines: its two design axes and its memory policy.

Every estimator evaluates ``sum_k J_k^T c_k`` (docs/design.md, "Estimators"); it chooses
which cotangents ``c_k`` to use and how to evaluate the VJP sum, and, independently, what
it keeps in memory. A built-in estimator class declares these as its ``axes`` class
attribute, an :class:`EstimatorAxes`, and ``gradest list --verbose`` prints them. Cost
formulas are written only in docs/design.md; the record points there. Plugins need not
declare ``axes`` (``gradest list --verbose`` then says "not declared").
"""

from __future__ import annotations

from typing import Any

import attrs

COST_FORMULAS = "docs/design.md#cost-formulas"
NOT_DECLARED = "not declared"


@attrs.frozen
class EstimatorAxes:
    """An estimator's design axes and memory policy, one short phrase each.

    Attributes:
        cotangents: which cotangents ``c_k`` it uses (e.g. "exact adjoint").
        evaluation: how ``sum_k J_k^T c_k`` is evaluated (e.g. "one VJP per step").
        memory: what it keeps while doing so (e.g. "graph of every step"), and the
            option that changes it, if any.
        cost: where its cost formula is written (the one place: docs/design.md).
    """

    cotangents: str
    evaluation: str
    memory: str
    cost: str = COST_FORMULAS


def axes_of(cls: Any) -> EstimatorAxes | None:
    """The ``axes`` an estimator class (or instance) declares; None when it declares none."""
    axes = getattr(cls, "axes", None)
    return axes if isinstance(axes, EstimatorAxes) else None


def describe_axes(cls: Any) -> list[tuple[str, str]]:
    """``(field, text)`` rows for ``gradest list --verbose`` ("not declared" for plugins
    without an :class:`EstimatorAxes`)."""
    axes = axes_of(cls)
    if axes is None:
        return [("axes", NOT_DECLARED)]
    return [(field.name, getattr(axes, field.name)) for field in attrs.fields(EstimatorAxes)]
