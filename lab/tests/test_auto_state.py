"""``auto`` holds no module state: its probe schedules belong to the instance
(:class:`gradest_lab.auto.ProbeSchedules`): separate per instance, resettable, copied
empty, saved in ``state_dict``, safe to call from several threads."""

from __future__ import annotations

import collections
import copy
import pickle
import sys
import threading
import weakref

import gradest_lab.auto as auto_module
import pytest
import torch
from gradest_lab.auto import Auto, ProbeSchedules

import gradest
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH, STEPS = 3, 4, 4
OPTIONS = {"candidates": ("exact", "truncated:k=1"), "draws": 2}


@pytest.fixture
def setup():
    return (
        tiny_mlp(DIM, hidden=8),
        gradest.RectifiedFlow(steps=STEPS),
        smooth_terminal_objective(DIM),
    )


def noise(i: int) -> torch.Tensor:
    return seeded_normal((BATCH, DIM), 100 + i)


def probing(est: Auto, model, flow, objective, i: int) -> bool:
    return bool(est.estimate(model, flow, objective, noise=noise(i)).decisions.probing)


def test_the_module_holds_no_mutable_state():
    """By principle, not by name: no module attribute is a container or a lock (the
    logger is no estimator state; classes, functions and modules are code)."""
    lock_types = (type(threading.Lock()), type(threading.RLock()))
    mutable = (
        dict,
        list,
        set,
        bytearray,
        collections.deque,
        weakref.WeakKeyDictionary,
        weakref.WeakValueDictionary,
        weakref.WeakSet,
        *lock_types,
    )
    found = {
        name: type(value).__name__
        for name, value in vars(auto_module).items()
        if not (name.startswith("__") and name.endswith("__")) and isinstance(value, mutable)
    }
    assert found == {}
    assert not hasattr(auto_module, "clear_cache")


def test_two_equal_instances_keep_separate_schedules_and_reset_only_their_own(setup):
    model, flow, objective = setup
    a, b = Auto(**OPTIONS), Auto(**OPTIONS)
    # The options are the identity: equal, same hash, same repr and spec.
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert gradest.estimator("auto") == gradest.estimator("auto")
    assert a.schedules is not b.schedules
    assert probing(a, model, flow, objective, 0) and not probing(a, model, flow, objective, 1)
    # b has not seen the model: it probes on its own first call.
    assert probing(b, model, flow, objective, 0) and not probing(b, model, flow, objective, 1)
    a.reset()
    assert len(a.schedules) == 0 and len(b.schedules) == 1
    assert probing(a, model, flow, objective, 2)
    assert not probing(b, model, flow, objective, 2)
    # reset(model) forgets that model's picks only.
    other = tiny_mlp(DIM, hidden=8, seed=1)
    assert probing(b, other, flow, objective, 3)
    b.reset(other)
    assert not probing(b, model, flow, objective, 4) and probing(b, other, flow, objective, 4)


def test_a_copy_or_an_unpickled_auto_starts_with_no_schedule(setup):
    model, flow, objective = setup
    est = Auto(**OPTIONS)
    est.estimate(model, flow, objective, noise=noise(0))
    for copied in (copy.copy(est), copy.deepcopy(est), pickle.loads(pickle.dumps(est))):
        assert copied == est and copied.schedules is not est.schedules
        assert len(copied.schedules) == 0
        assert probing(copied, model, flow, objective, 1)
    assert len(copy.deepcopy(est.schedules)) == 0
    assert not probing(est, model, flow, objective, 1)  # the original keeps its own


def test_state_dict_carries_the_schedule_to_a_new_instance(setup):
    model, flow, objective = setup
    est = Auto(**OPTIONS)
    est.estimate(model, flow, objective, noise=noise(0))
    state = est.state_dict(model)
    assert state["format"] == "gradest.auto.schedule/1" and state["auto"] == repr(est)
    assert [s["calls"] for s in state["schedules"]] == [1]
    assert Auto(**OPTIONS).state_dict(model)["schedules"] == []
    resumed = Auto(**OPTIONS)
    resumed.load_state_dict(model, state)
    assert not probing(resumed, model, flow, objective, 1)
    assert resumed.state_dict(model)["schedules"][0]["calls"] == 2
    assert est.state_dict(model)["schedules"][0]["calls"] == 1  # untouched by the other


def test_models_that_cannot_be_weakly_referenced_are_kept_and_reset():
    class NoWeakref:
        __slots__ = ()

    schedules = ProbeSchedules()
    model = NoWeakref()
    with schedules.lock:
        schedules.for_model(model)["key"] = auto_module._Schedule(calls=1)
        assert schedules.for_model(model)["key"].calls == 1
    assert len(schedules) == 1
    schedules.reset(model)
    assert len(schedules) == 0


def test_concurrent_calls_on_one_instance_count_every_call(setup):
    """Threads calling one instance: every call counted in the one schedule of the model,
    no error (the schedule's counters and the mapping are updated under the lock)."""
    model, flow, objective = setup
    est = Auto(candidates=("exact",), draws=2, recheck_every=10_000)
    threads, calls = 4, 6
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work() -> None:
        try:
            start.wait()
            for i in range(calls):
                est.estimate(model, flow, objective, noise=noise(i))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    (schedule,) = est.state_dict(model)["schedules"]
    assert schedule["calls"] == threads * calls
    assert schedule["choice"] == "exact"
