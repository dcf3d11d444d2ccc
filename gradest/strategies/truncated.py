"""``truncated``: exact cotangents for the last ``k`` steps, zero before (DRaFT-K).

Cotangents (docs/design.md#estimator-table, row ``truncated``): ``c_j`` exact for
``j >= N - k`` and 0 for earlier steps, i.e. backpropagation through the last ``k``
sampling steps with the chain detached before step ``N - k``::

    g_k = sum_{j = N-k}^{N-1} J_j^T c_j

The kept cotangents need only the adjoint of the kept steps (``a_{j+1}`` for ``j >=
N-k`` depends on steps after ``j`` only), so they are exactly those of ``exact``.
``k=1`` is DRaFT-1, ``k=N`` is ``exact``. Stepwise objectives likewise keep the last
``k`` terms of ``sum_j J_j^T c_j``.

VJP evaluation: one VJP per kept step. Sampling from noise: a no-graph rollout of the
first ``N - k`` steps, then the last ``k`` with the graph kept and one fused VJP through
them. On a recorded trajectory: an adjoint sweep over the last ``k`` steps only, each a
joint state-and-parameter VJP (``surrogate()``: the last ``k`` steps as a chain pinned to
the recorded states, graph kept). Memory: the graphs of the last ``k`` steps. (The record:
``Truncated.axes``, :class:`gradest.axes.EstimatorAxes`.)

DRaFT-K with a random K: ``random="uniform"`` draws ``k`` uniformly from
``{k_min, ..., K}`` (``K`` = the ``k`` option, or ``N`` if unset; ``k_min`` defaults to 1).
This is not AlignProp's randomized truncation, which draws at every step and never cuts
the state path: that is the ``alignprop`` estimator. A probability tuple
``(p_1, ..., p_K)`` draws ``k`` with ``P(k) = p_k``. ``k`` is drawn **once per call**
from the ``generator``, never per step, so the result is an
unbiased estimate of ``sum_k p_k g_k`` (``gradest.reference.truncated_expectation``),
itself still biased against ``exact`` unless ``p_N = 1``.

Noise gradient: with ``k < N`` the chain is detached before step ``N - k``, so this
estimator's gradient with respect to the initial noise is **zero** (returned as zeros,
not None). With ``k = N`` it equals ``exact``'s.

Cost (docs/design.md#cost-formulas, row ``truncated``): from noise, ``N - k`` forwards
without a graph and the ``k`` kept steps with graph and VJP; on a recorded trajectory or
stepwise, the kept steps only (plus the rollout from noise). Retained activations: those
of the ``k`` kept steps.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import attrs
import torch
from torch import Tensor

from gradest.axes import EstimatorAxes
from gradest.base import EstimatorBase
from gradest.context import EstimationContext
from gradest.errors import InvalidType, InvalidValue
from gradest.objectives import Objective
from gradest.options import (
    bool_types,
    int_option,
    optional_int_option,
    parse_float_tuple,
    too_many_steps,
)
from gradest.protocol import Decisions, Definition
from gradest.reference.decisions import replay_probability_draw, replay_uniform_int
from gradest.reference.dense import DenseChain
from gradest.reference.truncated import (
    truncated_definition,
    truncated_noise_grad_definition,
)
from gradest.strategies.sampling import (
    draw_from_probabilities,
    draw_uniform_int,
    stepwise_vjp_over,
)
from gradest.vjp import ParamGradient

_RANDOM_EXPECT = (
    "None (fixed k), 'uniform' (k uniform on 1..K, K = the k option or N), or a sequence "
    "(tuple, list, 1-d array) of probabilities (p_1, ..., p_K) of k = 1..K that are >= 0 "
    "and sum to 1 (spec string: random=uniform or random=0.5/0.3/0.2)"
)
# Spec strings write decimals such as 0.1/0.2/0.7 whose float sum is off by ~1e-16.
_SUM_TOLERANCE = 1e-6


def _parse_random(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered == "none":
        return None
    if lowered == "uniform":
        return "uniform"
    try:
        return parse_float_tuple(text)
    except ValueError:
        # Leave it to the validator, whose message lists the accepted forms.
        return text.strip()


def _is_number(value: Any) -> bool:
    # Real numbers of any kind (numpy's too), as everywhere an option takes a number.
    return isinstance(value, numbers.Real) and not isinstance(value, bool_types())


def _convert_random(value: Any) -> Any:
    """What ``random=`` accepts, by kind: None, a text, or a sequence of probabilities (a
    list, a tuple, a 1-d numpy array or tensor) of real numbers of any kind, stored as a
    tuple of floats (hashable). Anything else is left for the validator to refuse."""
    if value is None or isinstance(value, str):
        return value
    shape = getattr(value, "shape", None)
    if shape is not None and len(tuple(shape)) == 1 and callable(getattr(value, "tolist", None)):
        value = value.tolist()  # a 1-d array of probabilities is a sequence of them
    if isinstance(value, list | tuple) and all(_is_number(p) for p in value):
        return tuple(float(p) for p in value)
    return value


def _shown(value: Any) -> str:
    """``value`` on one line: an array by its type and shape (its repr spans lines)."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, str | tuple):
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    return " ".join(repr(value).split())


