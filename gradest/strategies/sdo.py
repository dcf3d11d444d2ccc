"""``sdo``: shortcut diffusion optimization, one-step cotangents on a random subset of steps.

Cotangents (docs/design.md#estimator-table, row ``sdo``). For a terminal objective the
chain is treated as if the model did not feed back into later states: differentiate
``z_N = (prod_j alpha_j) z_0 + sum_k beta_k (prod_{j>k} alpha_j) v_k + noise terms``
with each ``v_k`` an independent input. That gives the **one-step cotangents**::

    c~_k = beta_k (prod_{j>k} alpha_j) a_N        (h_k a_N for rectified flow)

where the exact ``c_k = beta_k a_{k+1}`` would carry the adjoint back through every
later state Jacobian ``dv_j/dz_j``. Only ``a_N`` is needed: no adjoint sweep. A stepwise
objective already has cotangents independent of the chain; ``sdo`` uses ``c_k`` itself.

VJP evaluation: ``m = samples`` steps ``S`` are drawn once per call from the
``generator``, uniformly without replacement (``select="uniform"``, the default) or
evenly spaced with one random offset (``select="stratified"``, systematic sampling:
``floor(u + j N/m)``, ``u ~ U[0, N/m)``; the ``drtune`` estimator,
:mod:`gradest.strategies.drtune`); their parameter VJPs are evaluated in one batched VJP
and scaled::

    g_sdo = (N / m) sum_{k in S} J_k^T c~_k        (scale="unbiased")

Under either selection every step is in ``S`` with probability ``m/N``
(:func:`gradest.strategies.sampling.draw_stratified_steps` says why for the stratified
one), so ``E[g_sdo] = sum_k J_k^T c~_k``, the **one-step sum** (``full_sum=True``
evaluates it deterministically). The selections differ in variance only. Memory: the
graphs of the ``m`` drawn steps. (The record: ``ShortcutDiffusion.axes``,
:class:`gradest.axes.EstimatorAxes`.)

What it drops, and the caveats of the SDO review (arXiv 2505.07477): the one-step sum
replaces every product of state Jacobians ``prod (alpha_j + beta_j dv_j/dz_j)`` by its
``dv/dz = 0`` part, so it is **biased** against the exact gradient whenever the model
depends on the state (always, in practice); the paper bounds that bias only under an
unmeasured contraction assumption. The single-sample estimator the paper fine-tunes with
is unbiased for the one-step sum, not for the exact gradient, and has high variance (one
step stands in for ``N``); the theorem bounding the one-step sum says nothing about that
variance. Use ``gradest.harness`` to measure both on your model before relying on it.

Noise gradient (terminal only): through the first step only, the latent shortcut of the
paper: ``(prod_{j>0} alpha_j)(alpha_0 a_N + beta_0 (dv_0/dz_0)^T a_N)``, i.e.
``a_N + h_0 (dv_0/dz_0)^T a_N`` for rectified flow.

Cost (docs/design.md#cost-formulas, row ``sdo``):

* terminal from noise: a no-graph rollout for the path and ``a_N``, then ``m`` forwards
  with graph and one batched VJP, with retained activations of the ``m`` sampled steps
  only (on a recorded trajectory, no rollout). The noise gradient adds one forward with
  graph and one state VJP.
* stepwise: the same ``m`` forwards and batched VJP (plus the rollout when sampling from
  noise).
* ``full_sum=True``: ``m = N`` in one batched VJP, so it holds ``N`` steps' activations at
  once; it is a reference for the expectation, not a memory saver.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.objectives import Objective
from gradest.options import bool_option, choice_option, int_option, too_many_steps
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import replay_stratified, replay_subset
from gradest.reference.dense import DenseChain
from gradest.reference.sdo import sdo_definition, sdo_noise_grad_definition
from gradest.strategies.sampling import draw_steps, draw_stratified_steps, stepwise_vjp_over
from gradest.vjp import ParamGradient, scale_grads

SCALES = ("unbiased", "none")
SELECTIONS = ("uniform", "stratified")


def samples_option(default: int) -> int:
    """The ``samples`` option (``m``) of the one-step estimators, with its default."""
    return int_option(
        default,
        minimum=1,
        doc="steps drawn per call, without replacement (m <= N)",
        expect="an int >= 1 (and at most the number of sampler steps N)",
    )


def select_option(default: str) -> str:
    """The ``select`` option (how the ``m`` steps are drawn), with its default."""
    return choice_option(
        default,
        SELECTIONS,
        doc="'uniform': a uniform m-subset; 'stratified': m evenly spaced steps, one random "
        "offset (DRTune)",
        expect="'uniform' (a uniform subset of the steps) or 'stratified' (evenly spaced "
        "steps with a random offset)",
    )


def scale_option() -> str:
    return choice_option(
        "unbiased",
        SCALES,
        doc="'unbiased' scales the sampled sum by N/m; 'none' by 1",
        expect="'unbiased' (factor N/samples) or 'none' (factor 1)",
    )


def full_sum_option() -> bool:
    return bool_option(
        False, doc="evaluate all N one-step terms (deterministic; ignores samples and scale)"
    )


def host_products_after(alpha: list[float]) -> list[float]:
    """``prod_{j>k} alpha_j`` for each ``k`` on host floats (the last entry is 1)."""
    products = [1.0] * len(alpha)
    for k in reversed(range(len(alpha) - 1)):
        products[k] = products[k + 1] * alpha[k + 1]
    return products


@attrs.frozen
class ShortcutDiffusion(EstimatorBase):
    """Shortcut diffusion optimization (SDO): one-step cotangents on a random subset of steps.

    Preferred for a terminal reward when memory or compute is tight: one step's graph at a
    time and ``samples`` parameter VJPs, unbiased for the one-step sum. Not recommended when
    the chain's state Jacobians carry the gradient (its bias is the gap between the later
    steps' product of state Jacobians and the product of ``alpha``: measure it with
    ``gradest compare`` or the contraction report), or when the steps should be spread
    evenly (``drtune``). On a stepwise objective ``full_sum=true`` is the exact gradient.

    Source: shortcut diffusion optimization (SDO, arXiv 2505.07477).

    Attributes:
        samples: ``m``, the number of steps drawn (without replacement, once per call);
            at most the sampler's ``N`` (checked when estimating, since ``N`` is only known
            then). Ignored when ``full_sum=True``.
        scale: ``"unbiased"`` multiplies the sampled sum by ``N/m`` (unbiased for the
            full one-step sum); ``"none"`` uses factor 1: the plain sampled sum, at
            ``m=1`` the single-step gradient of the SDO implementation, ``m/N`` times the
            one-step sum in expectation. Ignored with ``full_sum``.
        full_sum: evaluate all ``N`` one-step terms deterministically, factor 1 (the
            expectation of the sampled estimator; for stepwise objectives this is exact).
        select: how the ``m`` steps are drawn. ``"uniform"`` (default): a uniform
            ``m``-subset (the first ``m`` entries of a random permutation).
            ``"stratified"``: systematic sampling, ``floor(u + j N/m)`` for
            ``j = 0..m-1`` with one offset ``u ~ U[0, N/m)`` (drawn as the integer
            ``floor(m u)``, one ``randint``), DRTune's evenly spaced steps. Both include
            every step with probability ``m/N``, so the scale and the expectation are the
            same; only the variance differs. Ignored with ``full_sum``.

    The steps are drawn from the ``generator`` passed to ``estimate`` (with None, from
    torch's default generator: reproducible only through ``torch.manual_seed``).
    ``result.info`` holds ``sampled_steps`` (sorted step indices used) and ``scale`` (the
    factor applied). For stepwise objectives ``info["loss"]`` (``value``) is the full sum
    over all steps, as for every estimator; ``info["evaluated_value"]`` sums the sampled
    steps' losses only.
    """

    name: ClassVar[str] = "sdo"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = (
        "sdo:full_sum=true",
        "sdo:samples=3",
        "sdo:samples=3,select=stratified",
    )
    compare_specs: ClassVar[tuple[str, ...]] = ("sdo",)
    cost_specs: ClassVar[tuple[str, ...]] = ("sdo",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="one-step (model-detached chain; stepwise: c_k itself)",
        evaluation="m drawn steps (a uniform subset; select=stratified: evenly spaced, one "
        "random offset) in one batched VJP, scaled N/m (full_sum: all N)",
        memory="no-graph rollout; graphs of the m drawn steps only (full_sum: all N at once)",
    )

    samples: int = samples_option(1)
    scale: str = scale_option()
    full_sum: bool = full_sum_option()
    select: str = select_option("uniform")

    @property
    def stochastic(self) -> bool:
        """Whether an estimate depends on the generator: always, except with ``full_sum``.
        Declared for ``gradest.compare``, which otherwise probes with two draws: a
        stratified draw has as few as ``N/m`` outcomes, so two draws may agree."""
        return not self.full_sum

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        steps, factor = self._draw(ctx)
        trajectory = ctx.trajectory()
        terminal_adjoint = ctx.terminal_adjoint()
        alpha, beta, _ = ctx.host_coefficients
        # c~_k = w_k a_N: the model-detached chain's derivative of z_N in v_k. Schedule
        # math on host floats (host_products_after: no op per step).
        after = host_products_after(alpha)
        host_weights = [b * a for b, a in zip(beta, after, strict=True)]
        first_scale = alpha[0] * after[0]
        cotangents = torch.stack([host_weights[step] * terminal_adjoint for step in steps])
        grads = ctx.field.param_vjp(
            trajectory.states[steps], [ctx.host_times[k] for k in steps], cotangents
        )
        noise_grad = None
        if ctx.want_noise_grad:
            # d z_N / d z_0 with the model kept in step 0 only:
            # (prod_{j>0} alpha_j)(alpha_0 I + beta_0 dv_0/dz_0), transposed onto a_N.
            _, pulled = ctx.field.state_vjp(
                trajectory.states[0], ctx.times_at(0), host_weights[0] * terminal_adjoint
            )
            noise_grad = first_scale * terminal_adjoint + pulled
        return scale_grads(grads, factor), noise_grad

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        steps, factor = self._draw(ctx)
        return scale_grads(stepwise_vjp_over(ctx, steps), factor)

    def _draw(self, ctx: EstimationContext) -> tuple[list[int], float]:
        """The steps to evaluate and the factor on their sum; recorded as the decisions."""
        num_steps = ctx.num_steps
        if self.full_sum:
            steps, factor = list(range(num_steps)), 1.0
        else:
            draw = draw_stratified_steps if self.select == "stratified" else draw_steps
            # A host decision, rank 0's on every rank: the ranks make the same model calls.
            steps = ctx.ranks.same_ints(draw(num_steps, self.samples, ctx.generator))
            factor = num_steps / self.samples if self.scale == "unbiased" else 1.0
        ctx.decide(SdoDecisions(sampled_steps=tuple(steps), scale=factor))
        return steps, factor

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        if not self.full_sum and self.samples > num_steps:
            # Clamping would silently change the estimator (and its scale); refuse.
            fix = f"use samples <= {num_steps}, or full_sum=True to evaluate every step"
            raise too_many_steps(self.name, f"samples={self.samples}", num_steps, fix)

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> SdoDecisions:
        """The steps replayed from the generator (the selection's own replay); the factor
        from ``scale``."""
        num_steps = chain.num_steps
        if self.full_sum:
            return SdoDecisions(sampled_steps=tuple(range(num_steps)), scale=1.0)
        replay = replay_stratified if self.select == "stratified" else replay_subset
        return SdoDecisions(
            sampled_steps=replay(num_steps, self.samples, generator),
            scale=num_steps / self.samples if self.scale == "unbiased" else 1.0,
        )

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: SdoDecisions
    ) -> Definition:
        """``scale * sum_{k in S} J_k^T c~_k``; the noise gradient through the first step."""
        return Definition(
            grad=sdo_definition(chain, objective, decisions.sampled_steps, decisions.scale),
            noise_grad=sdo_noise_grad_definition(chain, objective),
        )


@attrs.frozen
class SdoDecisions(Decisions):
    """The steps ``sdo`` evaluated and the factor on their sum.

    Attributes:
        sampled_steps: the sorted step indices (all ``N`` with ``full_sum``).
        scale: ``N/m`` (``scale="unbiased"``), or 1.
    """

    sampled_steps: tuple[int, ...]
    scale: float
