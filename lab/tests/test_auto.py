"""The ``auto`` estimator: probes, picks within a budget, caches, rechecks, explains.

Each test builds its own ``Auto`` instances, which own their schedules: no cache to clear
between tests (lab/tests/test_auto_state.py: the schedules object itself)."""

from __future__ import annotations

import pytest
import torch
from gradest_lab.auto import Auto, AutoDecisions

import gradest
from gradest.errors import InvalidType, InvalidValue
from gradest.reference import relative_error
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 4, 8


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
    # exact on the path and from the noise (the cost baseline), then 2 draws of the
    # candidate on the path and 2 from the noise; the candidate `exact` reuses the reference.
    truncated = gradest.estimator("truncated:k=1")
    trajectory = gradest.rollout(model, flow, noise(0))
    expected = 2 * exact_units.cost.model_units() + sum(
        truncated.estimate(model, flow, objective, **source).cost.model_units()
        for source in ({"trajectory": trajectory}, {"noise": noise(0)})
        for _ in range(2)
    )
    assert probe.cost.model_units() == probe.info["auto_probe_units"] == expected
    assert after.info["auto_probe_units"] == after.info["auto_probe_planned_units"] == 0
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
    from gradest_lab.auto import _Measured, _Schedule

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
    # The instance continues its schedule on the same model...
    again = first
    assert not again.estimate(model, flow, objective, noise=noise(1)).decisions.probing
    # ...but another model (other parameter shapes) or sampler grid is probed anew.
    other = tiny_mlp(DIM, hidden=6)
    assert again.estimate(other, flow, objective, noise=noise(1)).decisions.probing
    longer = gradest.RectifiedFlow(steps=STEPS + 2)
    assert again.estimate(model, longer, objective, noise=noise(1)).decisions.probing
    # A new instance with the same options starts a schedule of its own: it probes.
    fresh = Auto(candidates=("exact", "sdo"), draws=2)
    assert fresh == first
    assert fresh.estimate(model, flow, objective, noise=noise(2)).decisions.probing


