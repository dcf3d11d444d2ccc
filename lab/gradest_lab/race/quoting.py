"""Race numbers in markdown pages, generated from the committed reports.

A page quotes a race in **generated text**: a block, the lines between ::

    <!-- race-quote KIND PATH [key=value ...] -->
    <!-- /race-quote -->

or a **span** inside a sentence, on one line, after other text of that line (an HTML
comment that begins a line ends the paragraph)::

    at <!-- race-quote tuned-budgets PATH verdict=ahead -->3 and 8 exact steps<!-- /race-quote -->

Either is what the renderer ``KIND`` makes of the race report in the folder ``PATH``
(relative to the page's repository root). ``python -m gradest_lab.race.quoting PAGE ...``
writes every block and span; ``--check`` writes nothing and fails on any whose text is
not what its report gives, so a number edited by hand inside one fails, whatever its
formatting.

**Outside generated text** (:func:`stray_figures`), on a page that quotes races, every
number in a *race section* (a heading that names a race, or a section holding generated
text; its heading included) is checked:

* a number of steps (``8 exact steps``, ``3, 7 and 8 exact steps``, ``18 steps``, ``from 2
  on``) must be the full budget of a race the section names; any other is a result (the
  budgets at which an estimator is ahead, the steps it took) and is generated;
* any other number must be one the section's race reports hold as written (rounded to its
  decimals, within 5%): a setting (seed counts and bounds, the budget, the lr grid's size,
  its points and its span ``39x``, the evaluation set, bootstrap resamples and level,
  task settings, target levels, the ceiling run's length and seed) or a measured constant
  (FLOPs of a forward, a step, the budget; the pretrained evaluation). Rewards,
  differences, shares and counts of verdicts are no such value: they are generated.

The section's reports are those whose folders (``docs/results/NAME``) its own text names
(in generated text, a command or prose), else those its subsections name, else its
parent section's. Numbers that are no race's are not checked: in fenced or indented code
(commands and examples document settings they take), in inline code that is code (a spec
``jagg:window=4``, an option ``--budget 4x``, a call or formula ``log p(3 | x)``, a path),
in link targets and comments, dates, a machine's cores, run times in minutes or hours,
section, issue and item numbers, and numbers glued to a word (``28x28``,
``42K-parameter``, ``float32``). Inline code that is a figure (``80%``, ``J = −12.63``,
``lr 1e-4``) is prose and checked. A number written as a word is not read. A section whose
heading names no race and that holds no generated text (a model's description) is not
checked.

Renderers (``KIND``), blocks:

* ``tuned-decision PATH [fractions=0.25,0.5,1]``: a tuned race's decision table.
* ``tuned-time PATH [estimators=exact,sdo]``: its time-to-target table.
* ``tuned-headline PATH [fraction=1]``: one paragraph: who beats exact at that budget.
* ``tuned-lrs PATH``: the chosen learning rates and final rewards.
* ``tuned-warnings PATH``: whether the race is ready to quote, and if not why; a page that
  quotes a race not ready to quote must hold this block for it.
* ``tuned-matrix PATH,PATH,... [fractions=0.25,0.5,1]``: the decision across tuned races
  (tasks): per task and budget, who beats exact and by how much, who falls behind.
* ``tuned-tally PATH,PATH,... [fractions=0.25,0.5,1]``: per estimator, on how many of those
  tasks it was ahead of exact, level, or behind.
* ``rule-score PATH,PATH,...``: the decision rule scored on each race, budget by budget.
* ``tuned-horizon PATH,PATH,...``: per race, whether its task has a long horizon and the
  numbers that say so (:mod:`gradest_lab.race.horizon`).
* ``race-contraction PATH,PATH,...``: the sampling chain's contraction on each race's task
  (``contraction.json``, :mod:`gradest_lab.race.race_contraction`) beside the one-step
  estimators' verdicts.
* ``race-final PATH``: an untuned race's final table (reward, paired difference, share of
  the attainable gain, compute to 90% of exact's gain, drift).
* ``race-fractions PATH``: an untuned race's reward and paired difference at every budget
  fraction.

Spans (phrases):

* ``tuned-budgets PATH verdict=ahead|level|behind [estimators=a,b] [match=all|any|none|only]
  [form=list|from] [unit=steps|none]``: the budgets at which the estimators have the
  verdict (``3, 7 and 8 exact steps``; ``from 2 exact steps on``).
* ``tuned-counts PATH,PATH,... fraction=F [estimators=a,b] [verdict=ahead]``: per
  estimator, on how many of those tasks it was ahead of exact, level, behind at ``F``.
* ``tuned-tasks PATH,PATH,... fraction=F verdict=ahead [estimators=a,b]``: per estimator,
  on which of those tasks it had the verdict at ``F``.
* ``rule-tally PATH,PATH,... [part=late|early]``: the decision rule's score over those
  races (:mod:`gradest_lab.race.decision_rule`).
* ``rule-rival PATH,PATH,... estimator=SPEC [prefers=SPEC]``: at how many (task, budget)
  cells where the rule prefers another estimator (that one) ``estimator``'s mean lead
  over exact was the larger.
* ``horizon-shares PATH,PATH,...``: the range of exact's share of the attainable gain at
  those races' first evaluation point (``32.2% to 65.8% of the attainable gain after 1
  exact step``).
* ``race-steps PATH estimator=a``: the steps an estimator took in an untuned race's budget.
* ``race-seeds-above PATH estimators=a,b [fractions=0.5,1]``: on how many seeds each was
  above exact.
* ``stopped-step PATH estimator=a``: what the step that did not fit the budget would have
  cost, in exact steps (``auto``'s probe).
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gradest import InvalidValue
from gradest_lab.generated_pages import page_command
from gradest_lab.race.task_options import parse_key_values
from gradest_lab.race.verdicts import row_verdicts

__all__ = ["page_problems", "render", "stray_figures", "update_page"]

# A block (the opening comment ends its line) or a span (text on the opening's line).
_BLOCK = re.compile(
    r"(?P<open><!-- race-quote (?P<args>[^>]*?) -->(?P<newline>\n?))(?P<body>.*?)"
    r"(?P<close><!-- /race-quote -->)",
    re.S,
)
_NUMBER = re.compile(r"(?<![\w.])[−+-]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[−+-]?\d+)?%?(?![\w])")


class _Quoted:
    """A report read for quoting: its :meth:`summary` (recomputed from the runs, with
    bootstrap intervals) is computed once however many blocks of a page read it."""

    def __init__(self, report: Any, folder: Path) -> None:
        self.report = report
        self.folder = folder
        self._summary: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.report, name)

    @property
    def tuned(self) -> bool:
        from gradest_lab.race.tuned_race import TunedRaceReport

        return isinstance(self.report, TunedRaceReport)

    def summary(self) -> dict[str, Any]:
        if self._summary is None:
            self._summary = self.report.summary()
        return copy.deepcopy(self._summary)


# Reports read so far, by folder and the state of its report.json (a changed file is read
# again): a page's blocks and figures read the same few reports many times.
_READ: dict[tuple[str, int, int], _Quoted] = {}


def _load(root: Path, path: str) -> Any:
    from gradest_lab.race.plain_race import SCHEMA, RaceReport
    from gradest_lab.race.tuned_race import TUNED_SCHEMA, TunedRaceReport
    from gradest_lab.storage.file_schema import read_report_json

    folder = Path(root) / path
    try:
        stat = (folder / "report.json").stat()
        key: tuple[str, int, int] | None = (
            str(folder.resolve()),
            stat.st_mtime_ns,
            stat.st_size,
        )
    except OSError:
        key = None
    if key is not None and key in _READ:
        return _READ[key]
    kinds = {SCHEMA: "race report", TUNED_SCHEMA: "tuned race report"}
    schema = read_report_json(folder, kinds=kinds)["schema"]
    report = _Quoted(
        TunedRaceReport.load(folder) if schema == TUNED_SCHEMA else RaceReport.load(folder),
        folder,
    )
    if key is not None:
        _READ[key] = report
    return report


def _load_all(root: Path, paths: str) -> list[Any]:
    """The tuned race reports of a comma-separated list of folders (a matrix block's PATH)."""
    reports = [_load(root, path) for path in paths.split(",")]
    for path, report in zip(paths.split(","), reports, strict=True):
        if not report.tuned:
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
    from gradest_lab.race.tuned_page import refinement_state

    tuned = refinement_state(report)
    gain = summary["ceiling"]["attainable_gain"]["gain"]
    apart = summary["ceiling"]["evaluation"] == "apart"
    return (
        f"`{config['task']}` ({settings}) at {row['budget_exact_steps']:.3g} exact steps of "
        f"compute, each estimator at its own lr (tuned on seeds "
        f"{_seed_text(config['tune_seeds'])}, {tuned}; reported on seeds "
        f"{_seed_text(config['seeds'])}; 95% paired-bootstrap intervals of the reward "
        f"difference to exact, a difference counted only past the margin of both estimators' "
        f"residual tuning gaps): beat exact: {beats}; no clear difference: {neither}; "
        f"behind exact: {behind}. Exact (lr {row['exact_lr']:.3g}) reached "
        + ("-" if share is None else f"{100 * share:.1f}%")
        + f" of the attainable gain ({gain['mean']:.4g} [{gain['low']:.4g}, "
        f"{gain['high']:.4g}]{_one_seed(gain)} over the pretrained "
        f"{report.initial['reward']:.4g}, measured "
        + ("apart from the report" if apart else "on the report's own evaluation set")
        + ").\n"
    )


def _one_seed(gain: Mapping[str, Any]) -> str:
    return " (1 seed: no interval)" if gain["n"] == 1 else ""


def _tuned_warnings(report: Any, options: Mapping[str, str]) -> str:
    """Whether a tuned race is ready to quote, and if not, why (its report's list): a page
    that quotes a race not ready must show this block for it (:func:`page_problems`)."""
    del options
    notes = report.grid_warnings()
    if not notes:
        return (
            f"Ready to quote: every choice bracketed at {report.bracket_ratio:g}x, none on the "
            f"tried rates' edge, the ceiling measured apart on "
            f"{len(report.ceiling_rows)} seeds.\n"
        )
    lines = ["**Not ready to quote** (the verdicts below are provisional):", ""]
    return "\n".join([*lines, *(f"- {note}" for note in notes)]) + "\n"


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


def _rule_cells(reports: Any, kind: str) -> list[tuple[str, Any]]:
    from gradest_lab.race.decision_rule import score_rule
    from gradest_lab.race.tuned_page import task_labels

    labels = task_labels([report.config for report in reports])
    cells = []
    for label, report in zip(labels, reports, strict=True):
        try:
            cells += [(label, cell) for cell in score_rule(report)]
        except ValueError as err:
            raise InvalidValue(f"race-quote {kind}: {err}") from None
    return cells


def _rule_score(reports: Any, options: Mapping[str, str]) -> str:
    """The decision rule (:data:`gradest_lab.race.decision_rule.RULE`) scored on each race:
    per task and budget, what it predicted, the outcome and the verdicts that decided it."""
    from gradest_lab.race.tuned_page import rule_score_table

    del options
    return "\n".join(rule_score_table(_rule_cells(reports, "rule-score"))) + "\n"


def _tuned_horizon(reports: Any, options: Mapping[str, str]) -> str:
    """Per race, one item: its task's horizon (:func:`gradest_lab.race.horizon.horizon`)."""
    from gradest_lab.race.horizon import horizon_sentence
    from gradest_lab.race.tuned_page import task_labels

    del options
    labels = task_labels([report.config for report in reports])
    return "".join(
        f"- {horizon_sentence(label, report.summary()['horizon'])}\n"
        for label, report in zip(labels, reports, strict=True)
    )


# -- phrases: generated text inside a sentence (a span) ---------------------------------------

_VERDICT_WORDS = {"ahead": "ahead of exact", "level": "level with exact", "behind": "behind exact"}


def _and_list(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _choice(kind: str, options: Mapping[str, str], key: str, allowed: Sequence[str]) -> str:
    value = options.get(key, allowed[0])
    if value not in allowed:
        raise InvalidValue(f"race-quote {kind}: {key}={value}; give one of {', '.join(allowed)}")
    return value


def _required(kind: str, options: Mapping[str, str], key: str) -> str:
    if key not in options:
        raise InvalidValue(f"race-quote {kind}: give {key}=...")
    return options[key]


def _specs(report: Any, options: Mapping[str, str], kind: str) -> list[str]:
    """The estimators a phrase is about: ``estimators=`` (each one the race ran), or every
    estimator of the race but exact."""
    from gradest.plugin import split_spec_list
    from gradest_lab.race.plain_race import REFERENCE

    raced = list(report.config["estimators"])
    if "estimators" not in options:
        return [spec for spec in raced if spec != REFERENCE]
    specs = split_spec_list(options["estimators"], what=f"race-quote {kind}: estimators")
    for spec in specs:
        if spec not in raced:
            raise InvalidValue(f"race-quote {kind}: the race did not run {spec!r}")
    return specs


def _row_at(report: Any, fraction: float, kind: str) -> Mapping[str, Any]:
    for row in report.summary()["decision"]:
        if row["fraction"] == fraction:
            return row
    raise InvalidValue(f"race-quote {kind}: a race has no budget fraction {fraction:g}")


def _steps_phrase(budgets: Sequence[float], unit: bool) -> str:
    text = _and_list([f"{b:g}" for b in budgets])
    if not unit:
        return text
    return text + (" exact step" if list(budgets) == [1] else " exact steps")


def _tuned_budgets(report: Any, options: Mapping[str, str]) -> str:
    """The budgets (exact steps) at which the estimators (``estimators=``, or all but exact)
    have the verdict ``verdict=``: ``3, 7 and 8 exact steps`` (``form=list``), or ``from 2
    exact steps on`` (``form=from``: from there to the end of the budget). ``match=all``
    (default): every one of them; ``any``: one of them; ``none``: none of them; ``only``:
    every one of them and no other estimator. ``unit=none`` leaves out "exact steps"."""
    kind = "tuned-budgets"
    if not report.tuned:
        raise InvalidValue(f"race-quote {kind}: give a tuned race (its decision table)")
    verdict = _choice(kind, options, "verdict", ["ahead", "level", "behind"])
    match = _choice(kind, options, "match", ["all", "any", "none", "only"])
    form = _choice(kind, options, "form", ["list", "from"])
    unit = _choice(kind, options, "unit", ["steps", "none"]) == "steps"
    specs = _specs(report, options, kind)
    budgets, holds = [], []
    for row in report.summary()["decision"]:
        words = row_verdicts(row)
        hits = [words[spec] == verdict for spec in specs]
        others = [word == verdict for spec, word in words.items() if spec not in specs]
        budgets.append(row["budget_exact_steps"])
        holds.append(
            {
                "all": all(hits),
                "any": any(hits),
                "none": not any(hits),
                "only": all(hits) and not any(others),
            }[match]
        )
    if form == "list":
        chosen = [b for b, ok in zip(budgets, holds, strict=True) if ok]
        return _steps_phrase(chosen, unit) if chosen else "no budget"
    if not holds[-1]:
        raise InvalidValue(
            f"race-quote {kind} {' '.join(f'{k}={v}' for k, v in options.items())}: the "
            "verdict does not hold at the full budget, so no 'from N on' does; say where it "
            "holds (form=list)"
        )
    start = max((i + 1 for i, ok in enumerate(holds) if not ok), default=0)
    return f"from {_steps_phrase([budgets[start]], unit)} on"


def _task_verdicts(
    reports: Sequence[Any], options: Mapping[str, str], kind: str
) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """Per estimator (those of ``estimators=``, or every one raced), its (task label,
    verdict) on each task that ran it, at the budget fraction ``fraction=``."""
    from gradest.plugin import split_spec_list
    from gradest_lab.race.tuned_page import task_labels

    fraction = float(_required(kind, options, "fraction"))
    labels = task_labels([report.config for report in reports])
    found: dict[str, list[tuple[str, str]]] = {}
    for label, report in zip(labels, reports, strict=True):
        for spec, word in row_verdicts(_row_at(report, fraction, kind)).items():
            found.setdefault(spec, []).append((label, word))
    if "estimators" not in options:
        return list(found), found
    specs = split_spec_list(options["estimators"], what=f"race-quote {kind}: estimators")
    for spec in specs:
        if spec not in found:
            raise InvalidValue(f"race-quote {kind}: no race ran {spec!r}")
    return specs, found


def _tasks(n: int) -> str:
    return "the 1 task" if n == 1 else f"the {n} tasks"


def _tuned_counts(reports: Any, options: Mapping[str, str]) -> str:
    """On how many tasks each estimator was ahead of exact, level, behind at ``fraction=``:
    ```alignprop` ahead of exact on 6 of the 7 tasks, level on 1, behind on 0``; with
    ``verdict=`` that count alone."""
    kind = "tuned-counts"
    specs, found = _task_verdicts(reports, options, kind)
    verdict = options.get("verdict")
    if verdict is not None:
        _choice(kind, options, "verdict", ["ahead", "level", "behind"])
    parts = []
    for spec in specs:
        words = [word for _, word in found[spec]]
        n = len(words)
        if verdict is not None:
            parts.append(
                f"`{spec}` {_VERDICT_WORDS[verdict]} on {words.count(verdict)} of {_tasks(n)}"
            )
        else:
            parts.append(
                f"`{spec}` ahead of exact on {words.count('ahead')} of {_tasks(n)}, level on "
                f"{words.count('level')}, behind on {words.count('behind')}"
            )
    return "; ".join(parts)


def _tuned_tasks(reports: Any, options: Mapping[str, str]) -> str:
    """Which tasks each estimator had the verdict ``verdict=`` on at ``fraction=``:
    ```sdo` on 2 of the 6 tasks (`digits target=5`, `mnist`)``."""
    kind = "tuned-tasks"
    verdict = _choice(kind, options, "verdict", ["ahead", "level", "behind"])
    specs, found = _task_verdicts(reports, options, kind)
    parts = []
    for spec in specs:
        tasks = [f"`{label}`" for label, word in found[spec] if word == verdict]
        n = len(found[spec])
        if tasks:
            parts.append(f"`{spec}` on {len(tasks)} of {_tasks(n)} ({', '.join(tasks)})")
        else:
            parts.append(f"`{spec}` on none of {_tasks(n)}")
    return "; ".join(parts)


def _race_contraction(reports: Any, options: Mapping[str, str]) -> str:
    """The chain's contraction on each race's task beside the one-step estimators' verdicts
    (:func:`gradest_lab.race.race_contraction.contraction_table`)."""
    from gradest_lab.race.race_contraction import contraction_table
    from gradest_lab.race.tuned_page import task_labels

    del options
    labels = task_labels([report.config for report in reports])
    folders = [report.folder for report in reports]
    return "\n".join(contraction_table(reports, labels, folders)) + "\n"


def _rule_tally(reports: Any, options: Mapping[str, str]) -> str:
    """The rule's score over the races: ``confirmed at 9, not confirmed at 4 and refuted at
    3 of the 16 (task, budget) cells``; with ``part=late|early`` the cells from (below) the
    rule's budget share only."""
    from gradest_lab.race.decision_rule import RULE, tally_sentence

    kind = "rule-tally"
    cells = [cell for _, cell in _rule_cells(reports, kind)]
    part = options.get("part")
    if part is not None:
        _choice(kind, options, "part", ["late", "early"])
        cells = [c for c in cells if (c.fraction >= RULE.from_fraction) == (part == "late")]
    return tally_sentence(cells, "(task, budget) cells")


def _rule_rival(reports: Any, options: Mapping[str, str]) -> str:
    """Confirmed is not best: at how many (task, budget) cells where the rule prefers
    another estimator (``prefers=SPEC``: that one) ``estimator=SPEC`` had the larger mean
    lead over exact (:func:`gradest_lab.race.decision_rule.rival_leads`): ``14 of the 21
    (task, budget) cells``, adding ``of the 2 races that ran it`` when not every race did."""
    from gradest_lab.race.decision_rule import RULE, rival_leads

    kind = "rule-rival"
    rival = options.get("estimator")
    if not rival:
        raise InvalidValue(f"race-quote {kind}: give estimator=SPEC, the rival to the rule")
    prefers = options.get("prefers")
    if prefers is not None:
        _choice(kind, options, "prefers", [RULE.early, RULE.late])
    leads, ran = [], 0
    for report in reports:
        try:
            found = rival_leads(report, rival, prefers=prefers)
        except ValueError as err:
            raise InvalidValue(f"race-quote {kind}: {err}") from None
        leads += found
        ran += rival in report.config["estimators"]
    if not ran:
        raise InvalidValue(f"race-quote {kind}: no race given ran {rival!r}")
    where = "" if ran == len(reports) else f" of the {ran} races that ran it"
    return f"{sum(leads)} of the {len(leads)} (task, budget) cells{where}"


def _horizon_shares(reports: Any, options: Mapping[str, str]) -> str:
    """The range of exact's share of the attainable gain at the races' first evaluation
    point (:func:`gradest_lab.race.horizon.horizon`'s ``share_first``): ``32.2% to 65.8% of
    the attainable gain after 1 exact step``; ``after its first evaluation`` where the races'
    first points are at different budgets."""
    del options
    kind = "horizon-shares"
    firsts = [report.summary()["horizon"]["share_first"] for report in reports]
    shares = [first["share"] for first in firsts]
    if None in shares:
        # A range that left a race out would read as covering it.
        raise InvalidValue(
            f"race-quote {kind}: race {shares.index(None) + 1} of those given has no "
            "attainable gain to share (its ceiling is not above the pretrained reward); "
            "leave it out of the block"
        )
    budgets = {first["budget"] for first in firsts}
    if len(budgets) == 1:
        (budget,) = budgets
        when = f"after {budget:.3g} exact step" + ("" if budget == 1 else "s")
    else:
        when = "after its first evaluation"
    low, high = 100 * min(shares), 100 * max(shares)
    span = f"{low:.1f}%" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}% to {high:.1f}%"
    return f"{span} of the attainable gain {when}"


def _plain(report: Any, kind: str) -> Any:
    if report.tuned:
        raise InvalidValue(f"race-quote {kind}: give a race at one lr (not a tuned race)")
    return report


def _race_steps(report: Any, options: Mapping[str, str]) -> str:
    """How many optimizer steps an estimator took in the budget (the mean over seeds)."""
    kind = "race-steps"
    spec = _required(kind, options, "estimator")
    summary = _plain(report, kind).summary()
    if spec not in summary:
        raise InvalidValue(f"race-quote {kind}: the race did not run {spec!r}")
    mean = summary[spec]["steps"]["mean"]
    return f"{mean:.3g} step" + ("" if mean == 1 else "s")


def _race_seeds_above(report: Any, options: Mapping[str, str]) -> str:
    """On how many seeds each estimator's reward was above exact's: ``15 of the 16 seeds``
    (one estimator at ``fractions=1``), else ``at 2 / 4 / 8 exact steps: `sdo` 7 / 7 / 8,
    ... of the 8 seeds``."""
    from gradest_lab.race.plain_race import REFERENCE

    kind = "race-seeds-above"
    _plain(report, kind)
    specs = _specs(report, options, kind)
    fractions = report.config["fractions"]
    wanted = _fractions(options, ",".join(f"{f:g}" for f in fractions))
    indices = []
    for fraction in wanted:
        if fraction not in fractions:
            raise InvalidValue(f"race-quote {kind}: the race has no budget fraction {fraction:g}")
        indices.append(fractions.index(fraction))

    def by_seed(spec: str, i: int) -> dict[int, float]:
        return {row["seed"]: row["curve"][i]["reward"] for row in report.runs[spec]}

    counts = {}
    for spec in specs:
        row = []
        for i in indices:
            mine, exact = by_seed(spec, i), by_seed(REFERENCE, i)
            row.append(sum(mine[seed] > exact[seed] for seed in mine))
        counts[spec] = row
    n = len(report.config["seeds"])
    if len(specs) == 1 and len(indices) == 1:
        return f"{counts[specs[0]][0]} of the {n} seeds"
    budget = (
        report.config["budget_exact_steps"] if report.axis == "flops" else report.config["budget"]
    )
    at = " / ".join(f"{fractions[i] * budget:.3g}" for i in indices)
    rows = _and_list([f"`{spec}` " + " / ".join(map(str, counts[spec])) for spec in specs])
    return f"at {at} {report.unit_name}: {rows} of the {n} seeds"


def _stopped_step(report: Any, options: Mapping[str, str]) -> str:
    """What the step an estimator did not take (it would have passed the budget) costs, in
    exact steps, the mean over seeds (a tuned race: at the lr chosen for the full budget):
    ``auto``'s probe, say."""
    from gradest_lab.race.shards import lr_label

    kind = "stopped-step"
    spec = _required(kind, options, "estimator")
    if spec not in report.config["estimators"]:
        raise InvalidValue(f"race-quote {kind}: the race did not run {spec!r}")
    if report.tuned:
        lr = report.summary()["final"][spec][-1]["lr"]
        rows = report.runs[spec][lr_label(lr)]
    elif report.axis == "flops":
        rows = report.runs[spec]
    else:
        raise InvalidValue(f"race-quote {kind}: give a race with a FLOPs budget")
    costs = [row["stopped_step"]["flops"] / report.unit for row in rows if row["stopped_step"]]
    if not costs:
        raise InvalidValue(f"race-quote {kind}: every run of {spec!r} ended its budget")
    return f"{sum(costs) / len(costs):.3g} exact steps"


# The renderers whose PATH is a comma-separated list of tuned race folders.
_MATRIX_RENDERERS: dict[str, Callable[[Any, Mapping[str, str]], str]] = {
    "tuned-matrix": _tuned_matrix,
    "tuned-tally": _tuned_tally,
    "tuned-counts": _tuned_counts,
    "tuned-tasks": _tuned_tasks,
    "rule-score": _rule_score,
    "tuned-horizon": _tuned_horizon,
    "race-contraction": _race_contraction,
    "rule-tally": _rule_tally,
    "rule-rival": _rule_rival,
    "horizon-shares": _horizon_shares,
}

_RENDERERS: dict[str, Callable[[Any, Mapping[str, str]], str]] = {
    "tuned-decision": _tuned_decision,
    "tuned-time": _tuned_time,
    "tuned-headline": _tuned_headline,
    "tuned-lrs": _tuned_lrs,
    "tuned-warnings": _tuned_warnings,
    "race-final": _race_final,
    "race-fractions": _race_fractions,
    "tuned-budgets": _tuned_budgets,
    "race-steps": _race_steps,
    "race-seeds-above": _race_seeds_above,
    "stopped-step": _stopped_step,
}

# The options each renderer reads (any other is refused: a misspelt key would be ignored).
_OPTIONS: dict[str, set[str]] = {
    "tuned-decision": {"fractions"},
    "tuned-time": {"estimators"},
    "tuned-headline": {"fraction"},
    "tuned-lrs": set(),
    "tuned-warnings": set(),
    "race-final": set(),
    "race-fractions": set(),
    "tuned-matrix": {"fractions"},
    "tuned-tally": {"fractions"},
    "tuned-budgets": {"verdict", "estimators", "match", "form", "unit"},
    "tuned-counts": {"fraction", "estimators", "verdict"},
    "tuned-tasks": {"fraction", "estimators", "verdict"},
    "rule-score": set(),
    "tuned-horizon": set(),
    "race-contraction": set(),
    "rule-tally": {"part"},
    "rule-rival": {"estimator", "prefers"},
    "horizon-shares": set(),
    "race-steps": {"estimator"},
    "race-seeds-above": {"estimators", "fractions"},
    "stopped-step": {"estimator"},
}

# Phrases: spans inside a sentence, written on one line; every other kind is a block.
_PHRASES = {
    "tuned-budgets",
    "tuned-counts",
    "tuned-tasks",
    "rule-tally",
    "rule-rival",
    "horizon-shares",
    "race-steps",
    "race-seeds-above",
    "stopped-step",
}


def render(root: Path, args: str) -> str:
    """The text of the block ``<!-- race-quote ARGS -->`` (``KIND PATH [key=value ...]``)."""
    words = args.split()
    if len(words) < 2 or words[0] not in {**_RENDERERS, **_MATRIX_RENDERERS}:
        raise InvalidValue(
            f"race-quote {args!r}: give KIND PATH [key=value ...], KIND one of "
            f"{', '.join([*_RENDERERS, *_MATRIX_RENDERERS])}"
        )
    kind = words[0]
    options = _options(args, words[2:])
    unknown = sorted(set(options) - _OPTIONS[kind])
    if unknown:
        takes = ", ".join(sorted(_OPTIONS[kind])) or "no option"
        raise InvalidValue(f"race-quote {args!r}: {kind} takes {takes}, not {', '.join(unknown)}")
    if kind in ("rule-score", "rule-tally"):
        from gradest_lab.race.decision_rule import RULE

        # By the race's identity, not its path: a path written another way names it too.
        before = [
            path
            for path in words[1].split(",")
            if _load(root, path).config["identity"] in RULE.raced_before
        ]
        if before:
            raise InvalidValue(
                f"race-quote {kind}: {', '.join(before)} was raced before the rule was "
                f"written ({RULE.written}); only races raced after it can score it"
            )
    if kind in _MATRIX_RENDERERS:
        return _MATRIX_RENDERERS[kind](_load_all(root, words[1]), options)
    return _RENDERERS[kind](_load(root, words[1]), options)


# -- where race figures may stand ------------------------------------------------------------

# A number as prose writes it: signed, with thousands commas, decimals, an exponent, a
# fraction (1/8), a percentage or a ratio (39x). Glued to a letter it is part of a name
# (DiT's 28x28, 42K-parameter, float32) and no number.
_FIGURE = re.compile(
    r"(?<![\w.])[−+-]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[−+-]?\d+)?(?:/\d+)?[%x]?(?![\w])"
)
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# Numbers that are no race's: a date, the machine's cores, how long a run took (the budget
# is FLOPs: load moves the time, not the numbers), an estimator's name (DRaFT-1), a
# section, issue or item number.
_NOT_RACE = re.compile(
    rf"\b(?:\d{{1,2}}\s+)?(?:{_MONTHS})\s+\d{{4}}\b|\b\d+[-\s]cores?\b"
    r"|\b\d+\s+(?:minutes|hours)\b|\bDRaFT-\d+\b"
    r"|\b(?:[Ss]ection|[Ii]ssue|[Ii]tem)s?\s+\d+(?:\.\d+)*"
)
# A number of steps (``8 exact steps``, ``3, 7 and 8 exact steps``, ``18 steps``, ``from 2
# on``): a budget at which a verdict holds or a count of steps taken. Only a race's full
# budget is a setting; any other is generated (tuned-budgets, race-steps).
_STEPS = re.compile(
    r"\b\d+(?:(?:,|\s/|,?\s+(?:and|or|to))\s+\d+)*\s+(?:exact\s+)?steps?\b"
    r"|\bfrom\s+\d+\s+(?:exact\s+)?(?:steps?\s+)?on\b"
)
_RACE_HEADING = re.compile(r"\braces?\b", re.I)
_FOLDER = re.compile(r"docs/results/[\w+-]+")


def _inline_is_code(text: str) -> bool:
    """Inline code that is code: a spec or option (``jagg:window=4``, ``--budget 4x``), a
    call or formula (``log p(3 | x)``), a path. Its numbers are settings it takes. Inline
    code that is a figure (```80%```, ```−6.79```, ```J = −12.63```, ```lr 1e-4```) is
    prose, checked like any number."""
    return re.search(r"[\w)\]][:=(\[]|(?:^|\s)--?[A-Za-z]|/", text) is not None


def _prose(text: str) -> str:
    """The text as a reader reads it for figures: without generated text (blocks and
    spans), comments, link targets, indented code and inline code that is code, and with
    the numbers that are no race's (dates, cores, run times) blanked."""
    text = _BLOCK.sub(" ", text)
    text = re.sub(r"(?s)<!--.*?-->", " ", text)
    text = re.sub(r"\]\([^)]*\)", "] ", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    text = re.sub(r"`([^`]*)`", lambda m: " " if _inline_is_code(m[1]) else f" {m[1]} ", text)
    return _NOT_RACE.sub(" ", text)


def _parse_figure(token: str) -> tuple[str, float, int]:
    """A figure's kind (``number``, ``ratio``, ``fraction``), value (a percentage as a
    share: ``80%`` is 0.8) and the decimals it is written to."""
    text = token.replace("−", "-").replace(",", "")
    kind = "number"
    percent = text.endswith("%")
    if percent:
        text = text[:-1]
    elif text.endswith("x"):
        kind, text = "ratio", text[:-1]
    if "/" in text:
        top, bottom = text.split("/")
        return "fraction", int(top) / int(bottom), 12
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2]) - (int(exponent) if exponent else 0)
    value = float(text)
    return kind, (value / 100 if percent else value), decimals + (2 if percent else 0)


