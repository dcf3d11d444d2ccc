"""``Auto.load_state_dict`` checks a saved schedule against its schema before it keeps
any of it: every field's type, bounds, membership, nesting and the gradients' shape and
dtype for the model's trainable parameters.

The refusals are generated, not listed: a real saved state (two schedules on a tiny model,
one picked, one still probing) is walked, and every field is corrupted by what its kind
allows (an int made a bool, a float or negative; a float made NaN, infinite or a string;
a string made an int; a mapping made a list and a list a mapping; a record's key removed
or an unknown one added; a gradient reshaped, cast or made NaN), besides the corruptions
that need the schedule's meaning (a choice that is not one of its candidates, a signature
of another model, counts that disagree). Each must be one error of gradest's types naming
the field's path in the state, and leave the estimator's own schedules as they were.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from gradest_lab.auto import Auto

import gradest
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH = 3, 4
# Two probe batches, so that one schedule can be saved mid-probe (choice None).
OPTIONS: dict[str, Any] = {
    "candidates": ("exact", "truncated:k=1"),
    "draws": 2,
    "probe_batches": 2,
}
# A valid estimator spec that is not among auto's candidates.
NOT_A_CANDIDATE = "sdo:samples=2"


def model() -> torch.nn.Module:
    return tiny_mlp(DIM, hidden=8)


def noise(i: int) -> torch.Tensor:
    return seeded_normal((BATCH, DIM), 100 + i)


def run(est: Auto, net: torch.nn.Module, steps: int, calls: int) -> None:
    objective = smooth_terminal_objective(DIM)
    for i in range(calls):
        est.estimate(net, gradest.RectifiedFlow(steps=steps), objective, noise=noise(i))


def checkpointed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a checkpoint gives it back: torch.save, then torch.load with weights
    only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


@cache
def _saved() -> dict[str, Any]:
    """A real saved state: schedule 0 picked after its two probes, schedule 1 (another
    grid) one probe into two (no choice yet, an empty table)."""
    est, net = Auto(**OPTIONS), model()
    run(est, net, steps=4, calls=2)
    run(est, net, steps=3, calls=1)
    return checkpointed(est.state_dict(net))


@cache
def _own() -> dict[str, Any]:
    """The schedule of the estimator a corrupted state is loaded into, unlike the saved
    one (one schedule, three calls): saved once, loaded into each test's estimator."""
    est, net = Auto(**OPTIONS), model()
    run(est, net, steps=4, calls=3)
    return checkpointed(est.state_dict(net))


def saved_state() -> dict[str, Any]:
    """A fresh copy of the saved state (a corruption changes its own copy)."""
    return copy.deepcopy(_saved())


def plain(value: Any) -> Any:
    """``value`` with its tensors as (dtype, values), so that states compare with ``==``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


# -- the corruptions ----------------------------------------------------------------------

Where = tuple[Any, ...]
"""A field's keys from the state down (``("schedules", 0, "choice")``)."""


def path_of(where: Where) -> str:
    """How a refusal names the field: ``state['schedules'][0]['choice']``."""
    return "state" + "".join(f"[{key!r}]" for key in where)


@dataclass(frozen=True)
class Corruption:
    """One change to a saved state, and the refusal it must meet."""

    label: str
    where: Where  # the field the refusal must name
    change: Callable[[dict[str, Any]], Any]  # the saved state -> the state loaded
    error: type[Exception]
    shows: str | None = None  # a text the message must show (the value), when known


def get(state: Any, where: Where) -> Any:
    for key in where:
        state = state[key]
    return state


def replaced(where: Where, value: Any) -> Callable[[dict[str, Any]], Any]:
    """The state with the field at ``where`` replaced by ``value`` (the whole state when
    ``where`` is empty)."""

    def change(state: dict[str, Any]) -> Any:
        if not where:
            return value
        get(state, where[:-1])[where[-1]] = value
        return state

    return change


def edited(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], Any]:
    def change(state: dict[str, Any]) -> Any:
        edit(state)
        return state

    return change


def without(where: Where) -> Callable[[dict[str, Any]], Any]:
    return edited(lambda state: get(state, where[:-1]).pop(where[-1]))