def _validate_random(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    where = f"estimator 'truncated': option {attribute.name}={_shown(value)}"
    # Decided by type first: comparing an array with "uniform" would be elementwise.
    if value is None:
        return
    if isinstance(value, str):
        if value == "uniform":
            return
        raise InvalidValue(f"{where} is not a known distribution; expected {_RANDOM_EXPECT}")
    if isinstance(value, list):  # a sequence left unconverted: an entry is not a number
        bad = next(p for p in value if not _is_number(p))
        raise InvalidType(
            f"{where} holds {type(bad).__name__} {bad!r}, not a probability; expected "
            f"{_RANDOM_EXPECT}"
        )
    if not isinstance(value, tuple):
        shape = getattr(value, "shape", None)
        what = (
            f"is an array of shape {tuple(shape)}, not a 1-d sequence of probabilities"
            if shape is not None
            else f"has type {type(value).__name__}"
        )
        raise InvalidType(f"{where} {what}; expected {_RANDOM_EXPECT}")
    if not all(_is_number(p) for p in value):
        bad = next(p for p in value if not _is_number(p))
        raise InvalidType(
            f"{where} holds {type(bad).__name__} {bad!r}, not a probability; expected "
            f"{_RANDOM_EXPECT}"
        )
    if not value:
        raise InvalidValue(f"{where} is empty; expected {_RANDOM_EXPECT}")
    if not all(math.isfinite(p) and p >= 0 for p in value):
        raise InvalidValue(f"{where} has a negative or non-finite entry; expected {_RANDOM_EXPECT}")
    total = sum(value)
    if abs(total - 1.0) > _SUM_TOLERANCE:
        raise InvalidValue(
            f"{where} sums to {total:g}, not 1; expected {_RANDOM_EXPECT}. "
            f"Normalise it, e.g. tuple(p / sum(p) for p in probabilities)"
        )


@attrs.frozen
class Truncated(EstimatorBase):
    """Backpropagation through the last ``k`` sampling steps only (DRaFT-K; a random K).

    Preferred when the reward is decided by the last steps and compute is tight: DRaFT-1
    costs one step's backward; a random ``k`` reaches earlier steps at its mean cost. Not
    recommended when the reward depends on what the early, noisy steps decide (layout,
    composition): they get no gradient; ``drtune`` or ``alignprop`` reach them.

    Source: DRaFT-K (Clark, Vicol, Swersky, Fleet, "Directly Fine-Tuning Diffusion Models on
    Differentiable Rewards", ICLR 2024, arXiv 2309.17400).

    Attributes:
        k: the number of kept steps (``1 <= k <= N``, checked against ``N`` when
            estimating); None means 1 (DRaFT-1). With ``random="uniform"`` it is the
            largest ``k`` drawn (None: ``N``).
        random: None for a fixed ``k``; ``"uniform"``; or probabilities ``(p_1, ..., p_K)``
            of ``k = 1..K`` (then leave ``k`` unset). ``k`` is drawn once per call.
        k_min: with ``random="uniform"``, the smallest ``k`` drawn (``k`` is drawn from
            ``k_min..k`` once per call; AlignProp's per-step draws are ``alignprop``).

    A random ``k`` comes from the ``generator`` passed to ``estimate`` (with None, from
    torch's default generator: reproducible only through ``torch.manual_seed``).
    ``result.info["k"]`` is the ``k`` used.
    """

    name: ClassVar[str] = "truncated"
    # The check's pinned configurations, compare's and cost's default entries
    # (gradest.plugin.line_up asks every estimator for these).
    check_specs: ClassVar[tuple[str, ...]] = (
        "truncated:k={N}",
        "truncated:random=uniform,k_min=2",
    )
    compare_specs: ClassVar[tuple[str, ...]] = (
        "truncated:k=1",
        "truncated:random=uniform,k_min=2",
    )
    cost_specs: ClassVar[tuple[str, ...]] = ("truncated:k=1",)
    axes: ClassVar[EstimatorAxes] = EstimatorAxes(
        cotangents="exact adjoint, last k steps (zero before; random: k drawn once per call)",
        evaluation="one VJP per kept step (from noise: one fused VJP through the last k)",
        memory="no-graph rollout of the first N - k steps; graphs of the last k steps",
    )

    k: int | None = optional_int_option(
        minimum=1,
        doc="steps kept at the end of the chain (None: 1, or N with random='uniform')",
        expect="an int >= 1 (at most the number of sampler steps N), or None",
    )
    random: None | str | tuple[float, ...] = attrs.field(
        default=None,
        converter=_convert_random,
        validator=_validate_random,
        metadata={
            "doc": "draw k once per call: None, 'uniform', or probabilities p_1/p_2/...",
            "expect": _RANDOM_EXPECT,
            "parse": _parse_random,
        },
    )

    k_min: int = int_option(
        1,
        minimum=1,
        doc="with random='uniform': the smallest k drawn (once per call; not AlignProp)",
        expect="an int >= 1 (at most k), used with random='uniform'",
    )

    def __attrs_post_init__(self) -> None:
        if self.k_min != 1 and self.random != "uniform":
            raise InvalidValue(
                f"estimator 'truncated': option k_min={self.k_min} applies to "
                f"random='uniform' only (got random={self.random!r}); add random=uniform, "
                f"or drop k_min"
            )
        if self.k is not None and self.k_min > self.k:
            raise InvalidValue(
                f"estimator 'truncated': option k_min={self.k_min} exceeds k={self.k}; "
                f"k is drawn from k_min..k, so use k_min <= k"
            )
        if isinstance(self.random, tuple) and self.k is not None:
            raise InvalidValue(
                f"estimator 'truncated': options k={self.k} and random={self.random!r} "
                f"conflict; with a probability tuple the largest k is its length "
                f"({len(self.random)}), so leave k unset"
            )

    # -- terminal -------------------------------------------------------------------------

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        kept = self._draw_k(ctx)
        start = ctx.num_steps - kept
        grads, start_grad = ctx.backprop_tail(start)
        return grads, self._noise_grad(ctx, start, start_grad, ctx.trajectory().states[0])

    @staticmethod
    def _noise_grad(
        ctx: EstimationContext, start: int, start_grad: Tensor | None, noise: Tensor
    ) -> Tensor | None:
        """``a_0`` when the whole chain was kept; zero when it was cut before step 0."""
        if not ctx.want_noise_grad:
            return None
        if start == 0:
            return start_grad
        return torch.zeros_like(noise)

    # -- stepwise -------------------------------------------------------------------------

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        kept = self._draw_k(ctx)
        return stepwise_vjp_over(ctx, range(ctx.num_steps - kept, ctx.num_steps))

    # -- the truncation depth -------------------------------------------------------------

    def _largest(self, num_steps: int) -> tuple[int, str]:
        """The largest ``k`` the options can keep on ``N`` steps, and how to name it."""
        if isinstance(self.random, tuple):
            return len(self.random), f"random has {len(self.random)} probabilities"
        if self.random == "uniform":
            largest = num_steps if self.k is None else self.k
            return largest, f"k={largest} (the largest k drawn by random='uniform')"
        largest = 1 if self.k is None else self.k
        return largest, f"k={largest}"

    def _draw_k(self, ctx: EstimationContext) -> int:
        """The ``k`` of this call (drawn once if random); recorded as the decisions."""
        largest, _ = self._largest(ctx.num_steps)
        if isinstance(self.random, tuple):
            kept = draw_from_probabilities(self.random, ctx.generator)
        elif self.random == "uniform":
            kept = draw_uniform_int(self.k_min, largest, ctx.generator)
        else:
            kept = largest
        (kept,) = ctx.ranks.same_ints([kept])  # data-parallel ranks keep rank 0's depth
        ctx.decide(TruncatedDecisions(k=kept))
        return kept

    # -- the contract -----------------------------------------------------------------------

    def check_steps(self, num_steps: int) -> None:
        # Depends on the options and N only, never on a draw, so a bad setting fails on
        # the first call rather than on an unlucky one.
        largest, what = self._largest(num_steps)
        if self.k_min > largest:
            fix = f"use k_min <= {min(largest, num_steps)}"
            raise too_many_steps("truncated", f"k_min={self.k_min}", num_steps, fix)
        if largest > num_steps:
            fix = f"keep at most {num_steps} steps (k={num_steps} is exact)"
            raise too_many_steps("truncated", what, num_steps, fix)

    def expected_decisions(
        self, chain: DenseChain, objective: Objective, generator: torch.Generator
    ) -> TruncatedDecisions:
        """``k`` fixed, or replayed from the option's distribution."""
        num_steps = chain.num_steps
        if isinstance(self.random, tuple):
            return TruncatedDecisions(k=replay_probability_draw(self.random, generator))
        if self.random == "uniform":
            largest = num_steps if self.k is None else self.k
            return TruncatedDecisions(k=replay_uniform_int(self.k_min, largest, generator))
        return TruncatedDecisions(k=1 if self.k is None else self.k)

    def definition(
        self, chain: DenseChain, objective: Objective, decisions: TruncatedDecisions
    ) -> Definition:
        """The last ``k`` exact terms; the noise gradient ``a_0`` at ``k = N``, else zero."""
        return Definition(
            grad=truncated_definition(chain, objective, decisions.k),
            noise_grad=truncated_noise_grad_definition(chain, objective, decisions.k),
        )


@attrs.frozen
class TruncatedDecisions(Decisions):
    """How many steps ``truncated`` kept.

    Attributes:
        k: the truncation depth of this call.
    """

    k: int
