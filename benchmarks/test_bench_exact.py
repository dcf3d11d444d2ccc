"""gradest ``exact`` against the loops a user would write by hand (``benchmarks/handwritten.py``).

Target: at most 3% wall-time overhead for ``est.surrogate(...).loss.backward()``
(exact / hand-written <= 1.03, terminal N=16 and N=50, stepwise N=16) with identical FLOPs
(pinned in ``tests/test_cost_model.py``). ``estimate()`` with the autograd and the
torch.func engines is measured beside it. The summary's ``us/step`` column is the
overhead per step, ``(gradest - hand-written) / N``; ``python -m benchmarks.overhead``
measures the same interleaved, with a profile of where it goes.
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


# Terminal N=50, and the overhead per step ((gradest - hand-written) / N, in the summary's
# us/step column) on the MLP whose forward takes >= 2 ms and on the overhead-dominated
# tiny MLP.

OVERHEAD_SETTINGS = [("terminal", 16), ("terminal", 50), ("stepwise", 16)]


def _calls(bench, kind: str, steps: int):
    if kind == "terminal":
        return bench.handwritten_terminal(steps), bench.gradest_terminal("exact", steps)
    return bench.handwritten_stepwise(), bench.gradest_stepwise("exact")


@pytest.mark.parametrize("workload", ["bench", "bench_wide", "bench_tiny"])
@pytest.mark.parametrize(("kind", "steps"), OVERHEAD_SETTINGS)
@pytest.mark.parametrize("method", [HANDWRITTEN, "gradest exact"])  # every hand-written first
def test_exact_overhead_per_step(request, measure, workload, kind, steps, method):
    if workload == "bench" and (kind, steps) != ("terminal", 50):
        pytest.skip("the 512-wide MLP's N=16 settings are the groups above")
    bench = request.getfixturevalue(workload)
    hand, exact = _calls(bench, kind, steps)
    measure(
        hand if method == HANDWRITTEN else exact,
        group=f"{workload} {kind} N={steps}: exact vs by hand",
        method=method,
        baseline=HANDWRITTEN,
        steps=0 if method == HANDWRITTEN else steps,
    )
