"""Prose that cannot drift (issue 44, item 6): every number a race section of README.md or
docs/*.md states outside generated text is one its reports hold (a setting, a measured
constant), a number of steps other than the budget is generated, and a figure in inline
code is checked like prose. The review's three false edits of docs/results.md, and a
backticked figure's, fail here; numbers that are no race's (code, dates) do not."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from gradest_lab.race import quoting

from gradest.errors import InvalidValue

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
STALE = "a race-quote block differs from its report"


def _results() -> str:
    return RESULTS.read_text(encoding="utf-8")


def _problems(text: str) -> list[str]:
    return quoting.page_problems(ROOT, text)


def _edit_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} is on the page {text.count(old)} times"
    return text.replace(old, new)


def test_the_committed_results_page_passes() -> None:
    """The edits below fail because of the edit, not because the page already fails."""
    assert _problems(_results()) == []


# A generated list of budgets (``2, 3 and 8 exact steps``) on the results page.
_LIST = re.compile(r"\d+(?:, \d+)* and \d+ exact steps")


def _spans(text: str) -> list[re.Match[str]]:
    """The page's tuned-budgets phrases."""
    return [m for m in quoting._BLOCK.finditer(text) if m["args"].startswith("tuned-budgets")]


def test_an_edited_list_of_budgets_fails() -> None:
    """The review's edit, on whichever list of budgets the page now holds: '3, 7 and 8
    exact steps' -> '3, 6 and 8'."""
    text = _results()
    span = next(m for m in _spans(text) if _LIST.fullmatch(m["body"]))
    first = re.match(r"\d+", span["body"])
    assert first is not None
    body = str(int(first[0]) + 1 if int(first[0]) < 8 else 1) + span["body"][first.end() :]
    edited = text[: span.start("body")] + body + text[span.end("body") :]
    assert STALE in _problems(edited)


def test_an_edited_grid_span_fails() -> None:
    """MNIST target 3's grid: 'a five-point grid over 39x' -> '93x'."""
    edited = _edit_once(_results(), "grid over 39x", "grid over 93x")
    problems = _problems(edited)
    assert any(p.startswith("a figure outside a generated block: 93x under") for p in problems)


def test_every_edited_budget_phrase_fails_wherever_it_stands() -> None:
    """Each generated phrase of budgets ('from 2 exact steps on', '3 and 8 exact steps'),
    its first number changed, fails the check."""
    text = _results()
    spans = [m for m in _spans(text) if re.search(r"\d", m["body"])]
    assert len(spans) >= 2
    for span in spans:
        first = re.search(r"\d+", span["body"])
        assert first is not None
        number = int(first[0])
        body = span["body"][: first.start()] + str(number + 9) + span["body"][first.end() :]
        edited = text[: span.start("body")] + body + text[span.end("body") :]
        assert STALE in _problems(edited), span["args"]


def test_a_generated_phrase_made_hand_written_fails() -> None:
    """Replacing the span by its own text (so a later report would not rewrite it) leaves a
    number of steps in prose: refused, even while it is still true."""
    text = _results()
    span = next(m for m in _spans(text) if _LIST.fullmatch(m["body"]))
    edited = text[: span.start()] + span["body"] + text[span.end() :]
    problems = _problems(edited)
    assert problems
    assert all("(a number of steps" in p for p in problems)
    numbers = re.findall(r"\d+", span["body"])
    # A number of steps may be the full budget of any race its section names.
    own = next(own for _, _, own, _ in quoting._sections(text) if span[0] in own)
    budgets = {
        float(report.config["budget_exact_steps"]) for report in quoting._reports_named(ROOT, own)
    }
    assert {p.split(" under ")[0] for p in problems} == {
        f"a figure outside a generated block: {n}" for n in numbers if float(n) not in budgets
    }


