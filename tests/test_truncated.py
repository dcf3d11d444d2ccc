"""`truncated` against its dense definition, `exact`, and its expectation when randomized.

The statistical tests use the same five-standard-error norm bound as ``test_sdo.py``
(``P(||mean - E|| > 5 se) <= P(|Z| > 5)`` for a mean of independent draws), and check
that the bound also rejects a wrong target.
"""

from __future__ import annotations

import functools

import attrs
import pytest
import scipy.stats
import torch
from recorded_problem import (
    BATCH,
    DIM,
    STEPS,
    objective_of,
    problem,
    run,
)
from torch import Tensor

import gradest
from gradest.errors import InvalidValue
from gradest.reference import exact_gradient, relative_error
from gradest.reference.truncated import (
    truncated_definition,
    truncated_expectation,
    truncated_noise_grad_definition,
    uniform_probabilities,
)
from gradest.strategies.truncated import Truncated
from gradest.testing import standard_error
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DRAWS = 400


def flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


SETUPS = [("rectified", False, False), ("rectified", True, True), ("noisy", True, False)]
OPTIONS = [
    {},
    {"k": 3},
    {"k": STEPS},
    {"random": "uniform"},
    {"random": "uniform", "k": 2},
    {"random": "uniform", "k_min": 3, "k": 5},
    {"random": (0.5, 0.3, 0.2)},
]


# -- 1. the estimator is its definition ------------------------------------------------------


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "noisy-sampler"])
def test_truncated_matches_its_dense_definition(setup, source, objective_kind, options):
    p = problem(*setup)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    result = run(Truncated(**options), p, objective, source, noise_grad=terminal)

    kept, random = result.info["k"], options.get("random")
    if random is None:
        assert kept == options.get("k", 1)
    elif random == "uniform":
        assert options.get("k_min", 1) <= kept <= options.get("k", STEPS)
    else:
        assert 1 <= kept <= len(random) and random[kept - 1] > 0
    assert list(result.grads) == [n for n, q in p.model.named_parameters() if q.requires_grad]
    truth = truncated_definition(p.chain, objective, kept)
    assert relative_error(result.flat(), truth) <= 1e-10
    if terminal:
        truth_noise = truncated_noise_grad_definition(p.chain, objective, kept)
        if kept < STEPS:  # the chain is cut before step 0
            assert torch.equal(result.noise_grad, truth_noise)
        else:
            assert relative_error(result.noise_grad, truth_noise) <= 1e-10
    else:
        assert result.noise_grad is None


# -- 2. known truths -------------------------------------------------------------------------


@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
@pytest.mark.parametrize("setup", SETUPS, ids=["plain", "cond-frozen", "noisy-sampler"])
def test_truncated_at_k_equal_n_is_exact(setup, source, objective_kind):
    p = problem(*setup)
    objective = objective_of(objective_kind)
    terminal = objective_kind == "terminal"
    result = run(Truncated(k=STEPS), p, objective, source, noise_grad=terminal)
    exact = run(gradest.estimator("exact"), p, objective, source, noise_grad=terminal)
    truth, truth_noise = exact_gradient(
        p.model, p.flow, objective, p.trajectory, p.cond, chain=p.chain
    )
    assert relative_error(result.grads, exact.grads) <= 1e-12
    assert relative_error(result.grads, truth) <= 1e-10
    if terminal:
        assert relative_error(result.noise_grad, exact.noise_grad) <= 1e-12
        assert relative_error(result.noise_grad, truth_noise) <= 1e-10


def test_truncated_keeps_more_of_the_exact_gradient_as_k_grows():
    # The tail sums telescope to exact: truncated_k - truncated_{k-1} = J_{N-k}^T c_{N-k}.
    p = problem()
    objective = objective_of("terminal")
    grads = [run(Truncated(k=k), p, objective, "trajectory").flat() for k in range(1, STEPS + 1)]
    truth, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)
    assert relative_error(grads[-1], truth) <= 1e-10
    assert all(relative_error(g, truth) > 1e-3 for g in grads[:-1])


