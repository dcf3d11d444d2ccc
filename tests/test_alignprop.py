"""`alignprop` against its dense definition, `exact`, and its expectation (with power).

AlignProp draws ``r_k ~ U{min..max}`` independently at every step and keeps the model
output's graph iff ``k >= r_k``, never cutting the state path. The statistical tests use
:mod:`gradest.testing.means` (a five-standard-error norm bound), and show the same
statistic rejects the two look-alikes: one depth drawn once per call
(``truncated:random=uniform``) and a variant that cuts the latent too.
"""

from __future__ import annotations

import functools

import pytest
import torch
from recorded_problem import STEPS, objective_of, problem, run, surrogate_flat
from torch import Tensor

import gradest
from gradest import testing
from gradest.errors import InvalidValue
from gradest.reference import (
    alignprop_definition,
    alignprop_expectation,
    alignprop_noise_grad_definition,
    dense_chain,
    exact_cotangents,
    exact_gradient,
    keep_probabilities,
    relative_error,
    replay_uniform_ints,
)
from gradest.reference.alignprop import (
    alignprop_noise_grad_expectation,
    kept_steps,
)
from gradest.reference.truncated import truncated_expectation
from gradest.strategies.alignprop import AlignProp
from gradest.strategies.truncated import Truncated

DRAWS = 400
OPTIONS = [{}, {"min": 2, "max": 5}, {"min": 0, "max": 0}, {"min": 3, "max": 3}, {"max": 2}]


