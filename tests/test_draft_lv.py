"""`draft_lv` (DRaFT-LV) against its dense definition, DRaFT-1, its copies and its cost."""

from __future__ import annotations

import pytest
import torch
from recorded_problem import BATCH, DIM, STEPS, objective_of, problem, run, surrogate_flat

import gradest
from gradest.errors import InvalidType, InvalidValue
from gradest.reference import relative_error
from gradest.reference.draft_lv import draft_lv_definition
from gradest.strategies import draft_lv
from gradest.strategies.draft_lv import DraftLV

SETUPS = [("rectified", False, False), ("rectified", True, True), ("sde", True, False)]


@pytest.mark.parametrize("copies", [1, 3])
@pytest.mark.parametrize(
    ("source", "seed"), [("noise", None), ("trajectory", None), ("trajectory", 7)]
)
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "flow-sde"])
def test_draft_lv_matches_its_dense_definition(setup, source, seed, copies):
    p = problem(*setup)
    objective = objective_of("terminal")
    result = run(DraftLV(copies=copies), p, objective, source, seed=seed, noise_grad=True)
    renoise = result.decisions.renoise
    assert renoise.shape == (copies, BATCH, DIM)
    truth, noise_truth = draft_lv_definition(p.chain, objective, renoise)
    assert relative_error(result.flat(), truth) <= 1e-10
    assert torch.equal(result.noise_grad, noise_truth.to(result.noise_grad.dtype))
    assert result.info["renoise"] == f"tensor[{copies}, {BATCH}, {DIM}]"  # not the tensor
    assert "tensor[" in repr(result.decisions)


def _renoise_with(monkeypatch, noise: torch.Tensor) -> None:
    monkeypatch.setattr(draft_lv, "draw_normal", lambda shape, like, generator: noise.clone())


@pytest.mark.parametrize("setup", SETUPS[:2], ids=["plain", "cond-frozen"])
def test_a_copy_at_the_recorded_state_is_draft_1(setup, monkeypatch):
    # eps with t eps + (1 - t) z_N = z_{N-1} re-noises onto the recorded last state, where
    # the copy's last step is the chain's own: DRaFT-LV with that copy is DRaFT-1.
    p = problem(*setup)
    objective = objective_of("terminal")
    states, t = p.trajectory.states, float(p.flow.times[STEPS - 1])
    _renoise_with(monkeypatch, ((states[-2] - (1 - t) * states[-1]) / t)[None])
    lv = run(DraftLV(copies=1), p, objective, "trajectory")
    draft = run(gradest.estimator("truncated:k=1"), p, objective, "trajectory")
    assert relative_error(lv.flat(), draft.flat()) <= 1e-10
    assert lv.info["loss"] == pytest.approx(draft.info["loss"], rel=1e-10)
    assert lv.info["sample_loss"] == pytest.approx(draft.info["loss"], rel=1e-12)


def test_copies_average_single_copy_gradients(monkeypatch):
    p = problem("sde", True, False)
    objective = objective_of("terminal")
    noise = torch.randn(
        3, BATCH, DIM, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    _renoise_with(monkeypatch, noise)
    together = run(DraftLV(copies=3), p, objective, "trajectory").flat()
    singles = []
    for eps in noise:
        _renoise_with(monkeypatch, eps[None])
        singles.append(run(DraftLV(copies=1), p, objective, "trajectory").flat())
    assert relative_error(together, torch.stack(singles).mean(0)) <= 1e-12


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_cost_is_the_sampling_plus_one_batched_step_per_copy(source):
    p = problem()
    result = run(DraftLV(copies=4), p, objective_of("terminal"), source)
    cost = result.cost
    assert cost.forwards_without_graph == (STEPS if source == "noise" else 0)
    assert (cost.forwards_with_graph, cost.param_vjps, cost.state_vjps) == (4, 4, 0)


def test_the_surrogate_gives_the_estimate():
    p = problem("rectified", True, True)
    objective = objective_of("terminal")
    result = run(DraftLV(), p, objective, "noise")
    flat, sur = surrogate_flat(DraftLV(), p, objective)
    assert torch.equal(sur.decisions.renoise, result.decisions.renoise)
    assert relative_error(flat, result.flat()) <= 1e-12


def test_refusals_name_the_problem():
    with pytest.raises(InvalidType, match="needs the sampler's interpolant"):
        run(DraftLV(), problem("noisy"), objective_of("terminal"), "trajectory")
    with pytest.raises(InvalidValue, match="terminal objectives only, got a stepwise"):
        run(DraftLV(), problem(), objective_of("stepwise"), "trajectory")
    with pytest.raises(InvalidValue, match="copies"):
        gradest.estimator("draft_lv:copies=0")
