"""``jagg``: endpoint-Jacobian aggregation, ``sum_k J_k^T c_k`` with interpolated ``J_k``.

Cotangents: exact ``c_k`` (terminal: from an adjoint sweep of state-only VJPs; stepwise:
``d l_k / d v_k``). VJP evaluation: the steps are cut into groups of ``window`` consecutive
steps; inside a group the parameter Jacobian is interpolated in time from a few nodes,
``J_{t_k} ~= sum_j L_j(t_k) J_{t_j}`` (Lagrange basis on ``order + 1`` nodes), so

    sum_{k in group} J_k^T c_k  ~=  sum_j J_{t_j}^T G_j,   G_j = sum_{k in group} L_j(t_k) c_k,

and only the nodes need a parameter VJP, all of them in one batched call. The layout of
groups and nodes is in :mod:`gradest.strategies.jagg_layout`. Memory: terminal keeps every
step's graph from sampling, or recomputes each step with ``checkpoint=True``. (The record:
``Jagg.axes``, :class:`gradest.axes.EstimatorAxes`.)

Gate (:mod:`gradest.strategies.jagg_gate`): the same interpolation predicts each group's
velocities; the cosine between actual and predicted velocities, aggregated with ``min``
or ``mean``, must be ``>= tau``, else the group falls back to exact per-step VJPs for all
its steps. The gate reads only detached velocities, so it never changes the gradient of a
passing group; ``gate="off"`` never falls back.

Debiasing (``debias=m``): ``m`` steps ``S`` are drawn uniformly without replacement (from
the generator) and ``(N/m) sum_{k in S} (J_k - J^_k)^T c_k`` is added, ``J^_k`` the
group's interpolation (zero at nodes and in groups that fell back, where ``J^_k = J_k``).
Every step is in ``S`` with probability ``m/N``, so the expectation is the **exact**
gradient: the interpolation's bias is traded for variance, and the gate becomes optional.
The ``-J^_k^T c_k`` part is folded into the node cotangents (``G_j -= (N/m) L_j(t_k) c_k``),
so the cost is the nodes plus at most ``m`` parameter VJPs.

Cost: the ``jagg`` rows of the cost model (docs/design.md#cost-formulas), with ``n`` the
distinct node steps. The work:

* stepwise (GRPO / policy-gradient surrogates, flow matching): forwards without a graph
  for the cotangents and the gate at the non-node steps (reused from the rollout when
  sampling from ``noise``), ``n`` forwards with a graph and one batched VJP at the nodes,
  plus a forward with graph and a VJP for each non-node step of a failing group (their
  graph forward is a second batched call, since the gate needs the node forwards first).
  The node graphs are held together until the batched VJP: activations of ``n`` steps.
  This is where ``jagg`` pays.
* terminal (fused, the default with the autograd engine): the chain is sampled with each
  step's graph kept, the exact adjoint is swept with state-only backward passes through
  those graphs (no forward), and one backward over the kept node graphs gives the
  parameter part. It holds every step's activations after sampling, as ``exact`` does.
  The noise gradient is the sweep's exact ``a_0``. On a recorded trajectory the graphs are
  those of one forward per recorded state.
* terminal with ``checkpoint=True`` (or ``engine="func"``): a no-graph rollout (from
  ``noise``), a sweep recomputing each step and a batched node VJP, holding one step's
  graph during the sweep and the ``n`` node graphs at the end.

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

from gradest._checks import is_symbolic
from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.objectives import Objective
from gradest.options import (
    at_most_steps,
    bool_option,
    choice_option,
    int_option,
    option,
)
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import jagg_fallbacks, jagg_layout, replay_subset
from gradest.reference.dense import DenseChain, exact_noise_grad
from gradest.reference.jagg import jagg_definition
from gradest.strategies.jagg_gate import gate_cosines, interpolated_count
from gradest.strategies.jagg_layout import Group, distinct_nodes, lagrange_rows, layout_groups
from gradest.strategies.sampling import draw_steps
from gradest.vjp import ParamGradient, add_grads

GATES = ("min", "mean", "off")


@attrs.frozen
class JaggDecisions(Decisions):
    """Where ``jagg`` put its groups and nodes, which groups failed the gate, and which
    steps it drew to debias.

    Attributes:
        groups: the steps of each group.
        nodes: the interpolation nodes of each group.
        fallback_groups: indices of the groups that fell back to exact per-step VJPs.
        debias_steps: the steps ``S`` drawn for the correction (empty without ``debias``).
        debias_scale: ``N/m`` (0 without ``debias``).
    """

    groups: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]
    fallback_groups: tuple[int, ...]
    debias_steps: tuple[int, ...] = ()
    debias_scale: float = 0.0


@attrs.frozen(eq=False)
class _Plan:
    """The layout, the gate's outcome, the debiasing draw, and where each cotangent goes."""

    groups: tuple[Group, ...]
    weights: list[list[list[float]]]  # per group: [len(steps)][len(nodes)] L_j(t_k), host
    cosines: list[float | None]
    fallback_groups: list[int]
    debias_steps: list[int]
    debias_scale: float

    def corrected(self) -> list[int]:
        """Drawn steps whose Jacobian is interpolated (the others' correction is zero)."""
        failed = {k for g in self.fallback_groups for k in self.groups[g].steps}
        nodes = set(distinct_nodes(self.groups))
        return [k for k in self.debias_steps if k not in failed and k not in nodes]

    def evaluated(self) -> list[int]:
        """Steps that take a parameter VJP: nodes, fallback steps, corrected steps."""
        steps = set(distinct_nodes(self.groups))
        for index in self.fallback_groups:
            steps.update(self.groups[index].steps)
        steps.update(self.corrected())
        return sorted(steps)

    def routing(self) -> list[list[tuple[int, float]]]:
        """Per evaluated step (in :meth:`evaluated` order), the ``(step k, weight)`` terms
        of its cotangent ``sum w c_k``: ``G_j`` at nodes of passing groups, ``c_k`` at the
        steps of failing groups, and the debiasing terms (``+s c_k`` at the drawn step,
        ``-s L_j(t_k) c_k`` at its group's nodes). Host floats, in the order the terms
        are summed."""
        position = {k: i for i, k in enumerate(self.evaluated())}
        terms: list[list[tuple[int, float]]] = [[] for _ in position]
        failed = set(self.fallback_groups)
        group_of = {k: index for index, group in enumerate(self.groups) for k in group.steps}
        for index, group in enumerate(self.groups):
            if index in failed:
                for k in group.steps:
                    terms[position[k]].append((k, 1.0))
                continue
            for column, node in enumerate(group.nodes):
                for row, k in enumerate(group.steps):
                    terms[position[node]].append((k, self.weights[index][row][column]))
        for k in self.corrected():
            group = self.groups[group_of[k]]
            row = group.steps.index(k)
            terms[position[k]].append((k, self.debias_scale))
            for column, node in enumerate(group.nodes):
                weight = self.weights[group_of[k]][row][column]
                terms[position[node]].append((k, -weight * self.debias_scale))
        return terms

    def route(self, cotangents: Tensor) -> Tensor:
        """The evaluated steps' cotangents ``[len(evaluated), B, ...]`` (see :meth:`routing`)
        from every step's ``cotangents [N, B, ...]``.

        Vectorized over the evaluated steps: with the steps ordered by their number of
        terms, the ``i``-th terms of all steps that have one are a prefix, added in one
        gather and one ``addcmul_`` (a few ops per term slot, about ``window`` slots, not
        two per (node, step) pair), each step's terms in the order of :meth:`routing`.
        In-place adds on disjoint rows: deterministic on every device. Elementwise work
        only: no matmul to count as FLOPs.
        """
        terms = self.routing()
        order = sorted(range(len(terms)), key=lambda row: -len(terms[row]))  # stable
        flat = cotangents.reshape(cotangents.shape[0], -1)
        steps: list[int] = []
        weights: list[float] = []
        counts: list[int] = []
        for slot in range(len(terms[order[0]])):
            rows = [row for row in order if slot < len(terms[row])]  # a prefix of order
            counts.append(len(rows))
            steps += [terms[row][slot][0] for row in rows]
            weights += [terms[row][slot][1] for row in rows]
        device = cotangents.device
        index = torch.tensor(steps, device=device)
        scale = torch.tensor(weights, dtype=cotangents.dtype, device=device)[:, None]
        totals = scale[: counts[0]] * flat[index[: counts[0]]]
        start = counts[0]
        for count in counts[1:]:
            part = slice(start, start + count)
            totals[:count].addcmul_(scale[part], flat[index[part]])
            start += count
        if order != list(range(len(terms))):
            inverse = [0] * len(order)
            for position, row in enumerate(order):
                inverse[row] = position
            totals = totals[inverse]
        return totals.reshape(len(terms), *cotangents.shape[1:])


