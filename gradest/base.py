"""Shared ``estimate``/``backward`` entry points; strategies implement two methods.

A strategy subclasses :class:`EstimatorBase` as a frozen attrs class and implements
``_terminal(ctx)`` and ``_stepwise(ctx)``. Input validation, sampling, cost counting,
the result record and gradient accumulation live here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradest.context import EstimationContext
from gradest.flow import AffineSampler, Trajectory
from gradest.nonfinite import ON_NONFINITE, NonFiniteError
from gradest.objectives import Objective
from gradest.protocol import GradientEstimate
from gradest.vjp import Grads


class EstimatorBase:
    """Base of the built-in estimators (plugins may use it or just follow the protocol)."""

    name: ClassVar[str] = "base"

    def estimate(
        self,
        model: torch.nn.Module,
        flow: AffineSampler,
        objective: Objective,
        *,
        noise: Tensor | None = None,
        trajectory: Trajectory | None = None,
        cond: Mapping[str, Any] | None = None,
        generator: torch.Generator | None = None,
        noise_grad: bool = False,
        on_nonfinite: str = "raise",
    ) -> GradientEstimate:
        """Estimate ``grad_theta L`` for ``model`` sampled along ``flow``.

        Args:
            model: ``nn.Module`` called as ``model(z, t, **cond)``; only parameters with
                ``requires_grad=True`` are differentiated.
            flow: the sampler, e.g. ``gradest.RectifiedFlow(steps=50)``.
            objective: ``TerminalObjective`` or ``StepwiseObjective``.
            noise: initial noise ``[B, ...]``; the estimator samples itself, the cheapest
                way for its strategy. Exclusive with ``trajectory``.
            trajectory: a path recorded with ``gradest.rollout`` on the same flow.
            cond: keyword arguments for the model (class labels, text embeddings).
            generator: the only source of randomness (sampled steps, truncation, SDE noise).
            noise_grad: also return the gradient w.r.t. the initial noise (terminal only).
            on_nonfinite: ``"raise"`` (default) raises :class:`~gradest.NonFiniteError`
                naming the tensor, the step and the estimator at the first NaN/Inf;
                ``"skip"`` returns an estimate with empty ``grads`` and
                ``info["nonfinite"]`` set (``result.usable`` is False).

        Returns:
            A :class:`~gradest.protocol.GradientEstimate`.
        """
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        ctx = EstimationContext(
            model,
            flow,
            objective,
            noise=noise,
            trajectory=trajectory,
            cond=cond,
            generator=generator,
            noise_grad=noise_grad,
        )
        try:
            if ctx.is_terminal:
                grads, state_grad = self._terminal(ctx)
            else:
                grads, state_grad = self._stepwise(ctx), None
        except NonFiniteError as err:
            err.locate(flow.times, repr(self))
            if on_nonfinite == "raise":
                raise
            return GradientEstimate(
                grads={},
                noise_grad=None,
                cost=ctx.meter.freeze(),
                info={**ctx.info, "nonfinite": str(err)},
            )
        # Keys and order exactly as model.named_parameters(), trainable ones only.
        ordered = {name: grads[name].detach() for name in ctx.field.params}
        return GradientEstimate(
            grads=ordered,
            noise_grad=state_grad.detach() if (noise_grad and state_grad is not None) else None,
            cost=ctx.meter.freeze(),
            info=ctx.info,
        )

    def backward(
        self,
        model: torch.nn.Module,
        flow: AffineSampler,
        objective: Objective,
        *,
        noise: Tensor | None = None,
        trajectory: Trajectory | None = None,
        cond: Mapping[str, Any] | None = None,
        generator: torch.Generator | None = None,
        noise_grad: bool = False,
        on_nonfinite: str = "raise",
    ) -> GradientEstimate:
        """Like :meth:`estimate`, then add the gradients into ``p.grad`` (like ``loss.backward()``).

        Existing ``.grad`` values are accumulated into, so gradient accumulation and
        ``optimizer.step()`` work as with plain autograd. With ``on_nonfinite="skip"`` an
        unusable estimate leaves ``.grad`` untouched (check ``result.usable``).
        """
        result = self.estimate(
            model,
            flow,
            objective,
            noise=noise,
            trajectory=trajectory,
            cond=cond,
            generator=generator,
            noise_grad=noise_grad,
            on_nonfinite=on_nonfinite,
        )
        if not result.usable:
            return result
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, grad in result.grads.items():
                param = parameters[name]
                if param.grad is None:
                    param.grad = grad.to(param.dtype).clone()
                else:
                    param.grad.add_(grad.to(param.grad.dtype))
        return result

    # -- what a strategy implements --------------------------------------------------------

    def _terminal(self, ctx: EstimationContext) -> tuple[Grads, Tensor | None]:
        """Gradient for a terminal objective; also the initial-state gradient if wanted."""
        raise NotImplementedError

    def _stepwise(self, ctx: EstimationContext) -> Grads:
        """Gradient for a stepwise objective."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__.lower()
