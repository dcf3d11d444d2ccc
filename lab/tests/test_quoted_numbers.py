"""Every race number README.md and docs/*.md quote comes from the committed reports
(gradest_lab.race.quoting): generated blocks and spans equal what their reports give, and
outside them a section about a race holds only numbers its reports hold as settings
(test_prose_figures.py edits those). A number edited by hand fails here, whatever its
formatting (bold, signed, in a table or in prose)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gradest_lab.race import quoting

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The pages that present results: they quote races, so their race sections say in words
# what the generated tables show (docs/harness.md's race section documents the command).
RESULT_PAGES = {"README.md", "results.md", "estimators.md"}
RACE_FIGURE = re.compile(r"[−+-]\d+\.\d+ \[[−+-]?\d+\.\d+, [−+-]?\d+\.\d+\]")


def _problems(text: str) -> list[str]:
    return quoting.page_problems(ROOT, text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_race_numbers_are_the_reports(page: Path) -> None:
    assert _problems(page.read_text(encoding="utf-8")) == []


def test_the_pages_that_present_results_quote_races() -> None:
    """The figure rule holds on the pages that quote races: the results pages do."""
    for name in RESULT_PAGES:
        page = ROOT / name if name == "README.md" else ROOT / "docs" / name
        assert quoting._BLOCK.search(page.read_text(encoding="utf-8")), name


def test_the_headline_is_generated() -> None:
    """README.md's one race figure is the generated headline (the long-horizon race); the
    decision and time tables of it and of the short-horizon race are docs/results.md's,
    generated too."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- race-quote tuned-headline docs/results/race_relabel_tuned" in readme
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    for race in ("race_relabel_tuned", "race_digits_tuned"):
        assert f"<!-- race-quote tuned-decision docs/results/{race} -->" in results
        assert f"<!-- race-quote tuned-time docs/results/{race} -->" in results


def test_no_interval_stands_in_prose_outside_a_generated_block() -> None:
    """A difference with its interval (``+0.71 [+0.64, +0.77]``) in a sentence is a race
    figure wherever it stands (the gate study quoting a race, say): none is left outside
    the generated blocks. Tables outside race sections are benchmarks' own (their seed
    ranges look alike); race sections are held by ``stray_figures``."""
    for page in PAGES:
        text = quoting._BLOCK.sub("", page.read_text(encoding="utf-8"))
        prose = [line for line in text.splitlines() if not line.lstrip().startswith("|")]
        assert not RACE_FIGURE.findall("\n".join(prose)), page.name


def test_a_figure_written_into_race_prose_fails() -> None:
    page = "## The race\n\nsdo ended +0.71 above exact (`jagg:window=4,tau=0.9` aside).\n"
    assert quoting.stray_figures(page) == ["+0.71 under '## The race'"]
    assert quoting.stray_figures(page.replace("+0.71", "**+0.91**")) == [
        "+0.91 under '## The race'"
    ]
    assert quoting.stray_figures("## Setup\n\nlr 2.5e-4, 16 seeds.\n") == []


BLOCKS = [
    (page, match)
    for page in PAGES
    for match in quoting._BLOCK.finditer(page.read_text(encoding="utf-8"))
]


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """Each block's text as its report gives it, rendered once for the edits below."""
    return {}


@pytest.mark.parametrize(
    ("page", "match"), BLOCKS, ids=[f"{p.name}:{m['args'][:40]}" for p, m in BLOCKS]
)
def test_a_number_edited_by_hand_inside_a_block_fails(
    page: Path, match: re.Match[str], rendered: dict[str, str], monkeypatch
) -> None:
    """Changing a digit of a block's first decimal number (or, in a block of counts, its
    first count), plain or in bold, is caught."""
    real_render = quoting.render

    def render_once(root: Path, args: str) -> str:
        if args not in rendered:
            rendered[args] = real_render(root, args)
        return rendered[args]

    monkeypatch.setattr(quoting, "render", render_once)
    text = page.read_text(encoding="utf-8")
    body_start, body = match.start("body"), match["body"]
    # The first decimal figure; a block of counts only (the tally) has its first count.
    numbers = list(quoting._NUMBER.finditer(body))
    number = next((n for n in numbers if "." in n.group()), numbers[0] if numbers else None)
    if number is None:
        # A phrase that holds no number ("no budget", "none"): given one, it fails.
        changed = text[:body_start] + "1 exact step" + text[body_start + len(body) :]
        assert _problems(changed), f"{page.name}: {body!r} -> '1 exact step' passed"
        return
    token = number.group()
    digits = token.rstrip("%")
    edited = digits[:-1] + str((int(digits[-1]) + 3) % 10) + token[len(digits) :]
    for replacement in (edited, f"**{edited}**"):
        start = body_start + number.start()
        changed = text[:start] + replacement + text[start + len(token) :]
        assert _problems(changed), f"{page.name}: {token} -> {replacement} passed"


def test_the_command_fails_on_an_edited_page(tmp_path: Path) -> None:
    """``python -m gradest_lab.race.quoting --check`` itself: 0 on the page as committed, 1
    on a copy with one generated figure changed, and without --check it writes it back."""
    page = ROOT / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(page.read_text(encoding="utf-8"), encoding="utf-8")
    assert quoting.main([str(copy), "--root", str(ROOT), "--check"]) == 0
    # The first generated text holding a decimal figure (the headline; a span may come first).
    number, match = next(
        (n, m)
        for m in quoting._BLOCK.finditer(copy.read_text(encoding="utf-8"))
        for n in quoting._NUMBER.finditer(m["body"])
        if "." in n.group()
    )
    start = match.start("body") + number.start()
    text = copy.read_text(encoding="utf-8")
    other = "8" if text[start] == "9" else "9"
    copy.write_text(text[:start] + other + text[start + 1 :], encoding="utf-8")
    assert quoting.main([str(copy), "--root", str(ROOT), "--check"]) == 1
    assert quoting.main([str(copy), "--root", str(ROOT)]) == 0
    assert copy.read_text(encoding="utf-8") == page.read_text(encoding="utf-8")
