"""``telescope``: randomized telescoping truncation, unbiased for the exact gradient.

Cotangents: the exact adjoint, on a random depth ``K`` of last steps. VJP evaluation: the
``K`` kept terms, each reweighted by ``1/q_j``, in one batched VJP. Memory: the graphs of
the ``K`` kept steps. (The record: ``Telescope.axes``, :class:`gradest.axes.EstimatorAxes`.)

The exact gradient is a sum over depths from the end of the chain,
``g = sum_{j=1}^{N} T_j`` with ``T_j = J_{N-j}^T c_{N-j}`` (exact cotangents). Truncated
backpropagation keeps the first ``K`` terms and is biased; the Russian-roulette
estimator (Tallec & Ollivier 2017, Beatson & Adams 2019) draws the depth ``K`` at random
with survival probabilities ``q_j = P(K >= j)`` and reweights each kept term::

    g_tel = sum_{j=1}^{K} T_j / q_j,        E[g_tel] = sum_j q_j T_j / q_j = g.

Survival: ``q_j = 1`` for ``j <= min_depth`` (always kept, no reweighting), then
geometric, ``q_j = rho^(j - min_depth)``, with ``rho`` set so that ``E[K] = sum_j q_j``
equals ``mean_depth`` (``mean_depth = N``: ``rho = 1``, the exact gradient every call).

Noise gradient (terminal): ``a_0`` is reached only when ``K = N`` (probability ``q_N``),
so the estimate is ``a_0 / q_N`` then and zero otherwise: unbiased as well.

Variance, honestly: every term beyond ``min_depth`` is multiplied by ``1/q_j``, which
grows geometrically with the depth, so a deep term that happens to be kept arrives
amplified. ``Var[g_tel] = sum_j (1/q_j - 1) |T_j|^2 + cross terms``: the estimator pays
for its unbiasedness in variance exactly where the truncated gradient pays in bias, and
it is only cheaper than ``exact`` on average when deep terms are small (a contracting
chain) or when the variance can be averaged away over many steps. Measure both with
``gradest.harness`` on your model; raise ``min_depth`` to keep the large late terms
exact.

Cost (docs/design.md#cost-formulas, row ``telescope``), for a drawn ``K``: from noise,
``N - K`` forwards without a graph, ``K`` with their graph kept, ``K - 1`` state-only
backward passes through them (``K`` with the noise gradient at ``K = N``) and one batched
parameter VJP over the ``K`` steps; activations of ``K`` steps. With ``engine="func"``
the sweep recomputes each step instead (``K`` more forwards). Stepwise objectives: ``K``
forwards with graph and parameter VJPs.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.objectives import Objective
from gradest.options import at_most_steps, int_option, option
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import replay_survival_depth
from gradest.reference.dense import DenseChain
from gradest.reference.telescope import (
    reference_survival,
    telescope_definition,
    telescope_noise_grad_definition,
)
from gradest.strategies.sampling import draw_survival_depth, stepwise_vjp_over
from gradest.vjp import ParamGradient

# Bisection on rho in [0, 1] to this absolute width (far below any float32 effect).
_RHO_TOLERANCE = 1e-15


def survival_probabilities(num_steps: int, mean_depth: float, min_depth: int) -> list[float]:
    """``q_1..q_N``: 1 up to ``min_depth``, then ``rho^(j - min_depth)`` with
    ``sum_j q_j = mean_depth`` (``rho`` by bisection; the sum increases with ``rho``)."""
    tail = num_steps - min_depth
    target = mean_depth - min_depth
    if tail == 0 or target <= 0:
        return [1.0] * min_depth + [0.0] * tail
    if target >= tail:
        return [1.0] * num_steps
    low, high = 0.0, 1.0
    while high - low > _RHO_TOLERANCE:
        rho = 0.5 * (low + high)
        if sum(rho**i for i in range(1, tail + 1)) < target:
            low = rho
        else:
            high = rho
    rho = 0.5 * (low + high)
    return [1.0] * min_depth + [rho**i for i in range(1, tail + 1)]


@attrs.frozen
class TelescopeDecisions(Decisions):
    """The depth ``telescope`` drew and the weights of the kept terms.

    Attributes:
        depth: ``K``, the number of kept steps at the end of the chain.
        weights: ``1/q_j`` of the kept steps, in step order ``N-K .. N-1``.
        noise_weight: ``1/q_N`` when ``K = N`` (the noise gradient's factor), else 0.
    """

    depth: int
    weights: tuple[float, ...]
    noise_weight: float


@attrs.frozen
class Telescope(EstimatorBase):
    """Randomized telescoping truncation: a random depth, kept terms reweighted by ``1/q_j``.

    Preferred when an unbiased estimate of the exact gradient is needed at less expected
    compute than exact's. Not recommended when the variance matters more than the bias: the
    survival weights ``1/q_j`` are heavy-tailed at a small mean depth; ``jagg:debias=m`` is
    the other unbiased choice.

    Source: randomized telescoping sums (Beatson, Adams, "Efficient Optimization of Loops and
    Limits with Randomized Telescoping Sums", ICML 2019, arXiv 1905.07006).

    Attributes:
        mean_depth: the expected number of kept steps ``E[K]`` (``min_depth <= mean_depth
            <= N``; ``N`` gives the exact gradient). Sets the expected cost.
        min_depth: the last ``min_depth`` steps are always kept, unweighted.
    """

    name: ClassVar[str] = "telescope"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("telescope:mean_depth=3,min_depth=2",)
    compare_specs: ClassVar[tuple[str, ...]] = ("telescope",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="exact adjoint, survival-weighted random depth K (Russian roulette)",
        evaluation="the last K steps, term j reweighted by 1/q_j, one batched parameter VJP",
        memory="no-graph rollout of the first N - K steps; graphs of the last K steps "
        "(engine='func': recompute each step in the sweep)",
    )

    mean_depth: float = option(
        4.0,
        kind=float,
        doc="expected number of kept steps E[K] (min_depth <= mean_depth <= N)",
        valid=lambda value: value >= 1.0,
        expect="a float >= 1 (and at most the number of sampler steps N)",
    )
    min_depth: int = int_option(1, minimum=1, doc="last steps always kept, with weight 1")

    def __attrs_post_init__(self) -> None:
        if self.min_depth > self.mean_depth:
            raise InvalidValue(
                f"estimator 'telescope': option min_depth={self.min_depth} exceeds "
                f"mean_depth={self.mean_depth:g}; the depth is never below min_depth, so "
                f"raise mean_depth to at least {self.min_depth}"
            )

    def _draw(self, ctx: EstimationContext) -> tuple[int, list[float]]:
        survival = survival_probabilities(ctx.num_steps, self.mean_depth, self.min_depth)
        (depth,) = ctx.ranks.same_ints([draw_survival_depth(survival, ctx.generator)])
        weights = [1.0 / survival[ctx.num_steps - k - 1] for k in self._steps(ctx, depth)]
        noise_weight = 1.0 / survival[-1] if depth == ctx.num_steps else 0.0
        ctx.decide(
            TelescopeDecisions(depth=depth, weights=tuple(weights), noise_weight=noise_weight)
        )
        return depth, weights

    @staticmethod
    def _steps(ctx: EstimationContext, depth: int) -> range:
        return range(ctx.num_steps - depth, ctx.num_steps)

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        depth, weights = self._draw(ctx)
        steps = self._steps(ctx, depth)
        start = steps.start
        scale = torch.tensor(weights, dtype=torch.float64)
        if ctx.field.engine == "autograd":
            chain = ctx.retained_chain(start)
            sweep = ctx.adjoint_sweep(
                ctx.terminal_adjoint(), start=start, chain=chain, keep=frozenset(steps)
            )
            cotangents = _weighted(sweep.cotangents, scale)
            grads = chain.param_vjp(list(steps), cotangents)
        else:
            sweep = ctx.adjoint_sweep(ctx.terminal_adjoint(), start=start)
            cotangents = _weighted(sweep.cotangents, scale)
            grads = ctx.field.param_vjp(
                ctx.trajectory().states[start:-1], ctx.times_at(slice(start, -1)), cotangents
            )
        noise_grad = None
        if ctx.want_noise_grad:
            decisions = ctx.decisions
            assert isinstance(decisions, TelescopeDecisions)
            noise_grad = (
                decisions.noise_weight * sweep.state_grad
                if start == 0
                else torch.zeros_like(ctx.trajectory().states[0])
            )
        return grads, noise_grad

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        depth, weights = self._draw(ctx)
        return stepwise_vjp_over(ctx, self._steps(ctx, depth), weights)

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        # min_depth <= mean_depth (checked at construction), so this bounds both.
        at_most_steps(
            "telescope",
            num_steps,
            hint=f"(mean_depth={num_steps} is exact)",
            mean_depth=self.mean_depth,
        )

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> TelescopeDecisions:
        """The depth replayed under the independently solved survival law."""
        num_steps = chain.num_steps
        survival = reference_survival(num_steps, self.mean_depth, self.min_depth)
        depth = replay_survival_depth(survival, generator)
        return TelescopeDecisions(
            depth=depth,
            weights=tuple(1.0 / survival[j - 1] for j in range(depth, 0, -1)),
            noise_weight=1.0 / survival[-1] if depth == num_steps else 0.0,
        )

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: TelescopeDecisions
    ) -> Definition:
        """``sum_{j <= K} T_j / q_j`` with ``q`` re-derived from the options; the noise
        gradient ``a_0 / q_N`` at ``K = N``, else zero."""
        survival = reference_survival(chain.num_steps, self.mean_depth, self.min_depth)
        return Definition(
            grad=telescope_definition(chain, objective, decisions.depth, survival),
            noise_grad=telescope_noise_grad_definition(chain, objective, decisions.depth, survival),
        )


def _weighted(cotangents: Tensor, weights: Tensor) -> Tensor:
    """Each step's cotangent times its weight (``cotangents [K, B, ...]``, ``weights [K]``)."""
    shape = (-1,) + (1,) * (cotangents.ndim - 1)
    return cotangents * weights.to(cotangents.dtype).reshape(shape).to(cotangents.device)
