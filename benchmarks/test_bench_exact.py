"""gradest ``exact`` against the loops a user would write by hand (``benchmarks/handwritten.py``).

Target: at most 3% wall-time overhead for ``est.surrogate(...).loss.backward()``
(speedup >= 0.97x against the hand-written loop) with identical FLOPs (pinned in
``tests/test_cost_model.py``). ``estimate()`` with the autograd and the torch.func
engines is measured beside it.
"""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_gradest_exact_terminal_estimate_engines(bench, measure, engine):
    measure(
        bench.gradest_terminal("exact", TERMINAL_STEPS, path=engine),
        group=TERMINAL,
        method=f"gradest exact, estimate() {engine}",
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
