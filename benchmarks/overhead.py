"""gradest's overhead per step, and every estimator's wall time against its FLOPs.

Usage (from the repository root)::

    python -m benchmarks.overhead                           # every section, 3 runs
    python -m benchmarks.overhead --runs 3 --repeats 9 --json overhead.json
    python -m benchmarks.overhead --sections handwritten,profile --hidden 512
    python -m benchmarks.overhead --combine a.json b.json c.json  # pool separate invocations

Sections (``--sections``, comma-separated; all by default):

* ``handwritten``: ``exact`` (``est.surrogate(...).loss.backward()``, the training path)
  against the hand-written loops of ``benchmarks/handwritten.py`` (terminal ``N=1``,
  ``N=16`` and ``N=50`` from noise, stepwise ``N=16`` on a recorded path): wall ratio,
  FLOPs ratio and the overhead per step, ``(gradest - hand-written) / N`` in microseconds;
  then the overhead split into a fixed cost per call and a cost per step (the line through
  the one-step and the 50-step overheads). Measured on the workload (a model whose forward
  takes at least 2 ms on one CPU thread; checked and printed) and on a tiny model whose
  forward takes ~0.1 ms, where the same subtraction isolates gradest's Python work from
  the model's.
* ``sd3``: ``exact`` on a new user's tiny SD3 training step (a 2-layer
  ``SD3Transformer2DModel``, LoRA, classifier-free guidance, fp32; ``benchmarks/sd3_loop.py``)
  against that user's hand-written diffusers loop, interleaved: wall ratio (target
  <= 1.03x) and the two gradients' relative difference.
* ``estimators``: every built-in estimator's wall time as a ratio to ``exact`` next to its
  FLOPs ratio to ``exact`` (terminal ``N=50`` from noise, stepwise ``N=16``), and the
  quotient ``wall ratio / FLOPs ratio`` (target <= 1.10: wall time follows FLOPs).
* ``profile``: where the time of one call goes, by cProfile, attributed to categories
  (model forward, the autograd engine's backward, finiteness checks, the surrogate's
  backward watch, RNG replay, model-call plumbing, the sampling loop, per-call setup,
  jagg's gate and routing) in microseconds per step, gradest ``exact`` beside the
  hand-written loop, and per call for ``jagg``. cProfile slows Python code down (every
  function call is timed), so the absolute numbers are larger than unprofiled ones; the
  unprofiled totals are printed beside them.
* ``state-vjp``: the cost of a state-only VJP (the adjoint's ``(dv/dz)^T a``), a parameter
  VJP and a joint VJP in units of one forward ``F``, in FLOPs and wall time, on each
  shipped model: the benchmark MLP, the embedded models of ``gradest compare`` (``mlp``,
  its default, and ``dit``) and the digits DiT of ``apps/digits`` (when installed). From
  them, terminal fused ``jagg``'s cost relative to ``exact``: ``(1 + s + n p / N) / (1 + j)``
  with ``s, p, j`` the state, parameter and joint VJP in units of ``F`` and ``n`` nodes.

Wall times are medians over interleaved rounds (``a, b, c, a, b, c, ...``) on one fixed
CPU thread; every ratio is taken inside one run, and ``--runs`` repeats each section so
the tables show the range of each ratio over the runs. FLOPs are deterministic.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gradest

if __package__ in (None, ""):  # run as a file: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sd3_loop import BATCH as SD3_BATCH  # noqa: E402
from benchmarks.sd3_loop import LORA_RANK as SD3_LORA_RANK  # noqa: E402
from benchmarks.sd3_loop import STEPS as SD3_STEPS  # noqa: E402
from benchmarks.sd3_loop import same_gradient, sd3_calls  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    ALL_STEPWISE_ESTIMATORS,
    ALL_TERMINAL_ESTIMATORS,
    NUM_THREADS,
    STEPWISE_STEPS,
    TERMINAL_STEPS,
    TINY_WORKLOAD,
    WIDE_WORKLOAD,
    Bench,
    Workload,
)
from gradest.harness import count_flops, interleaved_wall_times, ratio  # noqa: E402

HANDWRITTEN = "hand-written loop"
EXACT = "exact"
SHORT_STEPS = 16
# Wall time follows FLOPs: an estimator's wall ratio to exact at most its FLOPs ratio x this.
WALL_PER_FLOP_TARGET = 1.10
# exact (surrogate path) against the hand-written loop: at most this much slower.
HANDWRITTEN_TARGET = 1.02
# gradest's fixed cost per call (setup, checks, fingerprints) on the tiny model: at most this.
FIXED_COST_TARGET_US = 500.0
# exact on a new user's tiny SD3 step (LoRA, CFG, fp32) against that user's own loop.
SD3_TARGET = 1.03
MIN_FORWARD_MS = 2.0
TINY = TINY_WORKLOAD
SECTIONS = ("handwritten", "sd3", "estimators", "profile", "state-vjp")


# -- measuring ------------------------------------------------------------------------------


def forward_ms(bench: Bench, repeats: int = 31) -> float:
    """Median milliseconds of one no-grad forward of the workload's model on its batch."""
    t = torch.full((bench.workload.batch,), 0.5)

    def forward() -> None:
        with torch.no_grad():
            bench.model(bench.noise, t)

    return 1e3 * interleaved_wall_times({"f": forward}, repeats=repeats, warmup=3)["f"]