@pytest.mark.parametrize(
    ("old", "new", "token"),
    [
        # A figure in backticks: the headline race's time-to-target level.
        ("its time to `80%` of the attainable", "its time to `85%` of the attainable", "85%"),
        # The FLOPs race's pretrained reward and ceiling, and its lr, in backticks.
        ("Pretrained `J = −12.63`", "Pretrained `J = −12.36`", "−12.36"),
        ("ceiling `−6.79` (the best", "ceiling `−6.97` (the best", "−6.97"),
        (
            "AdamW `lr 1e-4`, batch 16, N = 16 Euler",
            "AdamW `lr 2e-4`, batch 16, N = 16 Euler",
            "2e-4",
        ),
        # Integers in prose: a seed count, the evaluation set, the grid's size and span.
        ("on the 16 report seeds 16-31", "on the 12 report seeds 16-31", "12"),
        (
            "every eighth of that on one fixed set of 256",
            "every eighth of that on one fixed set of 265",
            "265",
        ),
        (
            "grid spanning 100x, then refined; 8 tuning",
            "grid spanning 100x, then refined; 9 tuning",
            "9",
        ),
        (
            "grid spanning 100x, then refined; 8 tuning",
            "grid spanning 10x, then refined; 8 tuning",
            "10x",
        ),
        # A number of steps that is not the budget, written by hand.
        ("the full line-up. It is a", "the full line-up, by 7 exact steps. It is a", "7"),
    ],
)
def test_an_edited_figure_in_race_prose_fails(old: str, new: str, token: str) -> None:
    problems = _problems(_edit_once(_results(), old, new))
    flagged = [
        p.split(" under ")[0].removeprefix("a figure outside a generated block: ") for p in problems
    ]
    assert token in flagged, problems


def test_the_budget_itself_may_be_written_by_hand() -> None:
    edited = _edit_once(
        _results(), "the full line-up. It is a", "the full line-up, by 8 exact steps. It is a"
    )
    assert _problems(edited) == []


# -- the rule on pages of its own ------------------------------------------------------------

MNIST3 = "docs/results/race_mnist_tuned_target3"
# Its phrase and its readiness, as the committed report gives them (a page that quotes a
# race not ready to quote shows why).
SPAN = (
    f"<!-- race-quote tuned-budgets {MNIST3} verdict=ahead -->"
    + quoting.render(ROOT, f"tuned-budgets {MNIST3} verdict=ahead")
    + "<!-- /race-quote -->"
)
READY = (
    f"<!-- race-quote tuned-warnings {MNIST3} -->\n"
    + quoting.render(ROOT, f"tuned-warnings {MNIST3}")
    + "<!-- /race-quote -->"
)
PAGE = f"""# A page

Numbers before any heading, and under a heading that names no race, are no race's: 3, 6.

## Setup

ahead at 3, 6 and 8 exact steps, 0.97 and `85%`.

## The race

    gradest race --model mnist --tune lr=1.6e-5,4e-5 --budget 8x --out {MNIST3}

```bash
gradest race --steps 9 --seeds 11   # fenced code documents settings
```

Run on 1 December 2026 on the 2-core CPU (about 53 minutes), commit 3f9a2b1, section 2 of
the [harness](harness.md#race-2). Every estimator at its own lr from a five-point grid over
39x, with 4 tuning seeds and 8 report seeds, `95%` intervals, for 8 exact steps of
compute (`jagg:window=4,tau=0.9`, `--budget 8x`, `log p(3 | x)` are code); the 28x28 DiT,
42K-parameter, float32, DRaFT-1. Targets `50%` and `80%`, lr `2.5e-4`.
Ahead at {SPAN}.

{READY}
"""


def test_numbers_that_are_no_race_figures_pass() -> None:
    assert quoting.stray_figures(PAGE, ROOT) == []
    assert _problems(PAGE) == []


