"""Does jagg's gate predict the error it controls? A study on the trained digits DiT.

jagg replaces a group's per-step parameter VJPs ``sum_k J_k^T c_k`` by node VJPs with
interpolated cotangents, ``sum_j J_{t_j}^T G_j``. Its gate decides per group from the
cosine between the velocities and their interpolation from the nodes. This script
measures, per group and per fine-tuning checkpoint, what the gate sees and what it is
meant to control:

* ``error``: the relative error of the group's parameter-gradient contribution,
  ``|sum_j J_j^T G_j - sum_k J_k^T c_k| / |sum_k J_k^T c_k|`` (exact adjoint, per-step
  VJPs: the ground truth);
* ``gate_cosine``: the gate's statistic (min over interior steps and samples of the
  per-sample cosine of ``v_k`` and its interpolation);
* ``velocity_error``: the relative interpolation error of the velocities,
  ``max_k |v_k - v^_k| / |v_k|`` (over the batch, the same numbers the gate has);
* ``probe_error``: one interior step ``m`` (the group's middle) evaluated exactly and
  compared with the interpolation of the nodes' VJPs at the same cotangent,
  ``|sum_j L_j(t_m) J_j^T c_m - J_m^T c_m| / |J_m^T c_m|`` (one VJP more per group plus one
  cotangent column in the node VJPs): a direct estimate of the error, candidate criterion.

It reports Spearman's rank correlation of each statistic with ``error`` (over all groups
of all checkpoints and batches), and for each candidate the threshold that keeps the
interpolated groups' error below a target, with the fraction of groups it lets
interpolate (what jagg would save)::

    python -m gradest_digits.jagg_gate_study --out docs/results/jagg_gate_study

Checkpoints: the shipped model and the model after 8 and 16 ``exact`` fine-tuning steps
on the ``digits`` race task's reward (so the study covers the models jagg would train).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

import gradest
from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
from gradest_digits.datasets import DIGITS
from gradest_digits.rewards import ClassifierReward

TARGET = 3


def _flat(grads: tuple[Tensor | None, ...], params: list[nn.Parameter]) -> Tensor:
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    )


def chain_quantities(model: nn.Module, reward: Any, noise: Tensor, steps: int) -> dict[str, Any]:
    """States, velocities, exact cotangents ``c_k`` and the model at each step."""
    times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    labels = torch.full((noise.shape[0],), 10, dtype=torch.long)  # unconditional
    states, velocities = [noise], []
    with torch.no_grad():
        z = noise
        for k in range(steps):
            v = model(z, torch.full((z.shape[0],), times[k], dtype=z.dtype), y=labels)
            velocities.append(v)
            z = z + (times[k + 1] - times[k]) * v
            states.append(z)
    final = states[-1].detach().requires_grad_(True)
    (adjoint,) = torch.autograd.grad(reward(final).sum(), final)
    cotangents: list[Tensor] = [torch.empty(0)] * steps
    for k in reversed(range(steps)):
        h = times[k + 1] - times[k]
        cotangents[k] = h * adjoint
        z = states[k].detach().requires_grad_(True)
        v = model(z, torch.full((z.shape[0],), times[k], dtype=z.dtype), y=labels)
        (state_vjp,) = torch.autograd.grad(v, z, adjoint)
        adjoint = adjoint + h * state_vjp
    return {
        "times": times,
        "states": states,
        "velocities": velocities,
        "cotangents": cotangents,
        "labels": labels,
    }


def grpo_chain_quantities(
    model: nn.Module, classifier: nn.Module, generator: torch.Generator, batch: int, steps: int
) -> dict[str, Any]:
    """The ``digits-grpo`` race task's step: Flow-GRPO's SDE path (noise level 0.7),
    groups of 4 sharing a class label, the clipped surrogate with the per-element mean;
    ``c_k`` is the gradient of step ``k``'s loss with respect to ``v_k``."""
    from gradest import FlowSDE, rollout
    from gradest.rl import group_advantages, grpo_objective

    sampler = FlowSDE(steps, noise_level=0.7)
    labels = torch.randint(0, 10, (batch // 4,), generator=generator).repeat_interleave(4)
    noise = torch.randn(batch, 1, 8, 8, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        path = rollout(model, sampler, noise, {"y": labels}, generator=generator)
        rewards = ClassifierReward(classifier, labels)(path.states[-1])
        advantages = group_advantages(rewards, 4)
        old = sampler.trajectory_log_probs(path, reduction="mean")
    objective = grpo_objective(sampler, path, old, advantages, 0.2, reduction="mean")
    cotangents = []
    for k in range(steps):
        v = path.velocities[k].detach().requires_grad_(True)
        (c,) = torch.autograd.grad(objective.loss_fn(k, v, path), v)
        cotangents.append(c)
    times = sampler.times.tolist()
    return {
        "times": times,
        "states": list(path.states),
        "velocities": list(path.velocities),
        "cotangents": cotangents,
        "labels": labels,
    }


def param_vjp(model: nn.Module, chain: dict[str, Any], k: int, cotangent: Tensor) -> Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    z = chain["states"][k]
    t = torch.full((z.shape[0],), chain["times"][k], dtype=z.dtype)
    v = model(z, t, y=chain["labels"])
    return _flat(torch.autograd.grad(v, params, cotangent, allow_unused=True), params)


def group_statistics(model: nn.Module, chain: dict[str, Any], window: int) -> list[dict[str, Any]]:
    """Per group: the true relative error and the candidate predictors."""
    steps = len(chain["velocities"])
    times = chain["times"]
    rows = []
    # jagg's own layout and weights (its class owns them; typed as any estimator by name).
    jagg: Any = gradest.estimator("jagg", window=window, order=1, shared_knots=False)
    lagrange_rows = jagg.interpolation_weights
    for group in jagg.groups(steps):
        if group.is_exact:
            continue
        node_times = [times[j] for j in group.nodes]
        weights = lagrange_rows(node_times, [times[k] for k in group.steps])
        exact = cast(
            Tensor, sum(param_vjp(model, chain, k, chain["cotangents"][k]) for k in group.steps)
        )
        node_cotangents = [
            sum(w[i] * chain["cotangents"][k] for w, k in zip(weights, group.steps, strict=True))
            for i in range(len(group.nodes))
        ]
        approx = cast(
            Tensor,
            sum(
                param_vjp(model, chain, j, g)
                for j, g in zip(group.nodes, node_cotangents, strict=True)
            ),
        )
        interior = group.interpolated_steps
        cosines, velocity_errors = [], []
        for k in interior:
            row = lagrange_rows(node_times, [times[k]])[0]
            v = chain["velocities"][k].flatten(1)
            v_hat = sum(
                w * chain["velocities"][j].flatten(1) for w, j in zip(row, group.nodes, strict=True)
            )
            cosines.append(
                float(torch.nn.functional.cosine_similarity(v, v_hat, dim=1, eps=1e-8).min())
            )
            velocity_errors.append(float(((v - v_hat).norm(dim=1) / v.norm(dim=1)).max()))
        probe = interior[len(interior) // 2]
        row = lagrange_rows(node_times, [times[probe]])[0]
        c_m = chain["cotangents"][probe]
        truth = param_vjp(model, chain, probe, c_m)
        predicted = sum(
            w * param_vjp(model, chain, j, c_m) for w, j in zip(row, group.nodes, strict=True)
        )
        rows.append(
            {
                "steps": list(group.steps),
                "error": float((approx - exact).norm() / exact.norm()),
                "gate_cosine": min(cosines),
                "velocity_error": max(velocity_errors),
                "probe_error": float((predicted - truth).norm() / truth.norm()),
            }
        )
    return rows


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


# Each predictor as "smaller is safer" (the cosine negated), and the gate's default.
PREDICTORS = {"gate_cosine": -1.0, "velocity_error": 1.0, "probe_error": 1.0}
TARGETS = (0.05, 0.10)


def calibration(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task, window, predictor and error target: the most permissive threshold under
    which every group that passes has ``error <= target`` on this data, and the share of
    groups it lets interpolate (an optimistic, in-sample calibration: the best any
    threshold on that predictor could do here)."""
    out: dict[str, Any] = {}
    for task in sorted({r["task"] for r in rows}):
        for window in sorted({r["window"] for r in rows}):
            chosen = [r for r in rows if r["task"] == task and r["window"] == window]
            for name, sign in PREDICTORS.items():
                ordered = sorted(chosen, key=lambda r: sign * r[name])
                for target in TARGETS:
                    passed = 0
                    for r in ordered:  # admit groups in order of the predictor
                        if r["error"] > target:
                            break
                        passed += 1
                    threshold = ordered[passed - 1][name] if passed else None
                    out[f"{task}/w{window}/{name}/{target}"] = {
                        "threshold": threshold,
                        "pass_fraction": passed / len(chosen),
                        "oracle_pass_fraction": sum(r["error"] <= target for r in chosen)
                        / len(chosen),
                    }
    return out


def report(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# jagg's gate against the error it controls (trained digits DiT)",
        "",
        "`python -m gradest_digits.jagg_gate_study --out docs/results/jagg_gate_study` "
        "(study.json has every group). Shipped 8x8 digits DiT and the same model after 8 "
        "and 16 exact reward steps; 4 noise batches of 16 per checkpoint; N = 16; order-1 "
        "windows of 4 and 8 steps. `reward`: the ODE path and the exact adjoint of the "
        "classifier reward log p(3|x) (the `digits` race task's reward); `grpo`: the "
        "`digits-grpo` task's Flow-GRPO step (SDE path, noise level 0.7, groups of 4 "
        "sharing a label, per-element mean). error = relative error of the group's "
        "parameter-gradient contribution under interpolation (ground truth from per-step "
        "VJPs).",
        "",
        "| task | window | groups | median error | default gate (cos >= 0.995) passes "
        "| error of passed groups (max) | Spearman(-cos, error) | Spearman(probe, error) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task in sorted({r["task"] for r in rows}):
        for window in sorted({r["window"] for r in rows}):
            chosen = [r for r in rows if r["task"] == task and r["window"] == window]
            errors = sorted(r["error"] for r in chosen)
            passed = [r["error"] for r in chosen if r["gate_cosine"] >= 0.995]
            worst = max(passed) if passed else float("nan")
            truth = [r["error"] for r in chosen]
            by_cosine = spearman([-r["gate_cosine"] for r in chosen], truth)
            by_probe = spearman([r["probe_error"] for r in chosen], truth)
            lines.append(
                f"| {task} | {window} | {len(chosen)} | {errors[len(errors) // 2]:.3f} "
                f"| {len(passed)}/{len(chosen)} | {worst:.3f} | {by_cosine:.2f} "
                f"| {by_probe:.2f} |"
            )
    lines += [
        "",
        "In-sample calibration: the most permissive threshold on each predictor under which "
        "every passing group has error <= the target, the share of groups it passes, and "
        "the share an oracle (the true error) would pass.",
        "",
        "| task/window/predictor/target | threshold | passes | oracle passes |",
        "|---|---|---|---|",
    ]
    for key, value in summary["calibration"].items():
        threshold = "-" if value["threshold"] is None else f"{value['threshold']:.4g}"
        lines.append(
            f"| {key} | {threshold} | {value['pass_fraction']:.2f} "
            f"| {value['oracle_pass_fraction']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def fine_tuned(steps: int, seed: int) -> nn.Module:
    """The shipped model after ``steps`` exact reward steps (Adam, the race task's lr)."""
    model = load_pretrained_dit(dtype=torch.float64)
    reward = ClassifierReward(load_digit_classifier(dtype=torch.float64), TARGET)
    opt = torch.optim.Adam(model.parameters(), lr=DIGITS.task.lr)
    est = gradest.estimator("exact")
    gen = torch.Generator().manual_seed(seed)
    sampler = gradest.RectifiedFlow(steps=16)
    objective = gradest.TerminalObjective(lambda z: -reward(z).mean())
    for _ in range(steps):
        noise = torch.randn(16, 1, 8, 8, generator=gen, dtype=torch.float64)
        labels = torch.full((16,), 10, dtype=torch.long)
        est.surrogate(model, sampler, objective, noise=noise, cond={"y": labels}).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/jagg_gate_study"))
    parser.add_argument("--steps", type=int, default=16, help="sampling steps N")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4, help="noise batches per checkpoint")
    parser.add_argument("--windows", default="4,8")
    parser.add_argument("--checkpoints", default="0,8,16", help="exact fine-tuning steps")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite report.md from an existing study.json in --out",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        saved = json.loads((args.out / "study.json").read_text())
        saved["summary"]["calibration"] = calibration(saved["rows"])
        (args.out / "study.json").write_text(json.dumps(saved, indent=1))
        (args.out / "report.md").write_text(report(saved["summary"], saved["rows"]))
        return 0
    torch.set_default_dtype(torch.float64)
    reward = ClassifierReward(load_digit_classifier(dtype=torch.float64), TARGET)
    rows: list[dict[str, Any]] = []
    classifier = load_digit_classifier(dtype=torch.float64)
    for trained in (int(s) for s in args.checkpoints.split(",")):
        model = fine_tuned(trained, seed=0) if trained else load_pretrained_dit(dtype=torch.float64)
        for batch in range(args.batches):
            gen = torch.Generator().manual_seed(1000 + batch)
            noise = torch.randn(args.batch, 1, 8, 8, generator=gen, dtype=torch.float64)
            chains = {
                "reward": chain_quantities(model, reward, noise, args.steps),
                "grpo": grpo_chain_quantities(model, classifier, gen, args.batch, args.steps),
            }
            for task, chain in chains.items():
                for window in (int(w) for w in args.windows.split(",")):
                    for row in group_statistics(model, chain, window):
                        rows.append(
                            {
                                "task": task,
                                "checkpoint": trained,
                                "batch": batch,
                                "window": window,
                                **row,
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
    summary: dict[str, Any] = {"groups": len(rows)}
    for task in ("reward", "grpo", "both"):
        chosen = [r for r in rows if task in ("both", r["task"])]
        errors = [r["error"] for r in chosen]
        for name, sign in (("gate_cosine", -1), ("velocity_error", 1), ("probe_error", 1)):
            summary[f"{task}_spearman_{name}"] = spearman([sign * r[name] for r in chosen], errors)
        for window in sorted({r["window"] for r in chosen}):
            group = [r for r in chosen if r["window"] == window]
            summary[f"{task}_w{window}_error_median"] = sorted(r["error"] for r in group)[
                len(group) // 2
            ]
            summary[f"{task}_w{window}_default_gate_pass"] = sum(
                r["gate_cosine"] >= 0.995 for r in group
            ) / len(group)
    summary["calibration"] = calibration(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report(summary, rows))
    (args.out / "study.json").write_text(
        json.dumps(
            {"config": vars(args) | {"out": str(args.out)}, "summary": summary, "rows": rows},
            indent=1,
        )
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
