"""gradest ``exact`` against the loops a user would write by hand (``benchmarks/handwritten.py``).

Target of the issue: at most 5% wall-time overhead (speedup >= 0.95x against the
hand-written loop) with identical FLOPs (pinned in ``tests/test_cost_model.py``).
"""

from __future__ import annotations

TERMINAL_STEPS = 16
TERMINAL = f"terminal N={TERMINAL_STEPS}: exact vs by hand"
STEPWISE = "stepwise N=16: exact vs by hand"
HANDWRITTEN = "hand-written loop"


def test_handwritten_bptt_terminal(bench, measure):
    measure(
        bench.handwritten_terminal(TERMINAL_STEPS),
        group=TERMINAL,
        method=HANDWRITTEN,
        baseline=HANDWRITTEN,
    )


def test_gradest_exact_terminal(bench, measure):
    measure(
        bench.gradest_terminal("exact", TERMINAL_STEPS),
        group=TERMINAL,
        method="gradest exact",
        baseline=HANDWRITTEN,
    )


def test_handwritten_stepwise(bench, measure):
    measure(bench.handwritten_stepwise(), group=STEPWISE, method=HANDWRITTEN, baseline=HANDWRITTEN)


def test_gradest_exact_stepwise(bench, measure):
    measure(
        bench.gradest_stepwise("exact"),
        group=STEPWISE,
        method="gradest exact",
        baseline=HANDWRITTEN,
    )