def _matches(token: str, facts: Mapping[str, set[float]]) -> bool:
    """``token`` is one of ``facts`` as written: a fact rounded to the token's decimals,
    within 5% of it (``13.2`` and ``13`` are 13.238272, ``39x`` a span of 39.4)."""
    kind, value, decimals = _parse_figure(token)
    tolerance = 1e-9 * max(1.0, abs(value))
    return any(
        abs(round(fact, decimals) - value) <= tolerance
        # A rounding that keeps the fact (1 is no rounding of 0.9, 13 is one of 13.24).
        and abs(value - fact) <= 0.05 * abs(fact)
        for fact in facts[kind]
    )


def _report_facts(report: Any) -> dict[str, set[float]]:
    """What a race report holds that prose may state by hand, each in every form prose
    writes it: its settings (seeds and their count, the budget, the lr grid's size and span,
    the evaluation set, bootstrap resamples and level, task settings, target levels, the
    ceiling run's length and seed), the measured constants (FLOPs of a forward, a step, the
    budget; the pretrained evaluation). Results (rewards, differences, shares, verdicts,
    budgets between the first and the last, steps taken) are not here: those are generated."""
    config = report.config
    numbers: set[float] = set()

    def add(*values: Any) -> None:
        for value in values:
            if isinstance(value, int | float) and not isinstance(value, bool):
                if math.isfinite(value):
                    numbers.add(float(value))

    for key in ("seeds", "tune_seeds"):
        if key in config:
            add(len(config[key]), config[key][0], config[key][-1])
    add(config["eval_samples"], config["bootstrap"]["resamples"], config["bootstrap"]["level"])
    add(*config["task_settings"].values(), len(config["estimators"]))
    add(*(f for f in config["fractions"] if f < 1))
    add(config["exact_step_model_units"], *report.initial.values())
    flops = [config["forward_flops"], config["exact_step_flops"]]
    if config["budget_kind"] == "flops":
        flops.append(config["budget"])
    else:
        add(config["budget"])
    add(*(f / scale for f in flops for scale in (1, 1e6, 1e9)))
    ratios: set[float] = set()
    steps = config.get("budget_exact_steps")
    if steps is not None:
        add(steps)
        ratios.add(float(steps))
    add(config.get("ceiling"), config.get("task_ceiling"))
    if report.tuned:
        lrs = config["lrs"]
        add(len(lrs), *lrs, *config["levels"], config["primary_level"])
        add(config["ceiling_factor"], *(row["seed"] for row in report.ceiling_rows))
        add(report.ceiling_run["budget_exact_steps"])
        ratios |= {lrs[-1] / lrs[0], float(config["ceiling_factor"])}
        if config.get("bracket_ratio") is not None:
            ratios.add(float(config["bracket_ratio"]))
    return {"number": numbers, "ratio": ratios, "fraction": set(config["fractions"])}