def _ids(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


# -- 1. the estimator is its definition ------------------------------------------------------


def _problems():
    """(model, sampler, noise, cond): MLPs, a conditioned one, an affine model, a DiT."""
    dim = 3
    yield "mlp-rectified", testing.tiny_mlp(dim, hidden=8), gradest.RectifiedFlow(steps=6), None
    yield (
        "mlp-cond-uneven-grid",
        testing.tiny_mlp(dim, hidden=8, num_classes=3, seed=4),
        gradest.RectifiedFlow(times=[1.0, 0.8, 0.65, 0.4, 0.3, 0.1, 0.0]),
        {"y": torch.tensor([0, 2, 1, 3])},
    )
    yield "affine-rectified", testing.AffineVelocity(dim, seed=2), gradest.RectifiedFlow(6), None
    # alpha != 1 and recorded step noise: estimators see only the affine step form.
    yield (
        "mlp-noisy-affine",
        testing.tiny_mlp(dim, hidden=8),
        testing.NoisyAffineSampler(6, drift=0.3),
        None,
    )
    yield (
        "mlp-flow-sde",
        testing.tiny_mlp(dim, hidden=8, seed=5),
        gradest.FlowSDE(steps=6, noise_level=0.5),
        None,
    )


PROBLEMS = list(_problems())


@pytest.mark.parametrize("options", OPTIONS, ids=_ids)
@pytest.mark.parametrize("case", PROBLEMS, ids=[c[0] for c in PROBLEMS])
def test_alignprop_matches_its_dense_definition(case, options):
    _, model, sampler, cond = case
    noise = testing.seeded_normal((4, 3), seed=11)
    objective = testing.smooth_terminal_objective(3)
    for seed in range(3):
        testing.assert_matches_definition(
            AlignProp(**options), model, sampler, objective, noise=noise, cond=cond,
            generator=torch.Generator().manual_seed(seed), rtol=1e-10,
        )  # fmt: skip


@pytest.mark.parametrize("options", OPTIONS, ids=_ids)
@pytest.mark.parametrize("setup", [("rectified", True, True), ("noisy", False, False)])
def test_alignprop_from_noise_matches_its_definition_with_the_noise_gradient(setup, options):
    # Also on the stochastic sampler (assert_matches_definition checks from-noise estimates
    # on deterministic samplers only): the step noise is drawn first from the generator,
    # so seeding it as the rollout was seeded reproduces the recorded path.
    p = problem(*setup)
    objective = objective_of("terminal")
    stochastic = setup[0] == "noisy"
    for seed in [p.seed] if stochastic else [0, 1, 2, 3]:
        est = AlignProp(**options)
        result = run(est, p, objective, "noise", seed=seed, noise_grad=True)
        kept = result.decisions.kept
        assert kept == kept_steps(result.decisions.draws)
        truth = alignprop_definition(p.chain, objective, kept)
        assert relative_error(result.flat(), truth) <= 1e-10
        truth_noise = alignprop_noise_grad_definition(p.chain, objective, kept)
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10
        # On the recorded path no step noise is drawn first, so a stochastic sampler's
        # draws differ from those made from the noise: each against its own definition.
        on_path = run(est, p, objective, "trajectory", seed=seed, noise_grad=True)
        if not stochastic:
            assert on_path.decisions == result.decisions
        path_kept = on_path.decisions.kept
        path_truth = alignprop_definition(p.chain, objective, path_kept)
        assert relative_error(on_path.flat(), path_truth) <= 1e-10
        path_noise = alignprop_noise_grad_definition(p.chain, objective, path_kept)
        assert relative_error(on_path.noise_grad, path_noise) <= 1e-10
        for source, expected in (("noise", result), ("trajectory", on_path)):
            flat, sur = surrogate_flat(est, p, objective, source, seed=seed)
            assert sur.decisions == expected.decisions
            assert relative_error(flat, expected.flat()) <= 1e-10


def test_alignprop_func_engine_matches_its_definition():
    p = problem("noisy")
    objective = objective_of("terminal")
    est = AlignProp(min=1, max=4)
    for source in ("noise", "trajectory"):
        result = run(est, p, objective, source, engine="func", noise_grad=True)
        kept = result.decisions.kept
        assert (
            relative_error(result.flat(), alignprop_definition(p.chain, objective, kept)) <= 1e-10
        )
        truth_noise = alignprop_noise_grad_definition(p.chain, objective, kept)
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10


def test_alignprop_on_a_dit_matches_its_definition():
    model = testing.perturbed_dit("micro").double()
    config = model.config
    noise = testing.seeded_normal((2, config.in_channels, config.input_size, config.input_size), 3)
    weights = testing.seeded_normal(tuple(noise.shape[1:]), 4)
    objective = gradest.TerminalObjective(lambda z: torch.sin(weights * z).pow(2).sum())
    testing.assert_matches_definition(
        AlignProp(min=1, max=3), model, gradest.RectifiedFlow(steps=4), objective, noise=noise,
        cond={"y": torch.tensor([0, 3])}, generator=torch.Generator().manual_seed(1), rtol=1e-10,
    )  # fmt: skip


# -- 2. known truths -------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", [("rectified", False, False), ("noisy", True, False)])
def test_alignprop_min_0_max_0_is_exact(setup, source):
    p = problem(*setup)
    objective = objective_of("terminal")
    result = run(AlignProp(min=0, max=0), p, objective, source, noise_grad=True)
    assert result.decisions.kept == tuple(range(STEPS))
    exact = run(gradest.estimator("exact"), p, objective, source, noise_grad=True)
    truth, truth_noise = exact_gradient(
        p.model, p.flow, objective, p.trajectory, p.cond, chain=p.chain
    )
    assert relative_error(result.grads, exact.grads) <= 1e-12
    assert relative_error(result.grads, truth) <= 1e-10
    assert relative_error(result.noise_grad, truth_noise) <= 1e-10
    flat, _ = surrogate_flat(AlignProp(min=0, max=0), p, objective, source)
    assert relative_error(flat, result.flat()) <= 1e-12


def test_alignprop_keeping_nothing_is_zero_and_passes_the_noise_gradient_through_alpha():
    p = problem("noisy")
    objective = objective_of("terminal")
    est = AlignProp(min=STEPS, max=STEPS)
    result = run(est, p, objective, "noise", noise_grad=True)
    assert result.decisions.kept == ()
    assert all(float(g.abs().max()) == 0.0 for g in result.grads.values())
    # Every output detached: the adjoint is a_N times the product of the alphas.
    a_final = torch.autograd.functional.jacobian(
        lambda z: objective.loss_fn(z), p.trajectory.states[-1]
    )
    product = float(torch.prod(p.chain.alpha))
    assert relative_error(result.noise_grad, product * a_final) <= 1e-12
    assert result.cost.forwards_with_graph == 0 and result.cost.param_vjps == 0
    flat, _ = surrogate_flat(est, p, objective, "noise")
    assert float(flat.abs().max()) == 0.0


def test_alignprop_keeps_non_suffix_sets_unlike_a_once_per_call_depth():
    # Independent per-step draws keep sets with holes; a depth drawn once keeps a suffix.
    p = problem()
    objective = objective_of("terminal")
    sets = {run(AlignProp(), p, objective, "trajectory", seed=s).decisions.kept for s in range(40)}
    suffix = {tuple(range(STEPS - k, STEPS)) for k in range(STEPS + 1)}
    assert sets - suffix, sets


def test_alignprop_draws_are_uniform_per_step():
    p = problem()
    objective = objective_of("terminal")
    draws = [
        r
        for s in range(150)
        for r in run(AlignProp(min=1, max=4), p, objective, "trajectory", seed=s).decisions.draws
    ]
    assert min(draws) >= 1 and max(draws) <= 4
    assert testing.fits_distribution([r - 1 for r in draws], [0.25] * 4)


# -- 3. statistics: unbiased for its expectation, and the test has power ---------------------


def latent_cut_definition(chain, objective, draws) -> Tensor:
    """The wrong variant that detaches the latent too where ``k < r_k``: only the steps
    after the last detached one keep their (then exact) terms."""
    cut = max((k for k, r in enumerate(draws) if k < r), default=-1)
    steps = range(cut + 1, chain.num_steps)
    return chain.gradient(exact_cotangents(chain, objective), steps=steps)


def latent_cut_expectation(chain, objective, low: int, high: int) -> Tensor:
    """``sum_k (prod_{j >= k} p_j) J_k^T c_k`` (exact ``c``): the latent-cutting mean."""
    p = keep_probabilities(chain.num_steps, low, high)
    weights = [float(torch.prod(torch.tensor(p[k:], dtype=torch.float64))) for k in range(len(p))]
    cotangents = exact_cotangents(chain, objective)
    return chain.gradient(torch.tensor(weights, dtype=torch.float64)[:, None] * cotangents)


# The statistical problem: a chain whose state Jacobians matter (beta_k dv/dz up to ~0.8),
# since the look-alikes differ from alignprop through them; alpha != 1, N = 8.
STAT_STEPS, STAT_DRAWS = 8, 1600
# alignprop:min=0,max=N-1 against one depth K = N - r per call: K uniform on 1..N, which
# is truncated:random=uniform (k_min=1, k=N). Same per-step keep probabilities (k+1)/N.
LOW, HIGH = 0, STAT_STEPS - 1


@functools.cache
def stat_problem():
    model = testing.tiny_mlp(3, hidden=8)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(2.0)
    sampler = testing.NoisyAffineSampler(STAT_STEPS, drift=0.3)
    noise = testing.seeded_normal((4, 3), seed=11)
    trajectory = gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(3))
    return model, sampler, trajectory, dense_chain(model, sampler, trajectory)