@pytest.mark.parametrize(
    ("old", "new", "flagged"),
    [
        ("over\n39x", "over\n93x", "93x"),
        ("4 tuning seeds", "6 tuning seeds", "6"),
        ("8 report seeds", "9 report seeds", "9"),
        ("`95%` intervals", "`99%` intervals", "99%"),
        ("`80%`", "`85%`", "85%"),
        ("lr `2.5e-4`", "lr `2.6e-4`", "2.6e-4"),
        ("lr `2.5e-4`", "lr 2.6e-4", "2.6e-4"),
        ("for 8 exact steps", "for 5 exact steps", "5"),
        ("of\ncompute", "of\ncompute, ahead from 3 on", "3"),
        ("of\ncompute", "of\ncompute, −0.71 [+0.64, +0.77] above", "−0.71"),
    ],
)
def test_each_kind_of_hand_written_race_figure_is_checked(old: str, new: str, flagged: str) -> None:
    edited = _edit_once(PAGE, old, new)
    found = [item.split(" under ")[0] for item in quoting.stray_figures(edited, ROOT)]
    assert flagged in found, found


def test_a_section_names_its_reports_or_its_subsections_do() -> None:
    """A section naming no report (an introduction) reads those of its subsections; with
    none anywhere, no number is a setting."""
    page = f"## The races\n\nBoth at 8 report seeds.\n\n### Race one\n\n    --out {MNIST3}\n"
    assert quoting.stray_figures(page, ROOT) == []
    assert quoting.stray_figures(page.replace(MNIST3, "docs/results/nothing"), ROOT) == [
        "8 under '## The races'"
    ]


# -- the phrases -----------------------------------------------------------------------------


def _entry(spec: str) -> dict[str, Any]:
    return {"spec": spec, "minus_exact": {"mean": 0.1, "low": 0.0, "high": 0.2}}


class _Tuned:
    """What the phrases read of a TunedRaceReport: config and the decision rows."""

    tuned = True

    def __init__(self, rows: list[tuple[list[str], list[str], list[str]]]) -> None:
        self.config = {
            "task": "digits",
            "task_settings": {},
            "estimators": ["exact", "a", "b", "c"],
        }
        self._rows = [
            {
                "fraction": (i + 1) / len(rows),
                "budget_exact_steps": float(i + 1),
                "beats_exact": [_entry(s) for s in ahead],
                "no_clear_difference": [_entry(s) for s in level],
                "behind_exact": [_entry(s) for s in behind],
            }
            for i, (ahead, level, behind) in enumerate(rows)
        ]

    def summary(self) -> dict[str, Any]:
        return {"decision": self._rows}


RACE = _Tuned(
    [
        (["a"], ["b"], ["c"]),  # 1 step: a only
        ([], ["a", "b", "c"], []),  # 2: nobody
        (["a", "b"], ["c"], []),  # 3
        (["a", "b", "c"], [], []),  # 4: everyone
    ]
)


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"verdict": "ahead"}, "4 exact steps"),
        ({"verdict": "ahead", "estimators": "a"}, "1, 3 and 4 exact steps"),
        ({"verdict": "ahead", "estimators": "a", "match": "only"}, "1 exact step"),
        ({"verdict": "ahead", "match": "none"}, "2 exact steps"),
        ({"verdict": "ahead", "estimators": "b,c", "match": "any"}, "3 and 4 exact steps"),
        ({"verdict": "behind", "estimators": "a"}, "no budget"),
        ({"verdict": "ahead", "estimators": "a,b", "form": "from"}, "from 3 exact steps on"),
        ({"verdict": "behind", "match": "none", "form": "from"}, "from 2 exact steps on"),
        ({"verdict": "ahead", "estimators": "b", "form": "from", "unit": "none"}, "from 3 on"),
    ],
)
def test_tuned_budgets_says_where_a_verdict_holds(options: dict[str, str], text: str) -> None:
    assert quoting._tuned_budgets(RACE, options) == text


def test_a_from_claim_that_does_not_hold_at_the_end_is_refused() -> None:
    with pytest.raises(InvalidValue, match="does not hold at the full budget"):
        quoting._tuned_budgets(RACE, {"verdict": "level", "estimators": "c", "form": "from"})
    with pytest.raises(InvalidValue, match="did not run 'd'"):
        quoting._tuned_budgets(RACE, {"verdict": "ahead", "estimators": "d"})


