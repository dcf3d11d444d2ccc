"""The long-horizon race tasks (gradest_digits.long_horizon_tasks): their definitions, their
options and one tiny race each. The measurements that make them long-horizon are the
module docstring's (run apart)."""

from __future__ import annotations

import math

import pytest
import torch
from gradest_digits.datasets import NUM_CLASSES
from gradest_digits.long_horizon_tasks import (
    PRIOR_WEIGHT,
    RELABEL,
    BlendTask,
    RelabelTask,
    digits_blend_task,
    digits_relabel_task,
    mnist_relabel_task,
    parse_relabel,
)
from gradest_lab.race.plain_race import RaceTask, race, registered_tasks
from gradest_lab.race.task_options import task_options

from gradest.errors import InvalidValue

NAMES = {
    "digits-relabel": digits_relabel_task,
    "mnist-relabel": mnist_relabel_task,
    "digits-blend": digits_blend_task,
}


def test_the_tasks_are_registered_under_their_names():
    tasks = registered_tasks()
    for name, factory in NAMES.items():
        assert tasks[name] is factory
        assert set(task_options(tasks[name])) == {
            "lr",
            "batch",
            "sampler_steps",
            "relabel",
            "prior_weight",
        }


def test_the_default_label_map_moves_every_label_once():
    mapping = parse_relabel(RELABEL)
    assert sorted(mapping) == list(range(NUM_CLASSES))
    assert all(label != digit for label, digit in enumerate(mapping))  # no fixed points
    assert mapping == tuple((label + 1) % NUM_CLASSES for label in range(NUM_CLASSES))


@pytest.mark.parametrize(
    ("relabel", "message"),
    [
        ("0234567891", "keeps label 0 in place"),
        ("1023456789", "keeps labels 2, 3, 4, 5, 6, 7, 8, 9 in place"),
        ("1123456789", "not a permutation of 0..9 \\(no label draws 0\\)"),
        ("123456789", "relabel must be a text of the ten digits"),
        ("12345678a0", "relabel must be a text of the ten digits"),
        ("123456789\u00b2", "relabel must be a text of the ten digits"),
        (1234567890, "relabel must be a text of the ten digits"),
    ],
)
def test_a_label_map_that_is_no_derangement_is_refused(relabel, message):
    with pytest.raises(InvalidValue, match=message) as info:
        parse_relabel(relabel)
    assert 'e.g. relabel="1234567890"' in str(info.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(relabel="0123456789"), "relabel='0123456789' keeps labels 0, 1, 2"),
        (dict(prior_weight=-1.0), "prior_weight must be a finite number >= 0, got -1.0"),
        (dict(prior_weight=float("inf")), "prior_weight must be a finite number"),
        (dict(lr=0.0), "lr must be a finite number > 0, got 0.0"),
        (dict(batch=0), "batch must be an int >= 1, got 0"),
        (dict(sampler_steps=True), "sampler_steps must be an int >= 1, got True"),
        (dict(eval_samples=255), "--eval-samples must be >= 256, got 255"),
    ],
)
def test_bad_options_are_refused_naming_them(options, message):
    for factory in (digits_relabel_task, digits_blend_task):
        with pytest.raises(InvalidValue, match=message):
            factory(**options)


def test_settings_name_every_option_and_rebuild_the_task():
    task = digits_relabel_task(relabel="1032547698", prior_weight=3.0)
    settings = task.settings()
    assert settings == {
        "batch": 16,
        "sampler_steps": 16,
        "lr": task.lr,
        "device": "cpu",
        "relabel": "1032547698",
        "prior_weight": 3.0,
    }
    options = {k: v for k, v in settings.items() if k != "device"}
    assert digits_relabel_task(**options).settings() == settings
    assert isinstance(task, RaceTask) and task.ceiling is None
    assert task.objective_kind == "terminal" and task.name == "digits-relabel"
    blend = digits_blend_task()
    assert isinstance(blend, BlendTask) and blend.name == "digits-blend"
    assert blend.settings()["prior_weight"] == PRIOR_WEIGHT


def test_a_step_asks_for_the_relabelled_digit_of_each_label():
    task = digits_relabel_task(batch=4, sampler_steps=2)
    model, sampler = task.pretrained(), task.sampler()
    problem = task.step_problem(model, sampler, torch.Generator().manual_seed(0), 0)
    labels = problem.inputs["cond"]["y"]
    assert labels.shape == (4,) and problem.inputs["noise"].shape == (4, 1, 8, 8)
    assert problem.extra_cost.forwards_with_graph == 1  # the prior's forward
    log_p = torch.log_softmax(torch.randn(4, NUM_CLASSES), dim=1)
    relabelled = task.log_reward(log_p, labels)
    assert torch.equal(relabelled, log_p[torch.arange(4), (labels + 1) % NUM_CLASSES])
    # digits-blend: the mean of both digits' log-probabilities
    blend = digits_blend_task(batch=4, sampler_steps=2).log_reward(log_p, labels)
    assert torch.allclose(blend, 0.5 * (relabelled + log_p[torch.arange(4), labels]))


def test_the_pretrained_model_draws_the_old_labels():
    task = digits_relabel_task(sampler_steps=8)
    metrics = task.evaluate(task.pretrained())
    assert metrics["drift"] == 0.0 and metrics["accuracy"] < 0.2
    assert metrics["reward"] == metrics["log_p_target"] - PRIOR_WEIGHT * metrics["heldout_fm"]
    assert metrics["log_p_target"] < -5
    # the evaluation a tuned race measures its ceiling on: other noise, the same numbers
    apart = task.evaluate_apart(task.pretrained())
    assert apart["drift"] == 0.0 and set(apart) == set(metrics)
    assert apart["reward"] != metrics["reward"]


@pytest.mark.parametrize("factory", [digits_relabel_task, digits_blend_task, mnist_relabel_task])
def test_a_tiny_race_of_exact_trains_and_evaluates(factory):
    task = factory(batch=2, sampler_steps=2)
    assert isinstance(task, RelabelTask)
    report = race(
        task,
        ["exact"],
        seeds=1,
        budget_exact_steps=2,
        fractions=[1.0],  # one evaluation (MNIST's take a second each)
        show_progress=False,
        plots=False,
    )
    (row,) = report.runs["exact"]
    assert row["steps"] == 2
    assert all(math.isfinite(point["reward"]) for point in row["curve"])
    assert row["curve"][-1]["drift"] != 0.0  # the model moved
