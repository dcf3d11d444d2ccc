"""The race's files read back by schema (issue 44, item 8), one test per principle.

Each test corrupts a copy (under ``tmp_path``) of a real committed file, a shard or a
``run.json`` of docs/results/race_digits_tuned or race_digits, by one principle: types,
lengths, bounds, order, finite numbers, nesting depth. Every corruption must be refused as
one :class:`~gradest.errors.InvalidValue` line naming the file and the field, the file left
as it is; the uncorrupted copy must still load. Then the ``--tune`` grid: rates that share a
shard folder are refused up front with advice that does not loop, and a grid's size is
bounded before the grid is built.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gradest_lab.race import plain_race as race_module
from gradest_lab.race.file_schemas import check_race_settings, check_tuned_settings
from gradest_lab.race.plain_race import RACE_COMMAND, race
from gradest_lab.race.shards import ShardKey, ShardStore
from gradest_lab.race.tuned_race import (
    MAX_GRID_POINTS,
    TUNED_RACE_COMMAND,
    check_lr_grid,
    parse_lr_grid,
    tuned_race,
)
from gradest_lab.storage.config_file import load_defaults
from gradest_lab.storage.files import JsonLog, JsonLogError, read_json
from gradest_lab.storage.json_text import MAX_JSON_DEPTH
from gradest_lab.storage.run_folder import read_run_record
from test_race import SPECS, Killed, QuadraticTask

from gradest import cli
from gradest.errors import InvalidValue

REPO = Path(__file__).resolve().parents[2]
TUNED = REPO / "docs" / "results" / "race_digits_tuned"
PLAIN = REPO / "docs" / "results" / "race_digits"
SHARD = Path("shards", "telescope", "lr-0.0001", "seed-6.json")
KEY = ShardKey("telescope", 1e-4, 6)
SCHEMAS = {RACE_COMMAND: check_race_settings, TUNED_RACE_COMMAND: check_tuned_settings}
DEEP = "[" * 200_000 + "]" * 200_000

Edit = Callable[[dict[str, Any]], Any]


def _tuned_settings() -> dict[str, Any]:
    return json.loads((TUNED / "run.json").read_text())["settings"]


def _point(index: int, key: str, value: Any) -> Edit:
    return lambda data: data["row"]["curve"][index].__setitem__(key, value)


def _row(key: str, value: Any) -> Edit:
    return lambda data: data["row"].__setitem__(key, value)


def _top(key: str, value: Any) -> Edit:
    return lambda data: data.__setitem__(key, value)


def _nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def _swap_fractions(data: dict[str, Any]) -> None:
    curve = data["row"]["curve"]
    curve[2]["fraction"], curve[3]["fraction"] = curve[3]["fraction"], curve[2]["fraction"]


# (edit of the committed shard's parsed JSON, the field the refusal must name), by principle.
SHARD_CASES: dict[str, dict[str, tuple[Edit, str]]] = {
    "types": {
        "reward true": (_point(2, "reward", True), "row.curve[2].reward"),
        "steps a string": (_row("steps", "14"), "row.steps"),
        "fraction a string": (_point(0, "fraction", "0.125"), "row.curve[0].fraction"),
        "a point a list": (lambda d: d["row"]["curve"].__setitem__(1, [1, 2]), "row.curve[1]"),
        "row a string": (_top("row", "x"), "row"),
        "curve an object": (_row("curve", {}), "row.curve"),
        "lr true": (_top("lr", True), "lr"),
        "seed a float": (_top("seed", 6.0), "seed"),
        "stopped_step a list": (_row("stopped_step", [1]), "row.stopped_step"),
        "environment a string": (_top("environment", "x"), "environment"),
        "a metric missing": (lambda d: d["row"]["curve"][4].pop("drift"), "row.curve[4].drift"),
    },
    "lengths": {
        "curve one point short": (lambda d: d["row"]["curve"].pop(), "row.curve"),
        "curve empty": (_row("curve", []), "row.curve"),
        "curve one point long": (
            lambda d: d["row"]["curve"].append(dict(d["row"]["curve"][-1])),
            "row.curve is a list of 9, not a list of 8",
        ),
        "step_seconds one short": (lambda d: d["row"]["step_seconds"].pop(), "row.step_seconds"),
    },
    "bounds": {
        "steps -5": (_row("steps", -5), "row.steps"),
        "a point's steps -1": (_point(0, "steps", -1), "row.curve[0].steps"),
        "flops negative": (_row("flops", -1.0), "row.flops"),
        "a step time negative": (
            lambda d: d["row"]["step_seconds"].__setitem__(0, -0.1),
            "row.step_seconds[0]",
        ),
        "the row's seed another": (_row("seed", 7), "row.seed"),
    },
    "order": {
        "an edited fraction": (_point(3, "fraction", 0.45), "row.curve[3].fraction"),
        "two fractions swapped": (_swap_fractions, "row.curve[2].fraction"),
        "steps going down": (_point(4, "steps", 0), "row.curve[4].steps"),
        "flops going down": (_point(5, "flops", 0.0), "row.curve[5].flops"),
        "seconds going down": (_point(6, "seconds", 0.0), "row.curve[6].seconds"),
        "less spent than the curve": (_row("flops", 1.0), "row.flops"),
    },
    "finite": {
        "a NaN reward": (_point(2, "reward", math.nan), "row.curve[2].reward"),
        "infinite flops": (_row("flops", math.inf), "row.flops"),
        "a NaN task metric": (_point(0, "heldout_fm", math.nan), "row.curve[0].heldout_fm"),
        "-Infinity elsewhere": (
            lambda d: d["environment"].__setitem__("threads", -math.inf),
            "environment.threads",
        ),
    },
    "depth": {
        "a field nested 200 deep": (_top("environment", _nested(200)), "levels deep (at line"),
    },
}


def _cases(table: dict[str, dict[str, tuple[Edit, str]]]) -> list[Any]:
    return [
        pytest.param(edit, field, id=f"{principle}: {name}")
        for principle, cases in table.items()
        for name, (edit, field) in cases.items()
    ]


def _corrupted_shard(tmp_path: Path, edit: Edit) -> Path:
    data = json.loads((TUNED / SHARD).read_text())
    edit(data)
    path = tmp_path / SHARD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))  # NaN and Infinity as JSON's parser reads them
    return path


def _refused(read: Callable[[], Any], path: Path, field: str) -> str:
    """``read()`` is refused in one line naming ``path`` and ``field``; the file is kept."""
    before = path.read_bytes()
    with pytest.raises(InvalidValue) as info:
        read()
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    assert field in message, message
    assert path.read_bytes() == before
    return message


def _store(root: Path, *, fractions: bool = True) -> ShardStore:
    settings = _tuned_settings()
    return ShardStore(
        root, settings["identity"], fractions=settings["fractions"] if fractions else None
    )


def test_the_committed_shard_and_run_records_load() -> None:
    committed = json.loads((TUNED / SHARD).read_text())["row"]
    for fractions in (True, False):
        assert _store(TUNED, fractions=fractions).result(KEY) == committed
    for folder in (TUNED, PLAIN):
        record = read_run_record(folder / "run.json", schemas=SCHEMAS)
        assert record.settings == json.loads((folder / "run.json").read_text())["settings"]


@pytest.mark.parametrize(("edit", "field"), _cases(SHARD_CASES))
def test_a_corrupted_shard_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, edit: Edit, field: str
) -> None:
    path = _corrupted_shard(tmp_path, edit)
    _refused(lambda: _store(tmp_path).result(KEY), path, field)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        pytest.param(lambda d: d["row"]["curve"].pop(), "row.curve[6].fraction", id="one short"),
        pytest.param(_row("curve", []), "row.curve", id="empty"),
        pytest.param(_point(3, "fraction", 0.3), "row.curve[3].fraction", id="edited"),
        pytest.param(_point(0, "fraction", 1.5), "row.curve[0].fraction", id="past 1"),
    ],
)
def test_without_the_race_fractions_a_curve_must_be_a_finished_runs(
    tmp_path: Path, edit: Edit, field: str
) -> None:
    """A reader that does not know the race's fractions still refuses a curve that is not a
    finished run's (increasing fractions in (0, 1], the last at 1)."""
    path = _corrupted_shard(tmp_path, edit)
    _refused(lambda: _store(tmp_path, fractions=False).result(KEY), path, field)