def interleaved_times(
    calls: dict[str, Callable[[], Any]], repeats: int, warmup: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds and median CPU seconds of this process (``time.process_time``)
    per method, in rounds ``a, b, c, a, b, c, ...`` (as
    :func:`gradest.harness.cost.interleaved_wall_times`). CPU time leaves out the time
    other processes on a shared machine take the core away; both are reported."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return (
        {name: statistics.median(v) for name, v in wall.items()},
        {name: statistics.median(v) for name, v in cpu.items()},
    )


def timed_runs(
    calls: dict[str, Callable[[], Any]], runs: int, repeats: int, warmup: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``runs`` independent interleaved measurements: per run, each method's median wall
    seconds, and its median CPU seconds."""
    measured = [interleaved_times(calls, repeats, warmup) for _ in range(runs)]
    return [wall for wall, _ in measured], [cpu for _, cpu in measured]


def span(values: list[float], fmt: str = "{:.3f}") -> str:
    """``median [min–max]`` of per-run values (one value: itself)."""
    if len(values) == 1:
        return fmt.format(values[0])
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} [{fmt.format(lo)}–{fmt.format(hi)}]"


# -- section: exact against the hand-written loop -------------------------------------------


def handwritten_settings(bench: Bench) -> dict[str, tuple[int, dict[str, Callable[[], Any]]]]:
    return {
        # One step: gradest's overhead is then its fixed cost per call and one step's.
        "terminal N=1": (
            1,
            {
                HANDWRITTEN: bench.handwritten_terminal(1),
                EXACT: bench.gradest_terminal(EXACT, 1),
            },
        ),
        f"terminal N={SHORT_STEPS}": (
            SHORT_STEPS,
            {
                HANDWRITTEN: bench.handwritten_terminal(SHORT_STEPS),
                EXACT: bench.gradest_terminal(EXACT, SHORT_STEPS),
            },
        ),
        f"terminal N={TERMINAL_STEPS}": (
            TERMINAL_STEPS,
            {
                HANDWRITTEN: bench.handwritten_terminal(TERMINAL_STEPS),
                EXACT: bench.gradest_terminal(EXACT, TERMINAL_STEPS),
            },
        ),
        f"stepwise N={STEPWISE_STEPS}": (
            STEPWISE_STEPS,
            {HANDWRITTEN: bench.handwritten_stepwise(), EXACT: bench.gradest_stepwise(EXACT)},
        ),
    }


def handwritten_section(
    benches: dict[str, Bench], runs: int, repeats: int, warmup: int
) -> list[dict[str, Any]]:
    rows = []
    for label, bench in benches.items():
        for setting, (steps, calls) in handwritten_settings(bench).items():
            flops = {name: count_flops(call) for name, call in calls.items()}
            per_run, per_run_cpu = timed_runs(calls, runs, repeats, warmup)
            rows.append(
                {
                    "model": label,
                    "setting": setting,
                    "steps": steps,
                    "hand_ms": [1e3 * r[HANDWRITTEN] for r in per_run],
                    "exact_ms": [1e3 * r[EXACT] for r in per_run],
                    "wall_ratio": [r[EXACT] / r[HANDWRITTEN] for r in per_run],
                    "cpu_ratio": [r[EXACT] / r[HANDWRITTEN] for r in per_run_cpu],
                    "overhead_us_per_step": [
                        1e6 * (r[EXACT] - r[HANDWRITTEN]) / steps for r in per_run
                    ],
                    "cpu_overhead_us_per_step": [
                        1e6 * (r[EXACT] - r[HANDWRITTEN]) / steps for r in per_run_cpu
                    ],
                    "flops_ratio": ratio(flops[EXACT], flops[HANDWRITTEN]),
                }
            )
    return rows


def handwritten_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | setting | hand-written ms | exact ms | exact / hand-written (wall) "
        "| (CPU time) | FLOPs ratio | overhead per step, us (wall) | (CPU time) "
        f"| target <= {HANDWRITTEN_TARGET:.2f}x (wall) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        worst = max(row["wall_ratio"])
        met = "met" if worst <= HANDWRITTEN_TARGET else f"missed (worst run {worst:.3f})"
        lines.append(
            f"| {row['model']} | {row['setting']} | {span(row['hand_ms'], '{:.1f}')} "
            f"| {span(row['exact_ms'], '{:.1f}')} | {span(row['wall_ratio'])} "
            f"| {span(row['cpu_ratio'])} "
            f"| {row['flops_ratio']:.3f} | {span(row['overhead_us_per_step'], '{:.0f}')} "
            f"| {span(row['cpu_overhead_us_per_step'], '{:.0f}')} "
            f"| {_verdict(row, met)} |"
        )
    return "\n".join(lines)


def _verdict(row: dict[str, Any], met: str) -> str:
    if "tiny" in row["model"]:
        return "(overhead only)"
    # A one-step call is mostly gradest's fixed cost: it has a target of its own (below).
    return "(the fixed cost: below)" if row["steps"] == 1 else met


def call_cost_markdown(rows: list[dict[str, Any]]) -> str:
    """gradest's overhead split into a fixed cost per call and a cost per step: per run, the
    line through the terminal rows' overheads (``exact - hand-written``, per call) at one
    step and at the longest chain. Each of those rows interleaves gradest with the
    hand-written loop, so the one-step row's overhead (the fixed cost and one step's) is
    measured as robustly as the ratios; the cells give the median [min–max] over runs."""
    lines = [
        "| model | overhead of a one-step call, us | fixed cost per call, us "
        f"| overhead per step, us | target: fixed <= {FIXED_COST_TARGET_US:.0f} us (tiny model) |",
        "|---|---:|---:|---:|---|",
    ]
    short, long = "terminal N=1", f"terminal N={TERMINAL_STEPS}"
    for model in dict.fromkeys(row["model"] for row in rows):
        by_setting = {row["setting"]: row for row in rows if row["model"] == model}
        if short not in by_setting or long not in by_setting:
            continue
        one, fixed, per_step = [], [], []
        shorter, longer = _call_overheads(by_setting[short]), _call_overheads(by_setting[long])
        for a, b in zip(shorter, longer, strict=True):
            slope = (b - a) / (TERMINAL_STEPS - 1)
            one.append(a)
            per_step.append(slope)
            fixed.append(a - slope)
        worst = max(fixed)
        verdict = "met" if worst <= FIXED_COST_TARGET_US else f"missed (worst run {worst:.0f})"
        lines.append(
            f"| {model} | {span(one, '{:.0f}')} | {span(fixed, '{:.0f}')} "
            f"| {span(per_step, '{:.0f}')} "
            f"| {verdict if 'tiny' in model else '(lost in the model time)'} |"
        )
    return "\n".join(lines)


def _call_overheads(row: dict[str, Any]) -> list[float]:
    """``exact - hand-written`` per call in microseconds, per run."""
    return [1e3 * (e - h) for e, h in zip(row["exact_ms"], row["hand_ms"], strict=True)]


# -- section: a new user's tiny SD3 step ---------------------------------------------------


def sd3_section(runs: int, repeats: int, warmup: int) -> dict[str, Any]:
    """exact through gradest against the hand-written diffusers loop of
    ``benchmarks/sd3_loop.py`` (2-layer SD3 transformer, LoRA, CFG, fp32), interleaved."""
    try:
        calls, parameters = sd3_calls()
    except ImportError as err:
        return {"skipped": f"needs diffusers and peft ({err})"}
    difference = same_gradient(calls, parameters)
    per_run, per_run_cpu = timed_runs(calls, runs, repeats, warmup)
    return {
        "setting": f"SD3 2 layers, LoRA rank {SD3_LORA_RANK}, CFG, fp32, N={SD3_STEPS}, "
        f"batch {SD3_BATCH}",
        "gradient_difference": difference,
        "hand_ms": [1e3 * r[HANDWRITTEN] for r in per_run],
        "exact_ms": [1e3 * r[EXACT] for r in per_run],
        "wall_ratio": [r[EXACT] / r[HANDWRITTEN] for r in per_run],
        "cpu_ratio": [r[EXACT] / r[HANDWRITTEN] for r in per_run_cpu],
    }


def sd3_markdown(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    worst = max(row["wall_ratio"])
    met = "met" if worst <= SD3_TARGET else f"missed (worst run {worst:.3f})"
    return "\n".join(
        [
            "| setting | hand-written ms | exact ms | exact / hand-written (wall) | (CPU time) "
            f"| gradients' relative difference | target <= {SD3_TARGET:.2f}x (wall) |",
            "|---|---:|---:|---:|---:|---:|---|",
            f"| {row['setting']} | {span(row['hand_ms'], '{:.1f}')} "
            f"| {span(row['exact_ms'], '{:.1f}')} | {span(row['wall_ratio'])} "
            f"| {span(row['cpu_ratio'])} | {row['gradient_difference']:.1e} | {met} |",
        ]
    )


# -- section: every estimator's wall time against its FLOPs --------------------------------


def estimator_section(bench: Bench, runs: int, repeats: int, warmup: int) -> list[dict[str, Any]]:
    settings = {
        f"terminal N={TERMINAL_STEPS}": {
            spec: bench.gradest_terminal(spec) for spec in ALL_TERMINAL_ESTIMATORS
        },
        f"stepwise N={STEPWISE_STEPS}": {
            spec: bench.gradest_stepwise(spec) for spec in ALL_STEPWISE_ESTIMATORS
        },
    }
    rows = []
    for setting, calls in settings.items():
        flops = {name: count_flops(call) for name, call in calls.items()}
        info = {name: getattr(call(), "info", {}) or {} for name, call in calls.items()}
        per_run, per_run_cpu = timed_runs(calls, runs, repeats, warmup)
        for name in calls:
            flops_ratio = ratio(flops[name], flops[EXACT])
            wall = [r[name] / r[EXACT] for r in per_run]
            cpu = [r[name] / r[EXACT] for r in per_run_cpu]
            rows.append(
                {
                    "setting": setting,
                    "method": name,
                    "ms": [1e3 * r[name] for r in per_run],
                    "wall_ratio": wall,
                    "cpu_ratio": cpu,
                    "flops_ratio": flops_ratio,
                    "wall_per_flops": [w / flops_ratio for w in wall],
                    "cpu_per_flops": [c / flops_ratio for c in cpu],
                    "fallback": info[name].get("fallback_fraction"),
                }
            )
    return rows


def estimator_markdown(rows: list[dict[str, Any]], forward_flops: int) -> str:
    lines = [
        "| setting | method | median ms | wall / exact | FLOPs / exact "
        "| (wall / exact) / (FLOPs / exact) | (CPU time) | target <= 1.10 (wall) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        worst = max(row["wall_per_flops"])
        met = "met" if worst <= WALL_PER_FLOP_TARGET else f"missed (worst run {worst:.3f})"
        note = "" if row["fallback"] is None else f"; gate fallback {row['fallback']:.0%}"
        lines.append(
            f"| {row['setting']} | {row['method']} | {span(row['ms'], '{:.1f}')} "
            f"| {span(row['wall_ratio'])} | {row['flops_ratio']:.3f} "
            f"| {span(row['wall_per_flops'])} | {span(row['cpu_per_flops'])} | {met}{note} |"
        )
    return "\n".join(lines)


# -- section: where the time goes (cProfile) ------------------------------------------------

# Categories of the profile, by file (and for some, function). Functions of no category
# (torch's Python wrappers, builtins) pass their time on to their callers.
MODEL = "model forward (module code and its ops)"
BACKWARD = "autograd engine backward (C++; model backward ops)"
CATEGORY_ORDER = (
    MODEL,
    BACKWARD,
    "loss (the benchmark's objective)",
    "hand-written loop (its own lines)",
    "finiteness checks (nonfinite.py)",
    "backward watch (surrogate NaN hooks)",
    "RNG replay (replay.py)",
    "model-call plumbing (vjp.py, locks, cond)",
    "sampling loop (trajectory.py)",
    "jagg gate and layout",
    "jagg routing of cotangents",
    "per-call setup and bookkeeping (context, base, checks, objectives)",
    "benchmark harness (zero_grad, generator)",
    "other",
)


def _category(func: tuple[str, int, str]) -> str | None:
    path, _, name = func
    path = path.replace("\\", "/")
    if path == "~":
        if "run_backward" in name:
            return BACKWARD
        return None  # a builtin: its callers' category
    if "/gradest/models/" in path or "/torch/nn/modules/" in path:
        return MODEL
    if "/benchmarks/workloads.py" in path:
        if name in ("terminal_loss", "stepwise_loss"):
            return "loss (the benchmark's objective)"
        return "benchmark harness (zero_grad, generator)"
    if "/benchmarks/handwritten.py" in path:
        return "hand-written loop (its own lines)"
    if "/gradest/nonfinite.py" in path:
        if name in ("observe", "_hook", "record", "_parameter_hook", "start", "_finish"):
            return "backward watch (surrogate NaN hooks)"
        return "finiteness checks (nonfinite.py)"
    if "/gradest/replay.py" in path:
        return "RNG replay (replay.py)"
    if any(f"/gradest/{m}" in path for m in ("vjp.py", "model_lock.py", "conditioning.py")):
        return "model-call plumbing (vjp.py, locks, cond)"
    if "/gradest/trajectory.py" in path:
        return "sampling loop (trajectory.py)"
    if "/gradest/strategies/jagg_gate.py" in path or "/gradest/strategies/jagg_layout.py" in path:
        return "jagg gate and layout"
    if "/gradest/strategies/jagg.py" in path:
        if name in ("route", "evaluated", "corrected"):
            return "jagg routing of cotangents"
        if name in ("_plan", "_layout", "<listcomp>"):
            return "jagg gate and layout"
    if "/gradest/" in path:
        return "per-call setup and bookkeeping (context, base, checks, objectives)"
    if "/torch/nn/" in path and "module.py" in path:
        return MODEL
    return None


def attribute(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per category: each function's own time goes to its category, or (no
    category) up to its callers in proportion to the time spent under each of them."""
    raw = stats.stats  # type: ignore[attr-defined]
    totals: dict[str, float] = {}

    def give(func: tuple[str, int, str], seconds: float, depth: int) -> None:
        category = _category(func)
        if category is not None:
            totals[category] = totals.get(category, 0.0) + seconds
            return
        callers = raw.get(func, (0, 0, 0.0, 0.0, {}))[4]
        weights = {c: v[3] for c, v in callers.items() if c != func}
        total = sum(weights.values())
        if depth > 40 or not weights or total <= 0:
            totals["other"] = totals.get("other", 0.0) + seconds
            return
        for caller, weight in weights.items():
            give(caller, seconds * weight / total, depth + 1)

    for func, (_, _, own, _, callers) in raw.items():
        if own <= 0:
            continue
        if _category(func) is not None:
            give(func, own, 0)
            continue
        # A function without a category: split its own time by caller (exact per caller).
        by_caller = {c: v[2] for c, v in callers.items() if c != func}
        share = sum(by_caller.values())
        if not by_caller or share <= 0:
            totals["other"] = totals.get("other", 0.0) + own
            continue
        for caller, seconds in by_caller.items():
            give(caller, own * seconds / share, 1)
    return totals


