"""Race numbers in markdown pages, generated from the committed reports.

A page quotes a race in a **generated block**: the text between ::

    <!-- race-quote KIND PATH [key=value ...] -->
    <!-- /race-quote -->

is what the renderer ``KIND`` makes of the race report in the folder ``PATH`` (relative to
the page's repository root). ``python -m gradest_lab.race.quoting PAGE ...`` writes every
block; ``--check`` writes nothing and fails on any block whose text is not what its report
gives, so a number edited by hand inside a block fails, whatever its formatting. Outside
the blocks, a section whose heading names a race holds no decimal number at all
(:func:`stray_figures`; counts such as seeds and steps are integers): the prose around a
table says what it shows in words, so no figure escapes the check.

Renderers (``KIND``):

* ``tuned-decision PATH [fractions=0.25,0.5,1]``: a tuned race's decision table.
* ``tuned-time PATH [estimators=exact,sdo]``: its time-to-target table.
* ``tuned-headline PATH [fraction=1]``: one paragraph: who beats exact at that budget.
* ``tuned-lrs PATH``: the chosen learning rates and final rewards.
* ``tuned-matrix PATH,PATH,... [fractions=0.25,0.5,1]``: the decision across tuned races
  (tasks): per task and budget, who beats exact and by how much, who falls behind.
* ``tuned-tally PATH,PATH,... [fractions=0.25,0.5,1]``: per estimator, on how many of those
  tasks it was ahead of exact, level, or behind.
* ``race-final PATH``: an untuned race's final table (reward, paired difference, share of
  the attainable gain, compute to 90% of exact's gain, drift).
* ``race-fractions PATH``: an untuned race's reward and paired difference at every budget
  fraction.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gradest import InvalidValue
from gradest_lab.race.task_options import parse_key_values

__all__ = ["page_problems", "render", "stray_figures", "update_page"]

_BLOCK = re.compile(
    r"(?P<open><!-- race-quote (?P<args>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- /race-quote -->)",
    re.S,
)
_CHECKED = re.compile(
    r"<!-- race-numbers (?P<args>[^>]*?) -->\n(?P<body>.*?)<!-- /race-numbers -->", re.S
)
_NUMBER = re.compile(r"(?<![\w.])[−+-]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[−+-]?\d+)?%?(?![\w])")


def _load(root: Path, path: str) -> Any:
    from gradest_lab.race.plain_race import SCHEMA, RaceReport
    from gradest_lab.race.tuned_race import TUNED_SCHEMA, TunedRaceReport
    from gradest_lab.storage.file_schema import read_report_json

    folder = root / path
    kinds = {SCHEMA: "race report", TUNED_SCHEMA: "tuned race report"}
    schema = read_report_json(folder, kinds=kinds)["schema"]
    return TunedRaceReport.load(folder) if schema == TUNED_SCHEMA else RaceReport.load(folder)


def _load_all(root: Path, paths: str) -> list[Any]:
    """The tuned race reports of a comma-separated list of folders (a matrix block's PATH)."""
    from gradest_lab.race.tuned_race import TunedRaceReport

    reports = [_load(root, path) for path in paths.split(",")]
    for path, report in zip(paths.split(","), reports, strict=True):
        if not isinstance(report, TunedRaceReport):
            raise InvalidValue(f"race-quote matrix: {path} is not a tuned race; give tuned races")
    return reports


def _fractions(options: Mapping[str, str], default: str) -> list[float]:
    return [float(f) for f in options.get("fractions", default).split(",")]


def _options(args: str, items: Sequence[str]) -> dict[str, str]:
    """A block's ``key=value`` words (the lab's one reader: each key once)."""
    return parse_key_values(
        items, what=f"race-quote {args!r}: option", fix="write key=value, e.g. fraction=1"
    )


# -- the renderers ------------------------------------------------------------------------


def _tuned_decision(report: Any, options: Mapping[str, str]) -> str:
    from gradest_lab.race.tuned_page import decision_table

    fractions = (
        [float(f) for f in options["fractions"].split(",")] if "fractions" in options else None
    )
    return "\n".join(decision_table(report.summary(), fractions)) + "\n"


def _tuned_time(report: Any, options: Mapping[str, str]) -> str:
    from gradest.plugin import split_spec_list
    from gradest_lab.race.tuned_page import time_to_target_table

    specs = split_spec_list(options["estimators"]) if "estimators" in options else None
    return "\n".join(time_to_target_table(report.config, report.summary(), specs)) + "\n"


def _signed(interval: Mapping[str, Any]) -> str:
    return f"{interval['mean']:+.3g} [{interval['low']:+.3g}, {interval['high']:+.3g}]"


def _tuned_headline(report: Any, options: Mapping[str, str]) -> str:
    from gradest_lab.race.plain_race import _seed_text
    from gradest_lab.race.tuned_page import estimator_names

    fraction = float(options.get("fraction", "1"))
    summary, config = report.summary(), report.config
    rows = [row for row in summary["decision"] if row["fraction"] == fraction]
    if not rows:
        raise InvalidValue(f"tuned-headline: the race has no budget fraction {fraction}")
    row = rows[0]

    beats = estimator_names(row["beats_exact"], True)
    neither = estimator_names(row["no_clear_difference"], False)
    behind = estimator_names(row["behind_exact"], False)
    share = row["exact_share_of_attainable"]
    settings = ", ".join(f"{k}={v}" for k, v in config["task_settings"].items() if k != "device")
    return (
        f"`{config['task']}` ({settings}) at {row['budget_exact_steps']:.3g} exact steps of "
        "compute, each estimator at its own lr (tuned on seeds "
        f"{_seed_text(config['tune_seeds'])}, "
        f"reported on seeds {_seed_text(config['seeds'])}; 95% paired-bootstrap intervals of "
        f"the reward difference to exact): beat exact: {beats}; no clear difference: {neither}; "
        f"behind exact: {behind}. Exact (lr {row['exact_lr']:.2g}) reached "
        + ("-" if share is None else f"{100 * share:.1f}%")
        + f" of the attainable gain (ceiling {summary['ceiling']['value']:.4g}, pretrained "
        f"{report.initial['reward']:.4g}).\n"
    )


def _tuned_lrs(report: Any, options: Mapping[str, str]) -> str:
    del options
    from gradest_lab.race.tuned_page import format_lr

    summary, config = report.summary(), report.config
    lines = [
        "| estimator | lr at the full budget | lr for time to target | final reward [95% CI] "
        "| steps in budget |",
        "|---|---|---|---|---|",
    ]
    for spec in config["estimators"]:
        last = summary["final"][spec][-1]
        reward = last["reward"]
        lines.append(
            f"| `{spec}` | {format_lr(last['lr'])} | "
            f"{format_lr(summary['time_to_target'][spec]['lr'])} | {reward['mean']:.4g} "
            f"[{reward['low']:.4g}, {reward['high']:.4g}] | {last['steps']['mean']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def _race_final(report: Any, options: Mapping[str, str]) -> str:
    del options
    from gradest_lab.race.plain_race import REFERENCE, _num

    summary = report.summary()
    lr = report.config.get("task_settings", {}).get("lr")
    lines = [
        f"| estimator (all at lr {lr}) | steps in budget | final reward [95% CI] | Δ to exact, "
        "paired [95% CI] | share of attainable gain | compute to 90% of exact's final gain "
        "[CI] (seeds) | drift [CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, s in summary.items():
        last = s["points"][-1]
        reward, diff, drift = last["reward"], last["reward_minus_exact"], last["drift"]
        share = s["gain_fraction_of_ceiling"]
        reach = s["reach"]["90%"]
        n = len(reach["per_seed"])
        if "undefined" in reach:
            reach_text = f"- ({reach['undefined']})"
        elif reach["mean"] is not None and math.isfinite(reach["mean"]):
            reach_text = (
                f"{_num(reach['mean'], '.3g')} [{_num(reach['low'], '.3g')}, "
                f"{_num(reach['high'], '.3g')}] ({reach['reached']}/{n})"
            )
        else:
            reach_text = f"not reached ({reach['reached']}/{n})"
        lines.append(
            f"| `{spec}` | {_num(s['steps']['mean'], '.3g')} | {_num(reward['mean'])} "
            f"[{_num(reward['low'])}, {_num(reward['high'])}] | "
            + ("" if spec == REFERENCE else _signed(diff))
            + f" | {'-' if share is None else f'{100 * share:.1f}%'} | {reach_text} | "
            f"{_num(drift['mean'], '.3g')} [{_num(drift['low'], '.3g')}, "
            f"{_num(drift['high'], '.3g')}] |"
        )
    return "\n".join(lines) + "\n"


def _race_fractions(report: Any, options: Mapping[str, str]) -> str:
    del options
    from gradest_lab.race.plain_race import REFERENCE, _num

    fractions = report.config["fractions"]
    unit = report.unit_name
    budget = (
        report.config.get("budget_exact_steps")
        if report.axis == "flops"
        else report.config["budget"]
    )
    lines = [
        "| estimator | "
        + " | ".join(f"{_num(f * budget, '.3g')} {unit}" for f in fractions)
        + " |",
        "|---|" + "---|" * len(fractions),
    ]
    for spec, s in report.summary().items():
        cells = []
        for point in s["points"]:
            cell = _num(point["reward"]["mean"])
            if spec != REFERENCE:
                cell += f" (Δ {_signed(point['reward_minus_exact'])})"
            cells.append(cell)
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _tuned_matrix(reports: Any, options: Mapping[str, str]) -> str:
    from gradest_lab.race.tuned_page import matrix_table

    return "\n".join(matrix_table(reports, _fractions(options, "0.25,0.5,1"))) + "\n"


def _tuned_tally(reports: Any, options: Mapping[str, str]) -> str:
    from gradest_lab.race.tuned_page import tally_table

    return "\n".join(tally_table(reports, _fractions(options, "0.25,0.5,1"))) + "\n"


# The renderers whose PATH is a comma-separated list of tuned race folders.
_MATRIX_RENDERERS: dict[str, Callable[[Any, Mapping[str, str]], str]] = {
    "tuned-matrix": _tuned_matrix,
    "tuned-tally": _tuned_tally,
}

_RENDERERS: dict[str, Callable[[Any, Mapping[str, str]], str]] = {
    "tuned-decision": _tuned_decision,
    "tuned-time": _tuned_time,
    "tuned-headline": _tuned_headline,
    "tuned-lrs": _tuned_lrs,
    "race-final": _race_final,
    "race-fractions": _race_fractions,
}


def render(root: Path, args: str) -> str:
    """The text of the block ``<!-- race-quote ARGS -->`` (``KIND PATH [key=value ...]``)."""
    words = args.split()
    if len(words) < 2 or words[0] not in {**_RENDERERS, **_MATRIX_RENDERERS}:
        raise InvalidValue(
            f"race-quote {args!r}: give KIND PATH [key=value ...], KIND one of "
            f"{', '.join([*_RENDERERS, *_MATRIX_RENDERERS])}"
        )
    if words[0] in _MATRIX_RENDERERS:
        return _MATRIX_RENDERERS[words[0]](_load_all(root, words[1]), _options(args, words[2:]))
    return _RENDERERS[words[0]](_load(root, words[1]), _options(args, words[2:]))


# -- where race figures may stand ------------------------------------------------------------


def _prose(text: str) -> str:
    """The text without generated blocks, inline code and indented code (spec strings such
    as ``jagg:window=4,tau=0.9`` and commands hold numbers that are settings)."""
    text = _BLOCK.sub(" ", text)
    text = re.sub(r"`[^`]*`", " ", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("    "))


def stray_figures(page: str) -> list[str]:
    """Decimal numbers that stand in a race section (a heading that names a race) outside
    its generated blocks: a race figure there could be edited by hand unchecked. Counts
    (seeds, steps, samples) are integers and may stand anywhere."""
    stray = []
    # Fenced code (an example's comments are no headings, its numbers are settings).
    page = re.sub(r"(?ms)^```.*?^```", "", page)
    sections = re.split(r"(?m)^(#{1,6} .*)$", page)
    heading = ""
    for part in sections:
        if re.match(r"#{1,6} ", part):
            heading = part
            continue
        if "race" not in heading.lower():
            continue
        for number in _NUMBER.finditer(_prose(part)):
            token = number.group()
            if "." in token or "e" in token or token.endswith("%"):
                stray.append(f"{token} under {heading.strip()!r}")
    return stray


def page_problems(root: Path, page: str) -> list[str]:
    """What ``--check`` finds on a page: a block that differs from its report, and, on a
    page that quotes races (it holds a generated block), a figure outside the blocks."""
    updated = update_page(root, page)
    problems = []
    if updated != page:
        problems.append("a race-quote block differs from its report")
    if _BLOCK.search(updated):
        problems += [
            f"a figure outside a generated block: {item}" for item in stray_figures(updated)
        ]
    return problems


def update_page(root: Path, page: str) -> str:
    """The page with every generated block rewritten from its report."""

    def fill(match: re.Match[str]) -> str:
        return match["open"] + render(root, match["args"]) + match["close"]

    return _BLOCK.sub(fill, page)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradest_lab.race.quoting",
        description="Write (or --check) the race numbers of markdown pages from their reports.",
    )
    parser.add_argument("pages", nargs="+", type=Path)
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root")
    parser.add_argument("--check", action="store_true", help="write nothing; fail on a difference")
    args = parser.parse_args(argv)
    failures = []
    for page in args.pages:
        text = page.read_text(encoding="utf-8")
        try:
            problems = page_problems(args.root, text)
        except InvalidValue as err:
            failures.append(f"{page}: {err}")
            continue
        stale = "a race-quote block differs from its report"
        if stale in problems and not args.check:
            page.write_text(update_page(args.root, text), encoding="utf-8")
            print(f"wrote {page}")
            problems.remove(stale)
        failures += [f"{page}: {item}" for item in problems]
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