def walk(value: Any, where: Where = ()) -> Iterator[tuple[Where, Any]]:
    yield where, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, (*where, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk(item, (*where, index))


def by_kind(state: dict[str, Any]) -> Iterator[Corruption]:
    """Every field corrupted by what its kind allows."""
    bad_type, bad_value = gradest.InvalidType, gradest.InvalidValue
    for where, value in walk(state):
        name = path_of(where)
        if isinstance(value, torch.Tensor):
            yield Corruption(f"{name} one shorter", where, replaced(where, value[:-1]), bad_value)
            yield Corruption(f"{name} 2-D", where, replaced(where, value[None]), bad_value)
            yield Corruption(
                f"{name} float32", where, replaced(where, value.float()), bad_value, "float32"
            )
            nan = value.clone()
            nan[0] = math.nan
            yield Corruption(f"{name} with a NaN", where, replaced(where, nan), bad_value)
            yield Corruption(f"{name} a list", where, replaced(where, value.tolist()), bad_type)
        elif isinstance(value, dict):
            yield Corruption(
                f"{name} a list", where, replaced(where, list(value.values())), bad_type
            )
            if where and where[-1] in ("measured", "table"):  # keyed by candidate specs
                if value:
                    spare = copy.deepcopy(next(iter(value.values())))
                    at = (*where, NOT_A_CANDIDATE)
                    yield Corruption(
                        f"{name} of a spec not a candidate", at, replaced(at, spare), bad_value
                    )
                continue
            for key in value:
                at = (*where, key)
                yield Corruption(f"{path_of(at)} missing", at, without(at), bad_value)
            at = (*where, "extra")
            yield Corruption(f"{path_of(at)} unknown", at, replaced(at, 1), bad_value)
        elif isinstance(value, list):
            yield Corruption(
                f"{name} a dict", where, replaced(where, dict(enumerate(value))), bad_type
            )
        else:
            for wrong, error in scalar_corruptions(name, value):
                yield Corruption(
                    f"{name} {wrong!r}", where, replaced(where, wrong), error, repr(wrong)
                )
    for top in (None, "a state", [1, 2]):
        yield Corruption(f"state {top!r}", (), replaced((), top), bad_type)


def scalar_corruptions(name: str, value: Any) -> list[tuple[Any, type[Exception]]]:
    """What a scalar field is replaced by, each with the error it must meet: a count or
    a size made a bool, a float or negative; a measurement or a time made NaN, infinite,
    a string or a bool; a string made an int. None (a choice not yet made) is left be."""
    bad_type, bad_value = gradest.InvalidType, gradest.InvalidValue
    if isinstance(value, bool):
        raise AssertionError(f"{name}: a saved state holds no bool")
    if isinstance(value, int):
        return [(True, bad_type), (float(value), bad_type), (-1, bad_value)]
    if isinstance(value, float):
        return [(math.nan, bad_value), (math.inf, bad_value), ("0.5", bad_type), (True, bad_type)]
    if isinstance(value, str):
        return [(1, bad_type)]
    assert value is None, f"{name}: {value!r}"
    return []


def by_meaning(state: dict[str, Any]) -> Iterator[Corruption]:
    """The corruptions that need the schedule's meaning: membership and agreement."""
    bad = gradest.InvalidValue
    picked, probing = ("schedules", 0), ("schedules", 1)
    assert get(state, (*picked, "choice")) is not None and get(state, (*probing, "choice")) is None
    assert get(state, (*picked, "probes_done")) == 2 and get(state, (*probing, "table")) == {}

    def case(label: str, where: Where, change: Callable[[dict[str, Any]], Any]) -> Corruption:
        return Corruption(label, where, change, bad)

    yield case("another format", ("format",), replaced(("format",), "gradest.auto.schedule/0"))
    other = repr(Auto(**{**OPTIONS, "draws": 3}))
    yield case("another auto", ("auto",), replaced(("auto",), other))
    for wrong in ("nope", "truncated:k=2", NOT_A_CANDIDATE):
        at = (*picked, "choice")
        yield Corruption(f"choice {wrong!r}", at, replaced(at, wrong), bad, repr(wrong))
    # A schedule that has measured nothing to a table has picked nothing from it.
    at = (*probing, "choice")
    yield case("a pick before the table", at, replaced(at, "truncated:k=1"))
    signature = (*picked, "signature")
    yield case("another model class", (*signature, 0), replaced((*signature, 0), "Other"))
    yield case("another objective kind", (*signature, 4), replaced((*signature, 4), "neither"))
    yield case("a short signature", signature, edited(lambda s: get(s, signature).pop()))
    first = (*signature, 1, 0)
    yield case("a parameter renamed", first, replaced((*first, 0), "nope"))
    yield case("a parameter reshaped", first, replaced((*first, 1), [8, 31]))
    yield case("a parameter's dtype", first, replaced((*first, 2), "torch.float32"))
    yield case("a short parameter entry", first, edited(lambda s: get(s, first).pop()))
    params = (*signature, 1)
    yield case("a parameter left out", params, edited(lambda s: get(s, params).pop()))
    yield case(
        "a parameter added",
        (*params, len(get(state, params))),
        edited(lambda s: get(s, params).append(["extra", [1], "torch.float64"])),
    )
    yield case(
        "a schedule twice",
        ("schedules", 2, "signature"),
        edited(lambda s: s["schedules"].append(copy.deepcopy(s["schedules"][0]))),
    )
    yield case("more probes than calls", (*picked, "probes_done"), replaced((*picked, "calls"), 1))
    grads = (*picked, "exact_grads")
    yield case("a gradient short", grads, edited(lambda s: get(s, grads).pop()))
    measured = (*picked, "measured", "exact")
    yield case(
        "bias shorter than progress",
        (*measured, "bias"),
        edited(lambda s: get(s, (*measured, "bias")).pop()),
    )
    yield case(
        "more measurements than probes",
        (*measured, "progress"),
        edited(lambda s: get(s, (*measured, "progress")).append(0.5)),
    )
    yield case("no measurements", (*measured, "progress"), replaced((*measured, "progress"), []))
    yield case(
        "a cosine above 1", (*measured, "progress", 0), replaced((*measured, "progress", 0), 2.0)
    )
    yield case("a negative bias", (*measured, "bias", 0), replaced((*measured, "bias", 0), -0.5))
    yield case("a zero cost", (*measured, "cost", 0), replaced((*measured, "cost", 0), 0.0))
    row = (*picked, "table", "exact")
    yield case("a negative score", (*row, "score"), replaced((*row, "score"), -1.0))
    numbered: Where = (*picked, "measured", 5)
    spare = copy.deepcopy(get(state, measured))
    yield Corruption("a key not a spec", numbered, replaced(numbered, spare), gradest.InvalidType)


CORRUPTIONS = [*by_kind(_saved()), *by_meaning(_saved())]


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("saved", [_saved, _own], ids=["two schedules", "one schedule"])
def test_a_saved_state_round_tripped_through_torch_save_loads_whole(saved):
    state = copy.deepcopy(saved())
    est, net = Auto(**OPTIONS), model()
    est.load_state_dict(net, state)
    assert plain(est.state_dict(net)) == plain(state)


def test_the_corruptions_cover_every_field_of_the_saved_state():
    """Every field of the saved state is the subject of some corruption (the generator
    misses none), and the labels tell the cases apart."""
    named = {path_of(c.where) for c in CORRUPTIONS}
    fields = {path_of(where) for where, _ in walk(_saved()) if where}
    assert fields <= named
    assert len({c.label for c in CORRUPTIONS}) == len(CORRUPTIONS)


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.label)
def test_a_corrupted_state_is_refused_in_one_line_naming_the_field(corruption: Corruption):
    est, net = Auto(**OPTIONS), model()
    est.load_state_dict(net, copy.deepcopy(_own()))  # a schedule of its own
    before = plain(est.state_dict(net))
    corrupted = corruption.change(saved_state())
    with pytest.raises(gradest.GradestError) as raised:
        est.load_state_dict(net, corrupted)
    error, message = raised.value, str(raised.value)
    assert type(error) is corruption.error, message
    assert path_of(corruption.where) in message, message
    assert "\n" not in message and message.startswith("estimator 'auto'"), message
    assert "expected" in message, message  # what would be accepted, or how to get it
    if corruption.shows is not None:
        assert corruption.shows in message, message
    # All or nothing: the estimator's schedules are as they were.
    assert plain(est.state_dict(net)) == before == plain(_own())
