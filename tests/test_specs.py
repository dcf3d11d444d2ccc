"""The one list syntax for estimator specs (gradest.specs), in every command."""

from __future__ import annotations

import json
import re

import pytest
from check_table import check_rows

import gradest
from gradest.cli import build_parser, main
from gradest.errors import InvalidType, InvalidValue
from gradest.registry import parse_spec
from gradest.specs import as_spec_list, format_spec_list, split_spec_list

LIST = "exact,jagg:window=2,tau=0.9,sdo"


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ("exact", ["exact"]),
        ("", []),
        ("   ", []),
        (LIST, ["exact", "jagg:window=2,tau=0.9", "sdo"]),
        (" exact ,  jagg:window=4 , tau=0.9 ,sdo ", ["exact", "jagg:window=4,tau=0.9", "sdo"]),
        ("truncated:random=0.5/0.3/0.2,exact", ["truncated:random=0.5/0.3/0.2", "exact"]),
        (
            "auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)",
            ["auto:candidates=(exact,jagg:window=4,tau=0.9,sdo)"],
        ),
        (
            "exact,auto:candidates=(exact,jagg),max_slowdown=2,sdo",
            ["exact", "auto:candidates=(exact,jagg),max_slowdown=2", "sdo"],
        ),
        (
            "auto:candidates=( exact , sdo:samples=4 ),draws=2",
            ["auto:candidates=( exact , sdo:samples=4 ),draws=2"],
        ),
    ],
)
def test_the_grammar_splits_items_and_keeps_options_and_groups(text, items):
    assert split_spec_list(text) == items
    # Round trip: the formatted list reads back as the same items.
    assert split_spec_list(format_spec_list(items)) == items
    assert format_spec_list(split_spec_list(format_spec_list(items))) == format_spec_list(items)


@pytest.mark.parametrize(
    ("text", "position", "message"),
    [
        ("exact,,sdo", 6, "empty item"),
        ("exact,sdo,", 10, "empty item"),
        ("window=4,exact", 0, "comes before any estimator name"),
        ("exact;sdo", 5, "separate estimators with ','; the ';' / '/' separators were replaced"),
        ("jagg:window=4;sdo", 13, "the ';' / '/' separators were replaced"),
        ("exact/sdo", 5, "the ';' / '/' separators were replaced"),
        ("auto:candidates=(exact,sdo", 16, "unclosed '\\('"),
        ("exact),sdo", 5, "unmatched '\\)'"),
        ("exact sdo", 0, "expected an estimator name"),
        ("(exact,sdo)", 0, "expected an estimator name"),
    ],
)
def test_errors_are_one_line_naming_the_input_the_position_and_the_fix(text, position, message):
    with pytest.raises(InvalidValue, match=message) as info:
        split_spec_list(text, what="--estimators")
    text_of_error = str(info.value)
    assert "\n" not in text_of_error
    assert f"--estimators {text!r}" in text_of_error
    assert f"at position {position};" in text_of_error


def test_parse_spec_keeps_parenthesised_lists_in_one_option():
    assert parse_spec("auto:candidates=(exact,sdo:samples=4)") == (
        "auto",
        {"candidates": "exact,sdo:samples=4"},
    )
    assert parse_spec("auto:candidates=(exact,jagg:window=4,tau=0.9),max_bias=0.1") == (
        "auto",
        {"candidates": "exact,jagg:window=4,tau=0.9", "max_bias": "0.1"},
    )
    with pytest.raises(InvalidValue, match="more than one ':'"):
        parse_spec("jagg:window=4:tau=0.9")
    with pytest.raises(InvalidValue, match="unclosed"):
        parse_spec("auto:candidates=(exact")


def test_python_sequences_of_specs_and_estimators_are_lists_too():
    est = gradest.estimator("jagg:window=2,tau=0.9")
    assert as_spec_list(LIST) == as_spec_list(["exact", "jagg:window=2,tau=0.9", "sdo"])
    assert as_spec_list(["exact", est]) == ["exact", est]
    assert gradest.estimator(format_spec_list([est])) == est
    auto = gradest.estimator("auto:candidates=(exact,jagg:window=2,tau=0.9),draws=2")
    assert gradest.estimator(format_spec_list([auto])) == auto
    with pytest.raises(InvalidValue, match="holds 2 specs"):
        as_spec_list(["exact,sdo"])
    with pytest.raises(InvalidType):
        as_spec_list(3)


def test_both_commands_show_the_same_example():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = [
        next(a.help for a in sub.choices[name]._actions if a.dest == "estimators")
        for name in ("check", "compare")
    ]
    examples = [re.search(r"e\.g\. --estimators '([^']+)'", text).group(1) for text in helps]
    assert examples[0] == examples[1] == "exact,jagg:window=4,tau=0.9,sdo"


def _check_rows(stdout: str) -> list[str]:
    """The estimators of ``gradest check``'s table, as the estimator each spec builds."""
    return [repr(gradest.estimator(spec)) for spec in check_rows(stdout)]


def test_one_list_gives_the_same_estimators_in_compare_and_check(tmp_path, capsys):
    assert main(["check", "--estimators", LIST, "--steps", "4", "--quiet"]) == 0
    checked = _check_rows(capsys.readouterr().out)
    out = tmp_path / "cmp"
    argv = ["compare", "--estimators", LIST, "--steps", "4", "--seeds", "1", "--draws", "2"]
    argv += ["--repeats", "1", "--no-plots", "--no-sweeps", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    compared = list(dict.fromkeys(row["spec"] for row in report["estimators"]))
    expected = [repr(gradest.estimator(spec)) for spec in split_spec_list(LIST)]
    assert checked == compared == expected


@pytest.mark.parametrize("command", ["check", "compare"])
def test_both_commands_refuse_a_semicolon_list_in_one_line(tmp_path, capsys, command):
    argv = [command, "--estimators", "exact;sdo", "--quiet"]
    if command == "compare":
        argv += ["--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "separate estimators with ','" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "value",
    [f'"{LIST}"', '["exact", "jagg:window=2,tau=0.9", "sdo"]'],
)
def test_a_config_file_list_is_one_string_or_an_array_of_specs(tmp_path, value):
    import argparse

    from gradest_lab.storage.config_file import load_defaults

    from gradest.specs import spec_list_text

    parser = argparse.ArgumentParser()
    parser.add_argument("--estimators", type=spec_list_text, default="exact")
    path = tmp_path / "run.toml"
    path.write_text(f"estimators = {value}\n")
    assert split_spec_list(load_defaults(path, parser)["estimators"]) == split_spec_list(LIST)
    path.write_text('estimators = "exact,,sdo"\n')
    with pytest.raises(InvalidValue, match="empty item at position 6"):
        load_defaults(path, parser)
    path.write_text('estimators = ["exact,sdo"]\n')
    with pytest.raises(InvalidValue, match="holds 2 specs"):
        load_defaults(path, parser)
