"""``gradest check``: every estimator against its dense definition on the embedded toy model.

The toy problem is a class-conditional MLP velocity model in float64 with a smooth
terminal loss and a stepwise loss on one recorded trajectory (common random numbers).
For each estimator it reports the relative error to the estimator's own dense
definition (must be at float64 precision), the relative error of its surrogate loss's
autograd gradient to its estimate (must be at float64 precision too; "n/a" for an
estimator without ``surrogate()``), and its relative error and cosine to the exact
gradient (how good an approximation it is on this problem).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm import tqdm

from gradest.errors import InvalidValue
from gradest.flow import rollout
from gradest.objectives import Objective
from gradest.reference.definitions import definition_gradient
from gradest.reference.dense import dense_chain, exact_cotangents, relative_error
from gradest.reference.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)
from gradest.registry import available_estimators, estimator
from gradest.samplers import RectifiedFlow

DEFINITION_TOLERANCE = 1e-8

# Configurations DESIGN.md pins as known truths, checked in addition to the defaults.
PINNED = (
    "exact:checkpoint=true",
    "jagg:window=2,order=1",
    "jagg:window=4,shared_knots=true",
    "jagg:window=4,order=2,gate=off",
    "sdo:full_sum=true",
    "truncated:k={N}",
)


def default_specs(steps: int) -> list[str]:
    names = sorted(available_estimators())
    pinned = [s.format(N=steps) for s in PINNED if s.split(":")[0] in names]
    return names + pinned


def run_check(
    specs: Sequence[str] | None = None,
    *,
    steps: int = 8,
    seed: int = 0,
    show_progress: bool = True,
) -> bool:
    """Print the check table; True when every estimator matches its definition."""
    if steps < 1:
        raise InvalidValue(f"--steps must be >= 1, got {steps}")
    estimators = [estimator(spec) for spec in (specs or default_specs(steps))]
    dim, batch, classes = 4, 4, 3
    model = tiny_mlp(dim, hidden=12, num_classes=classes, seed=seed)
    flow = RectifiedFlow(steps=steps)
    noise = seeded_normal((batch, dim), seed + 100)
    cond = {"y": torch.arange(batch) % (classes + 1)}
    trajectory = rollout(model, flow, noise, cond=cond)
    chain = dense_chain(model, flow, trajectory, cond)
    objectives: dict[str, Objective] = {
        "terminal": smooth_terminal_objective(dim, seed=seed + 1),
        "stepwise": random_stepwise_objective(steps, (batch, dim), seed=seed + 2),
    }
    truth = {kind: chain.gradient(exact_cotangents(chain, obj)) for kind, obj in objectives.items()}

    rows, ok = [], True
    pairs = [(est, kind) for est in estimators for kind in objectives]
    for est, kind in tqdm(pairs, desc="gradest check", disable=not show_progress, leave=False):
        objective = objectives[kind]
        result = est.estimate(
            model,
            flow,
            objective,
            trajectory=trajectory,
            cond=cond,
            generator=torch.Generator().manual_seed(seed),
        )
        flat = result.flat()
        definition = definition_gradient(est, chain, objective, result)
        if definition is None:
            vs_definition = "n/a"
        else:
            error = relative_error(flat, definition)
            ok &= error <= DEFINITION_TOLERANCE
            vs_definition = f"{error:.1e}" + ("" if error <= DEFINITION_TOLERANCE else " FAIL")
        vs_surrogate = _surrogate_error(est, model, flow, objective, trajectory, cond, seed, flat)
        if vs_surrogate is None:
            surrogate_cell = "n/a"
        else:
            ok &= vs_surrogate <= DEFINITION_TOLERANCE
            surrogate_cell = f"{vs_surrogate:.1e}" + (
                "" if vs_surrogate <= DEFINITION_TOLERANCE else " FAIL"
            )
        exact = truth[kind]
        cosine = float(flat @ exact / (flat.norm() * exact.norm()).clamp_min(1e-300))
        cost = result.cost
        rows.append(
            (
                repr(est),
                kind,
                vs_definition,
                surrogate_cell,
                f"{relative_error(flat, exact):.2e}",
                f"{cosine:.4f}",
                str(cost.param_vjps),
                f"{cost.forwards_with_graph}/{cost.forwards_without_graph}",
                f"{cost.model_units():g}",
            )
        )
    header = (
        "estimator",
        "objective",
        "vs definition",
        "surrogate vs estimate",
        "rel.err vs exact",
        "cos vs exact",
        "param VJPs",
        "fwd graph/no-graph",
        "cost (F)",
    )
    print(
        f"gradest check: toy MLP (dim {dim}, {sum(p.numel() for p in model.parameters())} "
        f"parameters, float64), N={steps}, batch {batch}, seed {seed}"
    )
    print(_markdown_table(header, rows))
    print(
        "all estimators match their definitions"
        if ok
        else "SOME ESTIMATORS DO NOT MATCH THEIR DEFINITIONS"
    )
    return ok


def _surrogate_error(
    est, model, flow, objective, trajectory, cond, seed: int, estimate: torch.Tensor
) -> float | None:
    """Relative error of ``autograd.grad(est.surrogate(...).loss)`` to the estimate."""
    if not callable(getattr(est, "surrogate", None)):
        return None
    sur = est.surrogate(
        model,
        flow,
        objective,
        trajectory=trajectory,
        cond=cond,
        generator=torch.Generator().manual_seed(seed),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sur.loss, params, allow_unused=True)
    flat = torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(params, grads, strict=True)
        ]
    )
    return relative_error(flat, estimate)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )
