"""``draft_lv``: DRaFT-LV (Clark et al. 2024), the last step's gradient over re-noised copies.

Cotangents: the last step's only, on ``n`` re-noised copies of the final sample. VJP
evaluation: one batched VJP over the copies, averaged. Memory: the last step's graph for
the ``n`` copies. (The record: ``DraftLV.axes``, :class:`gradest.axes.EstimatorAxes`.)

The chain is sampled without a graph to its final sample ``x^ = z_N``. Then ``n`` copies
are noised back to the last step's time with fresh noise ``eps_i`` (the sampler's
interpolant, :meth:`gradest.samplers.TimeGrid.noised`), each takes the last step with
its graph, and the loss gradient is averaged::

    z^(i)   = t_{N-1} eps_i + (1 - t_{N-1}) x^      (rectified flow; DDIM:
                                                sqrt(a_{N-1}) x^ + sqrt(1 - a_{N-1}) eps_i)
    z_N^(i) = alpha_{N-1} z^(i) + beta_{N-1} v_theta(z^(i), t_{N-1}) + sigma_{N-1} xi_{N-1}
    g_lv    = (1/n) sum_i J(z^(i))^T (beta_{N-1} grad l(z_N^(i)))

What it drops: like DRaFT-1 (``truncated:k=1``) every step but the last, so it is biased
for the exact gradient; the re-noised copies reduce the variance of that last-step
gradient (the "LV" is low variance), not its bias, and the loss is taken on the copies'
denoised samples rather than on ``z_N`` itself. ``info["loss"]`` is the mean loss of the
copies, ``info["sample_loss"]`` the loss of ``z_N``.

Noise gradient (terminal): zero, ``x^`` is treated as data. Terminal objectives only.

Cost (docs/design.md#cost-formulas, row ``draft_lv``): sampling without a graph (none on
a recorded trajectory), then the ``n`` copies as one batched forward with graph and one
batched VJP; activations of ``n`` steps (one batched call of ``n B`` rows).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest._checks import check_allocation
from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext, host_floats
from gradest.objectives import Objective, TerminalObjective
from gradest.options import int_option
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import replay_normal
from gradest.reference.dense import DenseChain
from gradest.reference.draft_lv import draft_lv_definition
from gradest.samplers import require_interpolant
from gradest.strategies.sampling import draw_normal
from gradest.symbolic import host_value
from gradest.vjp import ParamGradient


@attrs.frozen(eq=False)
class DraftLvDecisions(Decisions):
    """The noise ``draft_lv`` re-noised its copies with.

    Attributes:
        renoise: ``eps`` of every copy, ``[n, B, ...]``.
    """

    renoise: Tensor = attrs.field(repr=lambda noise: f"tensor{list(noise.shape)}")


@attrs.frozen
class DraftLV(EstimatorBase):
    """DRaFT-LV: the last step's gradient averaged over ``copies`` re-noised final samples.

    Preferred when only the last step's gradient is wanted and DRaFT-1's variance is the
    problem: ``copies`` re-noised copies of the last step lower it. Not recommended when the
    gradient should reach earlier steps (it never does: ``truncated`` with a larger ``k``,
    ``drtune``, ``alignprop``).

    Source: DRaFT-LV (Clark, Vicol, Swersky, Fleet, ICLR 2024, arXiv 2309.17400).

    Attributes:
        copies: ``n``, the re-noised copies (DRaFT-LV uses 2); cost ``3nF`` after sampling.
    """

    name: ClassVar[str] = "draft_lv"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("draft_lv:copies=3",)
    compare_specs: ClassVar[tuple[str, ...]] = ("draft_lv",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="last step only, on n re-noised copies of the final sample",
        evaluation="one batched VJP over the n copies, averaged",
        memory="no-graph sampling; the last step's graph for the n copies (one batched call)",
    )
    objectives: ClassVar[tuple[str, ...]] = ("terminal",)

    copies: int = int_option(2, minimum=1, doc="re-noised copies of the final sample (n)")

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        sampler = require_interpolant(ctx.sampler, self.name)
        self._check_copies_fit(ctx)
        trajectory = ctx.trajectory()
        sample = trajectory.states[-1]
        last = ctx.num_steps - 1
        renoise = draw_normal((self.copies, *sample.shape), sample, ctx.generator)
        ctx.decide(DraftLvDecisions(renoise=renoise))
        states = sampler.noised(sample[None], last, renoise)
        velocities, pull = ctx.field.param_pullback(states, [ctx.host_times[last]] * self.copies)
        alpha, beta, sigma = (c[last] for c in ctx.host_coefficients)
        finals = alpha * states + beta * velocities
        step_noise = ctx.step_noise()
        if step_noise is not None and sigma != 0.0:
            finals = finals + sigma * step_noise[last]
        assert isinstance(ctx.objective, TerminalObjective)
        losses, cotangents = [], []
        for final in finals:
            loss, adjoint = ctx.objective.terminal_adjoint(final)
            losses.append(loss.detach())
            cotangents.append((beta / self.copies) * adjoint)
        ctx.info["loss"] = sum(host_floats(losses)) / self.copies  # one transfer
        sample_loss = ctx.objective.loss_fn(sample.detach().clone()).sum()
        ctx.info["sample_loss"] = host_value(sample_loss)
        grads = pull(torch.stack(cotangents))
        return grads, torch.zeros_like(sample) if ctx.want_noise_grad else None

    def _check_copies_fit(self, ctx: EstimationContext) -> None:
        """``copies`` re-noised copies of the batch (their noise, states, velocities and
        final states: 4 tensors of ``copies x batch x state``) must fit into memory;
        checked before sampling, from the shape of the noise or the recorded path."""
        like = ctx.noise if ctx.noise is not None else ctx.trajectory().states[0]
        check_allocation(
            f"estimator 'draft_lv': option copies={self.copies}",
            self.copies,
            4 * like.numel() * like.element_size(),
            name="copies",
            device=like.device,
            detail=f"4 tensors of copies x {tuple(like.shape)} x {like.element_size()} bytes",
        )

    # -- the contract -----------------------------------------------------------------------

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> DraftLvDecisions:
        """The copies' noise replayed."""
        states = chain.trajectory.states
        shape = (self.copies, *states.shape[1:])
        return DraftLvDecisions(renoise=replay_normal(shape, states.dtype, generator))

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: DraftLvDecisions
    ) -> Definition:
        """The copies' averaged last-step gradient at the decided noise; zero noise gradient."""
        return Definition(*draft_lv_definition(chain, objective, decisions.renoise))
