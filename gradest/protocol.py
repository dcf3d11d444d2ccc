"""The estimator protocol and what its two verbs return.

``surrogate()`` (training) returns a :class:`Surrogate`, ``estimate()`` (measuring) a
:class:`GradientEstimate`; both results share ``value``, ``cost``, ``info``,
``decisions`` and ``usable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypedDict, Unpack, runtime_checkable

import attrs
import torch
from torch import Tensor

from gradest._checks import check_surrogate as check_surrogate  # public here, for callers
from gradest.objectives import Objective
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory


@attrs.frozen
class Cost:
    """Work an estimate did, in units of one model call on the batch.

    A batched call over ``M`` stacked states counts ``M``. :meth:`model_units` applies the
    cost model (docs/design.md#cost-model); each estimator's formula is in
    docs/design.md#cost-formulas.

    Attributes:
        forwards_with_graph: forwards that kept an autograd graph for a later VJP.
        forwards_without_graph: forwards under ``no_grad`` (sampling, cotangents, gate).
        param_vjps: backward passes that produced parameter gradients (a joint
            state-and-parameter VJP counts here).
        state_vjps: backward passes for the state only (the adjoint), no parameter part.
    """

    forwards_with_graph: int = 0
    forwards_without_graph: int = 0
    param_vjps: int = 0
    state_vjps: int = 0

    @property
    def forwards(self) -> int:
        return self.forwards_with_graph + self.forwards_without_graph

    def model_units(self) -> float:
        """Cost in forward-equivalents under the cost model (docs/design.md#measuring-cost)."""
        return self.forwards + 2.0 * self.param_vjps + 1.0 * self.state_vjps

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            *(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other), strict=True))
        )


@attrs.frozen
class Decisions:
    """The random and gate decisions of one estimate; each estimator subclasses it.

    A frozen record of what the estimator chose (sdo's sampled steps and scale,
    truncated's depth, jagg's groups, nodes and fallbacks), so that its dense definition
    (:meth:`~gradest.base.EstimatorBase.definition`) and ``gradest check`` can re-evaluate
    exactly that estimate. Estimators without choices (``exact``) report the empty record.
    """


@attrs.frozen(eq=False)
class Definition:
    """An estimator's defining formula evaluated densely (``gradest.reference``).

    Attributes:
        grad: the flat ``[P]`` parameter gradient the formula prescribes (float64).
        noise_grad: the initial-noise gradient it prescribes (terminal objectives), or
            None where the estimator defines none.
    """

    grad: Tensor
    noise_grad: Tensor | None = None


def supports(estimator: Any, kind: str) -> bool:
    """Whether ``estimator`` defines ``kind`` (``"terminal"``/``"stepwise"``) objectives:
    its ``objectives`` class attribute, both kinds when it has none (plugins)."""
    return kind in getattr(estimator, "objectives", ("terminal", "stepwise"))


def check_steps(estimator: Any, num_steps: int) -> None:
    """Raise (``InvalidValue``, naming the option and the fix) if ``estimator``'s options
    cannot run on an ``num_steps``-step sampler; its optional ``check_steps``, nothing
    for a plugin without one. Call it before any work that knows ``N``."""
    method = getattr(estimator, "check_steps", None)
    if callable(method):
        method(num_steps)


def is_stateful(estimator: Any) -> bool:
    """Whether an estimator keeps state across calls that a training checkpoint must hold:
    one with ``state_dict(model)`` / ``load_state_dict(model, state)`` (``auto``'s
    schedule). A module's own ``state_dict()`` is not that."""
    return not isinstance(estimator, torch.nn.Module) and all(
        callable(getattr(estimator, name, None)) for name in ("state_dict", "load_state_dict")
    )


def is_estimator(candidate: Any) -> bool:
    """Whether ``candidate`` can estimate (has a callable ``estimate``): what measuring
    needs (``gradest.harness.compare`` takes such an object). A registered estimator has
    both verbs (:func:`missing_verbs`)."""
    return callable(getattr(candidate, "estimate", None))


#: The two verbs :class:`TrajectoryGradientEstimator` declares.
VERBS = ("estimate", "surrogate")


def missing_verbs(candidate: Any) -> tuple[str, ...]:
    """The verbs of the protocol (:data:`VERBS`) that ``candidate`` (an estimator or its
    class) lacks: what the registry refuses a plugin for."""
    return tuple(verb for verb in VERBS if not callable(getattr(candidate, verb, None)))


@attrs.frozen(eq=False)
class GradientEstimate:
    """The result of one ``estimate()``.

    Attributes:
        grads: ``dict[name, Tensor]`` for every trainable parameter, keyed as in
            ``model.named_parameters()``.
        noise_grad: gradient with respect to the initial noise, or None when not requested.
        value: (property) the objective's value on this batch, ``info["loss"]`` (NaN
            where the estimator recorded none), as on :class:`Surrogate`. For a stepwise
            objective it is the full ``sum_k loss_fn(k, v_k, trajectory)`` over all ``N``
            steps (the steps an estimator did not evaluate at their recorded velocities),
            the same for every estimator on the same trajectory; the evaluated steps'
            part is ``info["evaluated_value"]``.
        cost: the :class:`Cost` counts of this call.
        info: estimator diagnostics (loss, gate cosines, fallback fraction, and the
            decisions' fields for logs); ``info["nonfinite"]`` describes a dropped estimate
            (see ``usable``).
        decisions: the estimator's typed :class:`Decisions` record (None for a plugin
            that reports none).
    """

    grads: dict[str, Tensor]
    noise_grad: Tensor | None
    cost: Cost
    info: dict[str, Any] = attrs.field(factory=dict)
    decisions: Decisions | None = None

    @property
    def value(self) -> float:
        """The objective's value on this batch, as ``info["loss"]`` (for logging)."""
        return float(self.info.get("loss", float("nan")))

    @property
    def usable(self) -> bool:
        """False when a NaN/Inf was met and ``on_nonfinite="skip"`` dropped the estimate."""
        return "nonfinite" not in self.info

    def flat(self) -> Tensor:
        """All parameter gradients concatenated in ``named_parameters`` order."""
        return torch.cat([g.reshape(-1) for g in self.grads.values()])


