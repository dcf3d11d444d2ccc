"""``alignprop``: AlignProp's randomized truncation as it runs, one draw per step.

AlignProp's reference implementation (and TRL's ``truncated_rand_backprop_minmax``)
draws, inside the sampling loop, at every step ``i`` (``i = 0`` the noisiest; gradest's
step ``k = i``) an independent ``r_i`` uniform on ``{min, ..., max}`` (both ends
included) and detaches that step's **model output** when ``i < r_i``. The latent is never
detached, so a step whose output is detached still passes the adjoint through the
sampler's own linear part (``alpha_k``; the identity for Euler). With the kept set
``S = {k : k >= r_k}`` (docs/design.md#estimator-table, row ``alignprop``)::

    c~_N = grad l(z_N)
    c~_k = alpha_k c~_{k+1} + [k in S] beta_k (dv_k/dz_k)^T c~_{k+1}
    g    = sum_{k in S} J_k^T (beta_k c~_{k+1})           noise gradient: c~_0

Each step is kept with ``p_k = P(k >= r) = clip(k - min + 1, 0, max - min + 1) /
(max - min + 1)``, independently, so ``E[c~_k] = (alpha_k I + p_k beta_k dv_k/dz_k)^T
E[c~_{k+1}]`` and ``E[g] = sum_k p_k J_k^T beta_k E[c~_{k+1}]``
(:func:`gradest.reference.alignprop_expectation`): biased against
``exact`` unless every ``p_k = 1`` (``min = max = 0`` is ``exact``). This is *not*
``truncated:random=uniform``, which draws one depth ``K`` per call and cuts the chain
(state and outputs) before step ``N - K``: DRaFT-K with a random K.

Terminal objectives only (a reward method; ``objectives = ("terminal",)``).

How (one call): the draws ``r_0..r_{N-1}`` come first, from the ``generator`` (one
``randint`` of ``N`` values; rank 0's under data parallelism). From noise (autograd
engine, ``estimate()`` and ``surrogate()``): one fused chain, the kept steps' forwards with
their graph, the detached steps' forwards without one, the state path in the graph; one
backward of ``<z_N, a_N>`` through it (``surrogate()``: that is the loss). On a recorded
trajectory, ``surrogate()`` builds the same chain from the lowest kept step with every
state pinned to the recording (detached steps need no forward there); ``estimate()`` (and
``engine="func"``) sweeps the modified adjoint in reverse with one joint
state-and-parameter VJP per kept step and ``alpha_k`` alone elsewhere. (The record:
``AlignProp.axes``.)

Cost (docs/design.md#cost-formulas, row ``alignprop``): from noise ``N`` forwards (the
``K = |S|`` kept ones with graph) and one backward through the kept steps' model outputs
and the full state chain; activations of the ``K`` kept steps.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch
from torch import Tensor

from gradest._checks import outside_fake_mode
from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.errors import InvalidValue
from gradest.nonfinite import check_finite
from gradest.objectives import Objective
from gradest.options import int_option, optional_int_option, too_many_steps
from gradest.protocol import Decisions, Definition
from gradest.reference.alignprop import (
    alignprop_definition,
    alignprop_noise_grad_definition,
    kept_steps,
)
from gradest.reference.decisions import replay_uniform_ints
from gradest.reference.dense import DenseChain
from gradest.trajectory import affine_step
from gradest.vjp import ParamGradient, SurrogateTerms, add_grads, inner


@attrs.frozen
class AlignProp(EstimatorBase):
    """AlignProp's per-step randomized truncation (``truncated_rand_backprop_minmax``).

    Preferred for reward backpropagation at a fraction of exact's compute where every step
    may get a gradient: the state path is never cut, only some steps' model terms. Not
    recommended when an unbiased estimate of the exact gradient is required (step ``k``'s
    term is kept with probability ``p_k``, so its expectation is not exact's): ``exact`` or
    ``telescope``.

    Source: AlignProp (Prabhudesai, Goyal, Pathak, Fragkiadaki, "Aligning Text-to-Image
    Diffusion Models with Reward Backpropagation", arXiv 2310.03739).

    Attributes:
        min: the smallest ``r`` drawn (a step index; step 0 is the noisiest).
        max: the largest ``r`` drawn (None: ``N``, as AlignProp's ``(0, 50)`` at ``N = 50``).
            At every step ``k`` an independent ``r ~ randint(min, max)`` (both included);
            the model output of step ``k`` keeps its graph iff ``k >= r``. ``min = max =
            0`` keeps every step (``exact``).

    ``result.decisions.draws`` are the ``r_k``, ``result.decisions.kept`` the kept steps.
    """

    name: ClassVar[str] = "alignprop"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = ("alignprop:min=2,max=5",)
    compare_specs: ClassVar[tuple[str, ...]] = ("alignprop",)
    cost_specs: ClassVar[tuple[str, ...]] = ("alignprop",)
    objectives: ClassVar[tuple[str, ...]] = ("terminal",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="adjoint of the chain whose detached steps keep only alpha_k "
        "(each step kept independently iff k >= r_k, r_k ~ U{min..max}, drawn per step)",
        evaluation="one VJP per kept step (from noise: one fused backward through the kept "
        "outputs and the state chain)",
        memory="graphs of the kept steps (detached steps run without a graph)",
    )

    min: int = int_option(
        0,
        minimum=0,
        doc="smallest r drawn per step (a step index, 0 = the noisiest step)",
        expect="an int >= 0 (at most max)",
    )
    max: int | None = optional_int_option(
        minimum=0,
        doc="largest r drawn per step (None: N); step k keeps its graph iff k >= r",
        expect="an int >= 0 (at least min, at most the number of sampler steps N), or None",
    )

    def __attrs_post_init__(self) -> None:
        if self.max is not None and self.min > self.max:
            raise InvalidValue(
                f"estimator 'alignprop': option min={self.min} exceeds max={self.max}; "
                f"r is drawn from min..max, so use min <= max"
            )

    def _range(self, num_steps: int) -> tuple[int, int]:
        return self.min, num_steps if self.max is None else self.max

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        low, high = self._range(num_steps)
        if high > num_steps:
            fix = f"use max <= {num_steps} (r = N already detaches every step)"
            raise too_many_steps("alignprop", f"max={high}", num_steps, fix)
        if low > high:
            fix = f"use min <= {high}"
            raise too_many_steps("alignprop", f"min={low}", num_steps, fix)

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> AlignPropDecisions:
        """The ``N`` draws replayed (one ``randint``) and the steps they keep."""
        low, high = self._range(chain.num_steps)
        draws = replay_uniform_ints(low, high, chain.num_steps, generator)
        return AlignPropDecisions(draws=draws, kept=kept_steps(draws))

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: AlignPropDecisions
    ) -> Definition:
        """``sum_{k in S} J_k^T beta_k c~_{k+1}`` and ``c~_0`` for the decisions' kept set."""
        return Definition(
            grad=alignprop_definition(chain, objective, decisions.kept),
            noise_grad=alignprop_noise_grad_definition(chain, objective, decisions.kept),
        )

    # -- the draws --------------------------------------------------------------------------

    def _draw(self, ctx: EstimationContext) -> frozenset[int]:
        """One ``r_k`` per step (recorded as the decisions); the kept steps."""
        low, high = self._range(ctx.num_steps)
        generator = ctx.generator
        device = generator.device if generator is not None else torch.device("cpu")
        with outside_fake_mode():  # a host decision from a real generator
            steps = (ctx.num_steps,)
            draws = torch.randint(low, high + 1, steps, generator=generator, device=device)
            drawn = [int(r) for r in draws.tolist()]
        # Data-parallel ranks keep rank 0's draws: they decide which graphs are kept.
        values = tuple(ctx.ranks.same_ints(drawn))
        kept = kept_steps(values)
        ctx.decide(AlignPropDecisions(draws=values, kept=kept))
        return frozenset(kept)

    # -- terminal -----------------------------------------------------------------------------

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        kept = self._draw(ctx)
        if ctx.field.engine == "autograd" and (ctx.sampled_here or ctx.surrogate):
            return _fused_chain(ctx, kept)
        return _sweep(ctx, kept)


def _zero_gradient(ctx: EstimationContext) -> ParamGradient:
    """No step kept: zeros (``surrogate()``: a loss with zero gradient)."""
    params = ctx.field.params
    if ctx.surrogate:
        return SurrogateTerms([torch.stack([(p * 0).sum() for p in params.values()]).sum()])
    return {name: torch.zeros_like(p) for name, p in params.items()}


def _fused_chain(
    ctx: EstimationContext, kept: frozenset[int]
) -> tuple[ParamGradient, Tensor | None]:
    """One chain: kept steps' outputs with their graph, detached steps' without, the state
    path in the graph; one backward of ``<z_N, a_N>`` (or that loss, in ``surrogate()``)."""
    field, times, num_steps = ctx.field, ctx.host_times, ctx.num_steps  # host floats
    step_noise = ctx.step_noise()
    recorded = None if ctx.sampled_here else ctx.trajectory()
    want_state_grad = ctx.want_noise_grad and not ctx.surrogate
    if recorded is not None:
        # Pinned to the recording, nothing before the lowest kept step reaches theta.
        start = min(kept, default=num_steps)
        z0 = recorded.states[start].detach()
    else:
        assert ctx.noise is not None
        start = 0
        z0 = ctx.noise.detach().requires_grad_(want_state_grad)
    states, velocities = [z0.detach()], []
    with torch.enable_grad():
        z = z0
        for k in range(start, num_steps):
            t = times[k]
            if recorded is not None and k != start:
                # The recording's value, the chain's derivative (z - z.detach() is 0).
                z = z - z.detach() + recorded.states[k]
            if k in kept:
                v = field._graph_forward(z, [t], None, low_memory=False)
                field.meter.forwards_with_graph += 1
                check_finite(v.detach(), "velocity", [t])
                velocities.append(v.detach())
            elif recorded is not None:
                v = recorded.velocities[k]  # a constant; its value is pinned away
            else:
                v = field.velocity(z.detach(), t)  # no graph: the output is detached
                velocities.append(v)
            z = affine_step(ctx.host_coefficients, k, z, v, step_noise)
            states.append(z.detach())
        if recorded is not None and start < num_steps:
            z = z - z.detach() + recorded.states[num_steps]
    if recorded is None:
        ctx.record(torch.stack(states), torch.stack(velocities))
    terminal_adjoint = ctx.terminal_adjoint()
    field.meter.param_vjps += len(kept)
    if not kept and not want_state_grad:
        return _zero_gradient(ctx), None
    if ctx.surrogate:
        return SurrogateTerms([inner(z, terminal_adjoint)]), None
    params = list(field.params.values())
    extra = [z0] if want_state_grad else []
    with torch.enable_grad():
        pulled = torch.autograd.grad(z, params + extra, terminal_adjoint, allow_unused=True)
    filled = [
        torch.zeros_like(x) if g is None else g for x, g in zip(params + extra, pulled, strict=True)
    ]
    grads = dict(zip(field.params, filled[: len(params)], strict=True))
    kept_times = [times[k] for k in sorted(kept)]
    check_finite(grads, "parameter gradient", kept_times)
    noise_grad = filled[-1] if want_state_grad else None
    if noise_grad is not None:
        check_finite(noise_grad, "state gradient", kept_times)
    return grads, noise_grad


def _sweep(ctx: EstimationContext, kept: frozenset[int]) -> tuple[ParamGradient, Tensor | None]:
    """The modified adjoint swept in reverse along the path: a joint VJP per kept step,
    ``alpha_k`` alone elsewhere (``estimate()`` on a recorded path, or ``engine="func"``)."""
    trajectory = ctx.trajectory()
    alpha, beta, _ = ctx.host_coefficients  # host floats: no sync per step
    adjoint = ctx.terminal_adjoint()
    lowest = min(kept, default=ctx.num_steps)
    grads: ParamGradient | None = None
    for k in reversed(range(ctx.num_steps)):
        if k < lowest and not ctx.want_noise_grad:
            break
        if k in kept:
            cotangent = beta[k] * adjoint
            _, z_grad, step_grads = ctx.field.joint_vjp(
                trajectory.states[k], ctx.host_times[k], cotangent
            )
            grads = add_grads(grads, step_grads)
            adjoint = alpha[k] * adjoint + z_grad
        else:
            adjoint = alpha[k] * adjoint
        check_finite(adjoint, "adjoint", [ctx.host_times[k]])
    if grads is None:
        grads = _zero_gradient(ctx)
    return grads, adjoint if ctx.want_noise_grad else None


@attrs.frozen
class AlignPropDecisions(Decisions):
    """The per-step draws of ``alignprop`` and the steps they kept.

    Attributes:
        draws: ``r_k`` for ``k = 0..N-1``.
        kept: the steps ``k`` with ``k >= r_k`` (their outputs kept their graph).
    """

    draws: tuple[int, ...]
    kept: tuple[int, ...]
