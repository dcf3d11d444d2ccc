"""The ``auto`` estimator: probes, picks within a budget, caches, rechecks, explains."""

from __future__ import annotations

import pytest
import torch

import gradest
from gradest.errors import InvalidValue
from gradest.harness.auto import Auto, AutoDecisions, clear_cache
from gradest.reference import relative_error
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 4, 8


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def setup():
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=STEPS)
    return model, flow, smooth_terminal_objective(DIM)


def noise(i: int) -> torch.Tensor:
    return seeded_normal((BATCH, DIM), 100 + i)


def test_probe_calls_return_the_exact_gradient_then_the_choice_takes_over(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=1"), probe_batches=2, draws=2, recheck_every=5)
    exact = gradest.estimator("exact")
    probing = []
    for i in range(7):
        result = est.estimate(model, flow, objective, noise=noise(i))
        probing.append(result.decisions.probing)
        assert isinstance(result.decisions, AutoDecisions)
        if result.decisions.probing:
            truth = exact.estimate(model, flow, objective, noise=noise(i))
            assert relative_error(result.flat(), truth.flat()) <= 1e-12
        else:
            chosen = gradest.estimator(result.decisions.choice)
            again = chosen.estimate(model, flow, objective, noise=noise(i))
            assert relative_error(result.flat(), again.flat()) <= 1e-12
    # Two probes, then the choice; call 6 (index 5) starts the recheck's two probes.
    assert probing == [True, True, False, False, False, True, True]


def test_a_probe_reports_what_it_spent(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=1"), draws=2)
    probe = est.estimate(model, flow, objective, noise=noise(0))
    after = est.estimate(model, flow, objective, noise=noise(1))
    exact_units = gradest.estimator("exact").estimate(model, flow, objective, noise=noise(1))
    # exact on the path, then per candidate 2 draws on the path and 2 from the noise.
    assert probe.cost.model_units() > 4 * exact_units.cost.model_units()
    chosen = gradest.estimator(after.decisions.choice)
    assert after.cost == chosen.estimate(model, flow, objective, noise=noise(1)).cost


def test_the_budget_decides(setup):
    model, flow, objective = setup
    candidates = ("exact", "truncated:k=1")
    # truncated:k=1 is cheap but biased on this chain.
    unbounded = Auto(candidates=candidates, draws=2)
    strict = Auto(candidates=candidates, draws=2, max_bias=0.01)
    cheapest_only = Auto(candidates=candidates, draws=2, max_slowdown=1.0)
    for est in (unbounded, strict, cheapest_only):
        est.estimate(model, flow, objective, noise=noise(0))
    picks = {
        name: est.estimate(model, flow, objective, noise=noise(1)).decisions.choice
        for name, est in [
            ("strict", strict),
            ("cheapest", cheapest_only),
        ]
    }
    assert picks == {"strict": "exact", "cheapest": "truncated:k=1"}
    info = cheapest_only.estimate(model, flow, objective, noise=noise(2)).info
    table = info["auto_measurements"]
    assert table["exact"]["bias"] == 0 and table["exact"]["cost"] == 1
    assert table["truncated:k=1"]["bias"] > 0.01 and table["truncated:k=1"]["cost"] < 1
    assert info["auto_selected"] == info["auto_choice"] == "truncated:k=1"
    assert "truncated:k=1" in info["auto_reason"] and "cost" in info["auto_reason"]


def test_min_progress_keeps_estimators_close_to_exact_per_step(setup):
    """The rule itself, on planted measurements: per unit cost a cheap noisy candidate
    beats exact (0.5 / 0.25 > 1 / 1); a floor on progress per step keeps exact."""
    from gradest.harness.auto import _Measured, _Schedule

    model, _, _ = setup

    def choice(est: Auto) -> str:
        schedule = _Schedule(
            measured={
                "exact": _Measured(progress=[1.0], bias=[0.0], cost=[1.0]),
                "truncated:random=uniform": _Measured(progress=[0.5], bias=[0.0], cost=[0.25]),
            }
        )
        est._choose(model, schedule)
        return schedule.choice

    assert choice(Auto()) == "truncated:random=uniform"
    assert choice(Auto(min_progress=0.9)) == "exact"
    assert choice(Auto(min_progress=0.4)) == "truncated:random=uniform"
    # Nothing qualifies: choose among all, and say so.
    strict = _Schedule(measured={"sdo": _Measured(progress=[0.2], bias=[0.0], cost=[0.1])})
    Auto(min_progress=0.9)._choose(model, strict)
    assert strict.choice == "sdo" and "no candidate met the budget" in strict.reason
    with pytest.raises(InvalidValue, match="min_progress"):
        Auto(min_progress=-1.0)


def test_the_choice_is_cached_per_model_signature(setup):
    model, flow, objective = setup
    first = Auto(candidates=("exact", "sdo"), draws=2)
    assert first.estimate(model, flow, objective, noise=noise(0)).decisions.probing
    # A new instance with the same options continues the schedule on the same model...
    again = Auto(candidates=("exact", "sdo"), draws=2)
    assert not again.estimate(model, flow, objective, noise=noise(1)).decisions.probing
    # ...but another model (other parameter shapes) or sampler grid is probed anew.
    other = tiny_mlp(DIM, hidden=6)
    assert again.estimate(other, flow, objective, noise=noise(1)).decisions.probing
    longer = gradest.RectifiedFlow(steps=STEPS + 2)
    assert again.estimate(model, longer, objective, noise=noise(1)).decisions.probing


def test_the_surrogate_follows_the_same_schedule(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=2"), draws=2, max_slowdown=1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(2):
        sur = est.surrogate(model, flow, objective, noise=noise(i))
        grads = torch.autograd.grad(sur.loss, params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        chosen = gradest.estimator(sur.decisions.choice)
        truth = chosen.estimate(model, flow, objective, noise=noise(i))
        assert relative_error(flat, truth.flat()) <= 1e-12
        assert sur.decisions.probing == (i == 0)
    assert sur.decisions.choice == "truncated:k=2"


def test_terminal_only_candidates_are_left_out_of_a_stepwise_objective(setup):
    model, flow, _ = setup
    objective = random_stepwise_objective(STEPS, (BATCH, DIM))
    est = Auto(candidates=("exact", "refl", "draft_lv", "sdo:samples=2"), draws=2)
    result = est.estimate(model, flow, objective, noise=noise(0))
    assert set(result.info["auto_measurements"]) == {"exact", "sdo:samples=2"}


def test_auto_passes_gradest_check():
    from gradest.check import run_check

    assert run_check(["auto:draws=2"], steps=STEPS, show_progress=False)


def test_bad_options_fail_at_construction():
    with pytest.raises(InvalidValue, match="holds auto"):
        Auto(candidates=("exact", "auto"))
    with pytest.raises(gradest.UnknownEstimatorError, match="nope"):
        Auto(candidates=("exact", "nope"))
    with pytest.raises(InvalidValue, match="max_slowdown=0.5"):
        Auto(max_slowdown=0.5)
    assert gradest.estimator("auto:candidates=(exact,sdo),max_bias=0.1") == Auto(
        candidates=("exact", "sdo"), max_bias=0.1
    )


def test_candidates_in_a_spec_string_use_the_one_list_syntax():
    est = gradest.estimator("auto:candidates=(exact,jagg:window=4,tau=0.9,sdo),max_bias=0.1")
    assert est == Auto(candidates=("exact", "jagg:window=4,tau=0.9", "sdo"), max_bias=0.1)
    # The same list string as a compare/check list, then nested in auto's candidates.
    from gradest.specs import split_spec_list

    text = "exact,jagg:window=4,tau=0.9,sdo:samples=2"
    assert gradest.estimator(f"auto:candidates=({text})").candidates == tuple(split_spec_list(text))
    assert gradest.estimator("auto:candidates=exact").candidates == ("exact",)


def test_old_slash_separated_candidates_warn_and_still_work():
    with pytest.warns(gradest.errors.GradestDeprecationWarning, match="separate estimators"):
        est = gradest.estimator("auto:candidates=exact/sdo,max_bias=0.1")
    assert est.candidates == ("exact", "sdo") and est.max_bias == 0.1


def test_an_unparenthesised_candidate_list_is_refused_with_the_fix():
    with pytest.raises(InvalidValue, match=r"auto:candidates=\(exact,jagg:window=4\)"):
        gradest.estimator("auto:candidates=exact,jagg:window=4")
    with pytest.raises(InvalidValue, match="unclosed '\\('"):
        gradest.estimator("auto:candidates=(exact,sdo")