def test_truncated_default_is_draft_1():
    p = problem()
    result = run(Truncated(), p, objective_of("terminal"), "noise")
    assert result.info["k"] == 1
    assert result.cost.forwards_with_graph == 1


# -- 3. statistics: randomized truncation is unbiased for its expectation --------------------


@functools.cache
def truncated_draws(random: str | tuple[float, ...]) -> tuple[Tensor, tuple[int, ...]]:
    """``DRAWS`` independent terminal estimates sampled from the shared noise, and their k."""
    p = problem()
    objective = objective_of("terminal")
    results = [
        run(Truncated(random=random), p, objective, "noise", seed=1000 + i) for i in range(DRAWS)
    ]
    return torch.stack([r.flat() for r in results]), tuple(r.info["k"] for r in results)


@pytest.mark.slow  # DRAWS estimates, computed once and shared by these tests
@pytest.mark.parametrize("random", ["uniform", (0.5, 0.3, 0.2)], ids=["uniform", "tuple"])
def test_randomized_truncation_is_unbiased_for_its_expectation(random):
    p = problem()
    objective = objective_of("terminal")
    draws, _ = truncated_draws(random)
    probabilities = uniform_probabilities(STEPS) if random == "uniform" else random
    expectation = truncated_expectation(p.chain, objective, probabilities)
    mean, se = draws.mean(0), standard_error(draws)
    assert float((mean - expectation).norm()) <= 5 * se
    # Power: the bound rejects exact (the expectation of a truncation is still biased)
    # and a wrong distribution of k (uniform on 1..3 instead of the one asked for).
    exact, _ = exact_gradient(p.model, p.flow, objective, p.trajectory, chain=p.chain)
    assert float((mean - flat(exact)).norm()) > 5 * se
    wrong = truncated_expectation(p.chain, objective, uniform_probabilities(3))
    assert float((mean - wrong).norm()) > 5 * se


@pytest.mark.slow  # DRAWS estimates, computed once and shared by these tests
@pytest.mark.parametrize("random", ["uniform", (0.5, 0.3, 0.2)], ids=["uniform", "tuple"])
def test_randomized_truncation_draws_k_from_its_distribution(random):
    _, ks = truncated_draws(random)
    probabilities = torch.tensor(uniform_probabilities(STEPS) if random == "uniform" else random)
    counts = torch.bincount(torch.tensor(ks) - 1, minlength=len(probabilities)).double()
    assert counts.numel() == len(probabilities)  # never a k outside the support
    expected = DRAWS * probabilities
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square <= scipy.stats.chi2.ppf(1 - 1e-6, df=len(probabilities) - 1)


# -- 4. cost ---------------------------------------------------------------------------------


def _cost(result) -> tuple[int, int, int, int]:
    c = result.cost
    return c.forwards_without_graph, c.forwards_with_graph, c.param_vjps, c.state_vjps


def test_truncated_cost_counts_are_exact():
    steps = 10
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=steps)
    noise = seeded_normal((BATCH, DIM), seed=11)
    terminal = smooth_terminal_objective(DIM)
    stepwise = random_stepwise_objective(steps, (BATCH, DIM))
    trajectory = gradest.rollout(model, flow, noise)
    three = Truncated(k=3)
    # From noise: N-k no-graph forwards, then k forwards with graph and one fused VJP.
    assert _cost(three.estimate(model, flow, terminal, noise=noise)) == (steps - 3, 3, 3, 0)
    # The noise gradient of a cut chain is zero: it costs nothing.
    assert _cost(three.estimate(model, flow, terminal, noise=noise, noise_grad=True)) == (
        steps - 3,
        3,
        3,
        0,
    )
    assert _cost(three.estimate(model, flow, terminal, trajectory=trajectory)) == (0, 3, 3, 0)
    assert _cost(three.estimate(model, flow, stepwise, noise=noise)) == (steps, 3, 3, 0)
    assert _cost(three.estimate(model, flow, stepwise, trajectory=trajectory)) == (0, 3, 3, 0)
    full = Truncated(k=steps)
    assert _cost(full.estimate(model, flow, terminal, noise=noise, noise_grad=True)) == (
        0,
        steps,
        steps,
        0,
    )


