"""`drtune` (DRTune, arXiv 2405.00760): sdo's one-step cotangents on stratified steps.

``drtune`` is ``sdo`` with ``select="stratified"`` (systematic sampling: ``K`` steps
``floor(u + j N/K)``, one offset ``u ~ U[0, N/K)``) and ``K = 3``. Checked in float64
against ``gradest.reference``: its estimate is its dense definition at the decisions the
reference replays; the stratified draw includes every step with probability ``K/N``
(exact enumeration over the offset, and a binomial test of the draws); its mean is the
one-step sum (``sdo:full_sum=true``), exactly over the enumerated draws and statistically
over independent estimates; and the variance ``gradest.compare`` measures for each
selection agrees with the exact variance enumerated from the dense chain.

Tolerances of the statistical tests, as in test_sdo.py (``gradest.testing.means``): a
mean of ``n`` draws is within five standard errors in norm of its expectation except
with probability about ``6e-7``; a count of ``n`` Bernoulli(``p``) trials within five
binomial standard errors ``sqrt(n p (1 - p))`` of ``n p``; the sample variance's bound is
derived where it is used.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest
import torch
from gradest_lab.compare.command import compare_line_up
from recorded_problem import STEPS, objective_of, problem, run

import gradest
from gradest import check
from gradest.harness.comparison import compare
from gradest.reference import (
    drtune_definition,
    exact_gradient,
    inclusion_probabilities,
    relative_error,
    replay_stratified,
    selection_moments,
    selection_outcomes,
)
from gradest.reference.decisions import stratified_steps
from gradest.reference.sdo import sdo_full_sum_definition, sdo_noise_grad_definition
from gradest.strategies import sampling, sdo
from gradest.strategies.drtune import DRTune
from gradest.strategies.sdo import ShortcutDiffusion
from gradest.testing import (
    assert_biased,
    assert_matches_definition,
    assert_unbiased,
    fits_distribution,
)

DRAWS = 400
SETUPS = [("rectified", False, False), ("rectified", True, True), ("noisy", True, False)]
OPTIONS = [{}, {"samples": 2}, {"samples": 4, "scale": "none"}, {"samples": STEPS}]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- 1. drtune is sdo with stratified steps --------------------------------------------------


def test_drtune_is_sdo_with_stratified_steps_and_the_papers_k():
    est = gradest.estimator("drtune")
    assert isinstance(est, ShortcutDiffusion) and type(est) is DRTune
    assert (est.samples, est.select, est.scale, est.full_sum) == (
        3,
        "stratified",
        "unbiased",
        False,
    )
    # Defaults of sdo unchanged: uniform selection.
    assert gradest.estimator("sdo").select == "uniform"
    assert gradest.estimator("drtune:samples=5,scale=none") == DRTune(samples=5, scale="none")
    assert repr(est) == "DRTune(samples=3, scale='unbiased', full_sum=False, select='stratified')"
    # The same class's math: the same generator gives the same estimate, bit for bit.
    p = problem()
    objective = objective_of("terminal")
    for drtune_spec, sdo_spec in [
        ("drtune", "sdo:samples=3,select=stratified"),
        ("drtune:select=uniform,samples=2", "sdo:samples=2"),
    ]:
        a = run(gradest.estimator(drtune_spec), p, objective, "trajectory", seed=5)
        b = run(gradest.estimator(sdo_spec), p, objective, "trajectory", seed=5)
        assert a.decisions == b.decisions
        assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)


def test_drtune_is_in_the_default_compare_line_up_and_lists_its_paper():
    assert "drtune" in compare_line_up()
    doc = DRTune.__doc__ or ""
    assert "arXiv 2405.00760" in doc.splitlines()[0]
    flat = " ".join(doc.split())
    assert "Preferred for" in flat and "Not recommended" in flat and "What it drops" in flat


# -- 2. the estimator is its definition ------------------------------------------------------


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "noisy-sampler"])
def test_drtune_matches_its_dense_definition(setup, source, objective_kind, options):
    p = problem(*setup)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    est = DRTune(**options)
    result = run(est, p, objective, source, noise_grad=terminal)

    steps, factor = result.info["sampled_steps"], result.info["scale"]
    samples = options.get("samples", 3)
    assert len(steps) == samples and steps == sorted(set(steps))
    # Evenly spaced: consecutive steps floor(N/m) or ceil(N/m) apart.
    gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    assert gaps <= {STEPS // samples, -(-STEPS // samples)}
    assert factor == (STEPS / samples if options.get("scale", "unbiased") == "unbiased" else 1.0)
    truth = drtune_definition(p.chain, objective, steps, factor)
    assert relative_error(result.flat(), truth) <= 1e-10
    if terminal:
        assert (
            relative_error(result.noise_grad, sdo_noise_grad_definition(p.chain, objective))
            <= 1e-10
        )
    else:
        assert result.noise_grad is None


@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize(
    "spec", ["drtune", "drtune:samples=2,scale=none", "sdo:samples=4,select=stratified"]
)
def test_drtune_decisions_definition_and_surrogate_as_the_reference_rederives_them(
    spec, objective_kind
):
    # The reference replays the offset from a generator copy and evaluates the definition
    # there; from noise and through the surrogate too.
    p = problem("rectified", True, True)
    for seed in range(3):
        assert_matches_definition(
            spec, p.model, p.flow, objective_of(objective_kind), noise=p.noise, cond=p.cond,
            generator=generator(seed),
        )  # fmt: skip


def test_the_reference_replays_the_stratified_draw_independently():
    p = problem()
    objective = objective_of("terminal")
    for samples in range(1, STEPS + 1):
        est = DRTune(samples=samples)
        for seed in range(8):
            result = run(est, p, objective, "trajectory", seed=seed)
            expected = est.expected_decisions(p.chain, objective, generator(seed))
            assert result.decisions == expected
            assert expected.sampled_steps == replay_stratified(STEPS, samples, generator(seed))


def test_check_passes_drtune_and_fails_a_draw_with_the_papers_rounded_stride(monkeypatch, capsys):
    assert check.run_check(["drtune", "drtune:samples=2"], steps=8, show_progress=False)
    capsys.readouterr()

    def rounded_stride(num_steps, samples, gen):
        # floor(N/m) apart from an offset in what is left: consistent, not stratified.
        stride = num_steps // samples
        offset = sampling.draw_uniform_int(0, num_steps - 1 - (samples - 1) * stride, gen)
        return [offset + j * stride for j in range(samples)]

    monkeypatch.setattr(sdo, "draw_stratified_steps", rounded_stride)
    assert not check.run_check(["drtune"], steps=8, show_progress=False)
    # gradest check prints each failure on a "FAIL:" line under the estimator's row
    reasons = [
        line.strip()
        for line in capsys.readouterr().out.splitlines()
        if line.strip().startswith("FAIL:")
    ]
    assert reasons and all(line.startswith("FAIL: sampled_steps=") for line in reasons)


# -- 3. the stratified draw: every step with probability m/N ----------------------------------


@pytest.mark.parametrize("num_steps", range(1, 17))
def test_every_step_has_inclusion_probability_m_over_n_exactly(num_steps, monkeypatch):
    for samples in range(1, num_steps + 1):
        # The reference's enumeration over the offset u = a/m ...
        assert (
            inclusion_probabilities(num_steps, samples, "stratified")
            == [Fraction(samples, num_steps)] * num_steps
        )
        # ... and the strategy's own draw, at every value its one randint can take.
        counts = [0] * num_steps
        for a in range(num_steps):
            monkeypatch.setattr(sampling, "draw_uniform_int", lambda low, high, g, a=a: a)
            steps = sampling.draw_stratified_steps(num_steps, samples, None)
            assert tuple(steps) == stratified_steps(num_steps, samples, Fraction(a, samples))
            assert steps == sorted(set(steps)) and 0 <= steps[0] and steps[-1] < num_steps
            for k in steps:
                counts[k] += 1
        assert counts == [samples] * num_steps  # m of the N equally likely offsets each


def test_a_continuous_offset_gives_the_integer_offsets_steps():
    # floor(u + j N/m) depends on u in [0, N/m) only through floor(m u): drawing that
    # integer uniformly on {0..N-1} is the continuous offset's distribution.
    for num_steps in (5, 6, 7, 12):
        for samples in range(1, num_steps + 1):
            spacing = Fraction(num_steps, samples)
            for i in range(11 * num_steps):
                u = Fraction(i, 11 * samples)  # a fine rational grid of [0, N/m)
                assert u < spacing
                a = math.floor(samples * u)
                assert stratified_steps(num_steps, samples, u) == stratified_steps(
                    num_steps, samples, Fraction(a, samples)
                )


def test_one_stratified_step_is_a_uniform_step_and_all_of_them_every_step():
    for num_steps in (1, 4, 9):
        assert sorted(selection_outcomes(num_steps, 1, "stratified")) == sorted(
            selection_outcomes(num_steps, 1, "uniform")
        )
        assert selection_outcomes(num_steps, num_steps, "stratified") == [
            (tuple(range(num_steps)), Fraction(1))
        ]


@pytest.mark.parametrize(("num_steps", "samples"), [(6, 3), (7, 3), (50, 3), (10, 4)])
def test_the_draws_include_each_step_at_rate_m_over_n(num_steps, samples):
    # Binomial: each step's count over n draws is within five binomial standard errors.
    n = 4000
    draws = [sampling.draw_stratified_steps(num_steps, samples, generator(s)) for s in range(n)]
    rate = samples / num_steps
    counts = torch.bincount(torch.tensor([k for d in draws for k in d]), minlength=num_steps)
    bound = 5 * math.sqrt(n * rate * (1 - rate))
    assert all(abs(int(c) - n * rate) <= bound for c in counts)
    # And the step sets follow the enumerated distribution (chi-square).
    outcomes = selection_outcomes(num_steps, samples, "stratified")
    index = {steps: i for i, (steps, _) in enumerate(outcomes)}
    assert fits_distribution([index[tuple(d)] for d in draws], [float(q) for _, q in outcomes])


# -- 4. the expectation is the one-step sum ---------------------------------------------------


@pytest.mark.parametrize("samples", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
def test_the_enumerated_mean_is_the_one_step_sum_exactly(samples, objective_kind):
    p = problem()
    objective = objective_of(objective_kind)
    full_sum = sdo_full_sum_definition(p.chain, objective)
    for select in ("uniform", "stratified"):
        mean, _, _ = selection_moments(p.chain, objective, samples, select)
        assert relative_error(mean, full_sum) <= 1e-12


@functools.cache
def drtune_draws(samples: int) -> torch.Tensor:
    """``DRAWS`` independent terminal estimates on the shared path."""
    p = problem()
    objective = objective_of("terminal")
    est = DRTune(samples=samples)
    results = [run(est, p, objective, "trajectory", seed=3000 + i) for i in range(DRAWS)]
    return torch.stack([r.flat() for r in results])


@pytest.mark.slow  # DRAWS estimates per case
@pytest.mark.parametrize("samples", [2, 3])
def test_the_mean_of_drtune_draws_is_the_one_step_sum_not_exact(samples):
    p = problem()
    objective = objective_of("terminal")
    draws = drtune_draws(samples)
    assert_unbiased(draws, sdo_full_sum_definition(p.chain, objective))
    exact, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)
    assert_biased(draws, torch.cat([g.reshape(-1) for g in exact.values()]))


# -- 5. variance: stratified against uniform, exactly and as gradest.compare measures it -----


@pytest.mark.parametrize("samples", [2, 3])
def test_uniform_variance_by_enumeration_is_the_sampling_without_replacement_formula(samples):
    # Var((N/m) sum_{k in S} t_k) = N^2 (1 - m/N) S^2 / m, S^2 = sum ||t_k - mean t||^2/(N-1).
    p = problem()
    objective = objective_of("terminal")
    terms = torch.stack([drtune_definition(p.chain, objective, [k], 1.0) for k in range(STEPS)])
    spread = float((terms - terms.mean(0)).pow(2).sum()) / (STEPS - 1)
    _, variance, _ = selection_moments(p.chain, objective, samples, "uniform")
    formula = STEPS**2 * (1 - samples / STEPS) * spread / samples
    assert variance == pytest.approx(formula, rel=1e-12)
    # One step: the two selections are one distribution.
    assert selection_moments(p.chain, objective, 1, "stratified")[1] == pytest.approx(
        selection_moments(p.chain, objective, 1, "uniform")[1], rel=1e-12
    )


def variance_bound(variance: float, fourth: float, n: int) -> float:
    """How far the sample variance of ``n`` draws may be from the total variance.

    ``s^2 = n/(n-1) (mean_i Y_i - ||gbar - mu||^2)`` with ``Y_i = ||g_i - mu||^2``:
    ``mean Y`` has standard deviation ``sqrt((E Y^2 - var^2) / n)`` (five of them), and
    ``||gbar - mu||^2 <= 25 var / n`` by the five-standard-error norm bound; the
    ``n/(n-1)`` factor adds at most ``var/(n-1)`` plus its share of the two.
    """
    spread = 5 * math.sqrt(max(fourth - variance**2, 0.0) / n) + 25 * variance / n
    return n / (n - 1) * spread + variance / (n - 1)


@pytest.mark.slow  # 2 x DRAWS estimates per case, through gradest.compare
@pytest.mark.parametrize("samples", [2, 3])
def test_compare_measures_the_exact_variance_of_each_selection(samples):
    p = problem()
    objective = objective_of("terminal")
    specs = [
        f"sdo:samples={samples}",
        f"sdo:samples={samples},select=stratified",
        f"drtune:samples={samples}",
    ]
    report = compare(
        p.model, p.flow, objective, specs, noise_fn=lambda seed: p.noise, seeds=[0],
        draws=DRAWS, measure_cost=False, show_progress=False,
    )  # fmt: skip
    exact, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)
    scale = float(torch.cat([g.reshape(-1) for g in exact.values()]).norm()) ** 2
    measured, bounds = {}, {}
    for spec, select in zip(specs[:2], ("uniform", "stratified"), strict=True):
        _, variance, fourth = selection_moments(p.chain, objective, samples, select)
        measured[select] = report.row(spec).variance.mean * scale
        bounds[select] = (variance, variance_bound(variance, fourth, DRAWS))
        assert abs(measured[select] - variance) <= bounds[select][1]
    # Power: each measurement rejects the other selection's exact variance.
    for select, other in [("uniform", "stratified"), ("stratified", "uniform")]:
        variance, bound = bounds[other]
        assert abs(measured[select] - variance) > bound
    # drtune is that stratified row: the same draws (common random numbers), the same numbers.
    assert report.rows[2].name == "drtune"
    assert report.rows[2].variance.mean == report.row(specs[1]).variance.mean


# Stratified / uniform total variance on the recorded 6-step path (terminal objective), by
# enumeration: evenly spaced steps vary less at m = 2 and 4 and more at m = 3, where the
# two possible sets are the even and the odd steps, and the terms alternate.
EXACT_RATIOS = {1: 1.0, 2: 0.71521, 3: 1.31203, 4: 0.71521, 5: 1.0}


@pytest.mark.parametrize("samples", sorted(EXACT_RATIOS))
def test_the_exact_variance_ratio_of_the_selections(samples):
    p = problem()
    objective = objective_of("terminal")
    uniform = selection_moments(p.chain, objective, samples, "uniform")[1]
    stratified = selection_moments(p.chain, objective, samples, "stratified")[1]
    assert stratified / uniform == pytest.approx(EXACT_RATIOS[samples], abs=1e-5)


def test_a_bare_name_finds_that_estimators_default_row_in_a_report():
    p = problem()
    specs = ["sdo:select=stratified", "sdo", "drtune"]
    report = compare(
        p.model, p.flow, objective_of("terminal"), specs, noise_fn=lambda seed: p.noise,
        seeds=[0], draws=2, measure_cost=False, show_progress=False,
    )  # fmt: skip
    assert report.row("sdo").label == "sdo"
    assert report.row("sdo:select=stratified").label == "sdo:select=stratified"
    assert report.row("drtune").label == "drtune"


# -- 6. options and errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("drtune:select=bogus", "select='bogus'"),
        ("sdo:select=bogus", "select='bogus'"),
        ("drtune:samples=0", "samples=0"),
        ("drtune:scale=biased", "scale='biased'"),
        ("drtune:full_sum=maybe", "full_sum"),
    ],
)
def test_bad_options_are_refused_in_one_line_naming_them(spec, name):
    with pytest.raises((TypeError, ValueError)) as info:
        gradest.estimator(spec)
    message = str(info.value)
    assert name in message and "\n" not in message
    if "select" in spec:
        assert "'uniform'" in message and "'stratified'" in message  # the fix: valid values


def test_more_samples_than_steps_is_refused_at_estimate_time_naming_the_option():
    p = problem()
    with pytest.raises(ValueError) as info:
        run(DRTune(samples=7), p, objective_of("terminal"), "trajectory")
    message = str(info.value)
    assert "'drtune'" in message and f"samples=7 exceeds the sampler's N={STEPS}" in message
    assert f"use samples <= {STEPS}" in message and "\n" not in message
    with pytest.raises(ValueError, match="samples=7"):
        DRTune(samples=7).check_steps(STEPS)
    DRTune(samples=7, full_sum=True).check_steps(STEPS)  # full_sum ignores samples
