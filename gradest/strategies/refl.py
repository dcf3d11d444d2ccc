"""``refl``: ReFL (Xu et al. 2023, ImageReward): stop at a random late step, jump to the end.

Cotangents: one step's, from a one-step prediction of the end at a random late step ``s``
(the chain before ``s`` cut). VJP evaluation: one VJP at ``s``. Memory: the graph of one
step. (The record: ``Refl.axes``, :class:`gradest.axes.EstimatorAxes`.)

Sampling stops at a step ``s`` drawn uniformly from the last ``last_steps`` steps
(``N - last_steps <= s <= N - 1``); the final sample is predicted from ``z_s`` in one step
of the interpolant (:meth:`gradest.samplers.TimeGrid.jump_to_end` gives ``(a_s, b_s)``),

    z^ = a_s z_s + b_s v_theta(z_s, t_s)     (rectified flow: a_s = 1, b_s = t_N - t_s;
                                              DDIM: the deterministic step t_s -> t_N),

the loss is evaluated on ``z^`` and backpropagated through that one model call only::

    g_refl = J_s^T (b_s grad l(z^)),         z_s treated as data.

What it drops: everything. The loss is not the objective's loss on the sampled ``z_N``
but on a one-step prediction (blurry early in the chain, which is why ``s`` is late), and
the chain before ``s`` is cut, so the gradient is biased for the exact one by design; it
is the cheapest reward gradient there is. Use it as ReFL does (a late window, with a
pretraining loss beside it), and measure it with ``gradest.harness`` before trusting it.
``info["loss"]`` is the loss of the prediction ``z^``.

Noise gradient (terminal): zero, the chain is cut before ``s``. Terminal objectives only.

Cost (docs/design.md#cost-formulas, row ``refl``): ``s`` forwards without a graph to reach
``z_s`` (none on a recorded trajectory), then one forward with graph and one parameter
VJP; activations of one step.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.objectives import Objective, TerminalObjective
from gradest.options import at_most_steps, optional_int_option
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import replay_uniform_int
from gradest.reference.dense import DenseChain
from gradest.reference.refl import refl_definition
from gradest.samplers import require_interpolant
from gradest.strategies.sampling import draw_uniform_int
from gradest.symbolic import host_value
from gradest.vjp import ParamGradient


def default_window(num_steps: int) -> int:
    """The last quarter of the chain, at least one step (ReFL: steps 30-40 of 40)."""
    return max(1, -(-num_steps // 4))


@attrs.frozen
class ReflDecisions(Decisions):
    """The step ``refl`` stopped at.

    Attributes:
        step: ``s``, drawn uniformly from the window of late steps.
        window: the window's length (``last_steps``, or its default for this ``N``).
    """

    step: int
    window: int


@attrs.frozen
class Refl(EstimatorBase):
    """ReFL: a one-step prediction of the final sample from a random late step.

    Preferred for the cheapest reward gradient through one late step, as ReFL fine-tunes:
    the final sample is predicted in one jump from a random late step. Not recommended when
    that one-step prediction is poor (far from the end of the chain) or the gradient should
    reach earlier steps.

    Source: ReFL (Xu, Liu, Wu, Tong, Li, Ding, Tang, Dong, "ImageReward: Learning and
    Evaluating Human Preferences for Text-to-Image Generation", NeurIPS 2023,
    arXiv 2304.05977).

    Attributes:
        last_steps: the window ``s`` is drawn from, counted from the end (None: the last
            quarter of the chain, ``ceil(N/4)``).
    """

    name: ClassVar[str] = "refl"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("refl:last_steps=3",)
    compare_specs: ClassVar[tuple[str, ...]] = ("refl",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="one-step prediction of the end from a late step s (chain cut before s)",
        evaluation="one VJP at the drawn step s",
        memory="no-graph sampling to step s; the graph of one step",
    )
    objectives: ClassVar[tuple[str, ...]] = ("terminal",)

    last_steps: int | None = optional_int_option(
        minimum=1,
        doc="draw the stop step from the last this-many steps (None: ceil(N/4))",
        expect="an int >= 1 (at most the number of sampler steps N), or None",
    )

    def _window(self, num_steps: int) -> int:
        return default_window(num_steps) if self.last_steps is None else self.last_steps

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        sampler = require_interpolant(ctx.sampler, self.name)
        window = self._window(ctx.num_steps)
        step = draw_uniform_int(ctx.num_steps - window, ctx.num_steps - 1, ctx.generator)
        (step,) = ctx.ranks.same_ints([step])
        ctx.decide(ReflDecisions(step=step, window=window))
        state = ctx.state_at(step)
        velocity, pull = ctx.field.param_pullback(state[None], ctx.times_at(slice(step, step + 1)))
        scale, jump = sampler.jump_to_end(step)
        predicted = (state if scale == 1.0 else scale * state) + jump * velocity[0]
        assert isinstance(ctx.objective, TerminalObjective)
        loss, adjoint = ctx.objective.terminal_adjoint(predicted)
        ctx.info["loss"] = host_value(loss)
        grads = pull((jump * adjoint)[None])
        return grads, torch.zeros_like(state) if ctx.want_noise_grad else None

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        raise self.unsupported_objective("stepwise")

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        at_most_steps("refl", num_steps, last_steps=self.last_steps)

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> ReflDecisions:
        """The step replayed, uniform on the last ``last_steps`` (default ``ceil(N/4)``)."""
        num_steps = chain.num_steps
        window = math.ceil(num_steps / 4) if self.last_steps is None else self.last_steps
        step = replay_uniform_int(num_steps - window, num_steps - 1, generator)
        return ReflDecisions(step=step, window=window)

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: ReflDecisions
    ) -> Definition:
        """``J_s^T (b_s grad l(a_s z_s + b_s v_s))`` at the decided step; zero noise gradient."""
        return Definition(*refl_definition(chain, objective, decisions.step))
