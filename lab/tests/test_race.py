"""The compute-matched race (gradest_lab.race.plain_race) on a tiny synthetic task."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
import torch
from gradest_lab.race.bootstrap import bootstrap_mean, paired_bootstrap
from gradest_lab.race.plain_race import (
    MIN_EVAL_SAMPLES,
    RaceReport,
    RaceTask,
    StepProblem,
    compute_to_reach,
    race,
)

from gradest.errors import GradestError, InvalidValue
from gradest.objectives import TerminalObjective
from gradest.samplers import RectifiedFlow
from gradest.testing.problems import tiny_mlp

TARGET = torch.tensor([1.0, -0.5], dtype=torch.float64)


class Killed(Exception):
    """A simulated kill in the middle of a race."""


@attrs.define(eq=False, slots=False)
class QuadraticTask:
    """An MLP velocity on 2-D states; reward ``-||x - c||^2`` (optimum: every sample at c,
    an interior point of the state space); drift: the mean squared change of the velocity
    at fixed points. Records which evaluation noise every evaluation used."""

    eval_samples: int = MIN_EVAL_SAMPLES
    steps: int = 4
    batch: int = 8
    lr: float = 0.02
    kill_after: int | None = None  # raise Killed at this evaluation
    name: str = "quadratic"
    objective_kind: str = "terminal"
    ceiling: float | None = 0.0
    evaluated_with: list[Any] = attrs.Factory(list)
    pretrained_calls: int = 0

    def __attrs_post_init__(self) -> None:
        gen = torch.Generator().manual_seed(99)
        self.eval_noise = torch.randn(self.eval_samples, 2, generator=gen, dtype=torch.float64)
        self.drift_points = torch.randn(64, 2, generator=gen, dtype=torch.float64)
        self.drift_times = torch.rand(64, generator=gen, dtype=torch.float64)
        self.base = tiny_mlp(2, hidden=16, seed=0)
        with torch.no_grad():
            self.base_velocity = self.base(self.drift_points, self.drift_times)

    def settings(self) -> dict[str, Any]:
        return {"steps": self.steps, "batch": self.batch, "lr": self.lr}

    def pretrained(self) -> torch.nn.Module:
        self.pretrained_calls += 1
        return tiny_mlp(2, hidden=16, seed=0)

    def sampler(self) -> RectifiedFlow:
        return RectifiedFlow(steps=self.steps)

    def optimizer(self, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(parameters, lr=self.lr)

    def step_problem(self, model, sampler, generator, step) -> StepProblem:
        del model, sampler, step
        noise = torch.randn(self.batch, 2, generator=generator, dtype=torch.float64)
        return StepProblem(
            objective=TerminalObjective(lambda x: (x - TARGET).pow(2).sum(1).mean()),
            inputs={"noise": noise},
        )

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self.kill_after is not None and len(self.evaluated_with) >= self.kill_after:
            raise Killed
        self.evaluated_with.append(self.eval_noise)
        from gradest.trajectory import rollout

        x = rollout(model, self.sampler(), self.eval_noise).states[-1]
        drift = (model(self.drift_points, self.drift_times) - self.base_velocity).pow(2).mean()
        return {"reward": float(-(x - TARGET).pow(2).sum(1).mean()), "drift": float(drift)}

    def flops_inputs(self):
        return (
            torch.zeros(self.batch, 2, dtype=torch.float64),
            torch.full((self.batch,), 0.5, dtype=torch.float64),
        ), {}


SPECS = ["exact", "truncated:k=1"]


def test_task_follows_the_protocol() -> None:
    assert isinstance(QuadraticTask(), RaceTask)


def test_budgets_are_respected_and_cheaper_estimators_take_more_steps() -> None:
    task = QuadraticTask()
    report = race(
        task, SPECS, seeds=2, budget_exact_steps=3, fractions=(0.5, 1.0), show_progress=False
    )
    budget = report.config["budget"]
    assert report.config["budget_exact_steps"] == 3
    for spec in SPECS:
        for row in report.runs[spec]:
            assert row["flops"] <= budget
            # the step it stopped at would have passed the budget
            assert row["flops"] + row["stopped_step"]["flops"] > budget
            # every evaluation point lies within its fraction of the budget
            for point in row["curve"]:
                assert point["flops"] <= point["fraction"] * budget
    exact_steps = [row["steps"] for row in report.runs["exact"]]
    cheap_steps = [row["steps"] for row in report.runs["truncated:k=1"]]
    assert exact_steps == [3, 3]
    assert all(c > e for c, e in zip(cheap_steps, exact_steps, strict=True))


def test_evaluation_set_is_shared_and_large_enough() -> None:
    task = QuadraticTask()
    report = race(
        task, SPECS, seeds=2, budget_exact_steps=2, fractions=(0.5, 1.0), show_progress=False
    )
    # the initial point plus every (seed, estimator, fraction)
    assert len(task.evaluated_with) == 1 + 2 * len(SPECS) * 2
    assert all(noise is task.eval_noise for noise in task.evaluated_with)
    assert task.eval_noise.shape[0] >= MIN_EVAL_SAMPLES
    assert report.config["eval_samples"] == MIN_EVAL_SAMPLES
    with pytest.raises(InvalidValue, match="at least 256"):
        race(
            QuadraticTask(eval_samples=100),
            SPECS,
            seeds=1,
            budget_exact_steps=1,
            show_progress=False,
        )


def test_report_json_has_per_seed_curves(tmp_path) -> None:
    task = QuadraticTask()
    race(
        task,
        SPECS,
        seeds=2,
        budget_exact_steps=2,
        fractions=(0.25, 0.5, 1.0),
        out=tmp_path / "race",
        show_progress=False,
        plots=False,
    )
    data = json.loads((tmp_path / "race" / "report.json").read_text())
    assert data["schema"] == "gradest.race/1"
    assert data["config"]["seeds"] == [0, 1]
    assert data["config"]["eval_samples"] == 256
    assert data["config"]["ceiling"] == 0.0
    for spec in SPECS:
        rows = data["runs"][spec]
        assert [r["seed"] for r in rows] == [0, 1]
        for row in rows:
            assert [p["fraction"] for p in row["curve"]] == [0.25, 0.5, 1.0]
            assert {"reward", "drift", "flops", "seconds", "steps"} <= set(row["curve"][0])
        point = data["summary"][spec]["points"][-1]
        assert {"mean", "low", "high", "n", "resamples"} <= set(point["reward_minus_exact"])
        assert point["reward_minus_exact"]["resamples"] >= 2000
    # exact against itself: difference exactly 0 with the interval [0, 0]
    zero = data["summary"]["exact"]["points"][-1]["reward_minus_exact"]
    assert (zero["mean"], zero["low"], zero["high"]) == (0.0, 0.0, 0.0)
    text = (tmp_path / "race" / "report.md").read_text()
    assert "truncated:k=1" in text and "bootstrap" in text and "Ceiling" in text


def test_bootstrap_intervals() -> None:
    values = [0.3, -1.2, 2.5, 0.7, 1.1]
    same = paired_bootstrap(values, values)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    shifted = paired_bootstrap([v + 0.5 for v in values], values)
    assert shifted.low == pytest.approx(0.5) and shifted.high == pytest.approx(0.5)
    # a known difference of 1 with noise: the interval covers it and is not degenerate
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(32, generator=gen, dtype=torch.float64)
    other = base + 1.0 + 0.5 * torch.randn(32, generator=gen, dtype=torch.float64)
    ci = paired_bootstrap(other.tolist(), base.tolist())
    assert ci.low < 1.0 < ci.high and ci.high - ci.low < 1.0
    assert ci == paired_bootstrap(other.tolist(), base.tolist())  # fixed seed
    # "not reached" (+inf) makes the mean and the upper end infinite
    reach = bootstrap_mean([1.0, 2.0, math.inf])
    assert reach.mean == math.inf and reach.high == math.inf and reach.low < math.inf
    with pytest.raises(InvalidValue):
        bootstrap_mean([1.0, 2.0], resamples=100)


def test_compute_to_reach_interpolates() -> None:
    points = [(0.0, 0.0), (2.0, 1.0), (4.0, 3.0)]
    assert compute_to_reach(points, 0.5) == 1.0
    assert compute_to_reach(points, 2.0) == 3.0
    assert compute_to_reach(points, 0.0) == 0.0
    assert compute_to_reach(points, 3.5) == math.inf


def _numbers(report: RaceReport) -> dict[str, Any]:
    """Everything but the wall times."""
    return {
        spec: [
            {
                "steps": row["steps"],
                "flops": row["flops"],
                "curve": [{k: v for k, v in p.items() if k != "seconds"} for p in row["curve"]],
            }
            for row in rows
        ]
        for spec, rows in report.runs.items()
    }


def test_resume_after_a_kill_equals_an_uninterrupted_race(tmp_path) -> None:
    settings = dict(
        seeds=2, budget_exact_steps=4, fractions=(0.25, 0.5, 1.0), show_progress=False, plots=False
    )
    whole = race(QuadraticTask(), SPECS, out=tmp_path / "whole", **settings)
    # killed in the middle of seed 0's runs (after the initial and 3 more evaluations)
    with pytest.raises(Killed):
        race(QuadraticTask(kill_after=4), SPECS, out=tmp_path / "killed", **settings)
    assert not (tmp_path / "killed" / "report.json").exists()
    assert list((tmp_path / "killed" / "state").rglob("*.pt"))
    task = QuadraticTask()
    resumed = race(task, SPECS, out=tmp_path / "killed", **settings)
    # the resumed race did not redo the saved evaluation points
    assert len(task.evaluated_with) < 1 + 2 * len(SPECS) * 3
    assert _numbers(resumed) == _numbers(whole)
    # a finished race rerun just rewrites its report
    again = race(QuadraticTask(), SPECS, out=tmp_path / "killed", **settings)
    assert _numbers(again) == _numbers(whole)


def test_bad_settings_are_refused_before_work(tmp_path) -> None:
    task = QuadraticTask()
    cases = [
        (dict(specs=["exact", "nonesuch"]), "nonesuch"),
        (dict(specs=["sdo"]), "exact"),
        (dict(specs=["exact", "exact"]), "twice"),
        (dict(budget_flops=1e6), "exactly one budget"),
        (dict(fractions=(0.5, 0.25, 1.0)), "increasing"),
        (dict(fractions=(0.5,)), "last fraction"),
        (dict(seeds=0), "seeds"),
    ]
    for change, message in cases:
        kwargs: dict[str, Any] = (
            dict(specs=SPECS, seeds=1, budget_exact_steps=1, show_progress=False) | change
        )
        specs = kwargs.pop("specs")
        with pytest.raises(GradestError, match=message):
            race(task, specs, **kwargs)
    with pytest.raises(InvalidValue, match="exactly one budget"):
        race(task, SPECS, seeds=1, show_progress=False)
    assert task.pretrained_calls == 0
    # a folder that holds a race with other settings: refused naming them, before work
    out = tmp_path / "race"
    race(
        QuadraticTask(),
        SPECS,
        seeds=1,
        budget_exact_steps=1,
        fractions=(1.0,),
        out=out,
        show_progress=False,
        plots=False,
    )
    other = QuadraticTask(lr=0.1)
    with pytest.raises(InvalidValue, match="seeds.*task setting lr|task setting lr"):
        race(
            other,
            SPECS,
            seeds=2,
            budget_exact_steps=1,
            fractions=(1.0,),
            out=out,
            show_progress=False,
        )
    assert other.pretrained_calls == 0
    with pytest.raises(InvalidValue, match="budget_given"):
        race(
            QuadraticTask(),
            SPECS,
            seeds=1,
            budget_exact_steps=2,
            fractions=(1.0,),
            out=out,
            show_progress=False,
        )


@attrs.define
class WrongWayTask(QuadraticTask):
    """Trains towards the opposite of what it evaluates: exact loses reward."""

    name: str = "wrong-way"

    def step_problem(self, model, sampler, generator, step) -> StepProblem:
        del model, sampler, step
        noise = torch.randn(self.batch, 2, generator=generator, dtype=torch.float64)
        return StepProblem(
            objective=TerminalObjective(lambda x: -(x - TARGET).pow(2).sum(1).mean()),
            inputs={"noise": noise},
        )


def test_shares_of_exacts_gain_are_undefined_when_exact_lost_reward() -> None:
    report = race(
        WrongWayTask(), SPECS, seeds=2, budget_exact_steps=3, fractions=(1.0,),
        show_progress=False,
    )  # fmt: skip
    summary = report.summary()
    assert summary["exact"]["points"][-1]["reward"]["mean"] < report.initial["reward"]
    for spec in SPECS:
        assert summary[spec]["gain_fraction_of_exact"] is None
        for reach in summary[spec]["reach"].values():
            assert reach["undefined"] == "exact did not gain" and reach["mean"] is None
    assert "- (exact did not gain)" in report.to_markdown()


def quadratic_task(
    *, eval_samples: int = MIN_EVAL_SAMPLES, device: str = "cpu", lr: float = 0.02, steps: int = 4
) -> QuadraticTask:
    """A race-task factory as applications register them: its keywords are task options."""
    del device
    return QuadraticTask(eval_samples=eval_samples, lr=lr, steps=steps)


def test_cli_task_options_reach_the_task_and_the_record(tmp_path, monkeypatch, capsys) -> None:
    from gradest_lab.race import plain_race as race_module

    from gradest.cli import main

    monkeypatch.setattr(race_module, "registered_tasks", lambda: {"quadratic": quadratic_task})
    out = tmp_path / "race"
    argv = ["race", "--model", "quadratic", "--estimators", "exact", "--seeds", "1"]
    argv += ["--budget", "1x", "--fractions", "1", "--out", str(out), "--no-plots", "--quiet"]
    assert main([*argv, "--task-option", "lr=0.1", "--task-option", "steps=3"]) == 0
    settings = json.loads((out / "report.json").read_text())["config"]["task_settings"]
    assert settings == {"steps": 3, "batch": 8, "lr": 0.1}
    capsys.readouterr()
    # the same folder without the option is another race: refused, saying how to set it
    assert main(argv[:-1]) == 2
    err = capsys.readouterr().err
    assert "task setting lr" in err and "0.1 there, 0.02 now" in err and "--task-option" in err
    # a key the factory does not take is refused naming the task's options, before any work
    assert main([*argv, "--task-option", "rate=1"]) == 2
    assert "it takes: lr=0.02, steps=4" in capsys.readouterr().err
    assert main([*argv, "--task-option", "steps=2.5"]) == 2
    assert "steps is a whole number" in capsys.readouterr().err
    # gradest race --list-tasks shows each installed task's options; list stays estimators
    assert main(["race", "--list-tasks"]) == 0
    assert capsys.readouterr().out == "quadratic: lr=0.02, steps=4\n"
    assert main(["list"]) == 0
    assert "quadratic" not in capsys.readouterr().out
    monkeypatch.setattr(race_module, "registered_tasks", dict)
    assert main(["race", "--list-tasks"]) == 0
    assert "no race tasks installed" in capsys.readouterr().out


STALL_AT = 4


@attrs.define(eq=False, slots=False)
class StallingTask(QuadraticTask):
    """Sleeps once, inside one training step: what another process taking the cores does
    to a wall-time race."""

    stall_at: int = STALL_AT
    stall_seconds: float = 0.5
    evaluation_seconds: float = 0.5  # slow evaluations, which a step must not be charged

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        import time

        time.sleep(self.evaluation_seconds)
        return super().evaluate(model)

    def step_problem(self, model, sampler, generator, step) -> StepProblem:
        if step == self.stall_at:
            import time

            time.sleep(self.stall_seconds)
        return super().step_problem(model, sampler, generator, step)


def test_wall_time_budget_rule_and_machine_stalls(tmp_path) -> None:
    """A wall-time race takes a step while `spent + the previous step's seconds` fits the
    budget, keeps every step's seconds, and its report names the stalled step."""
    budget = 2.0
    report = race(
        StallingTask(),
        SPECS,
        seeds=1,
        budget_seconds=budget,
        fractions=(0.5, 1.0),
        show_progress=False,
        out=tmp_path / "race",
        plots=False,
    )
    assert report.axis == "seconds" and report.unit_name == "seconds"
    for spec in SPECS:
        (row,) = report.runs[spec]
        times = row["step_seconds"]
        assert len(times) == row["steps"] > STALL_AT
        assert math.isclose(sum(times), row["seconds"], rel_tol=1e-9)
        for k in range(len(times)):  # every step taken fitted when it was taken
            assert sum(times[:k]) + (times[k - 1] if k else 0.0) <= budget
        assert sum(times) + times[-1] > budget  # and the next one would not have
        # one evaluation point per fraction, in order of the seconds spent
        assert [p["fraction"] for p in row["curve"]] == [0.5, 1.0]
        assert row["curve"][0]["seconds"] <= row["curve"][1]["seconds"] == row["seconds"]
        # the one stall is the step's own; the slow evaluations were not charged to a step
        (stalled,) = [dict(entry["steps"]) for entry in report.stalls()[spec]]
        assert stalled[STALL_AT] >= 0.5
        assert max(t for i, t in enumerate(times) if i != STALL_AT) < 0.5
    text = (tmp_path / "race" / "report.md").read_text()
    assert "## Machine stalls" in text and f"| `exact` | 0 | {STALL_AT}: " in text
    # the per-step seconds survive the report file
    assert RaceReport.load(tmp_path / "race").stalls() == report.stalls()


