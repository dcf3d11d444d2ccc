"""``gradest race --task-option KEY=VALUE`` (gradest_lab.race.task_options): values take the
type of the factory's default, unknown keys are refused naming the task's options."""

from __future__ import annotations

import inspect

import pytest
from gradest_lab.race.task_options import (
    describe_task_options,
    parse_task_options,
    task_options,
)

from gradest.errors import InvalidValue


def factory(
    *,
    eval_samples: int = 256,
    device: str = "cpu",
    lr: float = 3e-4,
    batch: int = 16,
    reduction: str = "mean",
    anneal: bool = False,
    note=None,
):
    return dict(lr=lr, batch=batch, reduction=reduction, anneal=anneal, note=note)


def open_factory(*, eval_samples: int = 256, device: str = "cpu", **settings):
    return settings


def parse(*texts: str, of=factory):
    return parse_task_options(of, list(texts), model="toy")


def test_options_are_the_factorys_keywords_without_the_common_ones() -> None:
    assert list(task_options(factory)) == ["lr", "batch", "reduction", "anneal", "note"]
    assert describe_task_options(factory) == (
        "lr=0.0003, batch=16, reduction='mean', anneal=False, note=None"
    )
    assert describe_task_options(open_factory) == "none"


def test_values_take_the_type_of_the_default() -> None:
    parsed = parse("lr=1e-4", "batch=32", "reduction=sum", "anneal=true", "note=7")
    assert parsed == {"lr": 1e-4, "batch": 32, "reduction": "sum", "anneal": True, "note": 7}
    assert type(parsed["lr"]) is float and type(parsed["batch"]) is int
    # a whole number for a float setting is that float; a number-like text for a str
    # setting stays text (the default says which)
    assert parse("lr=1") == {"lr": 1.0} and type(parse("lr=1")["lr"]) is float
    assert parse("reduction=3") == {"reduction": "3"}
    assert parse(" lr = 0.5 ") == {"lr": 0.5}
    assert parse() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr=fast", r"lr='fast'.*finite number, e\.g\. lr=0\.0003"),
        ("lr=nan", "finite number"),
        ("lr=inf", "finite number"),
        ("batch=1e-4", r"batch is a whole number, e\.g\. batch=16"),
        ("batch=2.5", "whole number"),
        ("anneal=maybe", "true or false"),
        ("lrr=1", r"no option 'lrr'; it takes: lr=0\.0003, batch=16"),
        ("lr", "not KEY=VALUE"),
        ("=1", "not KEY=VALUE"),
        ("lr=", "not KEY=VALUE"),
        ("eval_samples=512", "--eval-samples instead"),
        ("device=cuda", "--device instead"),
    ],
)
def test_bad_options_are_refused_naming_the_fix(text: str, message: str) -> None:
    with pytest.raises(InvalidValue, match=message):
        parse(text)


def test_an_option_given_twice_is_refused() -> None:
    with pytest.raises(InvalidValue, match="lr is given twice"):
        parse("lr=1e-4", "lr=2e-4")


def test_a_factory_with_keyword_catchall_takes_any_key() -> None:
    assert parse("lr=1e-4", "name=x", of=open_factory) == {"lr": 1e-4, "name": "x"}
    with pytest.raises(InvalidValue, match="--device instead"):
        parse("device=cpu", of=open_factory)


def test_a_setting_without_default_must_be_given() -> None:
    def needs_target(*, eval_samples: int = 256, device: str = "cpu", target, lr: float = 1.0):
        return target, lr

    assert task_options(needs_target)["target"] is inspect.Parameter.empty
    with pytest.raises(InvalidValue, match="task 'toy' needs target: give --task-option target="):
        parse("lr=2", of=needs_target)
    assert parse("target=3", of=needs_target) == {"target": 3}
