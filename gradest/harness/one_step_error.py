"""How far the one-step cotangents of ``sdo`` / ``drtune`` are from the exact ones.

For a terminal objective the exact cotangent of step ``k`` is ``c_k = beta_k a_{k+1}``,
where the adjoint ``a_{k+1} = (dz_N/dz_{k+1})^T a_N`` carries ``a_N = dL/dz_N`` back
through every later state Jacobian ``A_j = alpha_j I + beta_j dv_j/dz_j``. The one-step
estimators replace it by ``c~_k = beta_k (prod_{j>k} alpha_j) a_N``: the same product with
every ``dv_j/dz_j`` dropped (docs/design.md#estimator-table, row ``sdo``). Their error on a
recorded trajectory is therefore exactly how far ``dz_N/dz_{k+1}``, applied to the task's
own ``a_N``, is from ``prod_{j>k} alpha_j`` times the identity: a more direct quantity than
the chain's operator norm (:func:`gradest.harness.chain_contraction`), which bounds the
products over every direction, not the one the reward pulls in. It costs one adjoint sweep
(``N - 1`` state VJPs), less than an ``exact`` gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import check_model_modes
from gradest.conditioning import check_cond
from gradest.errors import InvalidType
from gradest.harness.contraction import (
    RecordedJacobians,
    jacobian_calls,
    sample_norms,
)
from gradest.objectives import TerminalObjective
from gradest.samplers import AffineSampler
from gradest.trajectory import (
    Trajectory,
    check_model_fits_sampler,
    check_sampler,
    check_trajectory_matches,
    host_coefficients,
)
from gradest.vjp.model_call import unwrap_data_parallel

__all__ = ["OneStepCotangentError", "one_step_cotangent_error"]


@attrs.frozen(eq=False)
class OneStepCotangentError:
    """The one-step cotangents' error against the exact ones, per step and sample.

    Attributes:
        num_steps: ``N``, the sampler's number of steps (the rows, steps ``0 .. N-1``).
        errors: ``[N, B]`` float64 (CPU): ``||c~_k - c_k|| / ||c_k||`` of each sample (0
            where both are zero, inf where only the exact one is). Row ``N - 1`` is 0: the
            last step's cotangent is ``beta a_N`` either way.
        cosines: ``[N, B]`` float64: the cosine between ``c~_k`` and ``c_k`` (1 where the
            error is 0, nan where a cotangent is zero and the other is not).
    """

    num_steps: int
    errors: Tensor
    cosines: Tensor

    def summary(self) -> dict[str, Any]:
        """The measurement as JSON values: ``error`` / ``cosine`` per step (mean over the
        samples); ``mean_error`` / ``mean_cosine`` over every step and sample; ``at_start``
        the error at step 0 (mean over the samples), where the carried product is longest."""
        error = self.errors.mean(dim=1).tolist()
        return {
            "samples": int(self.errors.shape[1]),
            "steps": list(range(self.num_steps)),
            "error": error,
            "cosine": self.cosines.mean(dim=1).tolist(),
            "mean_error": float(self.errors.mean()),
            "mean_cosine": float(self.cosines.mean()),
            "at_start": error[0],
        }


def one_step_cotangent_error(
    model: torch.nn.Module,
    sampler: AffineSampler,
    trajectory: Trajectory,
    objective: TerminalObjective,
    cond: Mapping[str, Any] | None = None,
) -> OneStepCotangentError:
    """Measure the one-step cotangents' error (module docstring) on a recorded trajectory.

    Each sample of the batch is its own chain; its error is measured with its own rows of
    ``a_N = grad objective.loss_fn(z_N)``. The model is evaluated as it is (``model.eval()``
    first if it has dropout), under ``torch.no_grad`` (nothing lands in ``.grad``).

    Args:
        model: the velocity model, ``model(z, t, **cond)``.
        sampler: the sampler ``trajectory`` was recorded on.
        trajectory: a recorded path (:func:`gradest.rollout`).
        objective: the terminal objective whose ``a_N`` is carried back. A stepwise
            objective has no such error: the one-step estimators use its exact ``c_k``.
        cond: the conditioning the trajectory was recorded with.

    Returns:
        A :class:`OneStepCotangentError`.

    Raises:
        InvalidType / InvalidValue: a bad argument, in one line naming it.
    """
    if not isinstance(objective, TerminalObjective):
        raise InvalidType(
            "objective must be a gradest.TerminalObjective (a loss on z_N), got "
            f"{type(objective).__name__}; with a stepwise objective the one-step estimators "
            "use the exact cotangents, so there is no error to measure"
        )
    check_model_modes(model)
    check_sampler(sampler)
    check_model_fits_sampler(model, sampler)
    check_trajectory_matches(sampler, trajectory)
    states = trajectory.states
    cond = check_cond(cond, states.shape[1])

    alpha, beta, _ = host_coefficients(sampler.coefficients())
    jacobians = RecordedJacobians(
        unwrap_data_parallel(model), trajectory, sampler.times.tolist(), cond, chunk=None
    )  # one chain (the adjoint sweep), so one call per step
    _, a_final = objective.terminal_adjoint(states[-1])
    a_final = a_final.detach()
    num_steps = sampler.num_steps
    errors = torch.zeros(num_steps, states.shape[1], dtype=torch.float64)
    cosines = torch.ones_like(errors)
    # ``beta_k`` scales both cotangents of step k alike, so it cancels from the error and
    # the cosine: compare the adjoint ``a_{k+1}`` with ``(prod_{j>k} alpha_j) a_N``.
    adjoint, carried = a_final, 1.0
    with jacobian_calls():
        for k in reversed(range(num_steps)):
            errors[k], cosines[k] = _agreement(carried * a_final, adjoint)
            if k == 0:
                break  # a_0 is no step's cotangent
            # a_k = alpha_k a_{k+1} + beta_k (dv_k/dz_k)^T a_{k+1}
            pulled = jacobians.apply(k, adjoint[None], transpose=True)[0]
            adjoint = alpha[k] * adjoint + beta[k] * pulled
            carried *= alpha[k]
    return OneStepCotangentError(num_steps=num_steps, errors=errors, cosines=cosines)


def _agreement(one_step: Tensor, exact: Tensor) -> tuple[Tensor, Tensor]:
    """``[B]`` each: the relative error of ``one_step`` against ``exact`` and their cosine,
    per sample (rows of the batch), in float64."""
    one_step, exact = one_step.to(torch.float64)[None], exact.to(torch.float64)[None]
    exact_norm = sample_norms(exact)[0]
    error_norm = sample_norms(one_step - exact)[0]
    both = exact_norm * sample_norms(one_step)[0]
    dot = (one_step * exact).flatten(2).sum(dim=2)[0]
    error = torch.where(
        error_norm == 0, torch.zeros_like(error_norm), error_norm / exact_norm
    )  # x / 0 is inf: the exact cotangent vanishes where the one-step one does not
    cosine = torch.where(error_norm == 0, torch.ones_like(dot), dot / both)
    return error.cpu(), cosine.cpu()