def _reports_named(root: Path, text: str) -> list[Any]:
    """The race reports whose folders (``docs/results/NAME``) ``text`` names, in a block, a
    command or prose; folders of other reports (benchmarks) are no race's."""
    reports = []
    for folder in dict.fromkeys(_FOLDER.findall(text)):
        if not (Path(root) / folder / "report.json").is_file():
            continue
        try:
            reports.append(_load(root, folder))
        except InvalidValue:
            continue
    return reports


def _sections(page: str) -> list[tuple[int, str, str, str]]:
    """Per heading: its level, the heading line, its own text (to the next heading) and its
    scope (to the next heading of its level or above). Fenced code holds no headings."""
    masked = re.sub(r"(?ms)^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m[0]), page)
    heads = list(re.finditer(r"(?m)^(#{1,6}) .*$", masked))
    sections = []
    for i, head in enumerate(heads):
        level = len(head[1])
        end = heads[i + 1].start() if i + 1 < len(heads) else len(page)
        scope_end = next((h.start() for h in heads[i + 1 :] if len(h[1]) <= level), len(page))
        sections.append((level, head[0], page[head.end() : end], page[head.end() : scope_end]))
    return sections


def _facts_of(reports: Sequence[Any]) -> tuple[dict[str, set[float]], set[float]]:
    """The facts of several reports together, and their full budgets in exact steps."""
    facts: dict[str, set[float]] = {"number": set(), "ratio": set(), "fraction": set()}
    for report in reports:
        for kind, values in _report_facts(report).items():
            facts[kind] |= values
    budgets = {
        float(report.config["budget_exact_steps"])
        for report in reports
        if report.config.get("budget_exact_steps") is not None
    }
    return facts, budgets


def stray_figures(page: str, root: Path | None = None) -> list[str]:
    """The figures that stand in a race section outside generated text and are not what
    its reports hold (the rule of the module docstring). ``root``: the repository the
    page's report folders are in (None: no report is read, so no number is a setting)."""
    stray = []
    # The enclosing sections' levels and facts: a section that names no report (an
    # introduction above its races' subsections) reads those its subsections name, else
    # those of the section it is in.
    enclosing: list[tuple[int, tuple[dict[str, set[float]], set[float]]]] = []
    for level, heading, own, scope in _sections(page):
        while enclosing and enclosing[-1][0] >= level:
            enclosing.pop()
        reports = [] if root is None else _reports_named(root, own) or _reports_named(root, scope)
        if reports or not enclosing:
            facts, budgets = _facts_of(reports)
        else:
            facts, budgets = enclosing[-1][1]
        enclosing.append((level, (facts, budgets)))
        if not (_RACE_HEADING.search(heading) or _BLOCK.search(own)):
            continue
        name = heading.strip()
        code_free = re.sub(r"(?ms)^```.*?^```", "", own)
        for text in (_prose(heading.lstrip("#")), _prose(code_free)):
            steps = {
                number.start()
                for claim in _STEPS.finditer(text)
                for number in _FIGURE.finditer(text, claim.start(), claim.end())
            }
            for number in _FIGURE.finditer(text):
                token = number.group()
                if number.start() in steps:
                    if _parse_figure(token)[1] not in budgets:
                        stray.append(
                            f"{token} under {name!r} (a number of steps other than the "
                            "budget: generate it, e.g. with a tuned-budgets or race-steps span)"
                        )
                elif not _matches(token, facts):
                    stray.append(f"{token} under {name!r}")
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
            f"a figure outside a generated block: {item}" for item in stray_figures(updated, root)
        ]
    problems += _unflagged_drafts(root, updated)
    return problems