@attrs.frozen(eq=False)
class Surrogate:
    """The result of one ``surrogate()``: a loss for autograd whose parameter gradient is
    an estimator's estimate.

    Every estimate is ``sum_j J_j^T G_j`` over the steps it evaluates, so its surrogate is
    ``sum_j <v_theta(z_j, t_j), G_j>`` with the states and cotangents ``G_j`` detached;
    ``loss.backward()`` (or ``accelerator.backward(loss)``, ``scaler.scale(loss).backward()``)
    evaluates the VJPs through the model called as itself, so DDP/FSDP, AMP, hooks and
    layer checkpointing apply and only autograd writes ``.grad``.

    Attributes:
        loss: 0-dim tensor; its autograd gradient w.r.t. every trainable parameter is
            the estimate. Its *value* is not the objective (log ``value``).
        value: the objective's value on this batch, as ``info["loss"]`` (for logging); for
            a stepwise objective the full sum over all ``N`` steps, as on
            :class:`GradientEstimate` (``info["evaluated_value"]``: the evaluated steps').
        cost: the :class:`Cost` counts, including the VJPs the caller's backward will run.
        info: estimator diagnostics, as on :class:`GradientEstimate`.
        decisions: the estimator's typed :class:`Decisions` record.
        usable: (property) as on :class:`GradientEstimate`: False only when
            ``info["nonfinite"]`` is set (``surrogate()`` raises on a NaN/Inf instead, so
            a surrogate it returns is usable).
    """

    loss: Tensor
    value: float
    cost: Cost
    info: dict[str, Any] = attrs.field(factory=dict)
    decisions: Decisions | None = None

    @property
    def usable(self) -> bool:
        """False when ``info["nonfinite"]`` is set, as on :class:`GradientEstimate`."""
        return "nonfinite" not in self.info


class SamplingInputs(TypedDict, total=False):
    """The keyword arguments every estimator method takes: where the path comes from.

    Attributes:
        noise: initial noise ``[B, ...]``; the estimator samples itself, the cheapest way
            for its strategy. Exclusive with ``trajectory``.
        trajectory: a path recorded with ``gradest.rollout`` on the same sampler.
        cond: keyword arguments for the model (class labels, text embeddings;
            :mod:`gradest.conditioning`).
        generator: the only source of randomness (sampled steps, truncation, SDE noise;
            a training-mode model's dropout draws from a stream seeded by it,
            :func:`gradest.model_rng_seed`; without it, from the global RNG).
    """

    noise: Tensor | None
    trajectory: Trajectory | None
    cond: Mapping[str, Any] | None
    generator: torch.Generator | None


class EstimateOptions(SamplingInputs, total=False):
    """:meth:`~TrajectoryGradientEstimator.estimate`'s keyword arguments beyond the inputs
    (both verbs also take ``engine=``).

    Attributes:
        noise_grad: also return the gradient w.r.t. the initial noise (terminal only).
        on_nonfinite: ``"raise"`` (default) or ``"skip"`` a NaN/Inf estimate.
    """

    noise_grad: bool
    on_nonfinite: str


@runtime_checkable
class TrajectoryGradientEstimator(Protocol):
    """One way of evaluating ``grad_theta L = sum_k J_k^T c_k`` for a sampling trajectory.

    Two verbs: ``surrogate()`` for training (a loss whose autograd gradient is the
    estimate) and ``estimate()`` for measuring (the gradients as a dict); both take
    ``(model, sampler, objective)`` and the same keyword arguments, ``engine=`` included
    (``"autograd"`` or ``"func"``; a plugin may ignore it). Implementations are
    frozen attrs classes whose fields are their options (a plugin without attrs takes its
    options as constructor keyword arguments). Both methods are required: the registry
    skips a plugin without either (:func:`missing_verbs`; a ``surrogate()`` can be made
    from ``estimate()`` with ``gradest.plugin.estimated_surrogate``). ``estimate(...,
    noise_grad=True)`` returns the initial-noise gradient or raises
    :class:`~gradest.errors.NoNoiseGradient`; it never answers with None. Beyond the two
    methods below, an estimator may define (``gradest.base.EstimatorBase`` does):

    * ``check_steps(num_steps)``: raise if its options cannot run on an ``N``-step
      sampler (callers such as ``gradest finetune`` call it before any work);
    * ``definition(chain, objective, decisions) -> Definition``: its formula evaluated
      from dense Jacobians for the decisions an estimate reported (``gradest check``);
    * ``always_exact`` (class attribute): every estimate is the exact gradient.
    """

    name: ClassVar[str]

    def estimate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = "autograd",
        **options: Unpack[EstimateOptions],
    ) -> GradientEstimate: ...

    def surrogate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = "autograd",
        **inputs: Unpack[SamplingInputs],
    ) -> Surrogate: ...
