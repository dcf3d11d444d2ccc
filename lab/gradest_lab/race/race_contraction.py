"""SDO's falsifier on a raced task: how much of a perturbation of ``z_k`` reaches ``z_N``.

The one-step estimators (``sdo``, ``drtune``) drop the products ``dz_N/dz_k = A_{N-1} ...
A_k`` that carry a step's perturbation to the sample; SDO's error bound assumes they shrink
(the chain contracts). :func:`gradest.harness.chain_contraction` measures their operator
norm on a recorded trajectory. This module measures it on a tuned race's task, at the
pretrained weights and at the weights ``exact`` reaches in the race's budget (its lr
chosen for the full budget, on the first tuning seed), and writes ``contraction.json``
into the race folder beside the report, so that the pages can set it against where the
one-step estimators were ahead of exact or behind it (:func:`contraction_table`). On a
terminal task it also measures the one-step cotangents' error for the task's own reward
(:func:`gradest.harness.one_step_cotangent_error`): how far ``dz_N/dz_k``, applied to the
reward's ``a_N``, is from what the one-step estimators put in its place.

``python -m gradest_lab.race.race_contraction FOLDER [FOLDER ...]``: measure each folder
(a few seconds to a minute per task on a CPU); a folder measured already is skipped unless
``--again``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gradest import GradestError, InvalidValue, TerminalObjective, rollout
from gradest_lab.storage.files import atomic_write_text, read_json

__all__ = ["CONTRACTION_FILE", "contraction_table", "measure_race_contraction"]

CONTRACTION_FILE = "contraction.json"
# /2 added the one-step cotangents' error (a /1 file is measured again).
CONTRACTION_SCHEMA = "gradest.race-contraction/2"
# Samples whose chains are measured (each its own chain) and power iterations per step.
_SAMPLES = 16
_ITERS = 8


def _trajectory(task: Any, model: torch.nn.Module, sampler: Any, samples: int) -> Any:
    """The chain the estimators differentiate and its objective: the task's first training
    batch's (its noise rolled out by ``model``, or the recorded trajectory of a stepwise
    task), as ``(trajectory, cond, objective)``."""
    problem = task.step_problem(model, sampler, torch.Generator().manual_seed(0), 0)
    cond = problem.inputs.get("cond")
    if "trajectory" in problem.inputs:
        return problem.inputs["trajectory"], cond, problem.objective
    noise = problem.inputs["noise"][:samples]
    cond = None if cond is None else {k: v[:samples] for k, v in cond.items()}
    with torch.no_grad():
        return rollout(model, sampler, noise, cond), cond, problem.objective


def _measure(task: Any, model: torch.nn.Module, samples: int) -> dict[str, Any]:
    from gradest.harness import chain_contraction, one_step_cotangent_error

    sampler = task.sampler()
    model.eval()
    trajectory, cond, objective = _trajectory(task, model, sampler, samples)
    found = chain_contraction(
        model, sampler, trajectory, cond, iters=_ITERS, generator=torch.Generator().manual_seed(0)
    )
    summary = found.summary()
    norms = found.norms.clamp_min(1e-300)
    # One number per model: the geometric mean over steps and samples of ||dz_N/dz_k||.
    summary["geometric_mean"] = float(norms.log().mean().exp())
    # A stepwise objective's one-step cotangents are its exact ones: nothing to measure.
    summary["one_step_error"] = (
        one_step_cotangent_error(model, sampler, trajectory, objective, cond).summary()
        if isinstance(objective, TerminalObjective)
        else None
    )
    return summary


def measure_race_contraction(
    folder: str | os.PathLike[str], *, samples: int = _SAMPLES, again: bool = False
) -> dict[str, Any]:
    """Measure the chain's contraction on the tuned race ``folder``'s task (module
    docstring) and write it to ``contraction.json`` there; returns what was written."""
    from gradest_lab.race.plain_race import _Race, measure_budget
    from gradest_lab.race.rerun import race_task
    from gradest_lab.race.tuned_race import TunedRaceReport, _NoBar

    folder = Path(folder)
    path = folder / CONTRACTION_FILE
    report = TunedRaceReport.load(folder)
    if path.is_file() and not again:
        data = read_json(path, what="a race's contraction")
        chosen = report.choices()["exact"]["by_fraction"][-1]
        same = data.get("identity") == report.config["identity"]
        same = same and data.get("schema") == CONTRACTION_SCHEMA
        asked = data.get("samples_asked")
        if same and data["fine_tuned"]["lr"] == chosen and asked == samples:
            return data

    settings = read_json(folder / "race.json", what="a tuned race's settings")
    task = race_task(settings)
    config = report.config
    lr = report.choices()["exact"]["by_fraction"][-1]
    seed = config["tune_seeds"][0]
    measured = measure_budget(task, "exact_steps", float(config["budget_given"]["value"]))
    race = _Race(
        task=task,
        kind="flops",
        budget=measured.budget,
        fractions=[1.0],
        flops_per_unit=measured.flops_per_unit,
        state_path=None,
        bar=_NoBar(),
    )
    run = race.new_run("exact", seed, measured.pretrained, lr=lr)
    race.finish(run, task.sampler())
    pretrained = _measure(task, measured.pretrained, samples)
    data = {
        "schema": CONTRACTION_SCHEMA,
        "identity": config["identity"],
        # As measured: the task's batch may hold fewer than asked for.
        "samples": pretrained["samples"],
        "samples_asked": samples,
        "iters": _ITERS,
        "pretrained": pretrained,
        "fine_tuned": {
            "spec": "exact",
            "lr": lr,
            "seed": seed,
            "budget_exact_steps": config["budget_exact_steps"],
            **_measure(task, run.model, samples),
        },
    }
    atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
    return data


def contraction_table(
    reports: Sequence[Any], labels: Sequence[str], folders: Sequence[Path]
) -> list[str]:
    """Per race: the chain's contraction (geometric mean of ``||dz_N/dz_k||`` over steps
    and samples) and the one-step cotangents' relative error and cosine (means over steps
    and samples; "stepwise" where the objective hands them their exact cotangents) at the
    pretrained and fine-tuned weights, beside the one-step estimators' verdicts against
    exact at half and all of the budget. The lines of a markdown table."""
    from gradest_lab.race.verdicts import row_verdicts

    one_step = ("sdo", "drtune")
    lines = [
        "| task | steps N | contraction, pretrained | contraction, fine-tuned | "
        "one-step cotangent error (cosine), pretrained / fine-tuned | "
        + " | ".join(f"`{s}` at 50% / 100% of the budget" for s in one_step)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(one_step),
    ]
    for report, label, folder in zip(reports, labels, folders, strict=True):
        path = folder / CONTRACTION_FILE
        if not path.is_file():
            raise InvalidValue(
                f"{folder}: no {CONTRACTION_FILE}; measure it with python -m "
                f"gradest_lab.race.race_contraction {folder}"
            )
        data = read_json(path, what="a race's contraction")
        if data.get("identity") != report.config["identity"]:
            raise InvalidValue(f"{path}: measured on another race (its identity differs)")
        if data.get("schema") != CONTRACTION_SCHEMA:
            raise InvalidValue(
                f"{path}: written as {data.get('schema')!r}, before the one-step cotangents' "
                f"error was measured; measure again with python -m "
                f"gradest_lab.race.race_contraction --again {folder}"
            )
        chosen = report.choices()["exact"]["by_fraction"][-1]
        if data["fine_tuned"]["lr"] != chosen:
            raise InvalidValue(
                f"{path}: fine-tuned at lr {data['fine_tuned']['lr']:g}, but exact's lr for "
                f"the full budget is now {chosen:g}; measure again with --again"
            )
        decision = {row["fraction"]: row_verdicts(row) for row in report.summary()["decision"]}
        cells = []
        for spec in one_step:
            words = [
                decision[f].get(spec, "not raced") if f in decision else "-" for f in (0.5, 1.0)
            ]
            cells.append(" / ".join(words))
        pre, post = data["pretrained"], data["fine_tuned"]
        errors = " / ".join(_one_step_cell(m["one_step_error"]) for m in (pre, post))
        lines.append(
            f"| `{label}` | {len(pre['steps'])} | {_figure(pre['geometric_mean'])} | "
            f"{_figure(post['geometric_mean'])} | {errors} | " + " | ".join(cells) + " |"
        )
    return lines


def _one_step_cell(measured: Mapping[str, Any] | None) -> str:
    if measured is None:
        return "stepwise"
    return f"{_figure(measured['mean_error'])} ({_figure(measured['mean_cosine'])})"


def _figure(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    """The command: 0 when every folder is measured; 2 (the error in one line) when one is
    refused."""
    parser = argparse.ArgumentParser(
        prog="python -m gradest_lab.race.race_contraction", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folders", nargs="+", help="tuned race folders")
    parser.add_argument("--again", action="store_true", help="measure even if measured")
    args = parser.parse_args(argv)
    try:
        for folder in args.folders:
            data = measure_race_contraction(folder, again=args.again)
            pre, post = data["pretrained"]["geometric_mean"], data["fine_tuned"]["geometric_mean"]
            print(f"{folder}: contraction {pre:.3g} pretrained, {post:.3g} fine-tuned")
    except GradestError as err:
        print(f"race_contraction: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