def test_stalled_steps_are_those_far_above_the_runs_median() -> None:
    from gradest_lab.race.plain_race import STALL_FACTOR, stalled_steps

    assert stalled_steps([0.1, 0.1, 0.1, 0.1 * STALL_FACTOR]) == []  # not above the factor
    assert stalled_steps([0.1, 0.1, 0.1, 0.6, 0.1]) == [(3, 0.6)]
    assert stalled_steps([0.1, 5.0]) == []  # two steps have no median to speak of


def _small_race(out, **change: Any) -> RaceReport:
    settings: dict[str, Any] = dict(
        seeds=1, budget_exact_steps=1, fractions=(1.0,), show_progress=False, plots=False
    )
    return race(QuadraticTask(), SPECS, out=out, **(settings | change))


def test_a_race_folder_holds_one_race_and_one_writer(tmp_path) -> None:
    import subprocess
    import sys

    from gradest_lab.storage.run_folder import RUN_RECORD, FolderInUse, read_run_record

    out = tmp_path / "race"
    _small_race(out)
    record = read_run_record(out / RUN_RECORD)
    assert record.command == "gradest race" and record.settings["seeds"] == [0]
    # a second process while one runs: refused naming it, the folder unchanged
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from gradest_lab.storage.process_lock import try_lock; "
            "held = try_lock(sys.argv[1], command='gradest race'); print('held', flush=True); "
            "time.sleep(60)",
            str(out / ".gradest-run.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".lock"}
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse, match=rf"in use by pid {holder.pid} on "):
            _small_race(out)
    finally:
        holder.kill()
        holder.wait()
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".lock"}
    assert after == before
    # the killed holder's lock is free: the same race reruns (and finds itself finished)
    assert _numbers(_small_race(out)) == _numbers(RaceReport.load(out / "report.json"))


