"""`jagg` against its dense definition, known exact cases, its convergence order and its costs."""

from __future__ import annotations

import functools
import math

import attrs
import pytest
import torch
from torch import Tensor

import gradest
from gradest.reference import dense_chain, exact_gradient, relative_error
from gradest.reference.jagg import jagg_definition, jagg_gate_cosines
from gradest.strategies.jagg import Jagg
from gradest.strategies.jagg_layout import (
    distinct_nodes,
    lagrange_weights,
    layout_groups,
    node_positions,
)
from gradest.testing import problems
from gradest.testing.problems import (
    AffineVelocity,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    straight_trajectory,
    tiny_mlp,
)

DIM, BATCH, STEPS, CLASSES = 3, 4, 11, 3


# -- shared problems -------------------------------------------------------------------------


@functools.cache
def _problem(conditioned: bool, frozen: bool, steps: int = STEPS):
    """A tiny MLP, its rollout and dense chain (cached: the chain is the expensive part)."""
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES if conditioned else None)
    if frozen:
        model.input.weight.requires_grad_(False)
        model.time_embed.mlp[0].requires_grad_(False)
    noise = seeded_normal((BATCH, DIM), seed=11)
    cond = {"y": torch.tensor([0, 2, 1, 3])} if conditioned else None  # 3 is the null class
    flow = gradest.RectifiedFlow(steps=steps)
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    chain = dense_chain(model, flow, trajectory, cond)
    return model, noise, cond, flow, trajectory, chain


def _objective(kind: str, steps: int = STEPS):
    if kind == "terminal":
        return smooth_terminal_objective(DIM)
    return random_stepwise_objective(steps, (BATCH, DIM))


def _passed(info) -> list[bool]:
    return [index not in info["fallback_groups"] for index in range(len(info["groups"]))]


def _definition(chain, objective, info) -> dict[str, Tensor]:
    flat = jagg_definition(chain, objective, info["groups"], info["nodes"], _passed(info))
    return chain.unflatten(flat)


def _assert_cosines_match(reported, dense) -> None:
    assert len(reported) == len(dense)
    for got, want in zip(reported, dense, strict=True):
        if want is None:
            assert got is None
        else:
            assert got == pytest.approx(want, abs=1e-12)


def _estimate(estimator, problem, objective, source: str, **extra):
    model, noise, cond, flow, trajectory, _ = problem
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    return estimator.estimate(model, flow, objective, cond=cond, **inputs, **extra)


# -- 1. against the dense definition ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize(("order", "shared_knots"), [(1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize(("conditioned", "frozen"), [(False, False), (True, True)])
def test_jagg_matches_definition(kind, source, order, shared_knots, conditioned, frozen):
    problem = _problem(conditioned, frozen)
    model, chain = problem[0], problem[5]
    objective = _objective(kind)
    # tau=-1 passes every group but still evaluates and reports the gate.
    estimator = Jagg(window=4, order=order, tau=-1.0, shared_knots=shared_knots)
    result = _estimate(estimator, problem, objective, source, noise_grad=kind == "terminal")
    info = result.info
    assert info["fallback_groups"] == []
    assert list(result.grads) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert relative_error(result.grads, _definition(chain, objective, info)) <= 1e-10
    dense = jagg_gate_cosines(chain, info["groups"], info["nodes"], chain.trajectory.times, "min")
    _assert_cosines_match(info["gate_cosines"], dense)
    # Interpolation on a nonlinear model is an approximation: the test above can fail.
    truth, truth_noise = exact_gradient(
        model, problem[3], objective, chain.trajectory, problem[2], chain=chain
    )
    assert relative_error(result.grads, truth) > 1e-6
    if kind == "terminal":
        # The adjoint is exact, so is the noise gradient a_0.
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("seed", [0, 2, 9, 12])
def test_debiased_jagg_matches_its_definition(seed, source, kind, checkpoint, engine):
    # window 3 on 11 steps: interpolated steps 1 and 4 (group 3 is all nodes); tau=0.9995
    # fails group 2 (cosine 0.99887: exact there, no correction). The seeds draw nodes and
    # a fallback step (0: {0, 10}, 2: {3, 8}) and interpolated steps (9: {4, 9}, 12: {4, 10}).
    problem = _problem(True, True)
    chain = problem[5]
    objective = _objective(kind)
    est = Jagg(window=3, debias=2, tau=0.9995, checkpoint=checkpoint)
    result = _estimate(
        est,
        problem,
        objective,
        source,
        noise_grad=kind == "terminal",
        generator=torch.Generator().manual_seed(seed),
        engine=engine,
    )
    decisions = result.decisions
    assert decisions.fallback_groups == (2,)
    assert len(decisions.debias_steps) == 2 and decisions.debias_scale == STEPS / 2
    assert decisions == est.expected_decisions(
        chain, objective, torch.Generator().manual_seed(seed)
    )
    truth = est.definition(chain, objective, decisions)
    assert relative_error(result.flat(), truth.grad) <= 1e-10
    if kind == "terminal":
        assert relative_error(result.noise_grad, truth.noise_grad) <= 1e-10
    # The correction is real: without it the definition differs whenever a drawn step is
    # interpolated (J_k != J^_k there).
    plain = jagg_definition(
        chain,
        objective,
        decisions.groups,
        decisions.nodes,
        [i not in decisions.fallback_groups for i in range(len(decisions.groups))],
    )
    interpolated = {k for g, n in zip(decisions.groups, decisions.nodes, strict=True) for k in g}
    interpolated -= {k for n in decisions.nodes for k in n}
    interpolated -= {k for i in decisions.fallback_groups for k in decisions.groups[i]}
    corrected = interpolated & set(decisions.debias_steps)
    assert bool(corrected) == (seed in (9, 12))
    assert (relative_error(truth.grad, plain) > 1e-6) == bool(corrected)


