"""A repeated option key is refused wherever the lab parses ``key=value`` options.

``<!-- race-quote tuned-headline PATH fraction=1 fraction=0.5 -->`` used to quote the
fraction 0.5 (the last one won) and ``--task-option lr=1e-4 --task-option lr=2e-4`` was
refused without saying what to do. Both are one line naming the option list, the key,
both values and the fix (give each option once), as gradest's estimator specs refuse
``jagg:window=2,window=4``; a TOML ``--config`` that names one setting twice is refused
the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from gradest_lab.race import plain_race as race_module
from gradest_lab.race import quoting
from gradest_lab.storage.config_file import load_defaults
from test_race import quadratic_task

from gradest.cli import main
from gradest.errors import InvalidValue

ROOT = Path(__file__).resolve().parents[2]


def test_a_race_quote_option_given_twice_is_refused() -> None:
    args = "tuned-headline docs/results/race_digits_tuned fraction=1 fraction=0.5"
    with pytest.raises(InvalidValue) as refused:
        quoting.render(ROOT, args)
    line = str(refused.value)
    assert "\n" not in line
    assert f"race-quote {args!r}" in line
    assert "option fraction is given twice (fraction=1 and fraction=0.5)" in line
    assert "give each option once" in line
    # given once, it renders as before
    assert quoting.render(ROOT, "tuned-headline docs/results/race_digits_tuned fraction=1")


def test_a_task_option_given_twice_names_both_values_and_the_fix(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(race_module, "registered_tasks", lambda: {"quadratic": quadratic_task})
    out = tmp_path / "race"
    argv = ["race", "--model", "quadratic", "--seeds", "1", "--budget", "1x", "--fractions", "1"]
    argv += ["--task-option", "lr=0.1", "--task-option", "lr=0.2", "--out", str(out)]
    capsys.readouterr()
    assert main([*argv, "--no-plots", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--task-option lr is given twice (lr=0.1 and lr=0.2); give each option once" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (["a=1", "b=2", "a=3"], "--x a is given twice (a=1 and a=3); give each option once"),
        ([" a =1", "a=2"], "--x a is given twice"),
        (["a"], "--x 'a' is not KEY=VALUE; e.g. a=1"),
        (["=1"], "not KEY=VALUE"),
        (["a="], "not KEY=VALUE"),
    ],
)
def test_the_lab_key_value_reader(texts: list[str], message: str) -> None:
    """The one reader of the lab's ``key=value`` lists (task options, race-quote blocks)."""
    from gradest_lab.race.task_options import parse_key_values

    with pytest.raises(InvalidValue, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_key_values(texts, what="--x", fix="e.g. a=1")
    assert parse_key_values(["a=1", " b = x=y "], what="--x", fix="") == {"a": "1", "b": "x=y"}


def test_a_config_file_setting_given_twice_is_refused(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int)
    file = tmp_path / "run.toml"
    file.write_text("batch_size = 8\nbatch-size = 16\n")
    with pytest.raises(InvalidValue, match="'batch_size' and 'batch-size' are the same setting"):
        load_defaults(file, parser)