def test_a_second_model_instance_probes_again_the_same_model_reuses_its_pick(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=1"), draws=2)
    assert est.estimate(model, flow, objective, noise=noise(0)).info["auto_probing"]
    assert not est.estimate(model, flow, objective, noise=noise(1)).info["auto_probing"]
    # Same class, same parameter names and shapes, another initialisation: probes anew.
    second = tiny_mlp(DIM, hidden=8, seed=1)
    probe = est.estimate(second, flow, objective, noise=noise(1))
    assert probe.info["auto_probing"] and probe.info["auto_probe_units"] > 0
    assert not est.estimate(second, flow, objective, noise=noise(2)).info["auto_probing"]
    assert not est.estimate(model, flow, objective, noise=noise(2)).info["auto_probing"]


def test_reset_and_replaced_parameters_probe_again(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=1"), draws=2)
    other = Auto(candidates=("exact", "sdo"), draws=2)
    for auto in (est, other):
        auto.estimate(model, flow, objective, noise=noise(0))
        assert not auto.estimate(model, flow, objective, noise=noise(1)).decisions.probing
    # reset() forgets this instance's picks; an equal instance's reset() leaves them.
    Auto(candidates=("exact", "truncated:k=1"), draws=2).reset()
    assert not est.estimate(model, flow, objective, noise=noise(2)).decisions.probing
    est.reset()
    assert est.estimate(model, flow, objective, noise=noise(2)).decisions.probing
    assert not other.estimate(model, flow, objective, noise=noise(2)).decisions.probing
    # reset(model) on another model leaves this one's pick alone.
    est.reset(tiny_mlp(DIM, hidden=8))
    assert not est.estimate(model, flow, objective, noise=noise(3)).decisions.probing
    # A parameter replaced by a new one (same name, shape, dtype) probes again.
    first = next(iter(model.parameters()))
    name = next(name for name, p in model.named_parameters() if p is first)
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(first.detach().clone()))
    assert est.estimate(model, flow, objective, noise=noise(4)).decisions.probing
    assert not est.estimate(model, flow, objective, noise=noise(5)).decisions.probing
    # Freezing a parameter changes the trainable set: probes again.
    next(iter(model.parameters())).requires_grad_(False)
    assert est.estimate(model, flow, objective, noise=noise(6)).decisions.probing


def test_the_cache_does_not_keep_a_model_alive(setup):
    import gc
    import weakref

    _, flow, objective = setup
    model = tiny_mlp(DIM, hidden=8)
    Auto(candidates=("exact", "sdo"), draws=2).estimate(model, flow, objective, noise=noise(0))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_probe_states_its_plan_first_and_keeps_within_probe_budget(setup, caplog):
    import logging

    model, flow, objective = setup
    candidates = ("exact", "truncated:k=1", "sdo", "truncated:k=2")
    exact = gradest.estimator("exact").estimate(model, flow, objective, noise=noise(0))
    unit = exact.cost.model_units()  # 3N; from the noise the same for a terminal objective
    free = Auto(candidates=candidates, draws=4)

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "gradest.auto"]

    # What the auto logger had said when the model was first called: the probe's cost.
    said_before_the_model_ran: list[list[str]] = []
    hook = model.register_forward_pre_hook(
        lambda *_: (
            None if said_before_the_model_ran else said_before_the_model_ran.append(messages())
        )
    )
    try:
        with caplog.at_level(logging.INFO, logger="gradest.auto"):
            unbounded = free.estimate(model, flow, objective, noise=noise(0)).info
    finally:
        hook.remove()
    # Reference on the path and from the noise, then 3 candidates x 4 draws x 2 sources,
    # each predicted at exact's cost: the plan, logged before the first candidate ran.
    assert unbounded["auto_probe_planned_units"] == 2 * unit + 3 * 4 * 2 * unit
    assert unbounded["auto_probe_draws"] == 4 and unbounded["auto_probe_dropped"] == ""
    assert unbounded["auto_probe_units"] <= unbounded["auto_probe_planned_units"]
    expected, plan, spent = messages()
    # Before any model call: the cost in exact calls and in model units (3N per call).
    assert said_before_the_model_ran == [[expected]]
    assert expected.startswith("auto: probe 1 of 1 on this call, before it trains: about 26 ")
    assert f"{26 * unit:.0f} model units at 3N = {unit:.0f} per exact call" in expected
    assert plan.startswith("auto: probing 3 candidate(s) x 4 draws")
    assert f"planned {unbounded['auto_probe_planned_units']:.0f} model units" in plan
    assert "spent" in spent
    # A budget for 2 draws of every candidate: fewer draws, same candidates.
    budget = 2 * unit + 3 * 2 * 2 * unit
    info = (
        Auto(candidates=candidates, draws=4, probe_budget=budget)
        .estimate(model, flow, objective, noise=noise(0))
        .info
    )
    assert info["auto_probe_draws"] == 2 and info["auto_probe_dropped"] == ""
    assert info["auto_probe_planned_units"] <= budget
    assert info["auto_probe_units"] <= budget
    assert set(info["auto_measurements"]) == set(candidates)
    # Room for 2 draws of one candidate only: the first in the order given is kept.
    budget = 2 * unit + 1 * 2 * 2 * unit + unit
    info = (
        Auto(candidates=candidates, draws=4, probe_budget=budget)
        .estimate(model, flow, objective, noise=noise(0))
        .info
    )
    assert info["auto_probe_draws"] == 2 and info["auto_probe_dropped"] == "sdo,truncated:k=2"
    assert set(info["auto_measurements"]) == {"exact", "truncated:k=1"}
    assert info["auto_probe_units"] <= budget


def test_a_probe_budget_below_the_smallest_probe_is_refused_naming_the_option(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "sdo"), draws=2, probe_budget=10.0)
    with pytest.raises(InvalidValue, match=r"probe_budget=10 model units is below"):
        est.estimate(model, flow, objective, noise=noise(0))
    with pytest.raises(InvalidValue, match="probe_budget"):
        Auto(probe_budget=-1.0)
    assert gradest.estimator("auto:probe_budget=500").probe_budget == 500.0
    assert gradest.estimator("auto:probe_budget=none").probe_budget is None