def test_debias_costs_at_most_m_more_parameter_vjps():
    problem = _problem(False, False, steps=16)
    objective = _objective("stepwise", steps=16)
    plain = _estimate(Jagg(window=4, gate="off"), problem, objective, "trajectory")
    for seed in range(6):
        result = _estimate(
            Jagg(window=4, gate="off", debias=3),
            problem,
            objective,
            "trajectory",
            generator=torch.Generator().manual_seed(seed),
        )
        nodes = set(plain.info["node_steps"])
        extra = len(set(result.decisions.debias_steps) - nodes)
        assert result.cost.param_vjps == plain.cost.param_vjps + extra


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_fused_and_checkpointed_terminal_agree(kind):
    problem = _problem(True, True)
    objective = _objective(kind)
    results = [
        _estimate(Jagg(window=4, tau=-1.0, checkpoint=m), problem, objective, "noise")
        for m in (False, True)
    ]
    assert results[0].decisions == results[1].decisions
    assert relative_error(results[0].grads, results[1].grads) <= 1e-12


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("aggregate", ["min", "mean"])
@pytest.mark.parametrize("shared_knots", [False, True])
def test_jagg_gate_with_failing_groups_matches_definition(kind, aggregate, shared_knots):
    problem = _problem(True, False)
    chain = problem[5]
    objective = _objective(kind)
    probe = _estimate(
        Jagg(window=4, gate=aggregate, tau=-1.0, shared_knots=shared_knots),
        problem,
        objective,
        "trajectory",
    )
    dense = jagg_gate_cosines(
        chain, probe.info["groups"], probe.info["nodes"], chain.trajectory.times, aggregate
    )
    _assert_cosines_match(probe.info["gate_cosines"], dense)
    gated = sorted(c for c in dense if c is not None)
    assert len(gated) >= 2 and gated[0] < gated[1], "the problem must separate the groups' cosines"
    tau = 0.5 * (gated[0] + gated[1])  # the worst group fails, the others pass
    result = _estimate(
        Jagg(window=4, gate=aggregate, tau=tau, shared_knots=shared_knots),
        problem,
        objective,
        "trajectory",
    )
    info = result.info
    expected_fallback = [i for i, c in enumerate(dense) if c is not None and c < tau]
    assert info["fallback_groups"] == expected_fallback and len(expected_fallback) == 1
    _assert_cosines_match(info["gate_cosines"], dense)
    assert relative_error(result.grads, _definition(chain, objective, info)) <= 1e-10
    # The fallback changed the gradient (towards exact) relative to the all-pass run.
    assert relative_error(result.grads, probe.grads) > 1e-8


def test_gate_never_changes_a_passing_group():
    problem = _problem(False, False)
    objective = _objective("stepwise")
    off = _estimate(Jagg(window=4, gate="off"), problem, objective, "trajectory")
    for aggregate in ("min", "mean"):
        on = _estimate(Jagg(window=4, gate=aggregate, tau=-1.0), problem, objective, "trajectory")
        assert all(torch.equal(on.grads[n], off.grads[n]) for n in off.grads)
    assert off.info["gate_cosines"] == [None] * len(off.info["groups"])


