"""Estimators are stateless values, randomness is explicit, and threads do not interfere.

* Estimators are frozen attrs instances: assigning an option (or a new attribute)
  raises, and an estimate leaves the instance (its slots, hash, repr) and its class
  unchanged, so one instance can serve any number of models, processes and threads.
* Results depend only on the explicit ``generator``: the global torch RNG state neither
  changes a result nor is consumed by an estimate that was given a generator.
* The registry is safe under concurrent discovery: 8 threads clearing the cache and
  looking estimators up at once all see the same estimators and nothing warns.
* Estimates made from several threads at once (one shared estimator instance per spec,
  one model per thread) are bit-for-bit the estimates made one after another.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import attrs
import pytest
import torch

import gradest
from gradest import registry
from gradest.reference.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

DIM, BATCH, STEPS = 3, 2, 6
THREADS = 8
SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=3,order=2,tau=0.9",
    "jagg:window=4,shared_knots=true,gate=mean",
    "sdo",
    "sdo:samples=3,scale=none",
    "truncated:k=2",
    "truncated:random=uniform",
    "truncated:random=0.25/0.25/0.5",
]
STOCHASTIC = [
    "sdo",
    "sdo:samples=3,scale=none",
    "truncated:random=uniform",
    "truncated:random=0.25/0.25/0.5",
]
# One configuration per estimator (and both exact paths) for the threaded estimates.
THREADED_SPECS = [
    "exact",
    "exact:checkpoint=true",
    "jagg:window=3,order=2,tau=0.9",
    "sdo",
    "truncated:random=uniform",
]
ESTIMATING_THREADS = 4


def _problem(seed: int = 0):
    model = tiny_mlp(DIM, hidden=8, num_classes=2, seed=seed)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), seed + 10)
    cond = {"y": torch.tensor([0, 2])}
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    objectives = {
        "terminal": smooth_terminal_objective(DIM),
        "stepwise": random_stepwise_objective(STEPS, (BATCH, DIM)),
    }
    return model, flow, noise, cond, trajectory, objectives


def _all_estimates(estimators, problem, generator_seed: int = 7) -> list[torch.Tensor]:
    """Every estimator on both objectives and both sources, flattened (with noise grads)."""
    model, flow, noise, cond, trajectory, objectives = problem
    out = []
    for est in estimators:
        for kind, objective in objectives.items():
            for inputs in ({"noise": noise}, {"trajectory": trajectory}):
                result = est.estimate(
                    model,
                    flow,
                    objective,
                    cond=cond,
                    generator=torch.Generator().manual_seed(generator_seed),
                    noise_grad=kind == "terminal",
                    **inputs,
                )
                parts = [result.flat()]
                if result.noise_grad is not None:
                    parts.append(result.noise_grad.reshape(-1))
                out.append(torch.cat(parts))
    return out


# -- no mutable state ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_estimators_are_frozen_and_an_estimate_leaves_them_unchanged(spec):
    est = gradest.estimator(spec)
    cls = type(est)
    # The options live in attrs slots; the instance dict (EstimatorBase has no
    # __slots__, so there is one) stays empty.
    assert getattr(est, "__dict__", {}) == {}
    before = (attrs.asdict(est), hash(est), repr(est), dict(vars(cls)))
    field = attrs.fields(cls)[0]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(est, field.name, getattr(est, field.name))
    with pytest.raises((attrs.exceptions.FrozenInstanceError, AttributeError)):
        est.cache = {}  # type: ignore[attr-defined]
    _all_estimates([est], _problem())
    after = (attrs.asdict(est), hash(est), repr(est), dict(vars(cls)))
    assert after == before
    assert getattr(est, "__dict__", {}) == {}
    # Values, not identities: equal options are equal, hashable estimators.
    assert gradest.estimator(spec) == est and len({est, gradest.estimator(spec)}) == 1
    # attrs.evolve validates like the constructor (for sweeps).
    assert attrs.evolve(est) == est


def test_evolve_validates_options():
    with pytest.raises(ValueError, match=r"option window=1 is out of range"):
        attrs.evolve(gradest.estimator("jagg"), window=1)


# -- randomness only from the generator ------------------------------------------------------


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_results_depend_on_the_generator_only(spec):
    est = gradest.estimator(spec)
    problem = _problem()
    torch.manual_seed(1)
    first = _all_estimates([est], problem)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second = _all_estimates([est], problem)
    assert torch.equal(torch.get_rng_state(), state), "an estimate consumed the global RNG"
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # ... and the generator does matter: some other seed gives a different draw.
    others = [_all_estimates([est], problem, generator_seed=seed) for seed in range(8)]
    assert any(not torch.equal(other[0], first[0]) for other in others)


# -- threads ---------------------------------------------------------------------------------


def _run_in_threads(work: Callable[[int], object], count: int = THREADS) -> list[object]:
    """Run ``work(i)`` in ``count`` threads released together; re-raise any failure."""
    barrier = threading.Barrier(count)

    def start(index: int) -> object:
        barrier.wait(timeout=30)
        return work(index)

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(start, range(count)))


def test_registry_discovery_is_thread_safe():
    expected = registry.available_estimators()
    reprs = {spec: repr(gradest.estimator(spec)) for spec in SPECS}

    def work(index: int) -> list[tuple[dict, str]]:
        seen = []
        for round_ in range(20):
            if (index + round_) % 3 == 0:
                registry.clear_cache()
            spec = SPECS[(index + round_) % len(SPECS)]
            seen.append((registry.available_estimators(), spec, repr(gradest.estimator(spec))))
        return seen

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _run_in_threads(work)
    assert not [str(w.message) for w in caught if "gradest" in str(w.message)]
    for seen in results:
        for available, spec, text in seen:
            assert available == expected
            assert text == reprs[spec]


def test_estimates_from_threads_equal_sequential_estimates():
    estimators = [gradest.estimator(spec) for spec in THREADED_SPECS]  # shared by all threads
    problems = [_problem(seed) for seed in range(ESTIMATING_THREADS)]
    sequential = [_all_estimates(estimators, problem) for problem in problems]
    threaded = _run_in_threads(
        lambda index: _all_estimates(estimators, problems[index]), ESTIMATING_THREADS
    )
    for one, other in zip(sequential, threaded, strict=True):
        assert len(one) == len(other) == len(THREADED_SPECS) * 4
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))


def test_backward_from_threads_accumulates_into_each_model_only():
    est = gradest.estimator("jagg:window=3")
    problems = [_problem(seed) for seed in range(ESTIMATING_THREADS)]

    def work(index: int) -> list[torch.Tensor]:
        model, flow, noise, cond, _, objectives = problems[index]
        model.zero_grad(set_to_none=True)
        for _ in range(3):
            est.backward(model, flow, objectives["terminal"], noise=noise, cond=cond)
        return [p.grad.clone() for p in model.parameters()]

    threaded = _run_in_threads(work, ESTIMATING_THREADS)
    sequential = [work(index) for index in range(ESTIMATING_THREADS)]
    for one, other in zip(sequential, threaded, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))
