"""The ``jagg`` estimator's definition, computed densely and independently of its code path.

Given a layout (groups, their nodes, and which groups passed the gate; take them from a
result's ``info`` to check a run), the definition is

    grad = sum_{passing groups} sum_{k in group} (sum_j L_j(t_k) J_{t_j})^T c_k
         + sum_{failing groups} sum_{k in group} J_k^T c_k

with the dense Jacobians of :class:`~gradest.reference.dense.DenseChain` and the exact
cotangents. It interpolates the Jacobians themselves (the estimator interpolates the
cotangents onto the nodes instead), and computes the Lagrange basis with its own formula
(barycentric weights), so it shares no code with :mod:`gradest.strategies.jagg`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradest.errors import InvalidValue
from gradest.objectives import Objective
from gradest.reference.dense import DenseChain, exact_cotangents


def _basis(node_times: Tensor, t: float) -> Tensor:
    """Lagrange basis values ``L_j(t)`` through the barycentric form.

    ``L_j(t) = ell(t) w_j / (t - t_j)`` with ``ell(t) = prod_m (t - t_m)`` and
    ``w_j = 1 / prod_{m != j} (t_j - t_m)``; at a node time the basis is one-hot.
    """
    hits = (node_times == t).nonzero()
    if hits.numel():
        basis = torch.zeros_like(node_times)
        basis[int(hits[0])] = 1.0
        return basis
    differences = node_times[:, None] - node_times[None, :]
    differences.fill_diagonal_(1.0)
    barycentric = 1.0 / differences.prod(dim=1)
    return torch.prod(t - node_times) * barycentric / (t - node_times)


def jagg_definition(
    chain: DenseChain,
    objective: Objective,
    groups: Sequence[Sequence[int]],
    nodes: Sequence[Sequence[int]],
    passed: Sequence[bool],
    *,
    debias_steps: Sequence[int] = (),
    debias_scale: float = 0.0,
) -> Tensor:
    """The ``jagg`` gradient as a flat ``[P]`` vector (``chain.unflatten`` keys it by name).

    ``sum_k J^_k^T c_k`` with ``J^_k`` the group's interpolation (``J_k`` itself in a group
    that failed the gate), plus ``debias_scale * sum_{k in debias_steps} (J_k - J^_k)^T c_k``.

    Args:
        chain: dense Jacobians of the recorded trajectory.
        objective: terminal or stepwise; its exact cotangents are used.
        groups: the steps of each group (every step in exactly one group).
        nodes: the interpolation nodes of each group.
        passed: per group, whether it passed the gate (False: exact per-step Jacobians).
        debias_steps: the steps drawn for the correction; ``debias_scale`` its factor.
    """
    if not len(groups) == len(nodes) == len(passed):
        raise InvalidValue(
            f"groups, nodes and passed need one entry per group, got lengths "
            f"{len(groups)}, {len(nodes)}, {len(passed)}"
        )
    covered = sorted(k for steps in groups for k in steps)
    if covered != list(range(chain.num_steps)):
        raise InvalidValue(
            f"groups must cover steps 0..{chain.num_steps - 1} once each, got {covered}"
        )
    cotangents = exact_cotangents(chain, objective)
    times = chain.trajectory.times.to(torch.float64)
    jacobians = chain.param_jacobians
    total = torch.zeros(jacobians.shape[-1], dtype=torch.float64)
    interpolated: dict[int, Tensor] = {}
    for steps, group_nodes, ok in zip(groups, nodes, passed, strict=True):
        node_times = times[list(group_nodes)]
        for k in steps:
            if ok:
                basis = _basis(node_times, float(times[k]))
                jacobian = torch.einsum("j,jdp->dp", basis, jacobians[list(group_nodes)])
            else:
                jacobian = jacobians[k]
            interpolated[k] = jacobian
            total = total + jacobian.T @ cotangents[k]
    for k in debias_steps:
        total = total + debias_scale * (jacobians[k] - interpolated[k]).T @ cotangents[k]
    return total


def jagg_gate_cosines(
    chain: DenseChain,
    groups: Sequence[Sequence[int]],
    nodes: Sequence[Sequence[int]],
    times: Tensor,
    aggregate: str,
) -> list[float | None]:
    """Per group, the gate's aggregated cosine between ``v_k`` and ``sum_j L_j(t_k) v_{t_j}``.

    Per sample (flattened state), ``<v, v^> / (|v| |v^| + 1e-8)`` over the group's steps that
    are not nodes, aggregated with ``"min"`` or ``"mean"`` over those steps and the samples;
    None for a group whose steps are all nodes (nothing is interpolated).
    """
    if aggregate not in ("min", "mean"):
        raise InvalidValue(f"aggregate must be 'min' or 'mean', got {aggregate!r}")
    batch = chain.trajectory.batch_size
    times = times.to(torch.float64)
    velocities = chain.velocities.to(torch.float64).reshape(chain.num_steps, batch, -1)
    out: list[float | None] = []
    for steps, group_nodes in zip(groups, nodes, strict=True):
        interpolated = [k for k in steps if k not in group_nodes]
        if not interpolated:
            out.append(None)
            continue
        node_times = times[list(group_nodes)]
        values = []
        for k in interpolated:
            basis = _basis(node_times, float(times[k]))
            predicted = torch.einsum("j,jbd->bd", basis, velocities[list(group_nodes)])
            actual = velocities[k]
            for sample in range(batch):
                a, p = actual[sample], predicted[sample]
                values.append(float(a @ p) / (float(a.norm()) * float(p.norm()) + 1e-8))
        out.append(min(values) if aggregate == "min" else sum(values) / len(values))
    return out
