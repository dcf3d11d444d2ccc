"""Measure every benchmark ratio in one process and print a markdown table.

Usage (from the repository root)::

    python -m benchmarks.report                  # 7 interleaved repeats per group
    python -m benchmarks.report --repeats 3      # quicker, noisier
    python -m benchmarks.report --output docs/benchmarks-latest.md

For each setting, every method is timed in interleaved rounds (``a, b, c, a, b, c, ...``)
so load drifts on a shared machine hit all of them alike; the table gives median wall
times and their ratios to gradest ``exact`` and to the hand-written loop of
``benchmarks/handwritten.py``, next to the deterministic FLOPs and retained activation
bytes (``gradest.harness.cost``). Every estimator row is the training path,
``est.surrogate(...).loss.backward()``; ``exact`` also runs through ``estimate()`` with
the autograd and the torch.func engines, side by side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.overhead import forward_ms, machine  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    FLOPS_TARGETS,
    NUM_THREADS,
    SPEEDUP_TARGETS,
    STEPWISE_ESTIMATORS,
    STEPWISE_STEPS,
    TERMINAL_ESTIMATORS,
    TERMINAL_STEPS,
    Bench,
    target_of,
)
from gradest.harness.cost import (  # noqa: E402
    count_flops,
    interleaved_wall_times,
    ratio,
    retained_activation_bytes,
)

HANDWRITTEN = "hand-written loop"
EXACT = "exact"  # through est.surrogate(...).loss.backward(), like every estimator row
EXACT_AUTOGRAD = "exact, estimate() autograd engine"
EXACT_FUNC = "exact, estimate() torch.func engine"
OVERHEAD_STEPS = 16


@dataclass
class Row:
    """One method of one setting, with its measurements."""

    method: str
    seconds: float
    flops: int
    retained_bytes: int
    result: Any


def measure_setting(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> list[Row]:
    times = interleaved_wall_times(calls, repeats=repeats, warmup=warmup)
    return [
        Row(name, times[name], count_flops(call), retained_activation_bytes(call), call())
        for name, call in calls.items()
    ]


def _exact_paths(make: Callable[..., Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """``exact`` three ways: the surrogate loss (the training path, the reference of the
    ratios), and ``estimate()`` with the autograd and the torch.func engines."""
    return {
        EXACT: make(EXACT, path="surrogate"),
        EXACT_AUTOGRAD: make(EXACT, path="autograd"),
        EXACT_FUNC: make(EXACT, path="func"),
    }


def settings(bench: Bench) -> dict[str, dict[str, Callable[[], Any]]]:
    def terminal(steps: int) -> Callable[..., Callable[[], Any]]:
        return lambda spec, path="surrogate": bench.gradest_terminal(spec, steps, path=path)

    return {
        f"terminal, N={OVERHEAD_STEPS}, from noise": {
            HANDWRITTEN: bench.handwritten_terminal(OVERHEAD_STEPS),
            **_exact_paths(terminal(OVERHEAD_STEPS)),
        },
        f"stepwise, N={STEPWISE_STEPS}, recorded path": {
            HANDWRITTEN: bench.handwritten_stepwise(),
            **_exact_paths(bench.gradest_stepwise),
            **{spec: bench.gradest_stepwise(spec) for spec in STEPWISE_ESTIMATORS[1:]},
        },
        f"terminal, N={TERMINAL_STEPS}, from noise": {
            HANDWRITTEN: bench.handwritten_terminal(TERMINAL_STEPS),
            **_exact_paths(terminal(TERMINAL_STEPS)),
            **{spec: bench.gradest_terminal(spec) for spec in TERMINAL_ESTIMATORS[1:]},
        },
    }


def _notes(row: Row, setting: str, steps: int, exact: Row) -> str:
    notes = []
    target = target_of(SPEEDUP_TARGETS, setting, row.method)
    if target is not None:
        notes.append(f"target >= {target:g}x")
    flops_target = target_of(FLOPS_TARGETS, setting, row.method)
    if flops_target is not None:
        share = ratio(row.flops, exact.flops)
        met = "met" if share <= flops_target else "missed"
        notes.append(f"FLOPs target <= {flops_target:g} ({met})")
    if row.method == EXACT:
        notes.append("target: <= 3% slower than by hand, same FLOPs")
    if row.method.startswith("sdo"):
        bound = 1.1 / steps
        share = ratio(row.retained_bytes, exact.retained_bytes)
        notes.append(f"bytes target <= {bound:.3f} ({'met' if share <= bound else 'missed'})")
    info = getattr(row.result, "info", {}) or {}
    if "fallback_fraction" in info:
        notes.append(f"gate fallback {info['fallback_fraction']:.0%}")
    return "; ".join(notes)


def markdown(results: dict[str, list[Row]], forward_flops: int) -> str:
    lines = [
        "| setting | method | median ms | speedup vs exact | speedup vs by hand "
        "| FLOPs (F) | FLOPs / exact | retained MB | bytes / exact | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for setting, rows in results.items():
        by_name = {row.method: row for row in rows}
        exact, hand = by_name[EXACT], by_name[HANDWRITTEN]
        steps = int(setting.split("N=")[1].split(",")[0])
        for row in rows:
            lines.append(
                f"| {setting} | {row.method} | {1e3 * row.seconds:.1f} "
                f"| {ratio(exact.seconds, row.seconds):.2f}x "
                f"| {ratio(hand.seconds, row.seconds):.2f}x "
                f"| {row.flops / forward_flops:.1f} "
                f"| {ratio(row.flops, exact.flops):.3f} "
                f"| {row.retained_bytes / 2**20:.1f} "
                f"| {ratio(row.retained_bytes, exact.retained_bytes):.3f} "
                f"| {_notes(row, setting, steps, exact)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls (default 1)")
    parser.add_argument("--output", type=Path, help="also write the markdown to this file")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    torch.set_num_threads(NUM_THREADS)
    bench = Bench()
    forward_flops = bench.forward_flops()
    forward = forward_ms(bench)
    results = {
        name: measure_setting(calls, args.repeats, args.warmup)
        for name, calls in settings(bench).items()
    }
    command = "python -m benchmarks.report" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = "\n".join(
        [
            f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `{command}`",
            f"on {machine()}.",
            f"Workload: {bench.workload.description()}; F = one forward = "
            f"{forward_flops / 1e6:.0f} MFLOP, {forward:.2f} ms (no grad, median of 31); "
            f"median of {args.repeats} interleaved rounds. Load average (1/5/15 min): "
            f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start, "
            f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the end.",
            "",
            markdown(results, forward_flops),
            "",
        ]
    )
    print(text)
    if args.output is not None:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
