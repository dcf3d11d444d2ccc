"""`adjoint` (the continuous adjoint, AdjointDPM) against its dense definition, `exact`, its
convergence order, torchdiffeq's `odeint_adjoint`, its memory and its refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from recorded_problem import BATCH, DIM, STEPS, objective_of, problem, run
from test_ddim import hand_built
from test_jagg import _log_log_slope as log_log_slope

import gradest
from gradest.errors import InvalidValue
from gradest.harness import peak_allocated_bytes
from gradest.reference import (
    adjoint_definition,
    adjoint_reconstruction,
    dense_chain,
    relative_error,
)
from gradest.strategies.adjoint import Adjoint
from gradest.testing.problems import (
    AffineVelocity,
    NoisyAffineSampler,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

# -- 1. its definition, from noise and on a recorded path ------------------------------------


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize(
    ("order", "solver"), [(1, "inverse"), (2, "inverse"), (3, "inverse"), (1, "backsolve")]
)
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", [("rectified", False, False), ("rectified", True, True)])
def test_adjoint_matches_its_dense_definition(setup, source, order, solver, engine):
    p = problem(*setup)
    objective = objective_of("terminal")
    est = Adjoint(order=order, solver=solver)
    result = run(est, p, objective, source, noise_grad=True, engine=engine)
    truth, noise_truth = adjoint_definition(p.chain, objective, order, solver)
    assert relative_error(result.flat(), truth) <= 1e-10
    assert relative_error(result.noise_grad, noise_truth) <= 1e-10
    assert 0 < result.info["reconstruction_error"] < 0.1
    if solver == "inverse":
        rebuilt = adjoint_reconstruction(p.chain, order)
        first = p.trajectory.states[0]
        assert result.info["reconstruction_error"] == pytest.approx(
            float((rebuilt[0] - first).norm() / first.norm()), rel=1e-8
        )
    assert result.decisions == gradest.Decisions()


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: NoisyAffineSampler(STEPS, drift=0.3, noise_scale=0.0),  # alpha_k != 1
        lambda: hand_built("epsilon", 0.0),  # DDIM with eta = 0
        lambda: hand_built("v_prediction", 0.0),
    ],
    ids=["affine-alpha", "ddim-eps", "ddim-v"],
)
def test_adjoint_inverts_any_deterministic_affine_step(sampler):
    flow = sampler()
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    trajectory = gradest.rollout(model, flow, noise)
    chain = dense_chain(model, flow, trajectory)
    objective = smooth_terminal_objective(DIM)
    result = Adjoint(order=2).estimate(model, flow, objective, noise=noise, noise_grad=True)
    truth, noise_truth = adjoint_definition(chain, objective, 2)
    assert relative_error(result.flat(), truth) <= 1e-10
    assert relative_error(result.noise_grad, noise_truth) <= 1e-10


def test_adjoint_is_exact_where_the_velocity_ignores_the_state():
    # v(z, t) = t u + b: the inversion of every step is exact, so is the gradient.
    model = AffineVelocity(DIM, seed=4)
    with torch.no_grad():
        model.weight.zero_()
    model.weight.requires_grad_(False)
    flow = gradest.RectifiedFlow(steps=7)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    exact = gradest.estimator("exact").estimate(
        model, flow, objective, noise=noise, noise_grad=True
    )
    result = Adjoint().estimate(model, flow, objective, noise=noise, noise_grad=True)
    assert relative_error(result.grads, exact.grads) <= 1e-13
    assert relative_error(result.noise_grad, exact.noise_grad) <= 1e-13
    assert result.info["reconstruction_error"] <= 1e-14
    # ... and not where it does: the reconstruction error is then the gradient's error.
    curved = tiny_mlp(DIM, hidden=8)
    exact = gradest.estimator("exact").estimate(curved, flow, objective, noise=noise)
    result = Adjoint().estimate(curved, flow, objective, noise=noise)
    assert result.info["reconstruction_error"] > 1e-6
    assert relative_error(result.grads, exact.grads) > 1e-6


# -- 2. convergence: the error falls like h^order -------------------------------------------

CONVERGENCE_STEPS = [8, 16, 32, 64]


def _log_log_slope(steps: list[int], errors: list[float]) -> tuple[float, float]:
    """Least-squares slope of log(error) against log(h) = -log(N), and the largest residual."""
    return log_log_slope([1.0 / n for n in steps], errors)


def _errors_against_exact(estimator: Adjoint) -> list[float]:
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    exact = gradest.estimator("exact")
    errors = []
    for steps in CONVERGENCE_STEPS:
        flow = gradest.RectifiedFlow(steps=steps)
        truth = exact.estimate(model, flow, objective, noise=noise).grads
        errors.append(
            relative_error(estimator.estimate(model, flow, objective, noise=noise).grads, truth)
        )
    return errors


def _converges_at(order: int, errors: list[float]) -> bool:
    slope, residual = _log_log_slope(CONVERGENCE_STEPS, errors)
    return abs(slope - order) <= 0.3 and residual <= 0.15


@pytest.mark.parametrize(
    ("order", "solver"), [(1, "inverse"), (2, "inverse"), (3, "inverse"), (1, "backsolve")]
)
def test_adjoint_error_falls_like_step_size_to_its_order(order, solver):
    errors = _errors_against_exact(Adjoint(order=order, solver=solver))
    assert min(errors) > 1e-12, f"errors reached float64 noise: {errors}"
    slope, residual = _log_log_slope(CONVERGENCE_STEPS, errors)
    assert _converges_at(order, errors), f"slope {slope:.3f}, residual {residual:.3f}: {errors}"


class _ForwardStepped(Adjoint):
    """The mutation the convergence test must catch: the forward step in place of the
    reverse one (``z^_k = alpha_k z^_{k+1} + beta_k v``)."""

    def _reverse_step(self, ctx, k, later):  # type: ignore[no-untyped-def]
        alpha, beta = ctx.host_coefficients[0][k], ctx.host_coefficients[1][k]
        velocity = ctx.field.velocity(later, ctx.host_times[k])
        return alpha * later + beta * velocity


def test_the_convergence_test_fails_for_a_forward_step():
    errors = _errors_against_exact(_ForwardStepped())
    assert not _converges_at(1, errors), errors
    assert min(errors) > 1e-2, errors  # the rebuilt path runs the wrong way: O(1) errors


# -- 3. against torchdiffeq's odeint_adjoint ---------------------------------------------------


def _odeint_adjoint_gradients(model, noise, objective, steps):
    """torchdiffeq's continuous adjoint as its users run it to keep no trajectory: output
    times ``[1, 0]`` only (with every step as an output time, it resets the state to the
    forward pass's at each one), fixed Euler steps of ``1/steps``."""
    torchdiffeq = pytest.importorskip("torchdiffeq")

    class Dynamics(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.velocity = model

        def forward(self, t, z):  # type: ignore[no-untyped-def]
            return self.velocity(z, t.expand(z.shape[0]))

    model.zero_grad()
    start = noise.clone().requires_grad_(True)
    ends = torch.tensor([1.0, 0.0], dtype=torch.float64)
    final = torchdiffeq.odeint_adjoint(
        Dynamics(), start, ends, method="euler", options={"step_size": 1.0 / steps}
    )[-1]
    objective.loss_fn(final).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return final.detach(), grads, start.grad


def test_the_backsolve_is_torchdiffeqs_odeint_adjoint():
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    for steps in (3, 8, 50):
        final, grads, noise_grad = _odeint_adjoint_gradients(model, noise, objective, steps)
        flow = gradest.RectifiedFlow(steps=steps)
        ours = Adjoint(solver="backsolve").estimate(
            model, flow, objective, noise=noise, noise_grad=True
        )
        assert torch.allclose(final, gradest.rollout(model, flow, noise).states[-1], atol=1e-14)
        assert relative_error(ours.grads, grads) <= 1e-12, steps
        assert relative_error(ours.noise_grad, noise_grad) <= 1e-12, steps


def test_the_inverse_solver_and_odeint_adjoint_differ_by_the_step_size():
    """torchdiffeq's Euler backsolve reads each reverse step at the later state and time,
    the default solver at the rebuilt earlier state: two first-order discretizations of
    one continuous adjoint, whose gradients differ by O(h)."""
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    gaps = []
    for steps in CONVERGENCE_STEPS:
        _, grads, _ = _odeint_adjoint_gradients(model, noise, objective, steps)
        flow = gradest.RectifiedFlow(steps=steps)
        gaps.append(
            relative_error(Adjoint().estimate(model, flow, objective, noise=noise).grads, grads)
        )
    assert max(gaps) < 0.1, gaps
    assert _converges_at(1, gaps), gaps


# -- 4. memory: no state of the path is kept --------------------------------------------------


def test_adjoint_memory_does_not_grow_with_the_chain():
    dim, batch = 16, 64
    state_bytes = dim * batch * 8
    model = tiny_mlp(dim, hidden=8)
    noise = seeded_normal((batch, dim), seed=5)
    objective = smooth_terminal_objective(dim)

    def peak(spec: str, steps: int) -> int:
        est, flow = gradest.estimator(spec), gradest.RectifiedFlow(steps=steps)
        return peak_allocated_bytes(lambda: est.estimate(model, flow, objective, noise=noise))

    # 24 more steps: the adjoint's peak grows by less than one state (a few scalars per
    # step: the deferred finiteness flags), exact:checkpoint=true's by at least 24 states.
    assert peak("adjoint", 32) - peak("adjoint", 8) < state_bytes
    assert peak("exact:checkpoint=true", 32) - peak("exact:checkpoint=true", 8) >= 24 * state_bytes
    assert peak("adjoint", 32) < peak("exact:checkpoint=true", 32)


def test_adjoint_cost_counts_one_reverse_forward_per_order_and_step():
    p = problem("rectified", False, False)
    objective = objective_of("terminal")
    for order in (1, 2):
        cost = run(Adjoint(order=order), p, objective, "noise").cost
        assert cost.forwards_without_graph == STEPS + order * STEPS  # sampling, rebuilding
        assert cost.forwards_with_graph == cost.param_vjps == STEPS
        assert cost.state_vjps == 0
        assert cost.model_units() == (1 + order + 3) * STEPS  # N(F + order F + 3F)
    # The backsolve's joint VJP at the later state also gives the reverse step: 4NF.
    cost = run(Adjoint(solver="backsolve"), p, objective, "noise").cost
    assert cost.forwards_without_graph == STEPS
    assert cost.model_units() == 4 * STEPS


# -- 5. the surrogate ---------------------------------------------------------------------------


@pytest.mark.parametrize("no_grad", [False, True])
def test_adjoint_surrogate_trains_with_its_estimate(no_grad):
    p = problem("rectified", True, True)
    objective = objective_of("terminal")
    est = Adjoint(order=2)
    estimate = run(est, p, objective, "noise")
    p.model.zero_grad()
    with torch.no_grad() if no_grad else torch.enable_grad():
        surrogate = est.surrogate(
            p.model, p.flow, objective, noise=p.noise, cond=p.cond, generator=torch.Generator()
        )
    surrogate.loss.backward()
    for name, param in p.model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(param.grad, estimate.grads[name], rtol=0, atol=1e-14), name
    p.model.zero_grad()
    assert surrogate.value == pytest.approx(estimate.info["loss"])
    assert surrogate.info["reconstruction_error"] == estimate.info["reconstruction_error"]


# -- 6. refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: gradest.FlowSDE(steps=STEPS, noise_level=0.5),
        lambda: NoisyAffineSampler(STEPS),
        lambda: hand_built("epsilon", 1.0),
    ],
    ids=["flow-sde", "noisy-affine", "ddpm"],
)
@pytest.mark.parametrize("verb", ["estimate", "surrogate"])
def test_adjoint_refuses_stochastic_samplers_in_one_line(sampler, verb):
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    with pytest.raises(InvalidValue) as caught:
        getattr(Adjoint(), verb)(model, sampler(), smooth_terminal_objective(DIM), noise=noise)
    message = str(caught.value)
    assert "\n" not in message
    assert "exact:checkpoint=true" in message and "adds noise" in message


