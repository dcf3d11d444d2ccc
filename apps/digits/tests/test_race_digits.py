"""``gradest race`` on the digits tasks (gradest_digits.race_task): a smoke test of the
smallest settings (the CI's) and the tasks' definitions. The full races are run apart
(docs/results.md)."""

from __future__ import annotations

import json

import torch
from gradest_digits.race_task import (
    PRIOR_WEIGHT,
    REWARD_CEILING,
    DigitsGrpoTask,
    DigitsRewardTask,
)

from gradest.cli import main
from gradest.harness.race import RaceTask, registered_tasks


def test_gradest_race_smoke(tmp_path, capsys):
    out = tmp_path / "race"
    argv = ["race", "--model", "digits", "--estimators", "exact,sdo", "--seeds", "2"]
    argv += ["--budget", "2x", "--eval-samples", "256", "--out", str(out), "--no-plots"]
    assert main([*argv, "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["task"] == "digits"
    assert data["config"]["eval_samples"] == 256
    assert data["config"]["ceiling"] == REWARD_CEILING
    assert data["config"]["budget_exact_steps"] == 2
    assert data["config"]["task_settings"]["prior_weight"] == PRIOR_WEIGHT
    for spec in ("exact", "sdo"):
        rows = data["runs"][spec]
        assert [r["seed"] for r in rows] == [0, 1]
        assert all(len(r["curve"]) == 4 for r in rows)
        assert all(r["flops"] <= data["config"]["budget"] for r in rows)
    assert [r["steps"] for r in data["runs"]["exact"]] == [2, 2]
    text = (out / "report.md").read_text()
    assert "Ceiling (attainable reward): -6.79" in text and "`sdo`" in text
    # a rerun with the same settings continues (here: finds it finished); other settings
    # are refused by name before any work
    assert main([*argv, "--quiet"]) == 0
    assert main([*argv[:-5], "--budget", "3x", "--out", str(out), "--quiet"]) == 2
    assert "budget_given" in capsys.readouterr().err


def test_the_tasks_are_registered_and_follow_the_protocol():
    tasks = registered_tasks()
    assert {"digits", "digits-grpo"} <= set(tasks)


def test_grpo_groups_share_a_label_and_flow_grpo_defaults():
    task = DigitsGrpoTask()
    assert isinstance(task, RaceTask)
    assert task.noise_level == 0.7 and task.reduction == "mean" and task.ceiling == 0.0
    model, sampler = task.pretrained(), task.sampler()
    problem = task.step_problem(model, sampler, torch.Generator().manual_seed(0), 0)
    labels = problem.inputs["cond"]["y"]
    groups = labels.reshape(-1, task.group_size)
    assert bool((groups == groups[:, :1]).all())  # each group shares its prompt
    assert problem.extra_cost.forwards_without_graph == task.sampler_steps  # the rollout
    metrics = task.evaluate(model)
    assert metrics["drift"] == 0.0 and metrics["reward"] <= 0.0


def test_reward_task_objective_is_reward_minus_prior():
    task = DigitsRewardTask()
    metrics = task.evaluate(task.pretrained())
    assert metrics["drift"] == 0.0
    expected = metrics["log_p_target"] - PRIOR_WEIGHT * metrics["heldout_fm"]
    assert metrics["reward"] == expected < task.ceiling
