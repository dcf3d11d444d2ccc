"""``exact``: backpropagation through the whole chain, ``sum_k J_k^T c_k`` with exact ``c_k``.

Cotangents: the exact adjoint (terminal) or ``c_k = d l_k / d v_k`` (stepwise).
VJP evaluation: one VJP per step. Memory: the graph of every step, or ``checkpoint=True``.
(The record: ``Exact.axes``, :class:`gradest.axes.EstimatorAxes`.)

Cost: the ``exact`` rows of the cost model (docs/design.md#cost-formulas). The work:

* terminal, ``checkpoint=False`` from noise: ``N`` forwards with graph, then one fused
  backward through the chain; activations of all ``N`` steps are held.
* terminal, ``checkpoint=True`` (or on a recorded trajectory): sample without a graph
  (skipped on a trajectory), then recompute one step at a time in reverse with a joint
  state-and-parameter VJP; activations of one step at a time. ``surrogate()`` gets the
  same cost and memory from a chain whose steps are ``torch.utils.checkpoint``-ed
  (recomputed in the caller's backward); on a recorded trajectory with
  ``checkpoint=False`` it keeps the graph of all ``N`` steps.
* stepwise: a forward with graph and a parameter VJP per step; with ``checkpoint=False``
  all steps run as one batched call (activations of ``N`` steps held at once), with
  ``checkpoint=True`` one step at a time (activations of one step; ``surrogate()``
  recomputes each step in the backward for that).

Use it as the reference every other estimator is measured against, and whenever the
chain is short enough to afford it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.objectives import Objective
from gradest.options import bool_option
from gradest.protocol import Decisions, Definition
from gradest.reference.dense import DenseChain, exact_cotangents, exact_noise_grad
from gradest.vjp import ParamGradient, add_grads


@attrs.frozen
class Exact(EstimatorBase):
    """Exact gradient: backpropagation through every sampling step.

    Preferred when the chain's graphs fit in memory (or, with ``checkpoint=true``, the
    time of ``N`` more forwards does) and the gradient itself is wanted: it is the reference
    every other estimator is measured against. Not recommended when neither fits:
    ``drtune``, ``alignprop``, ``sdo`` or ``truncated`` keep the graphs of a few steps, at
    a bias.

    Source: backpropagation through the sampling chain, as DRaFT (Clark, Vicol, Swersky,
    Fleet, ICLR 2024, arXiv 2309.17400) and AlignProp (Prabhudesai, Goyal, Pathak,
    Fragkiadaki, arXiv 2310.03739) train; ``checkpoint=true`` is gradient checkpointing
    (Chen, Xu, Zhang, Guestrin, arXiv 1604.06174) at the granularity of a step.

    Attributes:
        checkpoint: False keeps the graph of all steps (terminal: while sampling, no extra
            forward; stepwise: one batched call over the steps), O(N) activation memory;
            True works one step at a time (terminal: samples without a graph and
            recomputes each step in reverse, N extra forwards), O(1) graph memory.
    """

    name: ClassVar[str] = "exact"
    always_exact: ClassVar[bool] = True
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("exact:checkpoint=true",)
    compare_specs: ClassVar[tuple[str, ...]] = ("exact",)
    cost_specs: ClassVar[tuple[str, ...]] = ("exact", "exact:checkpoint=true")
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="exact adjoint (stepwise: c_k = d l_k / d v_k)",
        evaluation="one VJP per step (terminal from noise: one fused VJP through the chain)",
        memory="graph of every step (checkpoint=True: sample without a graph, recompute "
        "each step in reverse, one step's graph at a time)",
    )

    checkpoint: bool = bool_option(
        False,
        doc="recompute steps in reverse instead of keeping the chain's graph "
        "(O(1) memory, +N forwards)",
    )

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> Decisions:
        """No choices: the empty record (what its hooks report: they record none)."""
        return Decisions()

    def definition(self, chain: DenseChain, objective: Objective, decisions: Any) -> Definition:
        """``sum_k J_k^T c_k`` with exact cotangents, and ``a_0`` for a terminal objective."""
        del decisions
        return Definition(
            grad=chain.gradient(exact_cotangents(chain, objective)),
            noise_grad=exact_noise_grad(chain, objective),
        )

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        return ctx.backprop_tail(0, low_memory=self.checkpoint)

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        trajectory = ctx.trajectory()
        if not self.checkpoint:
            # The states are data, so all N steps' forwards can run as one batched call
            # with the graph kept (O(N) activations, like the terminal chain's graph) and
            # all N VJPs as one batched pullback: the same FLOPs as a per-step loop with
            # far less per-call overhead.
            velocities, pull = ctx.field.param_pullback(
                trajectory.states[: ctx.num_steps], ctx.times_at(slice(None, ctx.num_steps))
            )
            cotangents = torch.stack(
                [ctx.step_cotangent(k, velocities[k]) for k in range(ctx.num_steps)]
            )
            return pull(cotangents)
        grads: ParamGradient | None = None
        for k in range(ctx.num_steps):
            velocity, pull_step = ctx.field.param_pullback(
                trajectory.states[k : k + 1], ctx.times_at(slice(k, k + 1)), low_memory=True
            )
            cotangent = ctx.step_cotangent(k, velocity[0])
            grads = add_grads(grads, pull_step(cotangent[None]))
        assert grads is not None
        return grads
