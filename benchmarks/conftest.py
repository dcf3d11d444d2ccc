"""pytest-benchmark setup: one workload per session, fixed threads, a speedup table at the end.

Run with ``python -m pytest benchmarks --benchmark-only`` (``GRADEST_BENCH_ROUNDS=N``
sets the timed rounds per benchmark, default 5). Wall-time speedups, the quotient
``(wall ratio) / (FLOPs ratio)`` and, against a hand-written loop, the overhead per step
in microseconds are recorded in each benchmark's ``extra_info`` and printed as a table;
they are never asserted, because a shared machine makes timed asserts flaky. pytest-
benchmark times one benchmark after the other; ``python -m benchmarks.overhead`` and
``python -m benchmarks.report`` interleave the methods of a setting, which a busy machine
needs for ratios of a few percent. ``tests/test_cost_model.py`` pins the
deterministic costs (FLOPs, retained activation bytes) instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# ``benchmarks`` is a plain folder, not an installed package; make ``benchmarks.*``
# importable however pytest was started.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.workloads import (  # noqa: E402
    NUM_THREADS,
    SPEEDUP_TARGETS,
    TINY_WORKLOAD,
    WIDE_WORKLOAD,
    Bench,
    DiTWorkload,
    Workload,
    target_of,
)
from gradest.harness.cost import count_flops, ratio, retained_activation_bytes  # noqa: E402

ROUNDS = int(os.environ.get("GRADEST_BENCH_ROUNDS", "5"))

# group -> method -> {"median_s", "flops", "retained_bytes", "baseline"}, for the summary.
_RESULTS: dict[str, dict[str, dict[str, Any]]] = {}


@pytest.fixture(scope="session")
def bench() -> Bench:
    previous = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield Bench()
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def bench_dit() -> Bench:
    previous = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield Bench(DiTWorkload())
    torch.set_num_threads(previous)


def _bench_of(workload: Workload) -> Bench:
    previous = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield Bench(workload)
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def bench_wide() -> Bench:
    """The MLP whose forward takes >= 2 ms on one thread (``WIDE_WORKLOAD``)."""
    yield from _bench_of(WIDE_WORKLOAD)


@pytest.fixture(scope="session")
def bench_tiny() -> Bench:
    """The overhead-dominated MLP (``TINY_WORKLOAD``, forward ~0.1 ms)."""
    yield from _bench_of(TINY_WORKLOAD)


@pytest.fixture
def measure(benchmark) -> Callable[..., None]:
    """Time ``fn`` with pytest-benchmark and record its costs next to its group's baseline.

    ``measure(fn, group=..., method=..., baseline=...)``: ``baseline`` names the method in
    the same group the ratios are taken against (measured earlier in the session).
    """

    def run(
        fn: Callable[[], Any], *, group: str, method: str, baseline: str, steps: int = 0
    ) -> None:
        benchmark.group = group
        flops = count_flops(fn)
        retained = retained_activation_bytes(fn)
        benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1, iterations=1)
        stats = getattr(benchmark, "stats", None)
        median = stats.stats.median if stats is not None else float("nan")
        row = {"median_s": median, "flops": flops, "retained_bytes": retained}
        _RESULTS.setdefault(group, {})[method] = {**row, "baseline": baseline}
        base = _RESULTS[group].get(baseline)
        benchmark.extra_info.update(method=method, baseline=baseline, **row)
        if base is not None:
            flops_ratio = ratio(flops, base["flops"])
            benchmark.extra_info.update(
                speedup=ratio(base["median_s"], median),
                flops_ratio=flops_ratio,
                # wall time follows FLOPs: (wall ratio) / (FLOPs ratio), target <= 1.10
                wall_per_flops=ratio(ratio(median, base["median_s"]), flops_ratio),
                retained_bytes_ratio=ratio(retained, base["retained_bytes"]),
            )
            if steps:
                # gradest's overhead per step over the baseline (a hand-written loop)
                overhead = 1e6 * (median - base["median_s"]) / steps
                benchmark.extra_info.update(overhead_us_per_step=overhead)
                _RESULTS[group][method]["overhead_us_per_step"] = overhead

    return run


def pytest_terminal_summary(terminalreporter) -> None:
    if not _RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("gradest benchmark ratios to each group's baseline (speedup = baseline / median time)")
    write(
        f"{'group':<36} {'method':<42} {'baseline':<18} {'ms':>8} {'speedup':>8} {'target':>7} "
        f"{'FLOPs':>6} {'bytes':>6} {'wall/FLOPs':>10} {'us/step':>8}"
    )
    for group, rows in _RESULTS.items():
        for method, row in rows.items():
            baseline = rows.get(row["baseline"])
            if baseline is None:
                continue
            target = target_of(SPEEDUP_TARGETS, group, method)
            flops_ratio = ratio(row["flops"], baseline["flops"])
            wall_per_flops = ratio(ratio(row["median_s"], baseline["median_s"]), flops_ratio)
            overhead = row.get("overhead_us_per_step")
            write(
                f"{group:<36} {method:<42} {row['baseline']:<18} {1e3 * row['median_s']:>8.1f} "
                f"{ratio(baseline['median_s'], row['median_s']):>7.2f}x "
                f"{(f'{target:.2f}x' if target else ''):>7} "
                f"{flops_ratio:>6.3f} "
                f"{ratio(row['retained_bytes'], baseline['retained_bytes']):>6.3f} "
                f"{wall_per_flops:>10.3f} "
                f"{(f'{overhead:.0f}' if overhead is not None else ''):>8}"
            )
