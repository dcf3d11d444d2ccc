"""``gradest check``: every estimator against its dense definition on the embedded toy model.

The toy problem is a class-conditional MLP velocity model in float64 with a smooth
terminal loss and a stepwise loss on one recorded trajectory (common random numbers).
For each estimator and objective kind it defines, the check

* re-derives the **decisions** the estimate must make (groups, nodes, gate outcomes from
  the reference's own velocities, scale factors, replayed random draws:
  ``expected_decisions``, :mod:`gradest.reference.decisions`) and compares them with the
  estimate's;
* evaluates the estimator's **definition** at those re-derived decisions and compares the
  estimate on the recorded trajectory with it, and again the estimate that samples
  from the noise itself, with its noise gradient for terminal objectives (all at float64
  precision);
* compares its surrogate loss's autograd gradient with its estimate;
* reports its relative error and cosine to the exact gradient (how good an
  approximation it is on this problem) and its cost.

"n/a" marks what an estimator (a plugin) does not define.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from gradest._checks import check_estimate_grads, trainable_parameters
from gradest.errors import InvalidType, InvalidValue
from gradest.objectives import Objective, TerminalObjective
from gradest.protocol import Definition, check_steps, supports
from gradest.reference.dense import dense_chain, exact_cotangents, relative_error
from gradest.registry import available_estimators, estimator, line_up, plugin_calls
from gradest.samplers import RectifiedFlow
from gradest.specs import as_spec_list, format_spec_list
from gradest.testing.checks import (
    estimate_from_noise,
    noise_grad_error,
    surrogate_gradient,
    verify_decisions,
)
from gradest.testing.problems import (
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)
from gradest.trajectory import rollout

DEFINITION_TOLERANCE = 1e-8
# Generator seeds per estimator whose decisions and definition are checked.
DRAW_SEEDS = 4


def default_specs(steps: int) -> list[str]:
    """Every registered estimator with its defaults, then the configurations each one pins
    (its ``check_specs``: the known truths of docs/design.md#known-truths and non-default
    options, :func:`gradest.plugin.line_up`), less those whose options need more than
    ``steps`` steps (an explicit list is not filtered: there such an option is the user's
    error)."""
    names = sorted(available_estimators())
    pinned = [spec.format(N=steps) for spec in line_up("check")]
    return [spec for spec in names + pinned if _runs_at(spec, steps)]


def _runs_at(spec: str, steps: int) -> bool:
    try:
        check_steps(estimator(spec), steps)
    except InvalidValue:
        return False
    return True


class _Verdict:
    """Collects the cells of one row, whether every checked number passed and what failed
    (said on a line below the row, so that a cell stays a number)."""

    def __init__(self) -> None:
        self.ok = True
        self.failures: list[str] = []

    def error_cell(self, column: str, *errors: float | None) -> str:
        present = [e for e in errors if e is not None]
        if not present:
            return "n/a"
        worst = max(present)
        if worst > DEFINITION_TOLERANCE:
            self.ok = False
            self.failures.append(f"{column}={worst:.1e}")  # above the tolerance
        return f"{worst:.1e}"

    def decisions_cell(self, problems: list[str] | None) -> str:
        if problems is None:
            return "n/a"
        if not problems:
            return "ok"
        self.ok = False
        self.failures.extend(dict.fromkeys(problems))
        return "FAIL"


def spec_label(spec: Any, est: Any) -> str:
    """What a row calls an estimator: the spec string as given (``auto``, not the repr of
    every option), an estimator object as its spec string (its name and non-default
    options), a plugin that cannot be written as one by its name."""
    if isinstance(spec, str):
        return spec.strip()
    try:
        return format_spec_list([est])
    except (InvalidType, InvalidValue):
        return str(getattr(est, "name", type(est).__name__))


def run_check(
    specs: str | Sequence[Any] | None = None,
    *,
    steps: int = 8,
    seed: int = 0,
    show_progress: bool = True,
) -> bool:
    """Print the check table; True when every estimator matches its definition.

    ``specs``: a spec list in the one list syntax (``"exact,jagg:window=4,tau=0.9,sdo"``,
    :mod:`gradest.specs`) or a sequence of spec strings and estimator objects; None (or
    empty): every registered estimator and the known truths.
    """
    if steps < 1:
        raise InvalidValue(f"--steps must be >= 1, got {steps}")
    listed = as_spec_list(specs, what="specs") if specs is not None else []
    labelled = [(spec, estimator(spec)) for spec in (listed or default_specs(steps))]
    estimators = [est for _, est in labelled]
    labels = {id(est): spec_label(spec, est) for spec, est in labelled}
    dim, batch, classes = 4, 4, 3
    model = tiny_mlp(dim, hidden=12, num_classes=classes, seed=seed)
    sampler = RectifiedFlow(steps=steps)
    noise = seeded_normal((batch, dim), seed + 100)
    cond = {"y": torch.arange(batch) % (classes + 1)}
    trajectory = rollout(model, sampler, noise, cond=cond)
    params = trainable_parameters(model)
    chain = dense_chain(model, sampler, trajectory, cond)
    objectives: dict[str, Objective] = {
        "terminal": smooth_terminal_objective(dim, seed=seed + 1),
        "stepwise": random_stepwise_objective(steps, (batch, dim), seed=seed + 2),
    }
    truth = {kind: chain.gradient(exact_cotangents(chain, obj)) for kind, obj in objectives.items()}

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    rows, ok = [], True
    pairs = [(est, kind) for est in estimators for kind in objectives if supports(est, kind)]
    # The bar on stderr, and only on a terminal (disable=None): stdout is the table alone,
    # and a log of stderr gets no carriage-return frames.
    bar = tqdm(
        pairs,
        desc="gradest check",
        disable=None if show_progress else True,
        leave=False,
        file=sys.stderr,
    )
    for est, kind in bar:
        with plugin_calls(est, f"gradest check ({kind} objective)"):
            objective = objectives[kind]
            verdict = _Verdict()
            inputs = {"cond": cond, "generator": generator()}
            # Decisions and definition over a few draws: one draw shows only the outcomes it
            # happened to make (a depth of 1 hides every weight of a telescope).
            problems, later_errors = None, []
            for offset in range(1, DRAW_SEEDS):
                again = est.estimate(
                    model,
                    sampler,
                    objective,
                    trajectory=trajectory,
                    cond=cond,
                    generator=torch.Generator().manual_seed(seed + offset),
                )
                check_estimate_grads(est, again, params)
                seen, definition = _verified(est, chain, objective, again, seed + offset)
                if seen is not None:
                    problems = (problems or []) + seen
                if definition is not None:
                    later_errors.append(relative_error(again.flat(), definition.grad))
            result = est.estimate(model, sampler, objective, trajectory=trajectory, **inputs)
            check_estimate_grads(est, result, params)
            flat = result.flat()
            seen, definition = _verified(est, chain, objective, result, seed)
            if seen is not None:
                problems = (problems or []) + seen
            # The same estimate sampling from the noise itself (the path is the recorded one:
            # the sampler is deterministic), with the noise gradient where there is one.
            terminal = isinstance(objective, TerminalObjective)
            sampled, silent = estimate_from_noise(
                est, model, sampler, objective, noise, terminal, inputs, generator
            )
            if silent:
                verdict.failures.append(silent)
                verdict.ok = False
            check_estimate_grads(est, sampled, params)
            vs_definition, from_noise, noise_grad = None, None, None
            if definition is not None:
                vs_definition = max([relative_error(flat, definition.grad), *later_errors])
                from_noise = relative_error(sampled.flat(), definition.grad)
                if (
                    terminal
                    and definition.noise_grad is not None
                    and sampled.noise_grad is not None
                ):
                    noise_grad = noise_grad_error(sampled.noise_grad, definition.noise_grad)
            surrogate = _surrogate_error(
                est, model, sampler, objective, trajectory, cond, seed, flat
            )
            exact = truth[kind]
            cosine = float(flat @ exact / (flat.norm() * exact.norm()).clamp_min(1e-300))
            cost = result.cost
            cells = (
                verdict.decisions_cell(problems),
                verdict.error_cell("path", vs_definition),
                verdict.error_cell("noise", from_noise, noise_grad),
                verdict.error_cell("surrogate", surrogate),
                f"{relative_error(flat, exact):.2e}",
                f"{cosine:.4f}",
                str(cost.param_vjps),
                f"{cost.forwards_with_graph}/{cost.forwards_without_graph}",
                f"{cost.model_units():g}",
            )
            rows.append((labels[id(est)], kind, cells, verdict.failures))
            ok &= verdict.ok
    print(
        f"gradest check: toy MLP (dim {dim}, {sum(p.numel() for p in model.parameters())} "
        f"parameters, float64), N={steps}, batch {batch}, seed {seed}"
    )
    print(_legend())
    print()
    print(_table(rows))
    print(
        "all estimators make the decisions and match the definitions they define"
        if ok
        else "SOME ESTIMATORS DO NOT MATCH THEIR DECISIONS OR DEFINITIONS"
    )
    return ok


def _verified(
    est: Any, chain: Any, objective: Objective, result: Any, seed: int
) -> tuple[list[str] | None, Definition | None]:
    """The decision mismatches of ``result`` (None if the estimator does not re-derive
    them) and the definition at the re-derived decisions (at its own without them)."""
    return verify_decisions(est, chain, objective, result, torch.Generator().manual_seed(seed))


def _surrogate_error(
    est, model, sampler, objective, trajectory, cond, seed: int, estimate: torch.Tensor
) -> float | None:
    """Relative error of ``autograd.grad(est.surrogate(...).loss)`` to the estimate."""
    flat = surrogate_gradient(
        est, model, sampler, objective, trajectory=trajectory, cond=cond,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    return None if flat is None else relative_error(flat, estimate)


# The table fits a terminal of this many columns: an estimator's spec (of any length) is
# a line of its own above its rows, failures are said on lines below them.
WIDTH = 100
HEADER = ("estimator", "decisions", "path", "noise", "surrogate", "rel.err", "cos", "VJPs",
          "fwd", "F")  # fmt: skip


def _legend() -> str:
    return textwrap.fill(
        f"Per estimator (its spec) and objective: decisions re-derived by the reference (ok, "
        f"FAIL, n/a: not defined); the relative error to the estimator's definition of its "
        f"estimate on the recorded path, of the estimate sampling from the noise (with its "
        f"noise gradient), and of its surrogate loss's gradient to the estimate (each "
        f"<= {DEFINITION_TOLERANCE:g} passes); rel.err and cos to the exact gradient; its "
        f"cost: parameter VJPs, forwards with / without graph, model units F.",
        WIDTH,
    )


def _table(rows: Sequence[tuple[str, str, Sequence[str], list[str]]]) -> str:
    """``rows`` of (spec, objective kind, cells, failures) as aligned columns: the spec on
    a line, its objective kinds indented under it."""
    body = [(f"  {kind}", *cells) for _, kind, cells, _ in rows]
    widths = [max(len(c) for c in column) for column in zip(HEADER, *body, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    lines, previous = [line(HEADER)], None
    for (spec, _, _, failures), cells in zip(rows, body, strict=True):
        if spec != previous:
            lines.append(spec)
            previous = spec
        lines.append(line(cells))
        if failures:  # the decisions that differ, then the errors above the tolerance
            lines.append(
                textwrap.fill(
                    "; ".join(failures),
                    WIDTH,
                    initial_indent="    FAIL: ",
                    subsequent_indent="      ",
                )
            )
    return "\n".join(lines)