def test_adjoint_refuses_stepwise_objectives_and_bad_options():
    p = problem("rectified", False, False)
    with pytest.raises(InvalidValue, match="terminal"):
        run(Adjoint(), p, objective_of("stepwise"), "trajectory")
    for bad in ("adjoint:order=0", "adjoint:order=-1", "adjoint:order=1.5"):
        with pytest.raises(gradest.GradestError, match="order"):
            gradest.estimator(bad)
    with pytest.raises(gradest.GradestError, match="solver"):
        gradest.estimator("adjoint:solver=rk4")
    with pytest.raises(InvalidValue, match="order=2 needs solver='inverse'"):
        gradest.estimator("adjoint:solver=backsolve,order=2")


def test_the_backsolve_refuses_steps_that_are_not_euler_steps():
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    sampler = NoisyAffineSampler(STEPS, drift=0.3, noise_scale=0.0)
    with pytest.raises(InvalidValue) as caught:
        Adjoint(solver="backsolve").estimate(
            model, sampler, smooth_terminal_objective(DIM), noise=noise
        )
    assert "\n" not in str(caught.value) and "solver=inverse" in str(caught.value)


# -- 7. the figures docs/estimators.md quotes are the committed reports' --------------------

ROOT = Path(__file__).resolve().parents[1]
REPORTS = {"MLP (untrained)": "mlp", "digits DiT (pretrained)": "digits"}