# -- 5. randomness only from the generator ---------------------------------------------------


@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_truncated_same_generator_state_gives_identical_results(source):
    p = problem("noisy", True, False)  # from noise, the sampler noise comes from it too
    objective = objective_of("terminal")
    est = Truncated(random="uniform")
    first = run(est, p, objective, source, seed=7, noise_grad=True)
    second = run(est, p, objective, source, seed=7, noise_grad=True)
    assert first.info == second.info
    assert all(torch.equal(first.grads[n], second.grads[n]) for n in first.grads)
    assert torch.equal(first.noise_grad, second.noise_grad)
    ks = {run(est, p, objective, source, seed=s).info["k"] for s in range(10)}
    assert len(ks) > 1


# -- 6. options and errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name", "error"),
    [
        ({"k": 0}, "k=0", ValueError),
        ({"k": 2.0}, "k=2.0", TypeError),
        ({"random": "gauss"}, "random='gauss'", ValueError),
        ({"random": (0.5, 0.4)}, "sums to 0.9", ValueError),
        ({"random": (1.5, -0.5)}, "negative", ValueError),
        ({"random": ()}, "empty", ValueError),
        ({"random": 3}, "random=3", TypeError),
        ({"random": (0.5, 0.5), "k": 2}, "k=2 and random", ValueError),
    ],
)
def test_truncated_rejects_bad_options_naming_them(options, name, error):
    with pytest.raises(error, match=name.replace("(", r"\(").replace(")", r"\)")):
        Truncated(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"k": 7}, "k=7 exceeds the sampler's N=6"),
        ({"random": "uniform", "k": 7}, "k=7 \\(the largest k drawn"),
        ({"random": (0.0,) * 6 + (1.0,)}, "random has 7 probabilities"),
    ],
)
def test_truncated_longer_than_the_chain_is_an_error_at_estimate_time(options, message):
    p = problem()
    with pytest.raises(ValueError, match=message):
        run(Truncated(**options), p, objective_of("terminal"), "trajectory")


def test_truncated_spec_strings_and_attrs():
    assert gradest.estimator("truncated:k=2") == Truncated(k=2)
    assert gradest.estimator("truncated:random=0.5/0.5") == Truncated(random=(0.5, 0.5))
    assert gradest.estimator("truncated:random=uniform,k=4") == Truncated(random="uniform", k=4)
    assert gradest.estimator("truncated:k=none") == Truncated()
    assert gradest.estimator("truncated:random=0.1/0.2/0.7").random == (0.1, 0.2, 0.7)
    with pytest.raises(ValueError, match="random='gauss/x' is not a known distribution"):
        gradest.estimator("truncated:random=gauss/x")
    # lists are stored as tuples, so the estimator stays hashable
    est = Truncated(random=[0.25, 0.75])
    assert est.random == (0.25, 0.75) and hash(est) == hash(Truncated(random=(0.25, 0.75)))
    assert attrs.evolve(Truncated(k=2), k=3).k == 3


def test_k_min_is_checked_against_the_other_options():
    with pytest.raises(InvalidValue, match="k_min=2 applies to random='uniform' only"):
        Truncated(k=3, k_min=2)
    with pytest.raises(InvalidValue, match="k_min=4 exceeds k=3"):
        Truncated(random="uniform", k=3, k_min=4)
    with pytest.raises(InvalidValue, match=r"k_min=7 exceeds the sampler's N=6"):
        run(Truncated(random="uniform", k_min=7), problem(), objective_of("terminal"), "noise")
    assert gradest.estimator("truncated:random=uniform,k_min=2,k=4") == Truncated(
        random="uniform", k_min=2, k=4
    )