def test_a_folder_of_another_run_or_tool_is_refused_untouched(tmp_path) -> None:
    from gradest_lab.storage.run_folder import RunRecord, claim_run_folder

    finetuned = tmp_path / "ft"
    with claim_run_folder(finetuned, RunRecord(command="gradest finetune", settings={"lr": 1})):
        (finetuned / "log.jsonl").write_text("{}\n")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (foreign / "state").mkdir()  # a state folder without its race's record
    for folder, message in [
        (finetuned, "holds a 'gradest finetune' run, not a 'gradest race' run"),
        (foreign, r"not a gradest run's \(notes.txt, state"),
    ]:
        before = sorted((p, p.is_file() and p.read_bytes()) for p in folder.rglob("*"))
        with pytest.raises(InvalidValue, match=message):
            _small_race(folder)
        assert sorted((p, p.is_file() and p.read_bytes()) for p in folder.rglob("*")) == before


class _Payload:
    """Unpickling this runs ``touch`` (if a reader ever ran pickled code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_damaged_or_foreign_run_state_is_one_line_and_kept(tmp_path) -> None:
    import pickle

    settings = dict(
        seeds=1, budget_exact_steps=4, fractions=(0.25, 0.5, 1.0), show_progress=False, plots=False
    )
    out = tmp_path / "killed"
    with pytest.raises(Killed):
        race(QuadraticTask(kill_after=2), SPECS, out=out, **settings)
    state_file = next((out / "state").rglob("*.pt"))
    good = state_file.read_bytes()
    saved = torch.load(state_file, weights_only=True)
    marker = tmp_path / "payload-ran"

    def saved_with(**change: Any) -> bytes:
        import io

        buffer = io.BytesIO()
        torch.save({**saved, **change}, buffer)
        return buffer.getvalue()

    def without(field: str) -> bytes:
        import io

        buffer = io.BytesIO()
        torch.save({k: v for k, v in saved.items() if k != field}, buffer)
        return buffer.getvalue()

    cases = {
        b"": "does not load",
        good[: len(good) // 2]: "does not load",
        pickle.dumps(_Payload(str(marker))): "does not load",
        saved_with(schema="other/1"): "has schema 'other/1'",
        without("optimizer"): "has optimizer = NoneType, not dict",
        saved_with(step="3"): "has step = str, not int",
        saved_with(done=1): "has done = int, not bool",
        saved_with(curve="{"): "curve that is not JSON",
        saved_with(seed=7): "not 'exact' seed 0|not 'truncated:k=1' seed 0",
        saved_with(model={"weight": torch.zeros(1)}): "does not fit the run",
    }
    for data, message in cases.items():
        state_file.write_bytes(data)
        with pytest.raises(InvalidValue, match=message) as info:
            race(QuadraticTask(), SPECS, out=out, **settings)
        assert "\n" not in str(info.value) and "move it away" in str(info.value)
        assert state_file.read_bytes() == data  # kept as it is
    assert not marker.exists()  # the pickled payload never ran
    # a state folder that is a link: refused before anything is written through it
    state_file.write_bytes(good)
    elsewhere = tmp_path / "elsewhere"
    seed_folder = state_file.parent
    seed_folder.rename(elsewhere)
    seed_folder.symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(GradestError, match="symbolic link"):
        race(QuadraticTask(), SPECS, out=out, **settings)
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    seed_folder.unlink()
    elsewhere.rename(seed_folder)
    whole = race(QuadraticTask(), SPECS, out=tmp_path / "whole", **settings)
    assert _numbers(race(QuadraticTask(), SPECS, out=out, **settings)) == _numbers(whole)


def test_ctrl_c_in_gradest_race_names_how_to_continue(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("gradest_digits")
    from gradest_lab.race import plain_race as race_module
    from gradest_lab.storage.run_folder import RunRecord, claim_run_folder

    from gradest import cli

    def interrupted_after_a_point(task, specs, *, out, **kwargs):
        with claim_run_folder(out, RunRecord(command="gradest race")):
            (out / "state").mkdir()
            raise KeyboardInterrupt

    def interrupted_at_once(task, specs, *, out, **kwargs):
        with claim_run_folder(out, RunRecord(command="gradest race")):
            raise KeyboardInterrupt

    argv = ["race", "--model", "digits", "--budget", "1x", "--seeds", "1", "--quiet"]
    monkeypatch.setattr(race_module, "race", interrupted_after_a_point)
    assert cli.main([*argv, "--out", str(tmp_path / "kept")]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradest race: interrupted; its finished runs")
    assert "rerun the same command" in err
    assert len(err.splitlines()) == 1
    monkeypatch.setattr(race_module, "race", interrupted_at_once)
    assert cli.main([*argv, "--out", str(tmp_path / "none")]) == 130
    assert capsys.readouterr().err.strip() == "gradest race: interrupted; nothing was written"
    assert not (tmp_path / "none").exists()
