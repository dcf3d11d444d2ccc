"""Where ``jagg`` puts its groups and interpolation nodes, and the Lagrange weights in time.

Pure bookkeeping, no model code: which steps form a group, at which steps the parameter
Jacobian is actually evaluated (the nodes), and the weights ``L_j(t_k)`` with which the
Jacobian at an interior step is predicted from the nodes,
``J_{t_k} ~= sum_j L_j(t_k) J_{t_j}`` (docs/design.md#estimator-table, row ``jagg``).

Layout (steps ``k = 0..N-1``, ``W = window``, ``p = order``):

* Group ``g`` owns steps ``gW .. min(gW + W, N) - 1``; the last group may be shorter.
  Every step belongs to exactly one group, so every cotangent ``c_k`` is counted once.
* Non-shared knots: the ``p + 1`` nodes of a group are the steps at
  ``round(linspace(first, last, p + 1))`` of its own steps (order 1: the two endpoints).
* Shared knots: the node interval of group ``g`` runs from its first step to the next
  group's first step ``(g+1)W`` (or to step ``N-1`` for the last group), so adjacent
  groups share their boundary node and a chain needs about ``N/W + 1`` node evaluations
  at order 1 instead of ``2N/W``.
* When the node interval holds no more than ``p + 1`` steps, all of them are nodes, and
  the group is exact (a group of one step always is).

``round`` rounds halves up (``floor(x + 1/2)``), computed in integer arithmetic so the
layout never depends on floating-point ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from gradest.errors import InvalidValue


@attrs.frozen
class Group:
    """One group of consecutive steps and the nodes that interpolate its Jacobians.

    Attributes:
        steps: the steps whose cotangents this group owns (consecutive, ascending).
        nodes: the interpolation nodes (ascending, distinct). With shared knots the last
            node may be the next group's first step, outside ``steps``.
    """

    steps: tuple[int, ...]
    nodes: tuple[int, ...]

    @property
    def is_exact(self) -> bool:
        """Every step is a node, so the interpolation reproduces each ``J_k`` exactly."""
        return set(self.steps) <= set(self.nodes)

    @property
    def interpolated_steps(self) -> tuple[int, ...]:
        """The steps whose Jacobian is predicted rather than evaluated (gated steps)."""
        return tuple(k for k in self.steps if k not in self.nodes)


def node_positions(first: int, last: int, order: int) -> tuple[int, ...]:
    """``order + 1`` steps at ``round(linspace(first, last, order + 1))``.

    If the interval ``first..last`` holds ``order + 1`` steps or fewer, all of them are
    returned (polynomial interpolation through every step is the identity).
    """
    if last < first:
        raise InvalidValue(f"node interval must not be empty, got first={first} > last={last}")
    if order < 1:
        raise InvalidValue(f"order must be >= 1, got {order}")
    span = last - first
    if span + 1 <= order + 1:
        return tuple(range(first, last + 1))
    # first + round(i * span / order), halves rounded up, in exact integer arithmetic. The
    # spacing span/order >= 1 keeps the rounded positions distinct.
    return tuple(first + (2 * i * span + order) // (2 * order) for i in range(order + 1))


def layout_groups(num_steps: int, window: int, order: int, shared_knots: bool) -> tuple[Group, ...]:
    """The groups and nodes of a chain of ``num_steps`` steps (see the module docstring).

    A ``window`` longer than the chain gives one group covering every step.
    """
    if num_steps < 1:
        raise InvalidValue(f"num_steps must be >= 1, got {num_steps}")
    if window < 2:
        raise InvalidValue(f"window must be >= 2, got {window}")
    if not 1 <= order < window:
        raise InvalidValue(f"order must satisfy 1 <= order < window={window}, got {order}")
    groups = []
    for first in range(0, num_steps, window):
        last = min(first + window, num_steps) - 1
        # Shared knots: interpolate up to the next group's first step (which that group
        # owns); the last group ends at the last step.
        node_last = min(first + window, num_steps - 1) if shared_knots else last
        groups.append(
            Group(
                steps=tuple(range(first, last + 1)), nodes=node_positions(first, node_last, order)
            )
        )
    return tuple(groups)


def distinct_nodes(groups: Sequence[Group]) -> tuple[int, ...]:
    """All nodes of all groups, ascending and distinct (a shared node counts once)."""
    return tuple(sorted({node for group in groups for node in group.nodes}))


def lagrange_weights(
    node_times: Sequence[float] | Tensor, at_times: Sequence[float] | Tensor
) -> Tensor:
    """``L_j(t)`` for each query time (rows) and node (columns), float64 ``[Q, M]``.

    ``L_j(t) = prod_{m != j} (t - t_m) / (t_j - t_m)``: the Lagrange basis in *time* on the
    node times, so non-uniform grids are interpolated correctly. At a node time the row is
    exactly one-hot (a zero factor and factors ``x / x = 1``). Node times must be distinct.
    """
    nodes = torch.as_tensor(node_times, dtype=torch.float64).reshape(-1)
    query = torch.as_tensor(at_times, dtype=torch.float64).reshape(-1)
    count = nodes.numel()
    if count == 0:
        raise InvalidValue("lagrange_weights needs at least one node")
    if torch.unique(nodes).numel() != count:
        raise InvalidValue(f"node times must be distinct, got {nodes.tolist()}")
    weights = torch.ones(query.numel(), count, dtype=torch.float64)
    for j in range(count):
        for m in range(count):
            if m != j:
                weights[:, j] *= (query - nodes[m]) / (nodes[j] - nodes[m])
    return weights


def lagrange_rows(node_times: Sequence[float], at_times: Sequence[float]) -> list[list[float]]:
    """:func:`lagrange_weights` as host floats, ``[Q][M]``, with no tensor op (the same
    float64 arithmetic in the same order, so the same values): jagg's per-call bookkeeping
    reads them as floats, and a tensor per group would cost an op and a sync each."""
    nodes = [float(t) for t in node_times]
    if not nodes:
        raise InvalidValue("lagrange_weights needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise InvalidValue(f"node times must be distinct, got {nodes}")
    rows = []
    for query in at_times:
        q = float(query)
        row = [1.0] * len(nodes)
        for j, node_j in enumerate(nodes):
            for m, node_m in enumerate(nodes):
                if m != j:
                    row[j] *= (q - node_m) / (node_j - node_m)
        rows.append(row)
    return rows