def stat_draws(est, seed: int) -> Tensor:
    model, sampler, trajectory, _ = stat_problem()
    objective = testing.smooth_terminal_objective(3)
    return torch.stack(
        [
            est.estimate(
                model, sampler, objective, trajectory=trajectory,
                generator=torch.Generator().manual_seed(seed + i),
            ).flat()
            for i in range(STAT_DRAWS)
        ]
    )  # fmt: skip


@functools.cache
def alignprop_draws() -> Tensor:
    return stat_draws(AlignProp(min=LOW, max=HIGH), seed=1000)


@pytest.mark.slow  # STAT_DRAWS estimates, computed once
def test_alignprop_is_unbiased_for_its_expectation_and_rejects_the_look_alikes():
    *_, chain = stat_problem()
    objective = testing.smooth_terminal_objective(3)
    draws = alignprop_draws()
    testing.assert_unbiased(draws, alignprop_expectation(chain, objective, LOW, HIGH))
    # Power: the same statistic is far outside the bound for the look-alikes' means.
    once = truncated_expectation(chain, objective, [1.0 / STAT_STEPS] * STAT_STEPS)
    latent = latent_cut_expectation(chain, objective, LOW, HIGH)
    exact = chain.gradient(exact_cotangents(chain, objective))
    for wrong in (once, latent, exact):
        testing.assert_biased(draws, wrong)
        assert testing.distance_in_se(draws, wrong) > 2 * testing.SE_BOUND


@pytest.mark.slow
def test_the_look_alikes_fail_the_alignprop_expectation_test():
    """Draws of the once-per-call depth and of latent cutting, put to the same test."""
    *_, chain = stat_problem()
    objective = testing.smooth_terminal_objective(3)
    expectation = alignprop_expectation(chain, objective, LOW, HIGH)
    once = Truncated(random="uniform", k_min=STAT_STEPS - HIGH, k=STAT_STEPS - LOW)
    once_draws = stat_draws(once, seed=2000)
    generator = torch.Generator().manual_seed(7)
    latent_draws = torch.stack(
        [
            latent_cut_definition(
                chain, objective, replay_uniform_ints(LOW, HIGH, STAT_STEPS, generator)
            )
            for _ in range(STAT_DRAWS)
        ]
    )
    for draws in (once_draws, latent_draws):
        testing.assert_biased(draws, expectation)
    # ... while each is unbiased for its own mean (the test is not just noisy).
    testing.assert_unbiased(
        once_draws, truncated_expectation(chain, objective, [1.0 / STAT_STEPS] * STAT_STEPS)
    )
    testing.assert_unbiased(latent_draws, latent_cut_expectation(chain, objective, LOW, HIGH))