def NoisyAffineSampler() -> problems.NoisyAffineSampler:  # noqa: N802 - stands for the class
    """alpha != 1 and recorded noise (DDIM / flow-SDE shape): estimators see only the step form."""
    return problems.NoisyAffineSampler(8, drift=0.1)


def test_jagg_on_a_general_affine_sampler_matches_definition():
    model = tiny_mlp(DIM, hidden=8)
    flow = NoisyAffineSampler()
    noise = seeded_normal((BATCH, DIM), seed=11)
    trajectory = gradest.rollout(model, flow, noise, generator=torch.Generator().manual_seed(5))
    chain = dense_chain(model, flow, trajectory)
    objective = smooth_terminal_objective(DIM)
    result = Jagg(window=3, order=1, tau=-1.0).estimate(
        model, flow, objective, trajectory=trajectory
    )
    assert relative_error(result.grads, _definition(chain, objective, result.info)) <= 1e-10


# -- 2. known truths -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_window_two_is_exact(kind):
    problem = _problem(True, True)
    model, _, cond, flow, trajectory, chain = problem
    objective = _objective(kind)
    truth, _ = exact_gradient(model, flow, objective, trajectory, cond, chain=chain)
    result = _estimate(
        Jagg(window=2, order=1, shared_knots=False), problem, objective, "trajectory"
    )
    assert relative_error(result.grads, truth) <= 1e-10
    # Every step is a node: nothing is interpolated, nothing gated.
    assert result.info["gate_cosines"] == [None] * len(result.info["groups"])
    assert result.cost.param_vjps == STEPS


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("shared_knots", [False, True])
def test_gate_failing_everywhere_is_exact(kind, shared_knots):
    problem = _problem(False, False)
    model, _, cond, flow, trajectory, chain = problem
    objective = _objective(kind)
    truth, _ = exact_gradient(model, flow, objective, trajectory, cond, chain=chain)
    result = _estimate(
        Jagg(window=4, gate="min", tau=1.0, shared_knots=shared_knots),
        problem,
        objective,
        "trajectory",
    )
    info = result.info
    gated = [i for i, c in enumerate(info["gate_cosines"]) if c is not None]
    assert gated and info["fallback_groups"] == gated
    assert relative_error(result.grads, truth) <= 1e-10
    assert result.cost.param_vjps == STEPS
    assert info["node_steps"] == list(range(STEPS))


NON_UNIFORM = [1.0, 0.93, 0.81, 0.77, 0.62, 0.5, 0.47, 0.33, 0.2, 0.16, 0.08, 0.03, 0.0]


@functools.cache
def _straight_problem(grid: str):
    """A straight recorded path, and dense chains of an affine model and an MLP on it."""
    flow = (
        gradest.RectifiedFlow(steps=12)
        if grid == "uniform"
        else gradest.RectifiedFlow(times=torch.tensor(NON_UNIFORM, dtype=torch.float64))
    )
    trajectory = straight_trajectory(flow, BATCH, DIM)
    affine, mlp = AffineVelocity(DIM, seed=4), tiny_mlp(DIM, hidden=8)
    chains = {model: dense_chain(model, flow, trajectory) for model in (affine, mlp)}
    return flow, trajectory, affine, mlp, chains


