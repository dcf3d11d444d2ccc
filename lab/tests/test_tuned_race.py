"""The tuned race (gradest_lab.race.tuned_race) and its shards, on the tiny quadratic task."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from gradest_lab.race import plain_race as race_module
from gradest_lab.race.bootstrap import paired_bootstrap, paired_ratio_bootstrap
from gradest_lab.race.plain_race import compute_to_reach
from gradest_lab.race.shards import ShardKey, ShardStore, lr_label
from gradest_lab.race.tuned_race import (
    TunedRaceReport,
    choose_lrs,
    parse_lr_grid,
    parse_seed_list,
    replay_shard,
    tuned_race,
)
from test_race import Killed, QuadraticTask

from gradest.errors import GradestError, InvalidValue

SPECS = ["exact", "truncated:k=1"]
LRS = [0.005, 0.02, 0.08]
SETTINGS = {
    "lrs": LRS,
    "tune_seeds": [0, 1],
    "seeds": [5, 6, 7],
    "budget_exact_steps": 4,
    "fractions": [0.25, 0.5, 0.75, 1.0],
    "ceiling_factor": 2,
    "show_progress": False,
    "plots": False,
}


def _numbers(report: TunedRaceReport) -> object:
    """The report without its measured wall times (which no two runs share)."""

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("seconds", "step_seconds")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(report.to_json()))


def _quiet_race(task, out, **overrides):
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradest race --tune")
        return tuned_race(task, SPECS, out=out, **{**SETTINGS, **overrides})


def test_grid_and_seed_forms() -> None:
    assert parse_lr_grid("lr=1e-4,3e-4,1e-3") == [1e-4, 3e-4, 1e-3]
    grid = parse_lr_grid("lr=3e-5..1e-3:6")
    assert len(grid) == 6 and grid[0] == 3e-5 and grid[-1] == 1e-3
    ratios = [b / a for a, b in zip(grid, grid[1:], strict=False)]
    assert all(abs(r - (1e-3 / 3e-5) ** 0.2) / r < 0.1 for r in ratios)  # log-spaced
    for bad in (
        "lr=",
        "wd=1e-4,1e-3",
        "lr=1e-3,1e-4",
        "lr=1e-4",
        "lr=1e-4,-1",
        "lr=1e-3..1e-4:3",
        "lr=1e-4,nan",
        "1e-4,3e-4",
    ):
        with pytest.raises(InvalidValue, match="--tune"):
            parse_lr_grid(bad)
    assert parse_seed_list("4") == [0, 1, 2, 3]
    assert parse_seed_list("16-19") == [16, 17, 18, 19]
    assert parse_seed_list("0-1,5") == [0, 1, 5]
    for bad in ("0", "3-1", "a", "1,1", "", "1-2-3", "99999999999"):
        with pytest.raises(InvalidValue, match="--seeds"):
            parse_seed_list(bad)


def _row(seed: int, rewards: list[float], unit: float = 1.0) -> dict:
    return {
        "seed": seed,
        "curve": [
            {"fraction": (i + 1) / len(rewards), "flops": (i + 1) * unit, "reward": r, "drift": 0.0}
            for i, r in enumerate(rewards)
        ],
    }


def test_choose_lrs_per_budget_and_for_time_to_target() -> None:
    # lr 1: fast start, low end; lr 2: slow start, best end; lr 3: never reaches the target.
    rows = {
        lr_label(1.0): [_row(0, [5, 6, 6.5, 7]), _row(1, [5, 6, 6.5, 7])],
        lr_label(2.0): [_row(0, [2, 5, 8, 9]), _row(1, [2, 5, 8, 9])],
        lr_label(3.0): [_row(0, [1, 2, 3, 4]), _row(1, [1, 2, 3, 4])],
    }
    fractions = [0.25, 0.5, 0.75, 1.0]
    chosen = choose_lrs(
        rows, [1.0, 2.0, 3.0], fractions=fractions, initial=0.0, target=6.0, unit=1.0
    )
    assert chosen["by_fraction"] == [1.0, 1.0, 2.0, 2.0]
    # time to 6: lr 1 at 2.0 steps, lr 2 at 2 + 1/3; lr 3 never
    assert chosen["primary"] == 1.0
    assert chosen["edge"] == ["0.25 of the budget", "0.5 of the budget", "time to target"]
    # a target no rate reaches on every seed: the most seeds, then the best final reward
    chosen = choose_lrs(
        rows, [1.0, 2.0, 3.0], fractions=fractions, initial=0.0, target=8.5, unit=1.0
    )
    assert chosen["primary"] == 2.0
    # an estimator that takes no step ties at every rate: the smallest, and no edge flag
    flat = {lr_label(lr): [_row(0, [0, 0, 0, 0])] for lr in (1.0, 2.0, 3.0)}
    chosen = choose_lrs(
        flat, [1.0, 2.0, 3.0], fractions=fractions, initial=0.0, target=1.0, unit=1.0
    )
    assert chosen == {
        "by_fraction": [1.0] * 4,
        "primary": 1.0,
        "gap_by_fraction": [0.0] * 4,
        "primary_gap": None,  # no time to target: the flat runs never reach it
        "edge": [],
        "unbracketed": [],  # flat: a finer rate has nothing to add
        "wanted": [],
    }


def test_tuned_race_statistics_follow_from_the_shards(tmp_path, counted_runs) -> None:
    out = tmp_path / "race"
    report = _quiet_race(QuadraticTask(), out)
    store_root = out / "shards"
    # every tuning run (the grid's and the refinement's) and only the chosen rates' report
    # runs; no seed in both roles
    for spec in SPECS:
        assert set(LRS) <= set(report.tried_lrs(spec))
    tuning = {
        (spec, lr, seed) for spec in SPECS for lr in report.tried_lrs(spec) for seed in (0, 1)
    }
    assert tuning <= set(counted_runs)
    choices = report.choices()
    reported = {
        (spec, lr, seed)
        for spec in SPECS
        for lr in {*choices[spec]["by_fraction"], choices[spec]["primary"]}
        for seed in (5, 6, 7)
    }
    ceiling = [(report.ceiling_run["spec"], report.ceiling_run["lr"], s) for s in (0, 1)]
    assert sorted(counted_runs) == sorted([*tuning, *reported, *ceiling])
    assert len(list(store_root.rglob("*.json"))) == len(tuning | reported)
    # the lr chosen for the full budget: the best mean final reward on the tuning seeds
    for spec in SPECS:
        finals = {
            lr: sum(r["curve"][-1]["reward"] for r in report.tuning[spec][lr_label(lr)]) / 2
            for lr in report.tried_lrs(spec)
        }
        assert choices[spec]["by_fraction"][-1] == max(finals, key=finals.get)
    # the ceiling: the best tuned (estimator, lr) by mean final reward, its best evaluation
    best = max(
        ((s, lr) for s in SPECS for lr in LRS),
        key=lambda p: sum(r["curve"][-1]["reward"] for r in report.tuning[p[0]][lr_label(p[1])]),
    )
    assert (report.ceiling_run["spec"], report.ceiling_run["lr"]) == best
    # ...on the first tuning seeds (both here), each its settled end: the mean of its last
    # quarter of evaluations (the task has no evaluation apart: the report's, flagged)
    assert report.ceiling_run["seeds"] == [0, 1] and report.ceiling_evaluation == "report"
    ends = [sum(p["reward"] for p in row["curve"][-8:]) / 8 for row in report.ceiling_run["rows"]]
    assert report.ceiling == pytest.approx(sum(ends) / 2, rel=1e-12)
    assert any("the report's own evaluation set" in n for n in report.grid_warnings())
    summary = report.summary()
    # reward differences: paired by seed, each at its own lr for that budget
    for i in range(4):
        lr = choices["truncated:k=1"]["by_fraction"][i]
        exact_lr = choices["exact"]["by_fraction"][i]
        mine = [r["curve"][i]["reward"] for r in report.runs["truncated:k=1"][lr_label(lr)]]
        theirs = [r["curve"][i]["reward"] for r in report.runs["exact"][lr_label(exact_lr)]]
        point = summary["final"]["truncated:k=1"][i]
        assert point["lr"] == lr
        assert point["reward_minus_exact"] == paired_bootstrap(mine, theirs).to_json()
    # time to target: the first crossing of initial + level * (ceiling - initial) per seed
    unit = report.unit
    for level in (0.5, 0.8, 0.9):
        target = report.initial["reward"] + level * (report.ceiling - report.initial["reward"])
        entry = summary["time_to_target"]["truncated:k=1"]
        rows = report.runs["truncated:k=1"][lr_label(entry["lr"])]
        expected = [
            compute_to_reach(
                [(0.0, report.initial["reward"])]
                + [(p["flops"] / unit, p["reward"]) for p in r["curve"]],
                target,
            )
            for r in sorted(rows, key=lambda r: r["seed"])
        ]
        got = entry["levels"][f"{level:g}"]
        assert got["per_seed"] == expected
        assert got["reached"] == sum(map(math.isfinite, expected))
    # the decision: the interval clears zero by more than the two residual tuning gaps
    for i, row in enumerate(summary["decision"]):
        for entry in row["beats_exact"] + row["behind_exact"] + row["no_clear_difference"]:
            gaps = [summary["final"][s][i]["residual_gap"] for s in (entry["spec"], "exact")]
            assert entry["margin"] == sum(gaps)
        for entry in row["beats_exact"]:
            assert entry["minus_exact"]["low"] > entry["margin"]
        for entry in row["behind_exact"]:
            assert entry["minus_exact"]["high"] < -entry["margin"]
        for entry in row["no_clear_difference"]:
            low, high = entry["minus_exact"]["low"], entry["minus_exact"]["high"]
            assert low <= entry["margin"] and high >= -entry["margin"]
    # the report reads back from its raw runs to the same file, and the page shows it
    assert TunedRaceReport.load(out).to_json() == (out / "report.json").read_text().rstrip("\n")
    page = (out / "report.md").read_text()
    assert "## Decision: who beats exact at equal compute" in page
    assert "## Time to target" in page and "## Tuning" in page


def test_a_ratio_of_means_and_its_paired_interval() -> None:
    interval = paired_ratio_bootstrap([2.0, 4.0, 6.0], [4.0, 8.0, 12.0])
    assert (
        interval.mean == 0.5
        and interval.low == pytest.approx(0.5)
        and interval.high == pytest.approx(0.5)
    )
    spread = paired_ratio_bootstrap([1.0, 4.0, 2.0, 3.0], [2.0, 2.0, 2.0, 2.0])
    assert spread.low < spread.mean == 1.25 < spread.high
    with pytest.raises(InvalidValue, match="finite"):
        paired_ratio_bootstrap([math.inf, 1.0], [1.0, 1.0])


def test_shards_merge_from_another_machine_without_rerunning(tmp_path, counted_runs) -> None:
    whole = _quiet_race(QuadraticTask(), tmp_path / "one")
    # "another machine" ran the tuning runs of seed 0: their files are copied over
    other = tmp_path / "two"
    shutil.copy(tmp_path / "one" / "run.json", other.mkdir() or other / "run.json")
    for shard in (tmp_path / "one" / "shards").rglob("seed-0.json"):
        target = other / shard.relative_to(tmp_path / "one")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shard, target)
    counted_runs.clear()
    merged = _quiet_race(QuadraticTask(), other)
    # seed 0's tuning runs were not run again; the one run of seed 0 is the ceiling's
    # (its folder was not copied), of the best tuned (estimator, lr)
    ceiling = (whole.ceiling_run["spec"], whole.ceiling_run["lr"], 0)
    assert [run for run in counted_runs if run[2] == 0] == [ceiling]
    assert {(s, lr, 1) for s in SPECS for lr in LRS} <= set(counted_runs)
    assert _numbers(merged) == _numbers(whole)


def test_a_killed_race_resumes_to_the_uninterrupted_one(tmp_path) -> None:
    whole = _quiet_race(QuadraticTask(), tmp_path / "whole")
    with pytest.raises(Killed):
        _quiet_race(QuadraticTask(kill_after=11), tmp_path / "killed")
    assert list((tmp_path / "killed" / "state").rglob("*.pt"))  # a run in progress was kept
    resumed = _quiet_race(QuadraticTask(), tmp_path / "killed")
    assert _numbers(resumed) == _numbers(whole)
    assert not list((tmp_path / "killed" / "state").rglob("*.pt"))


def test_a_race_grows_but_its_identity_is_fixed(tmp_path, counted_runs) -> None:
    out = tmp_path / "race"
    # (unrefined: the refinement's own reuse of shards is tested in test_race_refinement)
    _quiet_race(QuadraticTask(), out, lrs=LRS[:2], bracket_ratio=None)
    counted_runs.clear()
    # one more lr: only its tuning runs are new
    _quiet_race(QuadraticTask(), out, bracket_ratio=None)
    # per tuning seed: the new lr's runs, and at most one more, the ceiling's (on the first
    # tuning seeds, both here), if its choice moved
    for seed in (0, 1):
        runs = [run for run in counted_runs if run[2] == seed]
        new = [(s, LRS[2], seed) for s in SPECS]
        assert set(new) <= set(runs) and len(runs) <= len(new) + 1
    with pytest.raises(InvalidValue, match="budget_given"):
        _quiet_race(QuadraticTask(), out, budget_exact_steps=5)
    with pytest.raises(InvalidValue, match="batch"):
        _quiet_race(QuadraticTask(batch=4), out)


def test_foreign_malformed_and_linked_shards_are_refused_untouched(tmp_path) -> None:
    out = tmp_path / "race"
    _quiet_race(QuadraticTask(), out)
    shard = next((out / "shards").rglob("*.json"))
    original = shard.read_text()
    data = json.loads(original)
    cases = {
        "[]": "holds a list",
        "{": "not a readable race shard",
        json.dumps({**data, "identity": "0" * 16}): "a shard of another race",
        json.dumps({**data, "seed": 99}): "seed is 99",
        json.dumps({**data, "row": {**data["row"], "steps": "8"}}): r"row\.steps",
        json.dumps({**data, "row": {**data["row"], "curve": [{"reward": 1}]}}): r"row\.curve\[0\]",
    }
    for text, message in cases.items():
        shard.write_text(text)
        with pytest.raises(InvalidValue, match=message):
            _quiet_race(QuadraticTask(), out)
        assert shard.read_text() == text  # never rewritten
    shard.write_text(original)
    # a state folder that is a link (it may lead out of the race folder): refused
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "state").rename(tmp_path / "moved")
    (out / "state").symlink_to(elsewhere)
    shard.unlink()
    with pytest.raises(GradestError, match="symbolic link"):
        _quiet_race(QuadraticTask(), out)
    assert not list(elsewhere.iterdir())


def test_another_kind_of_race_folder_is_refused(tmp_path) -> None:
    out = tmp_path / "race"
    race_module.race(
        QuadraticTask(),
        SPECS,
        seeds=1,
        budget_exact_steps=2,
        out=out,
        show_progress=False,
        plots=False,
    )
    with pytest.raises(
        InvalidValue, match="holds a 'gradest race' run, not a 'gradest race --tune'"
    ):
        _quiet_race(QuadraticTask(), out)
    with pytest.raises(InvalidValue, match="disjoint"):
        _quiet_race(QuadraticTask(), tmp_path / "new", seeds=[1, 5])


def test_a_shard_claimed_by_a_live_process_is_skipped_and_a_dead_ones_taken_over(tmp_path) -> None:
    store = ShardStore(tmp_path, "id")
    key = ShardKey("exact", 0.01, 3)
    lock = tmp_path / "state" / "shards" / key.relative(".lock")
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from gradest_lab.storage.process_lock import try_lock; "
            "held = try_lock(sys.argv[1], command='other'); print('held', flush=True); "
            "time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with store.claim(key) as mine:
            assert not mine
        assert store.holder(key) is not None
        assert store.holder(key).startswith(f"pid {holder.pid} on ")
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # the killed holder left its lock file behind: it is free
    assert store.holder(key) is None
    with store.claim(key) as mine:
        assert mine
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_replay_reproduces_a_shards_first_points(tmp_path) -> None:
    out = tmp_path / "race"
    report = _quiet_race(QuadraticTask(), out)
    spec, lr = "truncated:k=1", report.choices()["truncated:k=1"]["by_fraction"][-1]
    committed = ShardStore(out, report.config["identity"]).result(ShardKey(spec, lr, 6))
    assert committed is not None
    replayed = replay_shard(QuadraticTask(), report.config, ShardKey(spec, lr, 6), points=2)

    def measured(curve):
        return [{k: v for k, v in point.items() if k != "seconds"} for point in curve]

    assert measured(replayed) == measured(committed["curve"][:2])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0-99999999999", "goes past the largest seed"),
        ("99999999999999999999-99999999999999999999", "goes past the largest seed"),
        ("0-999999999", "more than 1000000 seeds"),
        ("1,0-999999", "more than 1000000 seeds"),
    ],
)
def test_seed_lists_out_of_bounds_name_the_bound(text: str, message: str) -> None:
    with pytest.raises(InvalidValue, match=message):
        parse_seed_list(text)


class _ApartTask(QuadraticTask):
    """The quadratic task with an evaluation apart from the report's (other noise)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        gen = torch.Generator().manual_seed(1234)
        self.apart_noise = torch.randn(self.eval_samples, 2, generator=gen, dtype=torch.float64)

    def evaluate_apart(self, model: torch.nn.Module) -> dict[str, float]:
        report_noise = self.eval_noise
        self.eval_noise = self.apart_noise
        try:
            return self.evaluate(model)
        finally:
            self.eval_noise = report_noise