def test_the_probe_is_deterministic_given_a_generator(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "sdo:samples=2", "truncated:random=uniform"), draws=3)
    results = []
    for _ in range(2):
        est.reset()
        probe = est.estimate(
            model, flow, objective, noise=noise(0), generator=torch.Generator().manual_seed(5)
        )
        after = est.estimate(
            model, flow, objective, noise=noise(1), generator=torch.Generator().manual_seed(6)
        )
        results.append((probe, after))
    (probe_a, after_a), (probe_b, after_b) = results
    assert torch.equal(probe_a.flat(), probe_b.flat())
    assert probe_a.info["auto_measurements"] == probe_b.info["auto_measurements"]
    assert probe_a.info["auto_probe_units"] == probe_b.info["auto_probe_units"]
    assert after_a.decisions.choice == after_b.decisions.choice
    assert torch.equal(after_a.flat(), after_b.flat())


def test_estimate_and_surrogate_share_one_schedule(setup):
    model, flow, objective = setup
    est = Auto(candidates=("exact", "truncated:k=2"), draws=2, max_slowdown=1.0)
    assert est.surrogate(model, flow, objective, noise=noise(0)).decisions.choice == "exact"
    following = est.estimate(model, flow, objective, noise=noise(1))
    assert not following.decisions.probing and following.decisions.choice == "truncated:k=2"


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


def test_slash_separated_candidates_are_refused_with_the_fix():
    with pytest.raises(InvalidType, match=r"'/' between estimators.*write 'exact,sdo'"):
        gradest.estimator("auto:candidates=exact/sdo,max_bias=0.1")


def test_an_unparenthesised_candidate_list_is_refused_with_the_fix():
    with pytest.raises(InvalidValue, match=r"auto:candidates=\(exact,jagg:window=4\)"):
        gradest.estimator("auto:candidates=exact,jagg:window=4")
    with pytest.raises(InvalidValue, match="unclosed '\\('"):
        gradest.estimator("auto:candidates=(exact,sdo")


def test_candidates_that_cannot_run_here_are_said_with_why(setup, caplog):
    """A candidate the chain is too short for, or that takes no such objective, is not
    measured: ``info`` and the plan's log line name it with the reason."""
    import logging

    model, flow, objective = setup
    too_many = f"sdo:samples={STEPS + 1}"
    est = Auto(candidates=("exact", too_many, "truncated:k=1"), draws=2)
    with caplog.at_level(logging.INFO, logger="gradest.auto"):
        info = est.estimate(model, flow, objective, noise=noise(0)).info
    (skipped,) = info["auto_probe_skipped"].split(" | ")
    assert skipped.startswith(f"{too_many} (") and str(STEPS) in skipped
    assert too_many not in info["auto_measurements"]
    assert any(f"cannot run here: {too_many}" in r.getMessage() for r in caplog.records)
    stepwise = gradest.StepwiseObjective(lambda k, v, trajectory: v.pow(2).mean())
    path = gradest.rollout(model, flow, noise(1))
    info = (
        Auto(candidates=("exact", "alignprop"), draws=2)
        .estimate(model, flow, stepwise, trajectory=path)
        .info
    )
    assert info["auto_probe_skipped"] == "alignprop (takes no stepwise objective)"
    # The next call uses the choice and probes nothing: nothing skipped.
    after = est.estimate(model, flow, objective, noise=noise(2)).info
    assert after["auto_probe_units"] == 0.0 and after["auto_probe_skipped"] == ""


def test_auto_declares_its_axes():
    """``gradest list --verbose`` prints them (``auto`` is the lab's, registered like a
    plugin, and says what it is like the built-ins do)."""
    from gradest.plugin import EstimatorAxes

    assert isinstance(Auto.axes, EstimatorAxes)
    assert "chooses among candidates" in Auto.axes.evaluation
    assert Auto.axes.cotangents and Auto.axes.memory