def profile_calls(
    fns: dict[str, Callable[[], Any]], calls: int, repeats: int
) -> dict[str, tuple[dict[str, float], float]]:
    """Per function: ``(seconds per category per call, unprofiled median seconds per call)``.

    Both interleaved: the unprofiled medians over ``repeats`` rounds, then ``calls`` rounds
    with each function's own profiler enabled around its call only.
    """
    plain = interleaved_wall_times(fns, repeats=repeats, warmup=2)
    profilers = {name: cProfile.Profile() for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            profilers[name].enable()
            fn()
            profilers[name].disable()
    out = {}
    for name, profiler in profilers.items():
        totals = attribute(pstats.Stats(profiler))
        out[name] = ({k: v / calls for k, v in totals.items()}, plain[name])
    return out


def profile_section(benches: dict[str, Bench], calls: int, repeats: int) -> list[dict[str, Any]]:
    """Per model: exact vs hand-written (terminal N=50, per step), and jagg (per call)."""
    out = []
    for label, bench in benches.items():
        steps = TERMINAL_STEPS
        columns = {
            HANDWRITTEN: bench.handwritten_terminal(steps),
            EXACT: bench.gradest_terminal(EXACT, steps),
        }
        profiles = profile_calls(columns, calls, repeats)
        out.append(
            {
                "model": label,
                "setting": f"terminal N={steps}, per step",
                "per": steps,
                "columns": {
                    name: {"categories": cats, "unprofiled_s": plain}
                    for name, (cats, plain) in profiles.items()
                },
            }
        )
        jagg = {
            f"jagg terminal N={steps}": bench.gradest_terminal("jagg:window=4,tau=0.9", steps),
            f"jagg stepwise N={STEPWISE_STEPS}": bench.gradest_stepwise("jagg:window=4,tau=0.9"),
            f"exact stepwise N={STEPWISE_STEPS}": bench.gradest_stepwise(EXACT),
        }
        profiles = profile_calls(jagg, calls, repeats)
        out.append(
            {
                "model": label,
                "setting": "jagg:window=4,tau=0.9, per call",
                "per": 1,
                "columns": {
                    name: {"categories": cats, "unprofiled_s": plain}
                    for name, (cats, plain) in profiles.items()
                },
            }
        )
    return out


def profile_markdown(tables: list[dict[str, Any]]) -> str:
    parts = []
    for table in tables:
        names = list(table["columns"])
        per = table["per"]
        unit = "us per step" if per > 1 else "us per call"
        header = " | ".join(names)
        lines = [
            f"{table['model']}, {table['setting']} ({unit}, cProfile):",
            "",
            f"| category | {header} |" + (" exact - hand-written |" if per > 1 else ""),
            "|---|" + "---:|" * (len(names) + (1 if per > 1 else 0)),
        ]
        for category in CATEGORY_ORDER:
            values = [table["columns"][n]["categories"].get(category, 0.0) for n in names]
            if not any(v > 0 for v in values):
                continue
            cells = " | ".join(f"{1e6 * v / per:.0f}" for v in values)
            diff = f" {1e6 * (values[-1] - values[0]) / per:+.0f} |" if per > 1 else ""
            lines.append(f"| {category} | {cells} |{diff}")
        total = [sum(table["columns"][n]["categories"].values()) for n in names]
        plain = [table["columns"][n]["unprofiled_s"] for n in names]
        diff = f" {1e6 * (total[-1] - total[0]) / per:+.0f} |" if per > 1 else ""
        lines.append(
            "| total, profiled | " + " | ".join(f"{1e6 * v / per:.0f}" for v in total) + f" |{diff}"
        )
        diff = f" {1e6 * (plain[-1] - plain[0]) / per:+.0f} |" if per > 1 else ""
        cells = " | ".join(f"{1e6 * v / per:.0f}" for v in plain)
        lines.append(f"| total, unprofiled | {cells} |{diff}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# -- section: the state VJP on each shipped model --------------------------------------------


def shipped_models(hidden: int) -> dict[str, tuple[torch.nn.Module, torch.Tensor, dict[str, Any]]]:
    """``name -> (model, noise, cond)`` in float32 (the cost ratios do not depend on it)."""
    from gradest_lab.compare.problems import embedded_problem

    models: dict[str, tuple[torch.nn.Module, torch.Tensor, dict[str, Any]]] = {}
    workload = Workload(hidden=hidden)
    models[f"benchmark MLP (hidden {hidden}, batch {workload.batch})"] = (
        workload.model(),
        workload.noise(),
        {},
    )
    for name in ("mlp", "dit"):
        problem = embedded_problem(name, steps=16, objective="terminal", batch=64)
        model = problem.model.float()
        models[f"gradest compare --model {name} (embedded, batch 64)"] = (
            model,
            problem.noise_fn(0).float(),
            problem.cond_fn(0),
        )
    try:
        from gradest_digits.assets import load_pretrained_dit
        from gradest_digits.datasets import DIGITS
    except ImportError:  # apps/digits not installed
        return models
    generator = torch.Generator().manual_seed(0)
    models["digits DiT (apps/digits, shipped weights, batch 64)"] = (
        load_pretrained_dit(),
        torch.randn(64, *DIGITS.image_shape, generator=generator),
        {},
    )
    return models


def vjp_costs(
    model: torch.nn.Module, noise: torch.Tensor, cond: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """FLOPs (units of ``F``) and wall time (units of one no-grad forward) of the backward
    of one forward with graph into the state only, the parameters only, and both."""
    params = [p for p in model.parameters() if p.requires_grad]
    t = torch.full((noise.shape[0],), 0.5, dtype=noise.dtype)
    cotangent = torch.randn_like(noise)

    def graph() -> tuple[torch.Tensor, torch.Tensor]:
        z = noise.clone().requires_grad_(True)
        return z, model(z, t, **cond)

    def forward() -> None:
        with torch.no_grad():
            model(noise, t, **cond)

    def backward(inputs: str) -> Callable[[], Any]:
        def run() -> Any:
            z, v = graph()
            targets = {"state": [z], "param": params, "joint": [z, *params]}[inputs]
            return torch.autograd.grad(v, targets, cotangent, allow_unused=True)

        return run

    kinds = ("state", "param", "joint")
    forward_flops = count_flops(forward)
    graph_flops = count_flops(graph)
    flops = {k: (count_flops(backward(k)) - graph_flops) / forward_flops for k in kinds}
    calls = {"forward": forward, "graph": graph} | {k: backward(k) for k in kinds}
    times = interleaved_wall_times(calls, repeats=repeats, warmup=2)
    return {
        "F_mflop": forward_flops / 1e6,
        "forward_ms": 1e3 * times["forward"],
        "flops": flops,
        "wall": {k: (times[k] - times["graph"]) / times["forward"] for k in kinds},
    }


FUSED_JAGG = (
    "jagg:window=4,gate=off",
    "jagg:window=8,gate=off",
    "jagg:window=4,shared_knots=true,gate=off",
)


def fused_jagg_flops(
    model: torch.nn.Module, noise: torch.Tensor, cond: dict[str, Any], steps: int = 16
) -> dict[str, float]:
    """FLOPs of terminal fused jagg over exact's, measured (``surrogate(...).loss.backward()``
    from noise, ``steps`` steps, a squared-norm terminal loss, gate off)."""
    flow = gradest.RectifiedFlow(steps=steps)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).sum())

    def flops(spec: str) -> int:
        est = gradest.estimator(spec)

        def run() -> None:
            model.zero_grad(set_to_none=True)
            generator = torch.Generator().manual_seed(0)
            sur = est.surrogate(model, flow, objective, noise=noise, cond=cond, generator=generator)
            sur.loss.backward()

        return count_flops(run)

    exact = flops(EXACT)
    return {spec: flops(spec) / exact for spec in FUSED_JAGG}


def state_vjp_section(hidden: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, (model, noise, cond) in shipped_models(hidden).items():
        row = {"model": name, **vjp_costs(model, noise, cond, repeats)}
        row["fused_jagg_measured"] = fused_jagg_flops(model, noise, cond)
        s, p, j = (row["flops"][k] for k in ("state", "param", "joint"))
        # fused terminal jagg / exact at N steps with n nodes: (1 + s + n p / N) / (1 + j)
        row.update(
            jagg_floor=(1 + s) / (1 + j),
            jagg_w4=(1 + s + p / 2) / (1 + j),
            jagg_w8=(1 + s + p / 4) / (1 + j),
        )
        rows.append(row)
    return rows


def state_vjp_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | F (MFLOP) | forward ms | state VJP / F | parameter VJP / F | joint VJP / F "
        "| state VJP / forward (wall) | fused jagg / exact, FLOPs, from s, p, j: "
        "floor (n -> 0), W=4, W=8 | measured at N=16: W=4, W=8, W=4 shared knots |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        f = row["flops"]
        measured = ", ".join(f"{row['fused_jagg_measured'][spec]:.3f}" for spec in FUSED_JAGG)
        lines.append(
            f"| {row['model']} | {row['F_mflop']:.1f} | {row['forward_ms']:.2f} "
            f"| {f['state']:.2f} | {f['param']:.2f} | {f['joint']:.2f} "
            f"| {row['wall']['state']:.2f} "
            f"| {row['jagg_floor']:.2f}, {row['jagg_w4']:.2f}, {row['jagg_w8']:.2f} "
            f"| {measured} |"
        )
    return "\n".join(lines)


def combine(paths: list[Path]) -> str:
    """The tables of several ``--json`` files with each cell's runs pooled: median
    [min–max] over every run of every file (separate processes, separate times)."""
    loaded = [json.loads(Path(p).read_text()) for p in paths]
    out = [
        f"Pooled from {len(loaded)} invocations ({', '.join(str(p) for p in paths)}): "
        f"{', '.join(d['command'] for d in loaded)}.",
        "Forward of the workload: "
        + ", ".join(f"{d['forward_ms']:.2f}" for d in loaded)
        + " ms; load average at start / end: "
        + "; ".join(
            "/".join(f"{x:.1f}" for x in d["load_average"]["start"])
            + " / "
            + "/".join(f"{x:.1f}" for x in d["load_average"]["end"])
            for d in loaded
            if "load_average" in d
        )
        + ".",
        "",
    ]

    def pooled(section: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for data in loaded:
            for row in data.get(section, []):
                key = tuple(row[k] for k in keys)
                if key not in rows:
                    rows[key] = {k: (list(v) if isinstance(v, list) else v) for k, v in row.items()}
                    continue
                for name, value in row.items():
                    if isinstance(value, list):
                        rows[key].setdefault(name, []).extend(value)
        return list(rows.values())

    if any("handwritten" in d for d in loaded):
        out += ["### exact against the hand-written loop", ""]
        rows = pooled("handwritten", ("model", "setting"))
        out += [handwritten_markdown(rows), "", call_cost_markdown(rows), ""]
    if any("estimators" in d for d in loaded):
        out += ["### Wall time against FLOPs, every estimator", ""]
        out += [estimator_markdown(pooled("estimators", ("setting", "method")), 0), ""]
    return "\n".join(out)


# -- the report -----------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), cpu
        )
    except OSError:
        pass
    return (
        f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs (nproc), Python "
        f"{platform.python_version()}, torch {torch.__version__}, "
        f"torch.set_num_threads({NUM_THREADS})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=3, help="independent runs (default 3)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per run (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls (default 1)")
    parser.add_argument(
        "--hidden",
        type=int,
        default=WIDE_WORKLOAD.hidden,
        help=f"MLP width (default {WIDE_WORKLOAD.hidden})",
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated of {SECTIONS}"
    )
    parser.add_argument("--profile-calls", type=int, default=5, help="calls per profile")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--output", type=Path, help="also write the markdown here")
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        help="print the tables of these --json files with their runs pooled, and exit",
    )
    args = parser.parse_args(argv)
    if args.combine:
        text = combine(args.combine)
        print(text)
        if args.output is not None:
            args.output.write_text(text)
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")

    load_before = os.getloadavg()
    torch.set_num_threads(NUM_THREADS)
    bench = Bench(Workload(hidden=args.hidden))
    tiny = Bench(TINY)
    fwd_ms, tiny_ms = forward_ms(bench), forward_ms(tiny)
    forward_flops = bench.forward_flops()
    label = f"MLP hidden {args.hidden}"
    command = "python -m benchmarks.overhead" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    out: list[str] = [
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `{command}`",
        f"on {machine()}.",
        f"Workload: {bench.workload.description()}; F = {forward_flops / 1e6:.0f} MFLOP, "
        f"forward {fwd_ms:.2f} ms (no grad, median of 31; "
        f"{'>=' if fwd_ms >= MIN_FORWARD_MS else 'BELOW'} {MIN_FORWARD_MS:g} ms). Tiny model: "
        f"{tiny.workload.description()}, forward {tiny_ms:.3f} ms. {args.runs} run(s) of "
        f"{args.repeats} interleaved rounds; cells are median [min–max] over the runs.",
        "",
    ]
    results: dict[str, Any] = {
        "command": command,
        "machine": machine(),
        "workload": bench.workload.description(),
        "forward_ms": fwd_ms,
        "tiny_forward_ms": tiny_ms,
    }
    if "handwritten" in sections:
        rows = handwritten_section(
            {label: bench, "tiny MLP (hidden 32, batch 8)": tiny},
            args.runs,
            args.repeats,
            args.warmup,
        )
        results["handwritten"] = rows
        out += ["### exact against the hand-written loop", "", handwritten_markdown(rows), ""]
        out += [call_cost_markdown(rows), ""]
        print("\n".join(out[-4:]), flush=True)
    if "sd3" in sections:
        row = sd3_section(args.runs, args.repeats, args.warmup)
        results["sd3"] = row
        out += [
            "### exact on a tiny SD3 step against its hand-written loop",
            "",
            sd3_markdown(row),
            "",
        ]
        print("\n".join(out[-4:]), flush=True)
    if "estimators" in sections:
        rows = estimator_section(bench, args.runs, args.repeats, args.warmup)
        results["estimators"] = rows
        out += [
            "### Wall time against FLOPs, every estimator",
            "",
            estimator_markdown(rows, forward_flops),
            "",
        ]
        print("\n".join(out[-4:]), flush=True)
    if "profile" in sections:
        tables = profile_section(
            {label: bench, "tiny MLP (hidden 32, batch 8)": tiny}, args.profile_calls, args.repeats
        )
        results["profile"] = tables
        out += ["### Where the time goes", "", profile_markdown(tables), ""]
        print("\n".join(out[-4:]), flush=True)
    if "state-vjp" in sections:
        rows = state_vjp_section(args.hidden, max(args.repeats, 5))
        results["state_vjp"] = rows
        out += ["### The state VJP on each shipped model", "", state_vjp_markdown(rows), ""]
        print("\n".join(out[-4:]), flush=True)
    load_after = os.getloadavg()
    results["load_average"] = {"start": load_before, "end": load_after}
    out.insert(
        3,
        f"Load average (1/5/15 min; 2 cores, other jobs share the machine): "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in load_after)} at the end.",
    )
    text = "\n".join(out)
    if args.output is not None:
        args.output.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=_jsonable))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