def adjoint_table() -> str:
    """docs/estimators.md's adjoint table, from docs/results/compare_adjoint/*/report.json."""
    lines = [
        "| model | estimator | rel. error to exact | reconstruction error | FLOPs × "
        "| retained × | peak mem × |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, folder in REPORTS.items():
        report = json.loads(
            (ROOT / "docs/results/compare_adjoint" / folder / "report.json").read_text()
        )
        for row in report["estimators"]:
            if row["spec"] == report["config"]["reference"]:
                continue
            recon = row["reconstruction_error"]
            lines.append(
                f"| {label} | `{row['label']}` | {row['relative_error']['mean']:.3g} "
                f"| {'-' if recon is None else format(recon['mean'], '.3g')} "
                f"| {row['cost']['flops_ratio']:.3g} | {row['cost']['retained_ratio']:.3g} "
                f"| {row['cost']['peak_ratio']:.3g} |"
            )
    return "\n".join(lines)


def test_the_adjoint_figures_in_the_docs_are_the_committed_reports():
    page = (ROOT / "docs" / "estimators.md").read_text(encoding="utf-8")
    assert adjoint_table() in page


def test_the_committed_convergence_figure_is_what_its_script_computes(tmp_path):
    """benchmarks/adjoint_convergence.py (deterministic) reproduces the committed record,
    and its fitted slopes are the orders."""
    script = ROOT / "benchmarks" / "adjoint_convergence.py"
    spec = importlib.util.spec_from_file_location("adjoint_convergence_script", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads(
        (ROOT / "docs/results/compare_adjoint/convergence.json").read_text(encoding="utf-8")
    )
    assert committed["steps"] == module.STEPS
    for name, expected_order in (("adjoint:order=2", 2), ("adjoint:solver=backsolve", 1)):
        errors = module.errors_against_exact(name)
        row = committed["estimators"][name]
        assert errors == pytest.approx(row["errors"], rel=1e-9), name
        assert abs(module.fitted_slope(errors) - expected_order) <= 0.1, name
    assert set(committed["estimators"]) == set(module.SPECS)