def _unflagged_drafts(root: Path, page: str) -> list[str]:
    """The tuned races the page quotes that are not ready to quote and whose
    ``tuned-warnings`` block the page lacks (a provisional verdict shown as a final one)."""
    quoted: set[str] = set()
    flagged: set[str] = set()
    for match in _BLOCK.finditer(page):
        words = match["args"].split()
        if len(words) < 2:
            continue
        paths = words[1].split(",")
        (flagged if words[0] == "tuned-warnings" else quoted).update(paths)
    problems = []
    for path in sorted(quoted - flagged):
        report = _load(root, path)
        if report.tuned and report.grid_warnings():
            problems.append(
                f"quotes {path}, which is not ready to quote ({report.grid_warnings()[0]}), "
                f"without its <!-- race-quote tuned-warnings {path} --> block"
            )
    return problems


def update_page(root: Path, page: str) -> str:
    """The page with every generated block and span rewritten from its report."""

    def fill(match: re.Match[str]) -> str:
        kind = match["args"].split()[0] if match["args"].split() else ""
        if (kind in _PHRASES) == bool(match["newline"]):
            form = "on the opening's line" if kind in _PHRASES else "on the lines after it"
            raise InvalidValue(
                f"race-quote {match['args']!r}: write {kind}'s text {form} (a "
                + ("phrase inside a sentence)" if kind in _PHRASES else "block)")
            )
        line_start = page.rfind("\n", 0, match.start()) + 1
        if kind in _PHRASES and not page[line_start : match.start()].strip():
            raise InvalidValue(
                f"race-quote {match['args']!r}: a span begins its line, where markdown ends "
                "the paragraph (an HTML comment there opens a block); put the text before it "
                "on the same line"
            )
        return match["open"] + render(root, match["args"]) + match["close"]

    return _BLOCK.sub(fill, page)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradest_lab.race.quoting PAGES [--root ROOT] [--check]``."""
    return page_command(
        argv,
        prog="python -m gradest_lab.race.quoting",
        description="Write (or --check) the race numbers of markdown pages from their reports.",
        problems_of=page_problems,
        updated=update_page,
        stale="a race-quote block differs from its report",
    )


if __name__ == "__main__":
    sys.exit(main())