@pytest.mark.slow
def test_alignprop_noise_gradient_is_unbiased_for_its_expectation():
    p = problem("rectified")
    objective = objective_of("terminal")
    est = AlignProp(min=1, max=STEPS)
    draws = torch.stack(
        [
            run(est, p, objective, "noise", seed=3000 + i, noise_grad=True).noise_grad.reshape(-1)
            for i in range(DRAWS)
        ]
    )
    expected = alignprop_noise_grad_expectation(p.chain, objective, 1, STEPS).reshape(-1)
    testing.assert_unbiased(draws, expected)
    a_0 = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)[1]
    testing.assert_biased(draws, a_0.reshape(-1))


def test_expectation_reduces_to_exact_and_to_zero():
    p = problem("noisy")
    objective = objective_of("terminal")
    exact = torch.cat(
        [g.reshape(-1) for g in exact_gradient(p.model, p.flow, objective, p.trajectory,
                                                 chain=p.chain)[0].values()]
    )  # fmt: skip
    assert relative_error(alignprop_expectation(p.chain, objective, 0, 0), exact) <= 1e-12
    assert float(alignprop_expectation(p.chain, objective, STEPS, STEPS).abs().max()) == 0.0
    assert keep_probabilities(6, 2, 4) == (0.0, 0.0, 1 / 3, 2 / 3, 1.0, 1.0)


# -- 4. cost ---------------------------------------------------------------------------------


def test_alignprop_cost_counts_are_exact():
    p = problem()
    objective = objective_of("terminal")
    for seed in range(5):
        result = run(AlignProp(), p, objective, "noise", seed=seed)
        k = len(result.decisions.kept)
        c = result.cost
        # N forwards (the kept ones with graph), one backward through the kept outputs.
        assert (c.forwards_without_graph, c.forwards_with_graph) == (STEPS - k, k)
        assert (c.param_vjps, c.state_vjps) == (k, 0)
        on_path = run(AlignProp(), p, objective, "trajectory", seed=seed).cost
        assert (on_path.forwards_without_graph, on_path.forwards_with_graph) == (0, k)
        assert on_path.param_vjps == k


# -- 5. randomness, options, errors ----------------------------------------------------------


def test_alignprop_same_generator_state_gives_identical_results():
    p = problem("noisy")
    objective = objective_of("terminal")
    first = run(AlignProp(), p, objective, "noise", seed=7, noise_grad=True)
    second = run(AlignProp(), p, objective, "noise", seed=7, noise_grad=True)
    assert first.decisions == second.decisions
    assert all(torch.equal(first.grads[n], second.grads[n]) for n in first.grads)
    assert torch.equal(first.noise_grad, second.noise_grad)


def test_alignprop_refuses_stepwise_objectives():
    p = problem()
    with pytest.raises(ValueError, match="terminal"):
        run(AlignProp(), p, objective_of("stepwise"), "trajectory")


def test_alignprop_options_and_spec_strings():
    assert gradest.estimator("alignprop") == AlignProp()
    assert gradest.estimator("alignprop:min=2,max=5") == AlignProp(min=2, max=5)
    assert gradest.estimator("alignprop:max=none") == AlignProp()
    with pytest.raises(InvalidValue, match="min=4 exceeds max=3"):
        AlignProp(min=4, max=3)
    with pytest.raises(ValueError, match="min=-1"):
        AlignProp(min=-1)
    with pytest.raises(ValueError, match=r"max=7 exceeds the sampler's N=6"):
        run(AlignProp(max=7), problem(), objective_of("terminal"), "noise")
    with pytest.raises(ValueError, match=r"min=7 exceeds the sampler's N=6"):
        run(AlignProp(min=7), problem(), objective_of("terminal"), "noise")


def test_gradest_check_passes_on_alignprop():
    from gradest.check import run_check

    assert run_check("alignprop,alignprop:min=2,max=5", steps=8, show_progress=False)
