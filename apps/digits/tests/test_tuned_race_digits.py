"""``gradest race --tune`` on the digits task: the smallest settings (the CI's), and the
golden rerun that ties the committed tuned race to the code that computes it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gradest_digits.race_task import digits_reward_task
from gradest_lab.race.shards import ShardKey, ShardStore
from gradest_lab.race.tuned_race import TUNED_SCHEMA, TunedRaceReport, replay_shard

from gradest.cli import main

COMMITTED = Path(__file__).resolve().parents[3] / "docs" / "results" / "race_digits_tuned"


def _argv(out: Path, *budget: str) -> list[str]:
    argv = ["race", "--model", "digits", "--estimators", "exact,sdo", "--tune", "lr=1e-4,3e-4"]
    argv += ["--tune-seeds", "0-0", "--seeds", "1-1", *budget, "--fractions", "0.5,1"]
    # (unrefined, for time: the refinement is tested on the lab's quadratic task)
    argv += ["--ceiling-factor", "1", "--bracket-ratio", "none"]
    return [*argv, "--out", str(out), "--no-plots", "--quiet"]


def test_gradest_race_tune_smallest_settings(tmp_path, capsys):
    out = tmp_path / "tuned"
    argv = _argv(out, "--budget", "1x")
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert "not ready to quote: the grid has 2 points" in captured.err
    assert "not bracketed at 1.26x" in captured.err
    # one tuning seed: the ceiling's runs are one, on the evaluation apart from the report's
    assert "the ceiling was measured on 1 seed(s) and evaluation noise apart" in captured.err
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == TUNED_SCHEMA
    assert data["config"]["tune_seeds"] == [0] and data["config"]["seeds"] == [1]
    assert set(data["tuning"]["sdo"]) == {"lr-0.0001", "lr-0.0003"}
    for spec in ("exact", "sdo"):
        for rows in data["runs"][spec].values():
            assert [row["seed"] for row in rows] == [1]
            assert all(row["flops"] <= data["config"]["budget"] for row in rows)
    assert TunedRaceReport.load(out).to_json() + "\n" == (out / "report.json").read_text()
    # the lr belongs to the grid, not to --task-option; a wall-time budget is not tuned
    assert main([*argv, "--task-option", "lr=1e-4"]) == 2
    assert "both set the lr" in capsys.readouterr().err
    assert main(_argv(tmp_path / "wall", "--budget-seconds", "3")) == 2
    assert "FLOPs budget" in capsys.readouterr().err
    # a bracket out of bounds is refused naming the flag, before any model loads
    assert main([*argv, "--bracket-ratio", "9"]) == 2
    assert "--bracket-ratio must be none (no refinement) or a ratio" in capsys.readouterr().err
    # a different budget into the same folder is refused naming the setting
    assert main(_argv(out, "--budget", "2x")) == 2
    assert "budget_given" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "lr", "seed"), [("exact", 0.00025, 0), ("sdo", 0.00063, 0)])
def test_the_committed_tuned_race_reruns_to_its_curve(spec, lr, seed):
    """Two shards of the committed race rerun for their first two evaluation points (two
    exact steps of compute) equal the committed curve: code that changes the race's numbers
    cannot keep the old figures."""
    settings = json.loads((COMMITTED / "race.json").read_text())
    key = ShardKey(spec, lr, seed)
    committed = ShardStore(COMMITTED, settings["identity"]).result(key)
    assert committed is not None, f"{key.describe()} is not in the committed race"
    task = digits_reward_task(
        **{k: v for k, v in settings["task_settings"].items() if k != "device"}
    )
    replayed = replay_shard(task, settings, key, points=2)
    for ours, theirs in zip(replayed, committed["curve"][:2], strict=True):
        assert ours["steps"] == theirs["steps"] and ours["flops"] == theirs["flops"]
        for name in ("reward", "drift", "log_p_target", "heldout_fm"):
            assert math.isclose(ours[name], theirs[name], rel_tol=0, abs_tol=1e-5), name