@pytest.mark.parametrize("grid", ["uniform", "non-uniform"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize(
    ("window", "order", "shared_knots"),
    [
        (3, 1, False),
        (4, 1, True),
        (4, 2, False),
        (5, 2, True),
        (7, 1, False),
        (7, 3, True),
        (20, 1, False),
    ],
)
def test_affine_model_on_straight_path_is_exact(grid, kind, window, order, shared_knots):
    # J_t of v = W z + t u + b is affine in (z, t), hence a polynomial of degree 1 in t along
    # a straight path: every Lagrange interpolation in *time* of order >= 1 reproduces it
    # (interpolating in the step index would not, on the non-uniform grid).
    flow, trajectory, affine, mlp, chains = _straight_problem(grid)
    objective = _objective(kind, steps=flow.num_steps)
    estimator = Jagg(window=window, order=order, gate="off", shared_knots=shared_knots)
    truth, _ = exact_gradient(affine, flow, objective, trajectory, chain=chains[affine])
    result = estimator.estimate(affine, flow, objective, trajectory=trajectory)
    assert result.cost.param_vjps < flow.num_steps
    assert relative_error(result.grads, truth) <= 1e-10
    # The same layout on a nonlinear model is not exact, so the check above has teeth.
    mlp_truth, _ = exact_gradient(mlp, flow, objective, trajectory, chain=chains[mlp])
    mlp_result = estimator.estimate(mlp, flow, objective, trajectory=trajectory)
    assert relative_error(mlp_result.grads, mlp_truth) > 1e-6


# -- 3. convergence order --------------------------------------------------------------------

# The model's sinusoidal time embedding scales t by 1000 (frequencies up to 1000 rad per unit
# time), so J_t varies on a time scale of ~1e-3: the asymptotic regime starts at spans below
# that. From span 1e-3 the measured errors fall from ~1e-3 to ~5e-6 (order 1) and from ~5e-5
# to ~1e-8 (order 2), far above float64 rounding (~1e-15 relative).
CONVERGENCE_SPANS = [1e-3 * 2.0**-i for i in range(5)]


def _log_log_slope(spans: list[float], errors: list[float]) -> tuple[float, float]:
    """Least-squares slope of log(error) against log(span) and the largest residual."""
    x = torch.tensor([math.log(s) for s in spans], dtype=torch.float64)
    y = torch.tensor([math.log(e) for e in errors], dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], dim=1)
    fit = torch.linalg.lstsq(design, y[:, None]).solution.squeeze(1)
    residual = y - design @ fit
    return float(fit[0]), float(residual.abs().max())


@pytest.mark.parametrize("order", [1, 2])
def test_interpolation_error_scales_like_span_to_order_plus_one(order):
    steps, start = 8, 0.9
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = _objective("stepwise", steps=steps)
    # One group covering the whole chain over the time interval [start - span, start].
    estimator = Jagg(window=steps, order=order, gate="off")
    exact = gradest.estimator("exact")
    errors = []
    for span in CONVERGENCE_SPANS:
        flow = gradest.RectifiedFlow(
            times=torch.linspace(start, start - span, steps + 1, dtype=torch.float64)
        )
        trajectory = gradest.rollout(model, flow, noise)
        # `exact` is pinned to the dense reference in test_exact.py; it is much cheaper here.
        truth = exact.estimate(model, flow, objective, trajectory=trajectory).grads
        result = estimator.estimate(model, flow, objective, trajectory=trajectory)
        assert result.info["groups"] == [list(range(steps))]
        errors.append(relative_error(result.grads, truth))
    assert min(errors) > 1e-11, f"errors reached float64 noise: {errors}"
    slope, residual = _log_log_slope(CONVERGENCE_SPANS, errors)
    assert abs(slope - (order + 1)) <= 0.3, f"slope {slope:.3f}, errors {errors}"
    assert residual <= 0.1, f"not a power law (residual {residual:.3f}): {errors}"


# -- 4. cost accounting and info --------------------------------------------------------------


@pytest.mark.parametrize(("shared_knots", "nodes"), [(False, 8), (True, 5)])
def test_stepwise_costs_on_a_recorded_trajectory(shared_knots, nodes):
    problem = _problem(False, False, steps=16)
    objective = _objective("stepwise", steps=16)
    result = _estimate(
        Jagg(window=4, gate="off", shared_knots=shared_knots), problem, objective, "trajectory"
    )
    assert result.cost.param_vjps == nodes
    assert result.cost.forwards_with_graph == nodes
    assert result.cost.forwards_without_graph == 16 - nodes
    assert result.cost.state_vjps == 0
    assert len(result.info["node_steps"]) == nodes
    # From noise the rollout's velocities serve the non-node steps: N no-graph forwards.
    sampled = _estimate(
        Jagg(window=4, gate="off", shared_knots=shared_knots), problem, objective, "noise"
    )
    assert (sampled.cost.forwards_without_graph, sampled.cost.forwards_with_graph) == (16, nodes)
    assert sampled.cost.param_vjps == nodes


def test_stepwise_fallback_costs():
    problem = _problem(False, False, steps=16)
    objective = _objective("stepwise", steps=16)
    result = _estimate(Jagg(window=4, gate="min", tau=1.0), problem, objective, "trajectory")
    # Every group falls back: 8 node VJPs from the first batch, 8 more steps in a second one.
    assert result.info["fallback_fraction"] == 1.0
    assert result.cost.param_vjps == 16
    assert result.cost.forwards_with_graph == 16
    assert result.cost.forwards_without_graph == 8


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("noise_grad", [False, True])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_terminal_costs(noise_grad, source, checkpoint):
    steps, nodes = 16, 5
    problem = _problem(False, False, steps=steps)
    result = _estimate(
        Jagg(window=4, gate="off", shared_knots=True, checkpoint=checkpoint),
        problem,
        _objective("terminal"),
        source,
        noise_grad=noise_grad,
    )
    # The sweep takes a state VJP at every step except step 0 when a_0 is not wanted.
    swept = steps if noise_grad else steps - 1
    assert result.cost.state_vjps == swept
    assert result.cost.param_vjps == nodes
    if not checkpoint:
        # Fused: one forward with graph per step (sampling, or at the recorded states),
        # the sweep and the node VJP run through those graphs: (2N + 2n)F.
        assert result.cost.forwards_with_graph == steps
        assert result.cost.forwards_without_graph == 0
        return
    assert result.cost.forwards_with_graph == swept + nodes
    rollout = steps if source == "noise" else 0
    step_zero = 0 if (noise_grad or source == "noise") else 1  # v_0 for the gate
    assert result.cost.forwards_without_graph == rollout + step_zero


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_info_fields_are_consistent(kind):
    problem = _problem(False, False)
    probe = _estimate(Jagg(window=4, tau=-1.0), problem, _objective(kind), "trajectory")
    tau = sorted(c for c in probe.info["gate_cosines"] if c is not None)[1]  # >= 1 group fails
    result = _estimate(Jagg(window=4, tau=tau), problem, _objective(kind), "trajectory")
    info = result.info
    groups, nodes = info["groups"], info["nodes"]
    assert sorted(k for group in groups for k in group) == list(range(STEPS))
    assert len(nodes) == len(groups) == len(info["gate_cosines"])
    assert info["fallback_groups"] and len(info["fallback_groups"]) < len(groups)
    assert info["fallback_fraction"] == len(info["fallback_groups"]) / len(groups)
    evaluated = {k for group in nodes for k in group}
    evaluated |= {k for index in info["fallback_groups"] for k in groups[index]}
    assert info["node_steps"] == sorted(evaluated)
    assert result.cost.param_vjps == len(info["node_steps"])
    for index, cosine in enumerate(info["gate_cosines"]):
        assert isinstance(cosine, float)
        assert (index in info["fallback_groups"]) == (cosine < tau)
    assert isinstance(info["loss"], float)


# -- layout ----------------------------------------------------------------------------------


def test_layout_of_sixteen_steps():
    plain = layout_groups(16, window=4, order=1, shared_knots=False)
    assert [g.steps for g in plain] == [tuple(range(s, s + 4)) for s in (0, 4, 8, 12)]
    assert [g.nodes for g in plain] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    shared = layout_groups(16, window=4, order=1, shared_knots=True)
    assert [g.nodes for g in shared] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    assert distinct_nodes(shared) == (0, 4, 8, 12, 15)
    assert [g.steps for g in shared] == [g.steps for g in plain]


def test_layout_edge_cases():
    # A short last group, order 2: 10 steps, window 4 -> last group [8, 9] is all nodes.
    groups = layout_groups(10, window=4, order=2, shared_knots=False)
    assert [g.nodes for g in groups] == [(0, 2, 3), (4, 6, 7), (8, 9)]
    assert [g.is_exact for g in groups] == [False, False, True]
    shared = layout_groups(10, window=4, order=2, shared_knots=True)
    assert [g.nodes for g in shared] == [(0, 2, 4), (4, 6, 8), (8, 9)]
    # A last group of one step is exact.
    assert layout_groups(9, window=4, order=1, shared_knots=True)[-1].nodes == (8,)
    assert layout_groups(9, window=4, order=1, shared_knots=False)[-1].is_exact
    # A window longer than the chain: one group over every step.
    (single,) = layout_groups(6, window=10, order=1, shared_knots=True)
    assert single.steps == tuple(range(6)) and single.nodes == (0, 5)
    # Rounded linspace positions, halves up: linspace(0, 7, 3) = [0, 3.5, 7].
    assert node_positions(0, 7, 2) == (0, 4, 7)
    assert node_positions(3, 4, 3) == (3, 4)


def test_lagrange_weights():
    nodes = torch.tensor([0.9, 0.55, 0.3, 0.1], dtype=torch.float64)
    queries = torch.tensor([0.9, 0.7, 0.4, 0.3, 0.2, 0.0], dtype=torch.float64)
    weights = lagrange_weights(nodes, queries)
    torch.testing.assert_close(
        weights.sum(1), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-14
    )
    assert torch.equal(weights[0], torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(weights[3], torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    cubic = lambda t: 2 * t**3 - t + 0.5  # noqa: E731 - degree <= 3 is reproduced exactly
    torch.testing.assert_close(weights @ cubic(nodes), cubic(queries), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="distinct"):
        lagrange_weights([0.5, 0.5], [0.2])


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_window_longer_than_trajectory_is_one_group(kind):
    problem = _problem(False, False, steps=6)
    chain = problem[5]
    objective = _objective(kind, steps=6)
    result = _estimate(Jagg(window=10, gate="off"), problem, objective, "trajectory")
    assert result.info["groups"] == [list(range(6))]
    assert result.info["nodes"] == [[0, 5]]
    assert result.cost.param_vjps == 2
    assert relative_error(result.grads, _definition(chain, objective, result.info)) <= 1e-10


# -- 5. bad input and spec strings ------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"window": 1}, ValueError, "window=1"),
        ({"window": 2.5}, TypeError, "window=2.5"),
        ({"order": 0}, ValueError, "order=0"),
        ({"window": 4, "order": 4}, ValueError, "order=4 must be < window=4"),
        ({"window": 3, "order": 5}, ValueError, "order=5 must be < window=3"),
        ({"tau": 1.5}, ValueError, r"tau=1.5 .*\[-1, 1\]"),
        ({"tau": float("nan")}, ValueError, "tau=nan"),
        ({"gate": "max"}, ValueError, "gate='max'.*'min', 'mean', 'off'"),
        ({"shared_knots": "yes"}, TypeError, "shared_knots='yes'"),
    ],
)
def test_bad_options_fail_at_construction(options, error, words):
    with pytest.raises(error, match=words):
        Jagg(**options)
    with pytest.raises(error, match=words):
        gradest.estimator("jagg", **options)


def test_spec_string():
    est = gradest.estimator("jagg:window=4,tau=0.995,shared_knots=true")
    assert est == Jagg(window=4, tau=0.995, shared_knots=True)
    assert gradest.estimator("jagg:order=2,window=5,gate=mean") == Jagg(
        window=5, order=2, gate="mean"
    )
    with pytest.raises(ValueError, match="order=3 must be < window=3"):
        gradest.estimator("jagg:window=3,order=3")
    with pytest.raises(TypeError, match="shared_knots"):
        gradest.estimator("jagg:shared_knots=maybe")


# -- 6. determinism, evolve, repr -------------------------------------------------------------


def test_same_generator_gives_bitwise_identical_results():
    model = tiny_mlp(DIM, hidden=8)
    flow = NoisyAffineSampler()  # stochastic sampler: the generator draws the step noise
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    est = Jagg(window=3, tau=0.9)
    runs = [
        est.estimate(
            model,
            flow,
            objective,
            noise=noise,
            noise_grad=True,
            generator=torch.Generator().manual_seed(7),
        )
        for _ in range(2)
    ]
    assert all(torch.equal(runs[0].grads[n], runs[1].grads[n]) for n in runs[0].grads)
    assert torch.equal(runs[0].noise_grad, runs[1].noise_grad)
    assert runs[0].info == runs[1].info
    other = est.estimate(
        model, flow, objective, noise=noise, generator=torch.Generator().manual_seed(8)
    )
    assert not torch.equal(other.grads["output.bias"], runs[0].grads["output.bias"])


def test_evolve_repr_hash():
    est = Jagg()
    assert repr(est) == (
        "Jagg(window=4, order=1, tau=0.995, gate='min', shared_knots=False, debias=0, "
        "checkpoint=False)"
    )
    wider = attrs.evolve(est, window=8, order=3)
    assert (wider.window, wider.order, wider.tau) == (8, 3, 0.995)
    assert hash(wider) != hash(est) and wider != est
    with pytest.raises(ValueError, match="order=3 must be < window=3"):
        attrs.evolve(wider, window=3)
    assert Jagg.name == "jagg" and gradest.available_estimators()["jagg"] is Jagg
    assert isinstance(est, gradest.TrajectoryGradientEstimator)
