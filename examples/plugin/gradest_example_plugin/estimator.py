"""``sdo_mean``: the mean of ``draws`` independent SDO estimates, in one batched VJP.

Cotangents (as ``sdo``, gradest's docs/design.md#estimator-table): the one-step cotangents of the
model-detached chain, ``c~_k = beta_k (prod_{j>k} alpha_j) a_N`` for a terminal objective
(``h_k a_N`` for rectified flow), and ``c_k = d l_k / d v_k`` itself for a stepwise one.

VJP evaluation: ``K = draws`` independent subsets ``S_1..S_K`` of ``m = samples`` steps
each (uniform, without replacement within a subset, independent across subsets), and

    g = (1/K) sum_i (N/m) sum_{k in S_i} J_k^T c~_k
      = sum_k w_k J_k^T c~_k,        w_k = (N / (m K)) * #{i : k in S_i}

Each draw is an unbiased estimate of the one-step sum (``sdo:full_sum=true``), so their
mean is too, with ``1/K`` of the variance of a single draw. A step drawn by several
subsets is evaluated once with the summed weight, so the cost is one forward with graph
and one parameter VJP per *distinct* step (at most ``min(N, K m)``), in one batched VJP.

The estimator uses only gradest's public strategy interface: ``EstimatorBase``,
``option`` fields, the ``EstimationContext`` building blocks (trajectory, terminal
adjoint, step cotangents, the VJP engine ``ctx.field``, ``ctx.ranks``), and the contract
methods ``check_steps``, ``definition`` and ``expected_decisions``, so ``estimate()``,
``surrogate()``, ``gradest check`` (decisions and arithmetic) and early option checks all
work for it as for a built-in.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest.plugin import (
    Decisions,
    Definition,
    EstimationContext,
    EstimatorAxes,
    EstimatorBase,
    Objective,
    ParamGradient,
    option,
    too_many_steps,
)
from gradest.reference import DenseChain, replay_subset, sdo_definition


@attrs.frozen
class MeanOfSdoDraws(EstimatorBase):
    """Mean of K independent SDO draws (one-step cotangents, N/m scaling each).

    Attributes:
        draws: ``K``, independent step subsets averaged (variance / K).
        samples: ``m``, steps per subset (at most the sampler's ``N``).

    ``result.decisions`` holds the subsets (``draws``, each sorted, in draw order) and the
    ``scale`` ``N/m``; ``result.info`` also ``step_weights`` (``{step: w_k}``).
    """

    name: ClassVar[str] = "sdo_mean"
    # What ``gradest list --verbose`` prints for it: its design axes and memory policy.
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="one-step (model-detached chain), as sdo",
        evaluation="mean of `draws` uniform subsets of `samples` steps, scaled N/m; "
        "each distinct step once, in one batched VJP",
        memory="graph of the distinct drawn steps only",
    )

    draws: int = option(
        4,
        kind=int,
        doc="independent SDO draws averaged (variance / draws)",
        valid=lambda value: value >= 1,
        expect="an int >= 1",
    )
    samples: int = option(
        1,
        kind=int,
        doc="steps per draw, uniformly without replacement (m <= N)",
        valid=lambda value: value >= 1,
        expect="an int >= 1 (and at most the number of sampler steps N)",
    )

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        steps, weights = self._draw(ctx)
        trajectory = ctx.trajectory()
        terminal_adjoint = ctx.terminal_adjoint()
        # Host floats (one transfer per call): float(beta[k]) of a device tensor would
        # synchronise with the device at every step.
        alpha, beta, _ = ctx.host_coefficients
        cotangents = []
        for step, weight in zip(steps, weights, strict=True):
            # c~_k = beta_k prod_{j>k} alpha_j a_N: how z_N moves with v_k when the
            # model is held fixed in every later step.
            carried = beta[step] * math.prod(alpha[step + 1 :])
            cotangents.append(weight * carried * terminal_adjoint)
        grads = ctx.field.param_vjp(
            trajectory.states[steps], [ctx.host_times[k] for k in steps], torch.stack(cotangents)
        )
        return grads, None  # no noise gradient: this estimator does not define one

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        trajectory = ctx.trajectory()
        steps, weights = self._draw(ctx)
        velocities, pull = ctx.field.param_pullback(
            trajectory.states[steps], [ctx.host_times[k] for k in steps]
        )
        cotangents = torch.stack(
            [
                weight * ctx.step_cotangent(step, velocities[row])
                for row, (step, weight) in enumerate(zip(steps, weights, strict=True))
            ]
        )
        return pull(cotangents)

    def _draw(self, ctx: EstimationContext) -> tuple[list[int], list[float]]:
        """Distinct steps drawn by any subset and their weights ``w_k``; recorded as the
        decisions (the subsets) and in info (the weights)."""
        num_steps = ctx.num_steps
        device = ctx.generator.device if ctx.generator is not None else torch.device("cpu")
        drawn: list[int] = []
        for _ in range(self.draws):
            order = torch.randperm(num_steps, generator=ctx.generator, device=device)
            drawn.extend(sorted(int(step) for step in order[: self.samples].tolist()))
        # Data-parallel ranks must make the same model calls: take rank 0's draws.
        drawn = ctx.ranks.same_ints(drawn)
        subsets = [drawn[i : i + self.samples] for i in range(0, len(drawn), self.samples)]
        counts = Counter(step for subset in subsets for step in subset)
        scale = num_steps / self.samples
        steps = sorted(counts)
        weights = [scale * counts[step] / self.draws for step in steps]
        ctx.decide(SdoMeanDecisions(draws=tuple(tuple(s) for s in subsets), scale=scale))
        ctx.info["step_weights"] = dict(zip(steps, weights, strict=True))
        return steps, weights

    # -- the estimator's contract -----------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        if self.samples > num_steps:
            raise too_many_steps(
                "sdo_mean", f"samples={self.samples}", num_steps, f"use samples <= {num_steps}"
            )

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> SdoMeanDecisions:
        """The subsets replayed from the generator (``K`` uniform subsets in draw order)
        and the scale from the options, re-derived apart from ``_draw``: ``gradest check``
        compares them with the estimate's and evaluates :meth:`definition` at these."""
        subsets = [
            replay_subset(chain.num_steps, self.samples, generator) for _ in range(self.draws)
        ]
        return SdoMeanDecisions(draws=tuple(subsets), scale=chain.num_steps / self.samples)

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: SdoMeanDecisions
    ) -> Definition:
        """``(1/K) sum_i sdo(S_i, N/m)`` from dense Jacobians, for the reported subsets.

        Each ``sdo(S, s) = s sum_{k in S} J_k^T c~_k`` is gradest's own dense SDO definition,
        so ``gradest check`` compares this plugin's VJP code with its formula. It defines
        no noise gradient.
        """
        total = sum(
            sdo_definition(chain, objective, subset, decisions.scale) for subset in decisions.draws
        )
        return Definition(grad=total / len(decisions.draws))


@attrs.frozen
class SdoMeanDecisions(Decisions):
    """The subsets ``sdo_mean`` drew, in draw order, and their scale ``N/m``."""

    draws: tuple[tuple[int, ...], ...]
    scale: float
