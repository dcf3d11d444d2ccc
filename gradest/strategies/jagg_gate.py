"""``jagg``'s gate: does the group's interpolation predict its velocities?

For each group the interpolation that ``jagg`` applies to Jacobians predicts the
velocities, ``v^_k = sum_j L_j(t_k) v_{t_j}``, and the per-sample cosine
``<v_k, v^_k> / (|v_k| |v^_k| + 1e-8)`` (flattened non-batch dimensions, at least float32) is
aggregated with ``min`` or ``mean`` over the group's interpolated steps (its steps that
are not nodes: at a node the prediction is ``v_k`` itself, and counting it would only pull
a mean towards 1) and its samples. Groups in which every step is a node are exact and
not gated (``None``). The gate reads only detached velocities.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradest.strategies.jagg_layout import Group

# Added to |v| |v^| in the gate's cosine, as in the JAGG proposal: a zero velocity gives
# cosine 0 (fail) instead of NaN.
COSINE_EPS = 1e-8


def interpolated_count(group: Group, batch: int) -> int:
    """How many cosines the group's aggregate is taken over (steps x samples)."""
    return batch * len(group.interpolated_steps)


def gate_cosines(
    groups: Sequence[Group],
    weights: Sequence[Sequence[Sequence[float]]],
    velocities: Tensor | Sequence[Tensor],
    aggregate: str,
) -> list[float | None]:
    """Every group's aggregated cosine of actual to interpolated velocities as a host
    float, or None (an exact group, or ``aggregate="off"``).

    Groups with the same number of interpolated steps and nodes (all but a shorter last
    group, usually) are evaluated together, a handful of ops for all of them instead of a
    dozen per group, and every value comes back in one transfer.

    Args:
        groups: the layout.
        weights: per group, the host Lagrange weights ``[len(steps)][len(nodes)]``.
        velocities: every step's velocity ``[B, ...]``, indexed by step (a list, or the
            stacked ``[N, B, ...]`` tensor).
        aggregate: ``"min"``, ``"mean"`` or ``"off"``.
    """
    out: list[float | None] = [None] * len(groups)
    if aggregate == "off":
        return out
    buckets: dict[tuple[int, int], list[int]] = {}
    for index, group in enumerate(groups):
        if not group.is_exact:
            shape = (len(group.interpolated_steps), len(group.nodes))
            buckets.setdefault(shape, []).append(index)
    if not buckets:
        return out
    reference = velocities[0]
    batch = reference.shape[0]
    device = reference.device
    # The gate decides exact vs approximate: compute it in float32 or better even under
    # autocast, which would otherwise run the interpolation einsum in bfloat16.
    with torch.autocast(device_type=device.type, enabled=False):
        dtype = torch.promote_types(reference.dtype, torch.float32)
        stacked = velocities if isinstance(velocities, Tensor) else torch.stack(list(velocities))
        stacked = stacked.reshape(stacked.shape[0], batch, -1)
        order: list[int] = []
        values = []
        for members in buckets.values():
            rows = [
                [row for row, k in enumerate(groups[i].steps) if k not in groups[i].nodes]
                for i in members
            ]
            steps = [
                [groups[i].steps[row] for row in r] for i, r in zip(members, rows, strict=True)
            ]
            nodes = [list(groups[i].nodes) for i in members]
            w = torch.tensor(
                [[weights[i][row] for row in r] for i, r in zip(members, rows, strict=True)],
                dtype=dtype,
                device=device,
            )
            count, (q, m) = len(members), (len(steps[0]), len(nodes[0]))
            positions = [k for r in steps for k in r] + [j for r in nodes for j in r]
            at = torch.tensor(positions, device=device)  # one transfer for both
            actual = stacked[at[: count * q].reshape(count, q)].to(dtype)  # [G, q, B, D]
            node_v = stacked[at[count * q :].reshape(count, m)].to(dtype)  # [G, m, B, D]
            predicted = torch.einsum("gqm,gmbd->gqbd", w, node_v)
            cosine = (actual * predicted).sum(-1) / (
                actual.norm(dim=-1) * predicted.norm(dim=-1) + COSINE_EPS
            )
            per_group = cosine.reshape(count, -1)
            values.append(per_group.amin(1) if aggregate == "min" else per_group.mean(1))
            order.extend(members)
        host = (values[0] if len(values) == 1 else torch.cat(values)).to(torch.float64).tolist()
    for position, value in zip(order, host, strict=True):
        out[position] = value
    return out
