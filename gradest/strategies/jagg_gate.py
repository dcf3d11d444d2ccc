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


def group_cosine(
    group: Group,
    weights: Tensor,
    velocities: Sequence[Tensor],
    aggregate: str,
    on_device: bool = False,
) -> float | Tensor | None:
    """The aggregated cosine of ``group`` (None for an exact group or ``aggregate="off"``).

    ``on_device=True`` returns it as a 0-dim tensor (no host sync), for deciding every
    group at once (:func:`host_cosines`).

    Args:
        group: the group's steps and nodes.
        weights: ``[len(steps), len(nodes)]`` Lagrange weights ``L_j(t_k)``.
        velocities: every step's velocity ``[B, ...]``, indexed by step.
        aggregate: ``"min"``, ``"mean"`` or ``"off"``.
    """
    if aggregate == "off" or group.is_exact:
        return None
    rows = [row for row, k in enumerate(group.steps) if k not in group.nodes]
    reference = velocities[group.steps[0]]
    # The gate decides exact vs approximate: compute it in float32 or better even under
    # autocast, which would otherwise run the interpolation einsum in bfloat16.
    with torch.autocast(device_type=reference.device.type, enabled=False):
        dtype = torch.promote_types(reference.dtype, torch.float32)
        batch = reference.shape[0]
        node_v = torch.stack([velocities[j] for j in group.nodes]).to(dtype)
        actual = torch.stack([velocities[group.steps[row]] for row in rows]).to(dtype)
        predicted = torch.einsum(
            "qm,mbd->qbd",
            weights[rows].to(dtype=dtype, device=node_v.device),
            node_v.reshape(len(group.nodes), batch, -1),
        )
        actual = actual.reshape(len(rows), batch, -1)
        cosine = (actual * predicted).sum(-1) / (
            actual.norm(dim=-1) * predicted.norm(dim=-1) + COSINE_EPS
        )
        value = cosine.min() if aggregate == "min" else cosine.mean()
        return value if on_device else float(value)


def host_cosines(cosines: Sequence[float | Tensor | None]) -> list[float | None]:
    """Every group's cosine as a float, in one transfer for all device values."""
    tensors = [c for c in cosines if isinstance(c, Tensor)]
    if not tensors:
        return [c if c is None else float(c) for c in cosines]
    device = tensors[0].device
    values = iter(
        torch.stack([c.to(device=device, dtype=torch.float64) for c in tensors]).tolist()
    )
    return [next(values) if isinstance(c, Tensor) else c for c in cosines]
