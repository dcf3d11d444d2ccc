"""The two VJP engines behind one interface, against the dense reference (float64).

Every estimator reaches the engines through :class:`gradest.vjp.VelocityField`; these
tests call the field's VJPs directly, with each engine and in surrogate mode, on a
conditioned model at recorded states, and compare them with the dense Jacobians of
:func:`gradest.reference.dense_chain` (``J_k^T c`` and ``A_k^T c`` by explicit products).
"""

from __future__ import annotations

import pytest
import torch
from recorded_problem import BATCH, DIM, problem

from gradest.reference import relative_error
from gradest.testing.problems import seeded_normal
from gradest.vjp import (
    ENGINES,
    AutogradEngine,
    CostMeter,
    FuncEngine,
    SurrogateTerms,
    VelocityField,
)
from gradest.vjp.engines import ENGINE_CLASSES

EXACTNESS = 1e-12


def _field(engine: str, *, surrogate: bool = False) -> tuple[VelocityField, object]:
    p = problem(conditioned=True)
    field = VelocityField(
        p.model, p.cond or {}, BATCH, CostMeter(), engine=engine, surrogate=surrogate
    )
    return field, p


def _dense(p, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v, J, A)`` at recorded state ``k``: ``[D]``, ``[D, P]``, ``[D, D]``."""
    return p.chain.evaluate(p.trajectory.states[k], float(p.trajectory.times[k]))


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


def test_the_engine_names_are_the_two_classes():
    assert ENGINES == ("autograd", "func")
    assert ENGINE_CLASSES == {"autograd": AutogradEngine, "func": FuncEngine}
    for name in ENGINES:
        field, _ = _field(name)
        assert field.engine == name
    # surrogate() runs on the autograd engine whatever engine= says
    field, _ = _field("func", surrogate=True)
    assert field.engine == "autograd"


@pytest.mark.parametrize("engine", ENGINES)
def test_joint_and_state_vjps_match_the_dense_jacobians(engine):
    field, p = _field(engine)
    k = 2
    z, t = p.trajectory.states[k], float(p.trajectory.times[k])
    cotangent = seeded_normal((BATCH, DIM), seed=5)
    v_true, jac, state_jac = _dense(p, k)
    flat_c = cotangent.reshape(-1)

    v, z_grad, grads = field.joint_vjp(z, t, cotangent)
    assert list(grads) == [n for n, q in p.model.named_parameters() if q.requires_grad]
    assert relative_error(v, v_true) <= EXACTNESS
    assert relative_error(_flat(grads), jac.T @ flat_c) <= EXACTNESS
    assert relative_error(z_grad, state_jac.T @ flat_c) <= EXACTNESS
    assert not v.requires_grad and not z_grad.requires_grad

    v, z_grad = field.state_vjp(z, t, cotangent)
    assert relative_error(v, v_true) <= EXACTNESS
    assert relative_error(z_grad, state_jac.T @ flat_c) <= EXACTNESS
    assert (field.meter.forwards_with_graph, field.meter.param_vjps) == (2, 1)
    assert field.meter.state_vjps == 1
    assert all(q.grad is None for q in p.model.parameters())  # .grad never written


@pytest.mark.parametrize("surrogate", [False, True], ids=["estimate", "surrogate"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_batched_param_vjp_is_the_sum_of_the_steps(engine, surrogate):
    """Two stacked states in one call (the conditioning repeated): ``sum_j J_j^T c_j``,
    a gradient dict, or in surrogate mode a loss whose gradient it is."""
    field, p = _field(engine, surrogate=surrogate)
    steps = [1, 4]
    states = p.trajectory.states[steps]
    times = [float(p.trajectory.times[k]) for k in steps]
    cotangents = seeded_normal((len(steps), BATCH, DIM), seed=6)
    truth = sum(_dense(p, k)[1].T @ c.reshape(-1) for k, c in zip(steps, cotangents, strict=True))
    result = field.param_vjp(states, times, cotangents)
    if surrogate:
        assert isinstance(result, SurrogateTerms)
        params = [q for q in p.model.parameters() if q.requires_grad]
        grads = torch.autograd.grad(result.loss(), params)
        got = torch.cat([g.reshape(-1) for g in grads])
    else:
        assert isinstance(result, dict)
        got = _flat(result)
    assert relative_error(got, truth) <= EXACTNESS
    assert (field.meter.forwards_with_graph, field.meter.param_vjps) == (2, 2)
