"""``gradest check``'s output: stdout is the table alone, in rows of at most 100 columns
that name each estimator by its spec string (``auto``, not the repr of all its options);
the progress bar is on stderr, and only on a terminal."""

from __future__ import annotations

import io
import subprocess
import sys

from gradest import check

# auto's repr alone was 300+ characters; the longest pinned spec is 34.
SPECS = ["auto", "telescope:mean_depth=3,min_depth=2", "sdo"]
BAR = ("\r", "it/s", "\u2588", "%|")  # what a tqdm frame holds


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm shows its bar only on one)."""

    def isatty(self) -> bool:
        return True


def assert_table_only(out: str) -> None:
    assert not any(mark in out for mark in BAR), out
    long = [line for line in out.splitlines() if len(line) > check.WIDTH]
    assert not long, long
    lines = out.splitlines()
    for spec in SPECS:
        assert spec in lines  # the spec string on a line of its own
    assert "Auto(" not in out and "Telescope(" not in out


def test_rows_fit_100_columns_and_the_bar_goes_to_stderr(capsys, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert check.run_check(SPECS, steps=8, show_progress=True)
    out = capsys.readouterr().out
    assert_table_only(out)
    assert "gradest check" in terminal.getvalue() and "\r" in terminal.getvalue()  # the bar
    under_auto = out.splitlines()[out.splitlines().index("auto") + 1].split()
    assert under_auto[0] == "terminal" and under_auto[1] == "n/a"


def test_redirected_stdout_holds_the_table_alone():
    done = subprocess.run(
        [sys.executable, "-m", "gradest.cli", "check", "--estimators", ",".join(SPECS)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert_table_only(done.stdout)
    assert done.stdout.rstrip().endswith("match the definitions they define")
    assert not any(mark in done.stderr for mark in BAR)  # no terminal: no bar at all