@pytest.mark.parametrize("text", [DEEP, "[" * 200_000, '{"a": ' * 100_000])
def test_a_shard_nested_200000_deep_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / SHARD
    path.parent.mkdir(parents=True)
    path.write_text(text)
    message = _refused(lambda: _store(tmp_path).result(KEY), path, "not a readable race shard")
    assert f"more than {MAX_JSON_DEPTH} levels deep" in message


# -- run.json -------------------------------------------------------------------------------


def _settings_edit(key: str, value: Any) -> Edit:
    return lambda data: data["settings"].__setitem__(key, value)


# (folder of the committed run.json, edit of its parsed JSON, the field to name).
RECORD_CASES: dict[str, dict[str, tuple[Path, Edit, str]]] = {
    "types": {
        "task_settings a string": (
            TUNED,
            _settings_edit("task_settings", "x"),
            "settings.task_settings",
        ),
        "plain task_settings a string": (
            PLAIN,
            _settings_edit("task_settings", "x"),
            "settings.task_settings",
        ),
        "fractions a string": (TUNED, _settings_edit("fractions", "0.5"), "settings.fractions"),
        "eval_samples true": (TUNED, _settings_edit("eval_samples", True), "settings.eval_samples"),
        "budget_given a list": (TUNED, _settings_edit("budget_given", []), "settings.budget_given"),
        "a budget kind unknown": (
            PLAIN,
            lambda d: d["settings"]["budget_given"].__setitem__("kind", "steps"),
            "settings.budget_given.kind",
        ),
        "an estimator a number": (PLAIN, _settings_edit("estimators", [1]), "estimators[0]"),
        "a seed a string": (PLAIN, _settings_edit("seeds", ["0"]), "settings.seeds[0]"),
        "identity a number": (TUNED, _settings_edit("identity", 5), "settings.identity"),
        "command a number": (TUNED, _top("command", 5), "command"),
        "lineage a string": (TUNED, _top("lineage", "x"), "lineage"),
        "settings missing a field": (
            TUNED,
            lambda d: d["settings"].pop("fractions"),
            "settings.fractions",
        ),
    },
    "lengths": {
        "no fractions": (TUNED, _settings_edit("fractions", []), "settings.fractions"),
        "no estimators": (PLAIN, _settings_edit("estimators", []), "settings.estimators"),
    },
    "bounds": {
        "eval_samples 0": (TUNED, _settings_edit("eval_samples", 0), "settings.eval_samples"),
        "a negative budget": (
            TUNED,
            lambda d: d["settings"]["budget_given"].__setitem__("value", -8.0),
            "settings.budget_given.value",
        ),
        "a negative seed": (PLAIN, _settings_edit("seeds", [-1]), "settings.seeds[0]"),
        "a fraction past 1": (
            PLAIN,
            _settings_edit("fractions", [0.5, 1.5]),
            "settings.fractions[1]",
        ),
        "a seed twice": (PLAIN, _settings_edit("seeds", [0, 0]), "settings.seeds"),
    },
    "order": {
        "fractions going down": (
            TUNED,
            _settings_edit("fractions", [0.5, 0.25, 1.0]),
            "settings.fractions[1]",
        ),
        "fractions short of the budget": (
            PLAIN,
            _settings_edit("fractions", [0.5, 0.75]),
            "settings.fractions[1]",
        ),
    },
    "finite": {
        "a NaN budget": (
            TUNED,
            lambda d: d["settings"]["budget_given"].__setitem__("value", math.nan),
            "settings.budget_given.value",
        ),
        "an infinite task setting": (
            TUNED,
            lambda d: d["settings"]["task_settings"].__setitem__("prior_weight", math.inf),
            "settings.task_settings.prior_weight",
        ),
    },
    "depth": {
        "a task setting nested 200 deep": (
            TUNED,
            lambda d: d["settings"]["task_settings"].__setitem__("batch", _nested(200)),
            "levels deep",
        ),
    },
}