def test_counts_and_tasks_across_races() -> None:
    other = _Tuned([([], ["a"], ["b", "c"])] * 4)
    other.config = {**other.config, "task": "mnist"}
    counts = quoting._tuned_counts([RACE, other], {"fraction": "1", "estimators": "a,b"})
    assert counts == (
        "`a` ahead of exact on 1 of the 2 tasks, level on 1, behind on 0; "
        "`b` ahead of exact on 1 of the 2 tasks, level on 0, behind on 1"
    )
    assert quoting._tuned_counts([RACE, other], {"fraction": "0.25", "verdict": "behind"}) == (
        "`a` behind exact on 0 of the 2 tasks; `b` behind exact on 1 of the 2 tasks; "
        "`c` behind exact on 2 of the 2 tasks"
    )
    assert quoting._tuned_tasks([RACE, other], {"fraction": "1", "verdict": "ahead"}) == (
        "`a` on 1 of the 2 tasks (`digits`); `b` on 1 of the 2 tasks (`digits`); "
        "`c` on 1 of the 2 tasks (`digits`)"
    )


def test_a_misspelt_option_and_a_phrase_written_as_a_block_are_refused() -> None:
    with pytest.raises(InvalidValue, match="tuned-budgets takes .* not verdcit"):
        quoting.render(ROOT, f"tuned-budgets {MNIST3} verdcit=ahead")
    with pytest.raises(InvalidValue, match="write tuned-budgets's text on the opening's line"):
        quoting.update_page(
            ROOT, f"<!-- race-quote tuned-budgets {MNIST3} verdict=ahead -->\n<!-- /race-quote -->"
        )
    with pytest.raises(InvalidValue, match="a span begins its line"):
        quoting.update_page(
            ROOT,
            f"at\n<!-- race-quote tuned-budgets {MNIST3} verdict=ahead --><!-- /race-quote -->",
        )
    with pytest.raises(InvalidValue, match="on the lines after it"):
        quoting.update_page(
            ROOT, f"<!-- race-quote tuned-decision {MNIST3} --><!-- /race-quote -->"
        )


def test_figures_match_as_written() -> None:
    facts = {
        "number": {13.238272, 0.9, 0.8, 4000.0, -12.6297},
        "ratio": {39.375},
        "fraction": {0.125},
    }
    for token in ("13", "13.2", "80%", "4,000", "−12.63", "39x", "1/8"):
        assert quoting._matches(token, facts), token
    for token in ("1", "14", "13.3", "85%", "−12.7", "93x", "40x", "1/4", "0.125x"):
        assert not quoting._matches(token, facts), token


def test_the_phrases_of_a_race_at_one_lr_and_their_refusals() -> None:
    """race-steps and race-seeds-above read a race at one lr; stopped-step a FLOPs budget."""
    steps = quoting.render(ROOT, "race-steps docs/results/race_digits estimator=sdo")
    assert re.fullmatch(r"\d+(\.\d+)? steps", steps), steps
    seeds = quoting.render(
        ROOT, "race-seeds-above docs/results/race_digits_wall estimators=sdo fractions=1"
    )
    assert re.fullmatch(r"\d+ of the 16 seeds", seeds), seeds
    several = quoting.render(
        ROOT, "race-seeds-above docs/results/race_mnist estimators=sdo,alignprop"
    )
    assert (
        several.startswith("at 2 / 4 / 6 / 8 exact steps: `sdo` ")
        and " and `alignprop` " in several
    )
    with pytest.raises(InvalidValue, match="give a race at one lr"):
        quoting.render(ROOT, f"race-steps {MNIST3} estimator=sdo")
    with pytest.raises(InvalidValue, match="no budget fraction 0.3"):
        quoting.render(
            ROOT, "race-seeds-above docs/results/race_mnist estimators=sdo fractions=0.3"
        )
    with pytest.raises(InvalidValue, match="give a race with a FLOPs budget"):
        quoting.render(ROOT, "stopped-step docs/results/race_digits_wall estimator=sdo")
    probe = quoting.render(ROOT, "stopped-step docs/results/race_digits_tuned estimator=auto")
    assert re.fullmatch(r"\d+(\.\d+)? exact steps", probe), probe