@attrs.frozen
class Jagg(EstimatorBase):
    """Endpoint-Jacobian aggregation: parameter VJPs at a few nodes per group of steps.

    Preferred for stepwise objectives (a loss on every step's velocity: Flow-GRPO, flow
    matching) on paths smooth enough for its gate, where about ``2N/window`` parameter VJPs
    replace ``N``; ``debias=m`` makes it unbiased for the exact gradient. Not recommended for
    a terminal reward: its exact state adjoint keeps its FLOPs at or above exact's on the
    shipped models (docs/design.md#cost-formulas); nor on stochastic (SDE) paths, where its
    gate falls back to exact on every group, at a higher cost than exact.

    Source: endpoint-Jacobian aggregation (arXiv 2607.17572).

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
        debias: ``m >= 1`` draws ``m`` steps per call and adds their interpolation error,
            scaled by ``N/m``: unbiased for the exact gradient (0: off).
        checkpoint: terminal objectives recompute each step in the adjoint sweep instead
            of keeping every step's graph from sampling (more forwards, one step's graph).
    """

    name: ClassVar[str] = "jagg"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = (
        "jagg:window=2,order=1",
        "jagg:window=4,shared_knots=true",
        "jagg:window=4,order=2,gate=off",
        "jagg:debias=2,tau=0.5",
    )
    compare_specs: ClassVar[tuple[str, ...]] = (
        "jagg:window=4",
        "jagg:window=4,debias=2",
        "jagg:window=4,shared_knots=true",
    )
    cost_specs: ClassVar[tuple[str, ...]] = ("jagg:gate=off",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="exact adjoint (terminal: a sweep of state-only VJPs; stepwise: c_k)",
        evaluation="Jacobians interpolated in time from a few nodes per window of steps, one "
        "batched VJP at the nodes; a cosine gate falls back to one VJP per step; debias=m "
        "adds m uniformly drawn steps' corrections, scaled N/m",
        memory="terminal: graph of every step kept from sampling (checkpoint=True: recompute "
        "each step in the sweep, one step's graph, then the node graphs); stepwise: the "
        "node graphs",
    )

    window: int = int_option(
        4, minimum=2, doc="steps per group; Jacobians in a group are interpolated from its nodes"
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
    debias: int = int_option(
        0,
        minimum=0,
        doc="steps drawn per call to correct the interpolation (unbiased; 0: off)",
        expect="an int >= 0 (and at most the number of sampler steps N)",
    )
    checkpoint: bool = bool_option(
        False, doc="terminal: recompute steps in the sweep instead of keeping their graphs"
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
        debias_steps = self._draw_debias(ctx)
        if self.checkpoint or ctx.field.engine == "func":
            return self._terminal_recomputing(ctx, debias_steps)
        chain = ctx.retained_chain()
        plan = self._plan(ctx, chain.velocities, debias_steps)
        # The adjoint stays exact: a state-only backward through every step's kept graph;
        # the graphs of the steps that take a parameter VJP stay for the one backward.
        evaluated = plan.evaluated()
        sweep = ctx.adjoint_sweep(ctx.terminal_adjoint(), chain=chain, keep=frozenset(evaluated))
        grads = chain.param_vjp(evaluated, plan.route(sweep.cotangents))
        self._report(ctx, plan)
        return grads, sweep.state_grad

    def _terminal_recomputing(
        self, ctx: EstimationContext, debias_steps: list[int]
    ) -> tuple[ParamGradient, Tensor | None]:
        """Sample without a graph, recompute each step in the sweep, then the node VJPs."""
        sweep = ctx.adjoint_sweep(ctx.terminal_adjoint())
        plan = self._plan(ctx, sweep.velocities, debias_steps)
        evaluated = plan.evaluated()
        grads = ctx.field.param_vjp(
            ctx.trajectory().states[evaluated],
            [ctx.host_times[k] for k in evaluated],
            plan.route(sweep.cotangents),
        )
        self._report(ctx, plan)
        return grads, sweep.state_grad

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        debias_steps = self._draw_debias(ctx)
        trajectory = ctx.trajectory()
        groups = self._layout(ctx)
        nodes = list(distinct_nodes(groups))
        # Node forwards keep their graph: they give the node velocities (cotangents, gate)
        # now and take the aggregated cotangents G_j later, in one batched VJP.
        node_velocities, pull_nodes = ctx.field.param_pullback(
            trajectory.states[nodes], [ctx.host_times[k] for k in nodes]
        )
        row_of = {k: row for row, k in enumerate(nodes)}
        # The other steps' velocities (cotangents, gate): recorded, or no-graph forwards of
        # all of them in one batched call (its transient memory is small beside the node
        # graphs held meanwhile).
        others = [k for k in range(ctx.num_steps) if k not in row_of]
        other_of = dict(zip(others, ctx.velocities_at(others), strict=True))
        velocities = [
            node_velocities[row_of[k]] if k in row_of else other_of[k] for k in range(ctx.num_steps)
        ]
        cotangents = torch.stack(
            [ctx.step_cotangent(k, velocities[k]) for k in range(ctx.num_steps)]
        )
        plan = self._plan(ctx, velocities, debias_steps)
        evaluated = plan.evaluated()
        totals = plan.route(cotangents)
        if evaluated == nodes:  # every group passed, nothing to correct
            grads = pull_nodes(totals)
        else:
            position = {k: i for i, k in enumerate(evaluated)}
            grads = pull_nodes(totals[[position[k] for k in nodes]])
            # Steps of failing groups and corrected steps that are not nodes have no graph
            # yet: one more batched forward with graph and VJP over all of them.
            extra = [k for k in evaluated if k not in row_of]
            grads = add_grads(
                grads,
                ctx.field.param_vjp(
                    trajectory.states[extra],
                    [ctx.host_times[k] for k in extra],
                    totals[[position[k] for k in extra]],
                ),
            )
        self._report(ctx, plan)
        return grads

    # -- layout, gate, debiasing ----------------------------------------------------------

    def groups(self, num_steps: int) -> tuple[Group, ...]:
        """Where this estimator puts its groups and interpolation nodes on a chain of
        ``num_steps`` steps: each group's ``steps``, ``nodes``, ``interpolated_steps`` and
        whether it ``is_exact`` (every step a node)."""
        return layout_groups(num_steps, self.window, self.order, self.shared_knots)

    @staticmethod
    def interpolation_weights(
        node_times: Sequence[float], at_times: Sequence[float]
    ) -> list[list[float]]:
        """``L_j(t)``, the Lagrange basis in time on ``node_times`` at each of ``at_times``
        (rows: query times, columns: nodes), as host floats: ``J_t ~= sum_j L_j(t) J_j``."""
        return lagrange_rows(node_times, at_times)

    def _layout(self, ctx: EstimationContext) -> tuple[Group, ...]:
        return self.groups(ctx.num_steps)

    def _draw_debias(self, ctx: EstimationContext) -> list[int]:
        if not self.debias:
            return []
        # Data-parallel ranks correct the same steps, so they make the same model calls.
        return ctx.ranks.same_ints(draw_steps(ctx.num_steps, self.debias, ctx.generator))

    def _plan(
        self,
        ctx: EstimationContext,
        velocities: Tensor | Sequence[Tensor],
        debias_steps: list[int],
    ) -> _Plan:
        """Gate every group on the velocities; the routing of cotangents follows."""
        if self.gate != "off" and any(is_symbolic(v) for v in velocities[:1]):
            raise InvalidValue(
                f"jagg's gate needs the velocities' values; on fake/meta tensors pass "
                f"gate=off (got gate={self.gate})"
            )
        groups = self._layout(ctx)
        times = ctx.host_times  # schedule math on host floats: no tensor op per group
        weights = [
            lagrange_rows([times[j] for j in g.nodes], [times[k] for k in g.steps]) for g in groups
        ]
        # Every group's cosine on the device, groups of one shape together, then one
        # transfer for all of them (no host sync per group).
        cosines = gate_cosines(groups, weights, velocities, self.gate)
        # Data-parallel ranks gate on the union of their samples (gradest.ranks), so every
        # rank falls back in the same groups and makes the same model calls.
        batch = velocities[0].shape[0]
        cosines = ctx.ranks.gate(cosines, [interpolated_count(g, batch) for g in groups], self.gate)
        # ``not >=`` so that a NaN cosine (non-finite velocities) falls back too.
        failed = [i for i, c in enumerate(cosines) if c is not None and not c >= self.tau]
        scale = ctx.num_steps / self.debias if self.debias else 0.0
        return _Plan(groups, weights, cosines, failed, debias_steps, scale)

    def _report(self, ctx: EstimationContext, plan: _Plan) -> None:
        ctx.decide(
            JaggDecisions(
                groups=tuple(tuple(group.steps) for group in plan.groups),
                nodes=tuple(tuple(group.nodes) for group in plan.groups),
                fallback_groups=tuple(plan.fallback_groups),
                debias_steps=tuple(plan.debias_steps),
                debias_scale=plan.debias_scale,
            )
        )
        ctx.info.update(
            gate_cosines=plan.cosines,
            fallback_fraction=len(plan.fallback_groups) / len(plan.groups),
            node_steps=plan.evaluated(),
        )

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        at_most_steps("jagg", num_steps, debias=self.debias)

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> JaggDecisions:
        """Layout from the options, debiasing steps replayed, gate on the dense velocities."""
        num_steps = chain.num_steps
        debias_steps = replay_subset(num_steps, self.debias, generator) if self.debias else ()
        groups, nodes = jagg_layout(num_steps, self.window, self.order, self.shared_knots)
        return JaggDecisions(
            groups=groups,
            nodes=nodes,
            fallback_groups=jagg_fallbacks(chain, groups, nodes, self.tau, self.gate),
            debias_steps=debias_steps,
            debias_scale=num_steps / self.debias if self.debias else 0.0,
        )

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: JaggDecisions
    ) -> Definition:
        """The interpolated sum for the reported groups, nodes and gate outcomes, plus the
        debiasing correction of the drawn steps; the noise gradient is the exact ``a_0``
        (the adjoint sweep is exact)."""
        failed = set(decisions.fallback_groups)
        passed = [index not in failed for index in range(len(decisions.groups))]
        grad = jagg_definition(
            chain,
            objective,
            decisions.groups,
            decisions.nodes,
            passed,
            debias_steps=decisions.debias_steps,
            debias_scale=decisions.debias_scale,
        )
        return Definition(grad=grad, noise_grad=exact_noise_grad(chain, objective))