def _corrupted_record(tmp_path: Path, folder: Path, edit: Edit) -> Path:
    data = json.loads((folder / "run.json").read_text())
    edit(data)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data, indent=2))
    return path


@pytest.mark.parametrize(
    ("folder", "edit", "field"),
    [
        pytest.param(folder, edit, field, id=f"{principle}: {name}")
        for principle, cases in RECORD_CASES.items()
        for name, (folder, edit, field) in cases.items()
    ],
)
def test_a_corrupted_run_record_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, folder: Path, edit: Edit, field: str
) -> None:
    path = _corrupted_record(tmp_path, folder, edit)
    _refused(lambda: read_run_record(path, schemas=SCHEMAS), path, field)


def test_a_run_record_nested_200000_deep_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(DEEP)
    _refused(lambda: read_run_record(path), path, "levels deep")


def test_both_races_refuse_a_run_record_whose_task_settings_is_a_string(tmp_path: Path) -> None:
    """The reviewer's case end to end: before the schema, the plain race raised an
    AttributeError and the tuned race advised a rerun 'with its settings' it could not give."""
    quick = {"budget_exact_steps": 2, "fractions": (0.5, 1.0), "show_progress": False}
    for folder, run in (
        (PLAIN, lambda out: race(QuadraticTask(), SPECS, seeds=1, out=out, plots=False, **quick)),
        (
            TUNED,
            lambda out: tuned_race(
                QuadraticTask(),
                SPECS,
                lrs=[0.01, 0.02],
                tune_seeds=[0],
                seeds=[1],
                out=out,
                plots=False,
                **quick,
            ),
        ),
    ):
        out = tmp_path / folder.name
        out.mkdir()
        path = _corrupted_record(out, folder, _settings_edit("task_settings", "x"))
        _refused(lambda out=out, run=run: run(out), path, "settings.task_settings is 'x'")
        assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # nothing ran


