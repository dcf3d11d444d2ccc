"""``gradest race`` on the digits tasks (gradest_digits.race_task): a smoke test of the
smallest settings (the CI's) and the tasks' definitions. The full races are run apart
(docs/results.md)."""

from __future__ import annotations

import json

import torch
from gradest_digits.datasets import DIGITS
from gradest_digits.race_task import PRIOR_WEIGHT, DigitsGrpoTask, digits_reward_task
from gradest_lab.race.plain_race import RaceTask, registered_tasks

from gradest.cli import main

REWARD_CEILING = DIGITS.task.ceiling


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
    task = digits_reward_task()
    metrics = task.evaluate(task.pretrained())
    assert metrics["drift"] == 0.0
    expected = metrics["log_p_target"] - PRIOR_WEIGHT * metrics["heldout_fm"]
    assert metrics["reward"] == expected < task.ceiling


class _Stopped(Exception):
    """Raised where a race's work would start: its settings were accepted."""


# The heading of docs/results.md's section of races set out but not run yet.
PLANNED = "### Tuned races still to run"


def _documented_race_commands() -> list[tuple[list[str], bool]]:
    """Every ``gradest race ... --out docs/results/...`` command in docs/results.md, as argv
    (continuation lines joined, an environment prefix such as OMP_NUM_THREADS=1 dropped),
    with whether it stands in the section of races still to run."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "results.md").read_text()
    commands = []
    heading = ""
    for block in text.replace("\\\n", " ").splitlines():
        if re.match(r"#{1,6} ", block):
            heading = block
        words = shlex.split(block.strip()) if "gradest race " in block else []
        words = words[next((i for i, w in enumerate(words) if w == "gradest"), len(words)) :]
        if words[:2] == ["gradest", "race"] and "--out" in words:
            commands.append((words[1:], heading.startswith(PLANNED)))
    return commands


def test_documented_race_commands_reproduce_the_committed_races(tmp_path, monkeypatch):
    """Each race command docs/results.md shows is accepted as the race committed in its
    --out folder (same task settings, estimators, seeds, budget, fractions): rerun in a
    folder holding that run.json (the race's record), it passes the settings check and
    reaches the work."""
    import functools
    import shutil
    from pathlib import Path

    from gradest_lab.race import plain_race as race_module

    repo = Path(__file__).resolve().parents[3]
    real = registered_tasks()

    def stopping(factory):
        @functools.wraps(factory)  # keeps its signature: the options parse as they would
        def build(**kwargs):
            task = factory(**kwargs)

            def pretrained():
                raise _Stopped

            task.pretrained = pretrained
            return task

        return build

    monkeypatch.setattr(
        race_module, "registered_tasks", lambda: {k: stopping(f) for k, f in real.items()}
    )
    commands = _documented_race_commands()
    assert len([c for c, planned in commands if not planned]) >= 6, commands
    for argv, planned in commands:
        out = argv[argv.index("--out") + 1]
        committed = repo / out / "run.json"
        folder = tmp_path / out.replace("/", "_")
        folder.mkdir()
        if committed.is_file():
            shutil.copy(committed, folder / "run.json")
        else:
            # Only a race set out to run later may lack its data; its command must still
            # be one the race accepts (it reaches the work in an empty folder).
            assert planned, f"{out} has no committed run.json"
        at = argv.index("--out")
        argv = [*argv[:at], *argv[at + 2 :], "--out", str(folder), "--quiet", "--no-plots"]
        try:
            rc = main(argv)
        except _Stopped:
            continue
        raise AssertionError(f"{' '.join(argv)} was refused (rc {rc}) by {committed}")


def test_task_options_are_bounded_by_the_tasks():
    """What `--task-option` can set is refused out of bounds by the task, naming it."""
    import pytest
    from gradest_digits.mnist_race_task import mnist_reward_task
    from gradest_lab.race.task_options import task_options

    from gradest.errors import InvalidValue

    tasks = registered_tasks()
    assert set(task_options(tasks["digits"])) == {
        "lr",
        "batch",
        "sampler_steps",
        "prior_weight",
        "target",
    }
    assert {"group_size", "noise_level", "reduction", "clip"} <= set(
        task_options(tasks["digits-grpo"])
    )
    cases = [
        (tasks["digits"], dict(lr=0.0), "lr must be a finite number > 0"),
        (tasks["digits"], dict(lr=float("nan")), "lr must be"),
        (tasks["digits"], dict(batch=0), "batch must be an int >= 1"),
        (tasks["digits"], dict(sampler_steps=2.5), "sampler_steps must be an int"),
        (tasks["digits"], dict(prior_weight=-1.0), "prior_weight must be a finite number >= 0"),
        (tasks["digits"], dict(target=10), "target must be a digit 0..9"),
        (tasks["digits-grpo"], dict(group_size=1), "group_size must be an int >= 2"),
        (tasks["digits-grpo"], dict(group_size=3), "multiple of group_size=3"),
        (tasks["digits-grpo"], dict(noise_level=0.0), "noise_level must be a finite number > 0"),
        (tasks["digits-grpo"], dict(clip=-0.2), "clip must be"),
        (tasks["digits-grpo"], dict(reduction="max"), "reduction must be one of"),
        (mnist_reward_task, dict(target=10), "target must be a digit 0..9"),
    ]
    for factory, options, message in cases:
        with pytest.raises(InvalidValue, match=message):
            factory(**options)
    # the measured ceiling is reported only for the settings it was measured with
    assert tasks["digits"](sampler_steps=8).ceiling is None
    assert tasks["digits"](lr=3e-4).ceiling == REWARD_CEILING
