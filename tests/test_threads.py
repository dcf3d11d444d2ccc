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
* Threads sharing one model (estimate() with both engines, and surrogate()) get the
  serial results and the model keeps its own Parameters: the torch.func engine's
  parameter swaps hold the model's exclusive lock (``gradest.model_lock``). A model that
  sleeps inside its forward makes the threads interleave; without the lock this test
  fails in every run (a thread differentiates another's swapped-in, detached tensors).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import attrs
import pytest
import torch

import gradest
from gradest import registry
from gradest.testing.problems import (
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


def test_surrogate_backward_from_threads_accumulates_into_each_model_only():
    est = gradest.estimator("jagg:window=3")
    problems = [_problem(seed) for seed in range(ESTIMATING_THREADS)]

    def work(index: int) -> list[torch.Tensor]:
        model, flow, noise, cond, _, objectives = problems[index]
        model.zero_grad(set_to_none=True)
        for _ in range(3):
            sur = est.surrogate(model, flow, objectives["terminal"], noise=noise, cond=cond)
            sur.loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    threaded = _run_in_threads(work, ESTIMATING_THREADS)
    sequential = [work(index) for index in range(ESTIMATING_THREADS)]
    for one, other in zip(sequential, threaded, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))


class _YieldingVelocity(torch.nn.Module):
    """A small MLP velocity whose forward sleeps briefly in the middle, so that threads
    switch while one of them is inside a forward (with a functional_call's swapped-in
    tensors, if there were no lock); without the sleep the GIL rarely interleaves them."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM, hidden=8, num_classes=2, seed=0)

    def forward(self, z, t, y=None):
        time.sleep(0.0005)
        return self.inner(z, t, y=y)


def _shared_model_work(problem, estimators, params) -> Callable[[int], list[torch.Tensor]]:
    """Thread ``index``: every estimator through estimate() (both engines) and surrogate()
    on the one shared model, with generator seed ``index``."""
    _, flow, noise, cond, trajectory, objectives = problem
    model = problem[0]

    def work(index: int) -> list[torch.Tensor]:
        out = []
        for est in estimators:
            for objective in objectives.values():
                inputs = {"noise": noise} if index % 2 else {"trajectory": trajectory}
                for engine in ("autograd", "func"):
                    result = est.estimate(
                        model,
                        flow,
                        objective,
                        cond=cond,
                        generator=torch.Generator().manual_seed(index),
                        engine=engine,
                        **inputs,
                    )
                    out.append(result.flat())
                sur = est.surrogate(
                    model,
                    flow,
                    objective,
                    cond=cond,
                    generator=torch.Generator().manual_seed(index),
                    **inputs,
                )
                grads = torch.autograd.grad(sur.loss, params)
                out.append(torch.cat([g.reshape(-1) for g in grads]))
        return out

    return work


def test_threads_sharing_one_model_get_serial_results_and_keep_its_parameters():
    """Several threads on one model: the autograd path calls the module as itself, and the
    torch.func path swaps parameters only under the model's exclusive lock, so no thread
    sees another's swapped tensors and the module keeps its own Parameters."""
    model = _YieldingVelocity()
    problem = (model, *_problem()[1:])
    params = [p for p in model.parameters()]
    identities = [id(p) for p in params]
    estimators = [gradest.estimator(spec) for spec in THREADED_SPECS]
    work = _shared_model_work(problem, estimators, params)
    sequential = [work(index) for index in range(THREADS)]
    for _ in range(2):  # two rounds: interleavings differ between runs
        threaded = _run_in_threads(work)
        for one, other in zip(sequential, threaded, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))
    assert [id(p) for p in model.parameters()] == identities
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