# -- a run's saved state --------------------------------------------------------------------


def test_a_corrupted_run_state_is_one_line_naming_the_file_and_the_field(tmp_path: Path) -> None:
    settings = dict(seeds=1, budget_exact_steps=4, fractions=(0.25, 0.5, 1.0), plots=False)
    out = tmp_path / "killed"
    with pytest.raises(Killed):
        race(QuadraticTask(kill_after=2), SPECS, out=out, show_progress=False, **settings)
    state_file = next((out / "state").rglob("*.pt"))
    saved = torch.load(state_file, weights_only=True)
    curve = json.loads(saved["curve"])
    assert len(curve) == saved["next_point"] > 0

    def with_curve(edit: Callable[[list[dict[str, Any]]], Any]) -> dict[str, Any]:
        changed = copy.deepcopy(curve)
        edit(changed)
        return {"curve": json.dumps(changed)}

    cases = {
        "step": {"step": -1},
        "flops": {"flops": math.nan},
        "next_point": {"next_point": 99},
        "done": {"done": True},
        "step_seconds": {"step_seconds": json.dumps([0.1] * (saved["step"] + 1))},
        "curve[0].reward": with_curve(lambda c: c[0].__setitem__("reward", math.nan)),
        "curve[0].fraction": with_curve(lambda c: c[0].__setitem__("fraction", 0.3)),
        "curve is a list of": with_curve(lambda c: c.pop()),
        "levels deep": {"stopped_step": DEEP},
    }
    for field, change in cases.items():
        torch.save({**saved, **change}, state_file)
        _refused(
            lambda: race(QuadraticTask(), SPECS, out=out, show_progress=False, **settings),
            state_file,
            field,
        )


# -- the JSON every reader parses -----------------------------------------------------------


def test_deep_json_is_one_line_wherever_the_lab_reads_it(tmp_path: Path) -> None:
    """Cost configs (read_json), logs and reports share the bounded parser: JSON nested
    200,000 deep is a one-line refusal naming the file, never a RecursionError; and so is
    a --config TOML file nested as deep."""
    from gradest_lab.cost.reward_presets import reward_config
    from gradest_lab.race.plain_race import RaceReport

    config = tmp_path / "reward.json"
    config.write_text(DEEP)
    for read in (lambda: read_json(config, what="--reward"), lambda: reward_config(str(config))):
        _refused(read, config, "levels deep")
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n' + DEEP + "\n")
    with pytest.raises(JsonLogError, match=r"line 2 .*levels deep") as info:
        JsonLog(log).records()
    assert str(log) in str(info.value) and "\n" not in str(info.value)
    report = tmp_path / "report.json"
    report.write_text(DEEP)
    _refused(lambda: RaceReport.load(report), report, "levels deep")
    settings = tmp_path / "settings.toml"  # a command's --config: TOML, recursive too
    settings.write_text("steps = " + DEEP)
    _refused(lambda: load_defaults(settings, argparse.ArgumentParser()), settings, "nests")


