"""Every estimator's two verbs, ``surrogate`` and ``estimate``; strategies implement two methods.

``surrogate()`` is for training (a loss whose autograd gradient is the estimate),
``estimate()`` for measuring (the gradients as a dict); both take the same arguments
(``model, sampler, objective``, the sampling inputs and ``engine=``). A strategy
subclasses :class:`EstimatorBase` as a frozen attrs class and implements
``_terminal(ctx)`` and ``_stepwise(ctx)``, combining the engine's parameter VJPs with
:func:`gradest.vjp.add_grads` / :func:`gradest.vjp.scale_grads`. The same two methods
then serve ``estimate()`` (the VJPs evaluated) and ``surrogate()`` (the VJPs left to the
caller's autograd backward). Input validation, sampling, cost counting and the result
records live here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Unpack

import torch
from torch import Tensor

from gradest._checks import check_estimate_grads, trainable_parameters
from gradest._lone_rank import warn_if_lone_rank
from gradest.context import EstimationContext
from gradest.errors import InvalidType, InvalidValue, NoNoiseGradient
from gradest.errors import SurrogateOutdated as SurrogateOutdated  # its first home: re-exported
from gradest.model_state import ModelState, RecordedState
from gradest.nonfinite import ON_NONFINITE, NonFiniteError, deferred_checks
from gradest.objectives import Objective, StepwiseObjective
from gradest.protocol import (
    Decisions,
    Definition,
    EstimateOptions,
    GradientEstimate,
    SamplingInputs,
    Surrogate,
    supports,
)
from gradest.samplers import AffineSampler
from gradest.vjp import ENGINES, ParamGradient, SurrogateTerms, inner

# estimate()'s default engine, chosen by measurement (python -m benchmarks.report, two runs,
# docs/benchmarks.md): against the hand-written loop, terminal exact ran 0.96x-0.98x with
# the autograd engine and 0.91x-0.94x with torch.func (the transform around every op of
# the sequential chain); on the batched stepwise call the two were within noise. Only the
# autograd path runs layer checkpointing, and it never swaps the module's parameters.
DEFAULT_ENGINE = "autograd"


def _check_engine(engine: Any) -> None:
    if engine not in ENGINES:
        raise InvalidValue(
            f"engine must be one of {ENGINES} ('autograd' is the default), got {engine!r}"
        )


def _check_inputs(method: str, inputs: Mapping[str, Any], *, more: tuple[str, ...] = ()) -> None:
    """Unknown keyword arguments name the method and what it takes (not a bare TypeError)."""
    known = tuple(SamplingInputs.__annotations__)
    unknown = sorted(set(inputs) - set(known) - set(more))
    if unknown:
        raise InvalidType(
            f"{method}() got unexpected keyword argument(s) {', '.join(unknown)}; it takes "
            f"{', '.join(known + more)}"
        )


def _refuse_unrelated_stepwise_loss(ctx: EstimationContext) -> None:
    if ctx.is_terminal or ctx.stepwise_loss_depends:
        return
    # A random draw that missed every step the loss uses gives a zero estimate (the right
    # one for that draw); only a loss that depends on no step's velocity is refused.
    objective = ctx.objective
    if isinstance(objective, StepwiseObjective) and objective.depends_at_some_step(
        ctx.trajectory()
    ):
        return
    raise InvalidValue(
        "the stepwise loss does not depend on the velocities at any step "
        "(loss_fn returned tensors detached from v_k, integer/bool results, or values "
        "computed from something else), so the gradient would be zero; return a "
        "differentiable function of v_k (autograd refuses the same loss: 'element 0 of "
        "tensors does not require grad')"
    )


def _guard_backward(
    loss: Tensor, ctx: EstimationContext, estimator: str, start: ModelState
) -> None:
    """Checks at the start of ``loss``'s backward (a hook on the loss; no host sync).

    * The model must be as ``surrogate()`` left it (:mod:`gradest.model_state`: every
      parameter, buffer and submodule the same object at the same version, every module
      in the same train/eval mode), less what the call's own forwards changed (``start``
      is the fingerprint from before them). A changed model would make the backward
      disagree with it: ``exact:checkpoint=true`` recomputes its steps with the model as
      it is now (new weights, another dropout mode: a mixed gradient, or torch's raw
      ``CheckpointError``), the other estimators' graphs hold the old tensors (a replaced
      parameter gets no gradient; an in-place update fails inside torch's own check, or
      not). So every estimator raises :class:`SurrogateOutdated` first, before any
      gradient is computed or recomputation runs (the hook on the loss runs before the
      backward reaches anything the loss was computed from).
    * Non-finite gradients produced by the backward itself are watched
      (:class:`~gradest.nonfinite.BackwardWatch`, one check at the end of the backward).
    """
    if not loss.requires_grad:
        return
    field = ctx.field
    recorded = RecordedState.between(start, field.model_state())
    parameters = list(field.trainable.values())
    watch = field.watch
    if watch is not None:
        watch.sampler_times = ctx.times
        watch.estimator = estimator

    def on_backward(grad: Tensor) -> None:
        recorded.check(field.model_state(), estimator)
        if watch is not None:
            watch.start(grad, parameters)

    loss.register_hook(on_backward)


def surrogate_from_estimate(
    model: torch.nn.Module, result: GradientEstimate, *, estimator: Any = None
) -> Tensor:
    """``sum_p <p, g_p>``: a loss whose gradient is ``result.grads``, for any estimator.

    The fallback for estimators without a ``surrogate()`` of their own: autograd writes
    ``.grad`` and DDP's hooks average it, but the estimate itself was computed apart from
    autograd's backward (sharded FSDP parameters are not supported this way). The
    gradients are checked against the model's trainable parameters first (one per
    parameter, of its shape, dtype and device, finite), so an estimate that covers some
    parameters only never trains the others with zeros; ``estimator`` (the one that made
    ``result``) is named in that error.
    """
    trainable = trainable_parameters(model)
    if getattr(result, "usable", True) is False:
        raise InvalidValue(
            f"the estimate is unusable ({result.info.get('nonfinite', 'non-finite')}); it has "
            f"no gradients to train with: skip this batch (check result.usable first)"
        )
    grads = check_estimate_grads(estimator, result, trainable)
    terms = [inner(trainable[name], grad) for name, grad in grads.items()]
    return torch.stack(terms).sum()


def estimated_surrogate(
    estimator: Any,
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    **inputs: Any,
) -> Surrogate:
    """``estimator``'s surrogate made from its ``estimate()``: the ``surrogate()`` of a
    plugin that does not subclass :class:`EstimatorBase` (the protocol has two verbs)::

        def surrogate(self, model, sampler, objective, **inputs):
            return estimated_surrogate(self, model, sampler, objective, **inputs)

    The loss is :func:`surrogate_from_estimate` of the estimate (``sum_p <p, g_p>``: its
    gradient is the estimate, DDP averages it; it does not go through the model, so layer
    checkpointing and FSDP sharding do not apply); value, cost, info and decisions are the
    estimate's. Like every built-in surrogate, its backward first checks that the model is
    as the call left it (:class:`~gradest.errors.SurrogateOutdated` otherwise: the estimate
    belongs to the model that was sampled, not to one stepped or switched since).
    """
    start = ModelState.of(model)
    result = estimator.estimate(model, sampler, objective, **inputs)
    loss = surrogate_from_estimate(model, result, estimator=estimator)
    if loss.requires_grad:
        recorded = RecordedState.between(start, ModelState.of(model))
        name = repr(estimator)

        def on_backward(grad: Tensor) -> None:
            recorded.check(ModelState.of(model), name)

        loss.register_hook(on_backward)
    return Surrogate(
        loss=loss,
        value=result.value,
        cost=result.cost,
        info=dict(result.info),
        decisions=result.decisions,
    )


class EstimatorBase:
    """Base of the built-in estimators (plugins may use it or just follow the protocol).

    Two verbs: :meth:`surrogate` for training, :meth:`estimate` for measuring.
    """

    name: ClassVar[str] = "base"

    def estimate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = DEFAULT_ENGINE,
        **options: Unpack[EstimateOptions],
    ) -> GradientEstimate:
        """Estimate ``grad_theta L`` for ``model`` sampled along ``sampler``, for measuring.

        The gradients come back as a dict; ``.grad`` is never written. For training, use
        :meth:`surrogate` (same arguments) and backpropagate its ``loss``.

        Args:
            model: ``nn.Module`` called as ``model(z, t, **cond)``; only parameters with
                ``requires_grad=True`` are differentiated.
            sampler: the sampler, e.g. ``gradest.RectifiedFlow(steps=50)``.
            objective: ``TerminalObjective`` or ``StepwiseObjective``.
            engine: how the VJPs are evaluated. ``"autograd"`` (default): the module is
                called as itself and differentiated with ``torch.autograd.grad``, so hooks
                and layer checkpointing run; measured as fast as a hand-written loop.
                ``"func"``: ``functional_call`` + ``torch.func.vjp`` on a parameter dict
                (composable with ``vmap``/``jacrev``; 2-6% slower on the terminal chain
                in ``python -m benchmarks.report``; no layer checkpointing; the model's
                parameters are swapped in and out under a per-model lock). Both give the
                same numbers (to float rounding); ``.grad`` is never written.

        Keyword Args:
            noise: initial noise ``[B, ...]``: the estimator samples the path itself, the
                cheapest way for its strategy. ``noise``, ``trajectory``, ``cond`` and
                ``generator`` say where the path comes from
                (:class:`~gradest.protocol.SamplingInputs`).
            trajectory: instead of ``noise``, a path recorded with ``gradest.rollout``.
            cond: the model's keyword arguments.
            generator: the only source of randomness: the estimator's draws, and the
                stream a model in training mode draws its dropout masks from (seeded with
                :func:`gradest.model_rng_seed`, so they do not follow ``torch.manual_seed``;
                without ``generator`` they come from the global RNG, as in a hand-written
                loop).
            noise_grad: also return the gradient w.r.t. the initial noise (terminal only).
            on_nonfinite: ``"raise"`` (default) raises :class:`~gradest.NonFiniteError`
                naming the tensor, the step and the estimator at the first NaN/Inf;
                ``"skip"`` returns an estimate with empty ``grads`` and
                ``info["nonfinite"]`` set (``result.usable`` is False).

        Returns:
            A :class:`~gradest.protocol.GradientEstimate` (``grads``, ``value``, ``cost``,
            ``info``, ``decisions``, ``usable``).
        """
        _check_inputs("estimate", options, more=("noise_grad", "on_nonfinite", "engine"))
        warn_if_lone_rank()
        inputs: dict[str, Any] = dict(options)
        noise_grad = inputs.pop("noise_grad", False)  # validated by the context
        on_nonfinite = inputs.pop("on_nonfinite", "raise")
        if on_nonfinite not in ON_NONFINITE:
            raise InvalidValue(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        _check_engine(engine)
        whole = self._whole_call(
            model, sampler, objective, dict(options), engine=engine, surrogate=False
        )
        if whole is not None:
            return whole  # type: ignore[no-any-return]
        ctx = EstimationContext(
            model, sampler, objective, noise_grad=noise_grad, engine=engine, **inputs
        )
        try:
            grads, state_grad = self._run(ctx)
        except NonFiniteError as err:
            err.locate(sampler.times, repr(self))
            if on_nonfinite == "raise":
                raise
            return GradientEstimate(
                grads={},
                noise_grad=None,
                cost=ctx.meter.freeze(),
                info={**ctx.info, "nonfinite": str(err)},
                decisions=ctx.decisions,
            )
        assert isinstance(grads, dict), "estimate() evaluates every VJP"
        if noise_grad and state_grad is None:
            raise NoNoiseGradient(
                f"estimator {self!r} gives no noise gradient (its _terminal returned None for "
                f"it) but noise_grad=True was asked; leave noise_grad out, or return the "
                f"gradient w.r.t. the initial noise as _terminal's second item"
            )
        # Keys and order exactly as model.named_parameters(), trainable ones only.
        ordered = {name: grads[name].detach() for name in ctx.field.params}
        return GradientEstimate(
            grads=ordered,
            noise_grad=state_grad.detach() if noise_grad and state_grad is not None else None,
            cost=ctx.meter.freeze(),
            info=ctx.info,
            decisions=ctx.decisions,
        )

    def surrogate(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        engine: str = DEFAULT_ENGINE,
        **inputs: Unpack[SamplingInputs],
    ) -> Surrogate:
        """A loss whose autograd gradient is this estimator's estimate, for training loops.

        Does the estimator's cotangent work now (rollout, adjoint sweep, gate, random
        draws: the same decisions and numbers as :meth:`estimate` with the same inputs
        and generator state) and leaves every parameter VJP to the caller's backward::

            sur = est.surrogate(model, sampler, objective, noise=noise, generator=g)
            sur.loss.backward()          # or accelerator.backward(sur.loss),
            optimizer.step()             #    scaler.scale(sur.loss).backward()

        The loss is ``sum_j <v_theta(z_j, t_j), G_j>`` over the evaluated steps with the
        states and cotangents detached (a terminal objective's exact chains end in
        ``<z_N, a_N>`` with ``a_N = grad l(z_N)``), so ``loss.backward()`` evaluates exactly
        the VJPs ``estimate()`` would, through the model called as itself: forward hooks,
        ``DistributedDataParallel`` / ``fully_shard`` wrappers, autocast and
        ``torch.utils.checkpoint`` inside the model all apply, gradients accumulate over
        micro-batches, and only autograd writes ``.grad``. The cotangent work calls the
        module inside a DDP wrapper and differentiates states only, so it never touches
        ``.grad`` or the reducer. The graphs of the evaluated steps are held until the
        backward (as for a hand-written loss); ``exact:checkpoint=true`` recomputes them in
        the backward instead.

        The arguments are :meth:`estimate`'s: ``model``, ``sampler``, ``objective``,
        ``noise`` / ``trajectory`` / ``cond`` / ``generator`` and ``engine`` (no
        ``noise_grad``: the loss is for the parameters). ``engine`` is validated and
        accepted so that both verbs take the same arguments, but it does not change the
        result: the parameter VJPs run in the caller's backward through the module called
        as itself, and the cotangent work here uses autograd (what ``engine="func"`` would
        give, to float rounding).

        Returns:
            A :class:`~gradest.protocol.Surrogate` (``loss``, ``value``, ``cost``, ``info``,
            ``decisions``, ``usable``).

        Raises:
            NonFiniteError: a NaN/Inf in a velocity, cotangent or the loss's gradient.
        """
        _check_inputs("surrogate", inputs, more=("engine",))
        warn_if_lone_rank()
        _check_engine(engine)
        whole = self._whole_call(
            model, sampler, objective, dict(inputs), engine=engine, surrogate=True
        )
        if whole is not None:
            return whole  # type: ignore[no-any-return]
        ctx = EstimationContext(
            model, sampler, objective, noise_grad=False, engine=engine, surrogate=True, **inputs
        )
        # What the model is before the call's own forwards (its loss's backward refuses a
        # model changed since, except where those forwards changed it themselves).
        start = ctx.field.model_state()
        try:
            # The loss is for a backward: build its graph even when called under no_grad.
            with torch.enable_grad():
                terms, _ = self._run(ctx)
                loss = terms.loss() if isinstance(terms, SurrogateTerms) else None
        except NonFiniteError as err:
            err.locate(sampler.times, repr(self))
            raise
        if loss is not None:
            _guard_backward(loss, ctx, repr(self), start)
        if loss is None:
            raise InvalidType(
                f"estimator {self!r} combined its gradients outside the engine, so it has no "
                f"surrogate loss; combine them with gradest.plugin.add_grads/scale_grads, or "
                f"make its surrogate from its estimate with gradest.plugin.estimated_surrogate"
            )
        return Surrogate(
            loss=loss,
            value=float(ctx.info.get("loss", float("nan"))),
            cost=ctx.meter.freeze(),
            info=ctx.info,
            decisions=ctx.decisions,
        )

    def _run(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        kind = "terminal" if ctx.is_terminal else "stepwise"
        if kind not in self.objectives:
            raise self.unsupported_objective(kind)
        self.check_steps(ctx.num_steps)
        # No host sync per step: every NaN/Inf check of the call records device flags and
        # is decided once here at the end (the first failing check raises, as it would
        # have where it ran; a failure is located only after it is known).
        with deferred_checks():
            if ctx.is_terminal:
                grads, state_grad = self._terminal(ctx)
            else:
                grads, state_grad = self._stepwise(ctx), None
            _refuse_unrelated_stepwise_loss(ctx)
            ctx.finish_stepwise_value()
        if ctx.decisions is None:
            # Hooks that record no decisions made none (a deterministic estimator): the
            # empty record, which is also what gradest check expects of them.
            ctx.decide(Decisions())
        ctx.field.randomness.finish()
        return grads, state_grad

    # -- the estimator's contract ----------------------------------------------------------

    #: Every estimate is the exact gradient (``gradest compare`` needs one as reference).
    always_exact: ClassVar[bool] = False

    #: The objective kinds the estimator defines (``gradest check``/``compare`` skip others).
    #: Derived from the hooks a subclass writes (``_terminal`` -> ``"terminal"``,
    #: ``_stepwise`` -> ``"stepwise"``) unless a class sets it.
    objectives: ClassVar[tuple[str, ...]] = ("terminal", "stepwise")

    #: The configurations ``gradest check`` runs besides the default one (known truths,
    #: non-default options worth pinning; ``{N}`` is the check's step count).
    check_specs: ClassVar[tuple[str, ...]] = ()

    #: This estimator's entries in ``gradest compare``'s default line-up (its recommended
    #: forms; gradest's own estimators only, :func:`gradest.plugin.line_up`).
    compare_specs: ClassVar[tuple[str, ...]] = ()

    #: Its entries in ``gradest cost``'s default line-up (gradest's own estimators only).
    cost_specs: ClassVar[tuple[str, ...]] = ()

    def unsupported_objective(self, kind: str) -> InvalidValue:
        """The error for an objective kind this estimator does not define."""
        from gradest.registry import available_estimators  # the registry imports strategies

        other = "StepwiseObjective" if kind == "terminal" else "TerminalObjective"
        able = sorted(n for n, c in available_estimators().items() if supports(c, kind))
        return InvalidValue(
            f"estimator {self.name!r} ({self!r}) is defined for {' and '.join(self.objectives)} "
            f"objectives only, got a {kind} objective; use it with a {other}, or pick an "
            f"estimator for {kind} objectives: {', '.join(able)}"
        )

    def check_steps(self, num_steps: int) -> None:
        """Raise if the options cannot run on an ``num_steps``-step sampler (default: any).

        ``estimate``/``surrogate`` call it first; callers that know ``N`` early (a training
        script, ``gradest finetune``) call it before any work.
        """
        del num_steps

    def definition(self, chain: Any, objective: Objective, decisions: Any) -> Definition:
        """This estimator's formula, evaluated densely for the ``decisions`` an estimate made.

        Args:
            chain: a :class:`gradest.reference.DenseChain` of the recorded trajectory.
            objective: the objective the estimate was for.
            decisions: the estimate's :class:`~gradest.protocol.Decisions` record.

        Returns:
            A :class:`~gradest.protocol.Definition`. ``gradest check`` compares every
            estimate with it; plugins that define it are checked the same way.
        """
        raise NotImplementedError(f"{type(self).__name__} has no dense definition")

    def expected_decisions(
        self, chain: Any, objective: Objective, generator: torch.Generator
    ) -> Decisions:
        """The decisions an estimate on ``chain``'s trajectory must make, re-derived
        independently (:mod:`gradest.reference.decisions`) from the options, the dense
        chain and ``generator`` in the state the estimate started from.

        ``gradest check`` compares them with the estimate's and evaluates the
        :meth:`definition` at these, so wrong decisions fail even with right arithmetic.
        An estimator whose hooks record no decisions (``ctx.decide``) needs none of its
        own: its estimates report the empty :class:`~gradest.protocol.Decisions`, and that
        is what the check expects of them
        (:func:`gradest.testing.checks.verify_decisions`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not re-derive its decisions")

    # -- what a strategy implements --------------------------------------------------------

    def _whole_call(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        inputs: dict[str, Any],
        *,
        engine: str,
        surrogate: bool,
    ) -> Any:
        """For an estimator that hands whole calls to other estimators (``auto``: a probe,
        then its pick), the call's result: a ``GradientEstimate`` (``surrogate=False``,
        ``inputs`` as :meth:`estimate` got them) or a ``Surrogate``. Called by both verbs
        after their checks of the arguments. None, the default: the hooks below run."""
        del model, sampler, objective, inputs, engine, surrogate
        return None

    def _terminal(self, ctx: EstimationContext) -> tuple[ParamGradient, Tensor | None]:
        """Gradient for a terminal objective; also the initial-state gradient if wanted."""
        raise NotImplementedError

    def _stepwise(self, ctx: EstimationContext) -> ParamGradient:
        """Gradient for a stepwise objective."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__.lower()
        below = [base for base in cls.__mro__ if base is not EstimatorBase]
        if not any("objectives" in base.__dict__ for base in below):
            # No class below EstimatorBase says which kinds: the hooks written say it.
            written = tuple(
                kind
                for kind, hook in (("terminal", "_terminal"), ("stepwise", "_stepwise"))
                if getattr(cls, hook) is not getattr(EstimatorBase, hook)
            )
            cls.objectives = written or EstimatorBase.objectives
