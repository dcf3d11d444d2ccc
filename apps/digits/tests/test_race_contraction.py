"""The chain's contraction measured on a raced task (gradest_lab.race.race_contraction)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from gradest_lab.race.quoting import render
from gradest_lab.race.race_contraction import CONTRACTION_FILE, measure_race_contraction

from gradest import InvalidValue, RectifiedFlow, rollout
from gradest.cli import main
from gradest.harness import chain_contraction, one_step_cotangent_error


def _tiny_race(out) -> None:
    argv = ["race", "--model", "digits", "--estimators", "exact,sdo,drtune"]
    argv += ["--tune", "lr=1e-4,3e-4", "--tune-seeds", "0-0", "--seeds", "1-1", "--budget", "1x"]
    argv += ["--fractions", "0.5,1", "--ceiling-factor", "1", "--bracket-ratio", "none"]
    argv += ["--task-option", "sampler_steps=4", "--out", str(out), "--no-plots", "--quiet"]
    assert main(argv) == 0


def test_contraction_on_a_raced_task_and_its_table(tmp_path) -> None:
    out = tmp_path / "race"
    _tiny_race(out)
    data = measure_race_contraction(out, samples=3)
    written = json.loads((out / CONTRACTION_FILE).read_text())
    assert written == data
    pre = data["pretrained"]
    assert pre["samples"] == 3 and pre["steps"] == [0, 1, 2, 3]
    # the pretrained figure is the harness's measurement of the task's first training batch
    from gradest_digits.race_task import digits_reward_task

    task = digits_reward_task(sampler_steps=4)
    model = task.pretrained().eval()
    problem = task.step_problem(model, task.sampler(), torch.Generator().manual_seed(0), 0)
    path = rollout(model, RectifiedFlow(steps=4), problem.inputs["noise"][:3])
    direct = chain_contraction(
        model, RectifiedFlow(steps=4), path, iters=8, generator=torch.Generator().manual_seed(0)
    )
    assert pre["mean"] == pytest.approx(direct.mean.tolist(), rel=1e-9)
    assert pre["geometric_mean"] == pytest.approx(
        math.exp(direct.norms.log().mean().item()), rel=1e-9
    )
    # the one-step cotangents' error, for the task's own reward on the same batch
    error = one_step_cotangent_error(model, RectifiedFlow(steps=4), path, problem.objective)
    assert pre["one_step_error"]["error"] == pytest.approx(error.summary()["error"], rel=1e-9)
    assert pre["one_step_error"]["mean_error"] > 0
    assert data["fine_tuned"]["spec"] == "exact" and data["fine_tuned"]["seed"] == 0
    # a second call reads the file back; the page's table renders beside the verdicts
    assert measure_race_contraction(out, samples=3) == data
    table = render(tmp_path, "race-contraction race")
    assert "`sdo` at 50% / 100% of the budget" in table
    assert f"{pre['geometric_mean']:.3g}" in table
    cells = [
        f"{m['one_step_error']['mean_error']:.3g} ({m['one_step_error']['mean_cosine']:.3g})"
        for m in (pre, data["fine_tuned"])
    ]
    assert f"| {cells[0]} / {cells[1]} |" in table
    # a file from before the error was measured is refused, naming the fix
    (out / CONTRACTION_FILE).write_text(
        json.dumps({**written, "schema": "gradest.race-contraction/1"})
    )
    with pytest.raises(InvalidValue, match="measure again with python -m"):
        render(tmp_path, "race-contraction race")
    # a measurement at an lr that is no longer exact's choice is refused, naming the fix
    written["fine_tuned"]["lr"] = 1.0
    (out / CONTRACTION_FILE).write_text(json.dumps(written))
    with pytest.raises(InvalidValue, match="measure again with --again"):
        render(tmp_path, "race-contraction race")
