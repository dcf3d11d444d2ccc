"""An estimate against the estimator's own dense definition, for tests and ``gradest check``.

An estimator that implements :meth:`~gradest.base.EstimatorBase.definition` (and,
optionally, :meth:`~gradest.base.EstimatorBase.expected_decisions`) states its formula
densely; :mod:`gradest.reference` evaluates it from materialised Jacobians. The functions
here run one estimate and compare it with that formula:

* :func:`verify_decisions` re-derives the decisions the estimate must make and evaluates
  the definition at them (the core of ``gradest check``);
* :func:`surrogate_gradient` is the autograd gradient of the estimator's surrogate loss;
* :func:`definition_error` / :func:`assert_matches_definition` do all of it for one
  model, sampler and objective.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Unpack

import torch
from torch import Tensor

from gradest._checks import check_surrogate
from gradest.errors import NoNoiseGradient
from gradest.objectives import Objective, StepwiseObjective
from gradest.protocol import Decisions, Definition, GradientEstimate, SamplingInputs, supports
from gradest.reference.decisions import decisions_mismatch
from gradest.reference.definitions import definition_at, expected_decisions
from gradest.reference.dense import dense_chain, relative_error
from gradest.trajectory import Trajectory, rollout

# Float64 definitions agree with float64 estimates to rounding.
DEFINITION_RTOL = 1e-8


def objective_kind(objective: Objective) -> str:
    """``"stepwise"`` or ``"terminal"``."""
    return "stepwise" if isinstance(objective, StepwiseObjective) else "terminal"


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A new generator in ``generator``'s current state (``generator`` is not advanced)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def verify_decisions(
    estimator: Any,
    chain: Any,
    objective: Objective,
    result: GradientEstimate,
    generator: torch.Generator,
) -> tuple[list[str] | None, Definition | None]:
    """The decision mismatches of ``result`` and the definition to compare it with.

    ``generator`` is in the state the estimate started from (it is copied, not advanced).
    Returns ``(mismatches, definition)``: ``mismatches`` is None when the estimator does
    not re-derive its decisions (``expected_decisions``) yet reported some (an estimate
    with the empty record, from hooks that recorded none, expects the empty record), and
    the definition is then
    evaluated at the estimate's own decisions; otherwise at the re-derived ones, so wrong
    decisions fail even with right arithmetic. The definition is None where the estimator
    defines none (a plugin may not).
    """
    expected = expected_decisions(estimator, chain, objective, copy_generator(generator))
    if expected is None and type(result.decisions) is Decisions:
        # Its hooks recorded no decisions (EstimatorBase records the empty one for them): a
        # deterministic estimator, whose expected decisions are none. One that draws and
        # forgets to say so fails on its definition, which no decisions can then match.
        expected = Decisions()
    if expected is None:
        return None, definition_at(estimator, chain, objective, result.decisions)
    return decisions_mismatch(result.decisions, expected), definition_at(
        estimator, chain, objective, expected
    )


def estimate_from_noise(
    est: Any,
    model: torch.nn.Module,
    sampler: Any,
    objective: Objective,
    noise: Tensor,
    terminal: bool,
    inputs: Mapping[str, Any],
    generator: Any,
) -> tuple[GradientEstimate, str | None]:
    """``est``'s estimate sampling from ``noise`` (``generator()`` gives each call its
    generator), with the noise gradient asked for when ``terminal``, and what is wrong with
    how it answered that: ``(result, problem)``. An estimator that gives no noise gradient
    refuses the request (:class:`~gradest.errors.NoNoiseGradient`; then the estimate
    without it is the result, no problem); one that returns None for it silently has the
    problem named."""
    call = {**inputs, "noise": noise, "generator": generator()}
    if not terminal:
        return est.estimate(model, sampler, objective, **call), None
    try:
        result = est.estimate(model, sampler, objective, noise_grad=True, **call)
    except NoNoiseGradient:
        call["generator"] = generator()
        return est.estimate(model, sampler, objective, **call), None
    if result.noise_grad is None:
        return result, (
            "noise_grad=True returned None: an estimator without a noise gradient refuses "
            "the request (gradest.plugin.NoNoiseGradient), never answers with a silent None"
        )
    return result, None


def noise_grad_error(estimate: Tensor, truth: Tensor) -> float:
    """Relative error, or the absolute one where the truth is zero (a cut chain)."""
    if float(truth.norm()) == 0.0:
        return float(estimate.to(torch.float64).norm())
    return relative_error(estimate, truth)


def surrogate_gradient(
    estimator: Any,
    model: torch.nn.Module,
    sampler: Any,
    objective: Objective,
    **inputs: Any,
) -> Tensor | None:
    """``autograd.grad(estimator.surrogate(model, sampler, objective, **inputs).loss)``
    over the trainable parameters, flat (zeros for unused ones); None for an estimator
    without a ``surrogate`` method."""
    if not callable(getattr(estimator, "surrogate", None)):
        return None
    sur = check_surrogate(estimator, estimator.surrogate(model, sampler, objective, **inputs))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sur.loss, params, allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(params, grads, strict=True)
        ]
    )


def definition_errors(
    estimator: Any,
    model: torch.nn.Module,
    sampler: Any,
    objective: Objective,
    *,
    trajectory: Trajectory | None = None,
    noise: Tensor | None = None,
    cond: Mapping[str, Any] | None = None,
    generator: torch.Generator | None = None,
    surrogate: bool = True,
) -> dict[str, Any]:
    """How far estimates of ``estimator`` are from its dense definition, by aspect.

    The path is ``trajectory`` or, with ``noise=``, a rollout of ``model`` from ``noise``
    (drawing any step noise from a generator seeded 0). ``generator`` (default: seeded 0)
    drives the estimator's random decisions; it is copied, never advanced. Returns a dict
    with

    * ``"decisions"``: the mismatches between the estimate's decisions and the re-derived
      ones (an empty list when they agree; None when the estimator re-derives none);
    * ``"trajectory"``: the relative error of the estimate on the path to the definition;
    * ``"noise"`` (``noise=`` with a deterministic sampler only): that of the estimate
      that samples from ``noise`` itself, and ``"noise_grad"`` its initial-noise gradient
      for a terminal objective (``"problems"``: an estimator that answered
      ``noise_grad=True`` with a silent None instead of refusing it);
    * ``"surrogate"`` (``surrogate=True``): the relative error of the surrogate loss's
      autograd gradient to the estimate (pass ``surrogate=False`` for an estimator whose
      calls depend on the calls before them, as ``auto``'s do: its first call probes);

    and ``"estimate"``, the estimate on the path. Raises ``ValueError`` when the estimator
    does not take ``objective``'s kind or defines no dense formula.
    """
    from gradest.registry import estimator as make_estimator

    est = make_estimator(estimator) if isinstance(estimator, str) else estimator
    kind = objective_kind(objective)
    if not supports(est, kind):
        raise ValueError(f"{est!r} does not take {kind} objectives")
    if (trajectory is None) == (noise is None):
        raise ValueError("pass exactly one of trajectory= and noise=")
    start = generator if generator is not None else torch.Generator().manual_seed(0)
    # Each call starts from the estimator's state before the check (``auto`` probes and
    # then picks a candidate: its calls depend on the calls before them).
    fresh = copy.deepcopy(est)
    if trajectory is None:
        assert noise is not None
        trajectory = rollout(
            model, sampler, noise, cond=cond, generator=torch.Generator().manual_seed(0)
        )
    chain = dense_chain(model, sampler, trajectory, cond)
    result = est.estimate(
        model, sampler, objective, trajectory=trajectory, cond=cond,
        generator=copy_generator(start),
    )  # fmt: skip
    mismatches, definition = verify_decisions(est, chain, objective, result, start)
    if definition is None:
        raise ValueError(f"{est!r} defines no dense formula (EstimatorBase.definition)")
    errors: dict[str, Any] = {
        "estimate": result,
        "decisions": mismatches,
        "trajectory": relative_error(result.flat(), definition.grad),
    }
    deterministic = not bool(sampler.coefficients()[2].ne(0).any())
    if noise is not None and deterministic:
        terminal = kind == "terminal"
        sampled, problem = estimate_from_noise(
            copy.deepcopy(fresh), model, sampler, objective, noise, terminal, {"cond": cond},
            lambda: copy_generator(start),
        )  # fmt: skip
        if problem:
            errors["problems"] = [problem]
        errors["noise"] = relative_error(sampled.flat(), definition.grad)
        if terminal and definition.noise_grad is not None and sampled.noise_grad is not None:
            errors["noise_grad"] = noise_grad_error(sampled.noise_grad, definition.noise_grad)
    if surrogate:
        flat = surrogate_gradient(
            copy.deepcopy(fresh), model, sampler, objective, trajectory=trajectory, cond=cond,
            generator=copy_generator(start),
        )  # fmt: skip
        if flat is not None:
            errors["surrogate"] = relative_error(flat, result.flat())
    return errors


def definition_error(
    estimator: Any, model: torch.nn.Module, sampler: Any, objective: Objective, **inputs: Any
) -> float:
    """The largest relative error of :func:`definition_errors` (decisions not included)."""
    errors = definition_errors(estimator, model, sampler, objective, **inputs)
    return max(value for key, value in errors.items() if key not in ("estimate", "decisions"))


def assert_matches_definition(
    estimator: Any,
    model: torch.nn.Module,
    sampler: Any,
    objective: Objective,
    *,
    rtol: float = DEFINITION_RTOL,
    surrogate: bool = True,
    **inputs: Unpack[SamplingInputs],
) -> GradientEstimate:
    """Assert that ``estimator`` computes what its own dense definition states.

    Runs :func:`definition_errors` (arguments as there: ``trajectory`` or ``noise``,
    ``cond``, ``generator``; ``estimator`` an instance or a spec string) and raises
    ``AssertionError`` naming what differs when the estimate's decisions differ from the
    re-derived ones, or an estimate (on the path, from the noise, its noise gradient, its
    surrogate's gradient) is more than ``rtol`` (relative, in norm) from the definition.
    The model should be small (dense Jacobians) and in float64 for the default ``rtol``.
    Returns the estimate on the path.
    """
    errors = definition_errors(estimator, model, sampler, objective, surrogate=surrogate, **inputs)
    result = errors.pop("estimate")
    mismatches = errors.pop("decisions")
    problems = errors.pop("problems", [])
    name = repr(estimator) if not isinstance(estimator, str) else estimator
    if mismatches:
        raise AssertionError(f"{name}: decisions differ: " + "; ".join(dict.fromkeys(mismatches)))
    if problems:
        raise AssertionError(f"{name}: " + "; ".join(problems))
    failed = {key: value for key, value in errors.items() if not value <= rtol}
    if failed:
        detail = ", ".join(f"{key} {value:.2e}" for key, value in failed.items())
        raise AssertionError(
            f"{name} differs from its definition (relative error > {rtol:g}): {detail}"
        )
    return result
