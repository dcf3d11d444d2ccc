"""Each built-in estimator's docstring says when to use it and when not, and cites its
source: a user choosing between them reads that first (``gradest list`` shows the summary
line, the API reference the rest)."""

from __future__ import annotations

import inspect
import re

import pytest

from gradest.registry import builtin_estimators

BUILTINS = sorted(builtin_estimators().items())


@pytest.mark.parametrize(("name", "cls"), BUILTINS, ids=[name for name, _ in BUILTINS])
def test_the_docstring_says_when_to_use_it_and_cites_its_source(name, cls):
    doc = inspect.getdoc(cls) or ""
    summary, _, rest = doc.partition("\n\n")
    assert summary and "\n" not in summary.strip(), f"{name}: a one-line summary first"
    opening = " ".join(rest.split("\n\n")[0].split())
    assert opening.startswith("Preferred "), f"{name}: the second paragraph says when to use it"
    assert "Not recommended" in opening, f"{name}: ... and when not"
    assert re.search(r"Source: .*arXiv \d{4}\.\d{4,5}", " ".join(doc.split())), (
        f"{name}: cite the source with its arXiv id"
    )


def test_every_built_in_is_covered():
    assert {name for name, _ in BUILTINS} >= {
        "exact", "jagg", "sdo", "drtune", "truncated", "alignprop", "telescope", "draft_lv",
        "refl",
    }  # fmt: skip
