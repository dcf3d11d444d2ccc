"""``jagg``: endpoint-Jacobian aggregation, ``sum_k J_k^T c_k`` with interpolated ``J_k``.

Cotangents: exact ``c_k`` (terminal: from an adjoint sweep of state-only VJPs; stepwise:
``d l_k / d v_k``). VJP evaluation: the steps are cut into groups of ``window`` consecutive
steps; inside a group the parameter Jacobian is interpolated in time from a few nodes,
``J_{t_k} ~= sum_j L_j(t_k) J_{t_j}`` (Lagrange basis on ``order + 1`` nodes), so

    sum_{k in group} J_k^T c_k  ~=  sum_j J_{t_j}^T G_j,   G_j = sum_{k in group} L_j(t_k) c_k,

and only the nodes need a parameter VJP, all of them in one batched call. The layout of
groups and nodes is in :mod:`gradest.strategies.jagg_layout`.

Gate: for each group, the same interpolation predicts the velocities,
``v^_k = sum_j L_j(t_k) v_{t_j}``, and the per-sample cosine
``<v_k, v^_k> / (|v_k| |v^_k| + 1e-8)`` (flattened non-batch dimensions, at least float32)
is aggregated with ``min`` or ``mean`` over the group's interpolated steps (its steps that
are not nodes: at a node the prediction is ``v_k`` itself, and counting it would only pull a
mean towards 1) and its samples. A group passes iff the aggregate is ``>= tau``; a failing
group falls back to exact per-step VJPs for all its steps. The gate reads only detached
velocities, so it never changes the gradient of a passing group. Groups in which every
step is a node are exact, never gated, and report ``None`` as their cosine; ``gate="off"``
reports ``None`` everywhere.

Cost (DESIGN.md section 4, ``F`` = one forward, a parameter VJP ``~2F``, a state-only VJP
``~F``; ``n`` = distinct node steps, ``f`` = steps of failing groups that are not nodes):

* stepwise (GRPO / policy-gradient surrogates, flow matching): ``N - n`` forwards without a
  graph for the cotangents and the gate (reused from the rollout when sampling from
  ``noise``, which costs ``NF`` itself), ``n`` forwards with a graph and one batched VJP at
  the nodes: ``NF + 2nF``, plus ``f(F + 2F)`` for fallbacks (their graph forward is a second
  batched call, since the gate needs the node forwards first). The node graphs are held
  together until the batched VJP: activations of ``n`` steps. Exact costs ``N(F + 2F)``;
  at order 1, ``n = 2N/W`` (or ``N/W + 1`` with shared knots): 1.5x fewer model units at
  ``W=4``, 2x with shared knots. This is where ``jagg`` pays.
* terminal: the adjoint ``a_k`` is still exact, so every step needs a state VJP:
  (rollout ``NF`` from ``noise``) + sweep ``N(F + F)`` + nodes ``n(F + 2F)``. That is **not**
  cheaper than ``exact`` from noise (``3NF``, fused chain); on a recorded trajectory, or
  against checkpointed exact (``4NF`` from noise), it saves only when ``n < N/3``. The
  batched node VJP holds the graphs of ``n`` steps at once. Prefer ``exact`` (or ``sdo`` /
  ``truncated`` when biased cotangents are acceptable) for terminal rewards; the noise
  gradient is the sweep's exact ``a_0``.

Error: order ``p`` interpolation of a smooth ``J_t`` errs by ``O(span^(p+1))`` over a
group spanning ``span`` in time; it is exact when ``J_t`` is a polynomial of degree ``<= p``
in ``t`` along the path (an affine model on a straight path, order 1), and with
``window=2, order=1, shared_knots=False`` (every step is a node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.objectives import Objective
from gradest.options import bool_option, choice_option, int_option, option
from gradest.protocol import Decisions, Definition
from gradest.reference.dense import DenseChain, exact_noise_grad
from gradest.reference.jagg_definition import jagg_definition
from gradest.strategies.jagg_layout import Group, distinct_nodes, lagrange_weights, layout_groups
from gradest.vjp import ParamGradient, add_grads

GATES = ("min", "mean", "off")
# Added to |v| |v^| in the gate's cosine, as in the JAGG proposal: a zero velocity gives
# cosine 0 (fail) instead of NaN.
COSINE_EPS = 1e-8


@attrs.frozen
class JaggDecisions(Decisions):
    """Where ``jagg`` put its groups and nodes, and which groups failed the gate.

    Attributes:
        groups: the steps of each group.
        nodes: the interpolation nodes of each group.
        fallback_groups: indices of the groups that fell back to exact per-step VJPs.
    """

    groups: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]
    fallback_groups: tuple[int, ...]


@attrs.frozen(eq=False)
class _Plan:
    """What the gate decided and which cotangent each evaluated step receives."""

    cotangents: dict[int, Tensor]
    cosines: list[float | None]
    fallback_groups: list[int]


@attrs.frozen
class Jagg(EstimatorBase):
    """Endpoint-Jacobian aggregation: parameter VJPs at a few nodes per group of steps.

    Attributes:
        window: steps per group (>= 2). Larger windows mean fewer node VJPs and a larger
            interpolation error (``O(span^(order+1))``).
        order: interpolation order, ``1 <= order < window``; order 1 interpolates linearly
            between a group's two endpoints.
        tau: gate threshold in ``[-1, 1]`` on the aggregated cosine between the actual and
            the interpolated velocities; a group below it falls back to exact VJPs.
        gate: ``"min"`` or ``"mean"`` over the group's interpolated steps and samples, or
            ``"off"`` (never fall back).
        shared_knots: adjacent groups share their boundary node (about ``N/window + 1``
            node VJPs at order 1 instead of ``2N/window``).
    """

    name: ClassVar[str] = "jagg"

    window: int = int_option(
        4,
        minimum=2,
        doc="steps per group; Jacobians inside a group are interpolated from its nodes",
    )
    order: int = int_option(
        1,
        minimum=1,
        doc="Lagrange interpolation order in time (1 = the two endpoints); 1 <= order < window",
        expect="an int with 1 <= order < window",
    )
    tau: float = option(
        0.995,
        kind=float,
        doc="gate threshold on the cosine of actual vs interpolated velocities",
        valid=lambda value: -1.0 <= value <= 1.0,
        expect="a float in [-1, 1]",
    )
    gate: str = choice_option(
        "min", GATES, doc="aggregate the gate cosines with min or mean, or switch the gate off"
    )
    shared_knots: bool = bool_option(
        False,
        doc="adjacent groups share boundary nodes (~N/window+1 node VJPs instead of 2N/window)",
    )

    def __attrs_post_init__(self) -> None:
        if self.order >= self.window:
            raise InvalidValue(
                f"estimator 'jagg': option order={self.order} must be < window={self.window} "
                f"(a group of {self.window} steps has room for at most order {self.window - 1} "
                f"interpolation); lower order or raise window"
            )

    # -- the two objectives ---------------------------------------------------------------

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        # The adjoint stays exact, so every step takes a state-only VJP; skipping the
        # parameter part of those VJPs is the whole saving.
        sweep = ctx.adjoint_sweep(ctx.terminal_adjoint())
        groups = layout_groups(ctx.num_steps, self.window, self.order, self.shared_knots)
        plan = self._plan(ctx, groups, list(sweep.velocities), list(sweep.cotangents))
        steps = sorted(plan.cotangents)
        trajectory = ctx.trajectory()
        grads = ctx.field.param_vjp(
            trajectory.states[steps],
            ctx.times[steps],
            torch.stack([plan.cotangents[k] for k in steps]),
        )
        self._report(ctx, groups, plan)
        return grads, sweep.state_grad

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        trajectory = ctx.trajectory()
        groups = layout_groups(ctx.num_steps, self.window, self.order, self.shared_knots)
        nodes = list(distinct_nodes(groups))
        # Node forwards keep their graph: they give the node velocities (cotangents, gate)
        # now and take the aggregated cotangents G_j later, in one batched VJP.
        node_velocities, pull_nodes = ctx.field.param_pullback(
            trajectory.states[nodes], ctx.times[nodes]
        )
        row_of = {k: row for row, k in enumerate(nodes)}
        velocities = [
            node_velocities[row_of[k]] if k in row_of else ctx.velocity(k)
            for k in range(ctx.num_steps)
        ]
        cotangents = [ctx.step_cotangent(k, velocities[k]) for k in range(ctx.num_steps)]
        plan = self._plan(ctx, groups, velocities, cotangents)
        grads = pull_nodes(torch.stack([plan.cotangents[k] for k in nodes]))
        # Steps of failing groups that are not nodes have no graph yet: one more batched
        # forward with graph and VJP over all of them.
        extra = [k for k in sorted(plan.cotangents) if k not in row_of]
        if extra:
            grads = add_grads(
                grads,
                ctx.field.param_vjp(
                    trajectory.states[extra],
                    ctx.times[extra],
                    torch.stack([plan.cotangents[k] for k in extra]),
                ),
            )
        self._report(ctx, groups, plan)
        return grads

    # -- gate and node cotangents ---------------------------------------------------------

    def _plan(
        self,
        ctx: EstimationContext,
        groups: Sequence[Group],
        velocities: Sequence[Tensor],
        cotangents: Sequence[Tensor],
    ) -> _Plan:
        """Gate each group, then route its cotangents: ``G_j`` to the nodes if it passes,
        each ``c_k`` to its own step if it falls back."""
        times = ctx.times
        # Every node is evaluated (the stepwise graph exists before the gate decides).
        totals: dict[int, Tensor] = {
            k: torch.zeros_like(cotangents[k]) for k in distinct_nodes(groups)
        }
        weights_of = [
            lagrange_weights(times[list(group.nodes)], times[list(group.steps)]) for group in groups
        ]
        cosines = [
            self._gate_cosine(group, weights, velocities)
            for group, weights in zip(groups, weights_of, strict=True)
        ]
        # Data-parallel ranks gate on the union of their samples (gradest.ranks), so every
        # rank falls back in the same groups and makes the same model calls.
        batch = velocities[0].shape[0]
        cosines = ctx.ranks.gate(
            cosines,
            [batch * sum(k not in g.nodes for k in g.steps) for g in groups],
            self.gate,
        )
        fallback_groups: list[int] = []
        for index, (group, weights, cosine) in enumerate(
            zip(groups, weights_of, cosines, strict=True)
        ):
            # ``not >=`` so that a NaN cosine (non-finite velocities) falls back too.
            if cosine is not None and not cosine >= self.tau:
                fallback_groups.append(index)
                for k in group.steps:
                    totals[k] = totals[k] + cotangents[k] if k in totals else cotangents[k]
                continue
            for column, node in enumerate(group.nodes):
                node_cotangent = sum(
                    (
                        float(weights[row, column]) * cotangents[k]
                        for row, k in enumerate(group.steps)
                    ),
                    start=torch.zeros_like(cotangents[node]),
                )
                totals[node] = totals[node] + node_cotangent
        return _Plan(cotangents=totals, cosines=cosines, fallback_groups=fallback_groups)

    def _gate_cosine(
        self, group: Group, weights: Tensor, velocities: Sequence[Tensor]
    ) -> float | None:
        """Aggregated cosine between ``v_k`` and ``v^_k`` over interpolated steps and samples."""
        if self.gate == "off" or group.is_exact:
            return None
        rows = [row for row, k in enumerate(group.steps) if k not in group.nodes]
        reference = velocities[group.steps[0]]
        # The gate decides exact vs approximate: compute it in float32 or better even under
        # autocast, which would otherwise run the interpolation einsum in bfloat16.
        with torch.autocast(device_type=reference.device.type, enabled=False):
            return self._aggregate_cosine(group, weights, velocities, rows, reference)

    def _aggregate_cosine(
        self,
        group: Group,
        weights: Tensor,
        velocities: Sequence[Tensor],
        rows: list[int],
        reference: Tensor,
    ) -> float:
        dtype = torch.promote_types(reference.dtype, torch.float32)
        batch = reference.shape[0]
        node_v = (
            torch.stack([velocities[j] for j in group.nodes])
            .to(dtype)
            .reshape(len(group.nodes), batch, -1)
        )
        actual = (
            torch.stack([velocities[group.steps[row]] for row in rows])
            .to(dtype)
            .reshape(len(rows), batch, -1)
        )
        predicted = torch.einsum(
            "qm,mbd->qbd", weights[rows].to(dtype=dtype, device=node_v.device), node_v
        )
        cosine = (actual * predicted).sum(-1) / (
            actual.norm(dim=-1) * predicted.norm(dim=-1) + COSINE_EPS
        )
        aggregate = cosine.min() if self.gate == "min" else cosine.mean()
        return float(aggregate)

    def _report(self, ctx: EstimationContext, groups: Sequence[Group], plan: _Plan) -> None:
        ctx.decide(
            JaggDecisions(
                groups=tuple(tuple(group.steps) for group in groups),
                nodes=tuple(tuple(group.nodes) for group in groups),
                fallback_groups=tuple(plan.fallback_groups),
            )
        )
        ctx.info.update(
            gate_cosines=plan.cosines,
            fallback_fraction=len(plan.fallback_groups) / len(groups),
            node_steps=sorted(plan.cotangents),
        )

    # -- the contract -----------------------------------------------------------------------

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: JaggDecisions
    ) -> Definition:
        """The interpolated sum for the reported groups, nodes and gate outcomes; the noise
        gradient is the exact ``a_0`` (the adjoint sweep is exact)."""
        failed = set(decisions.fallback_groups)
        passed = [index not in failed for index in range(len(decisions.groups))]
        return Definition(
            grad=jagg_definition(chain, objective, decisions.groups, decisions.nodes, passed),
            noise_grad=exact_noise_grad(chain, objective),
        )