def test_the_ceiling_is_measured_apart_from_the_report(tmp_path) -> None:
    task = _ApartTask()
    report = _quiet_race(task, tmp_path / "race", tune_seeds=[0, 1, 2], bracket_ratio=None)
    apart = [noise is task.apart_noise for noise in task.evaluated_with]
    # the ceiling's runs (3 seeds x 32 points) and the pretrained model there: apart;
    # every other evaluation (tuning, report, the pretrained model): the report's set
    assert sum(apart) == 3 * 32 + 1
    assert report.ceiling_evaluation == "apart" and report.ceiling_run["seeds"] == [0, 1, 2]
    initial_apart = report.ceiling_run["initial"]["reward"]
    assert initial_apart != report.initial["reward"]  # another set, another number
    gains = [
        sum(p["reward"] for p in row["curve"][-8:]) / 8 - initial_apart
        for row in report.ceiling_run["rows"]
    ]
    gain = report.attainable_gain()
    assert gain["per_seed"] == pytest.approx(gains, rel=1e-12)
    assert gain["gain"]["low"] <= gain["gain"]["mean"] <= gain["gain"]["high"]
    # the bar on the report's scale: its pretrained reward plus the gain measured apart
    assert report.ceiling == pytest.approx(report.initial["reward"] + sum(gains) / 3)
    assert not any("ceiling" in note for note in report.grid_warnings())
    assert "measured apart from the report" in report.to_markdown()
