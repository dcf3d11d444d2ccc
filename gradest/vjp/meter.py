"""The counts of one estimate's model calls, kept as they happen (:class:`CostMeter`)."""

from __future__ import annotations

import attrs

from gradest.protocol import Cost


@attrs.define
class CostMeter:
    """Mutable counters behind :class:`gradest.protocol.Cost`; one per estimate call."""

    forwards_with_graph: int = 0
    forwards_without_graph: int = 0
    param_vjps: int = 0
    state_vjps: int = 0

    def freeze(self) -> Cost:
        return Cost(**attrs.asdict(self))