# -- the --tune grid ------------------------------------------------------------------------


def test_rates_sharing_a_shard_folder_are_refused_up_front(tmp_path: Path, monkeypatch) -> None:
    text = "lr=1e-4,1.0000001e-4"
    with pytest.raises(InvalidValue, match=r"share the shard folder lr-0\.0001") as info:
        parse_lr_grid(text)
    assert "drop one of them" in str(info.value)
    assert parse_lr_grid("lr=1e-4,3e-4") == [1e-4, 3e-4]  # the advice taken: accepted
    started: list[Any] = []
    monkeypatch.setattr(race_module._Race, "new_run", lambda *a, **k: started.append(a))
    out = tmp_path / "race"
    with pytest.raises(InvalidValue, match="share the shard folder"):
        tuned_race(
            QuadraticTask(),
            SPECS,
            lrs=[1e-4, 1.0000001e-4, 1e-3],
            tune_seeds=[0],
            seeds=[1],
            budget_exact_steps=2,
            out=out,
            show_progress=False,
        )
    assert not started and not out.exists()  # refused before anything ran or was written


def test_the_command_refuses_a_shared_folder_and_a_huge_grid_in_one_line(
    tmp_path: Path, capsys
) -> None:
    for grid, message in (
        ("lr=1e-4,1.0000001e-4", "share the shard folder"),
        ("lr=1e-4..1e-3:999999999", f"at most {MAX_GRID_POINTS} rates"),
    ):
        out = tmp_path / "race"
        argv = ["race", "--model", "digits", "--budget", "8x", "--tune", grid]
        argv += ["--tune-seeds", "0-1", "--seeds", "2-3", "--out", str(out), "--quiet"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
        assert not out.exists()


@pytest.mark.parametrize(
    "text",
    [
        "lr=1e-4..1e-3:999999999",
        "lr=1e-4..1e-3:" + "9" * 5000,
        "lr=" + ",".join(f"{i + 1}e-5" for i in range(MAX_GRID_POINTS + 1)),
    ],
)
def test_a_huge_grid_is_refused_before_it_is_built(text: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(InvalidValue, match=f"at most {MAX_GRID_POINTS} rates") as info:
            parse_lr_grid(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # no grid of a billion floats was built
    assert len(str(info.value)) < 300  # a 5000-digit count is not quoted whole


def test_an_api_grid_or_seed_list_is_never_listed_past_its_bound() -> None:
    def endless(first: float) -> Iterator[float]:
        for index in range(10_000_000):
            yield first * (1 + index)
        raise AssertionError("listed to the end")

    with pytest.raises(InvalidValue, match=f"at most {MAX_GRID_POINTS} learning rates"):
        check_lr_grid(endless(1e-5))
    with pytest.raises(InvalidValue, match="more than 1000000 seeds"):
        tuned_race(
            QuadraticTask(),
            SPECS,
            lrs=[0.01, 0.02],
            tune_seeds=(int(s) for s in endless(1)),
            seeds=[0],
            budget_exact_steps=2,
        )


def test_a_range_whose_rounded_rates_repeat_is_refused_with_a_fix() -> None:
    with pytest.raises(InvalidValue, match="only 1 distinct rate; give a wider range"):
        parse_lr_grid("lr=1e-4..1.04e-4:5")
    with pytest.raises(InvalidValue, match=r"ask for at most \d+ points or give a wider range"):
        parse_lr_grid("lr=1e-4..1.3e-4:20")


def test_the_grid_bound_and_the_file_checks_are_documented() -> None:
    harness = " ".join((REPO / "docs" / "harness.md").read_text().split())
    assert f"A grid has at most {MAX_GRID_POINTS} rates" in harness
    assert f"JSON nested at most {MAX_JSON_DEPTH} levels" in harness
    runs = " ".join((REPO / "docs" / "runs.md").read_text().split())
    assert re.search(rf"nested deeper than {MAX_JSON_DEPTH} levels", runs)
