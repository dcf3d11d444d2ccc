"""Paired benchmark: reward fine-tuning of the pretrained digits DiT with each estimator.

Every seed gives every estimator the same initial model (the shipped checkpoint) and the
same seed, so differences are the estimators'. The estimators' runs advance **in lockstep**:
at every training step each estimator takes its step in turn (the order rotates from step
to step), so machine load hits all of them alike, and each step's backward is timed where
it runs. Cost is also counted deterministically: model units from each estimator's own
``Cost`` (a forward F, a parameter VJP 2F, a state VJP F) times one forward's FLOPs
(FlopCounterMode).

Per estimator it reports the final reward on a fixed evaluation batch, paired wins against
``exact`` out of the seeds with a paired test's p-value (Wilcoxon signed-rank, exact for
small samples; and a paired t-test), for reward at equal steps and for reward gain per
backward-FLOP and per backward-second; FID / KID of the samples against the held-out
digits of the target class (torch-fidelity, on the digit classifier's features); backward
FLOPs and time as ratios to ``exact``; and, on one minibatch at the initial model, the
gradient's cosine, Adam-normalised cosine and sign agreement to ``exact``, with the rank
correlation of each with the final reward across estimators.

    python -m gradest_digits.paired_benchmark --mode reward --seeds 8 \
        --out docs/results/digits_reward
    python -m gradest_digits.paired_benchmark --mode grpo --seeds 8 --out docs/results/digits_grpo

``--prior-weight w`` adds prior preservation (a flow-matching loss on the real training
digits) to every backward, so the reward cannot be maximised by collapsing onto one blob
and the estimators differ on sample quality as well. Runs on the CPU; ``--device cuda``
runs unchanged on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import math
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gradest_lab.storage.files import atomic_write_text
from tqdm import tqdm

import gradest
from gradest import FlowSDE
from gradest.harness import (
    TensorLayout,
    adam_cosine,
    count_flops,
    mean_of,
    retained_activation_bytes,
    second_moment,
    sign_agreement,
)
from gradest.plugin import split_spec_list, supports
from gradest.rl import group_advantages, grpo_objective
from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
from gradest_digits.datasets import DIGITS
from gradest_digits.finetune import start_run
from gradest_digits.metrics import fid_kid
from gradest_digits.rewards import ClassifierReward

DEFAULT_ESTIMATORS = (
    "exact,jagg:window=4,jagg:window=4,shared_knots=true,jagg:window=4,tau=0.9,"
    "jagg:window=4,debias=2,sdo,truncated:k=1,truncated:random=uniform,k_min=2,telescope,"
    "draft_lv,refl,auto,auto:min_progress=0.95"
)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def _cond(args: argparse.Namespace, batch: int) -> dict[str, torch.Tensor] | None:
    """Class-conditional on the target, or unconditional (the null class) by default."""
    if args.labels == "none":
        return None
    return {"y": torch.full((batch,), args.target, device=args.device)}


def _agreement_problem(args: argparse.Namespace, model: torch.nn.Module, reward: ClassifierReward):
    """The minibatch every estimator is compared on: a recorded path and its objective."""
    gen = torch.Generator().manual_seed(12345)
    noise = torch.randn(args.batch, 1, 8, 8, generator=gen).to(args.device)
    cond = _cond(args, args.batch)
    if args.mode == "reward":
        flow: Any = gradest.RectifiedFlow(steps=args.sampler_steps)
        trajectory = gradest.rollout(model, flow, noise, cond=cond)
        objective: Any = gradest.TerminalObjective(lambda z: -reward(z).mean())
        return flow, objective, trajectory, cond
    flow = FlowSDE(steps=args.sampler_steps)
    trajectory = gradest.rollout(model, flow, noise, cond=cond, generator=gen)
    with torch.no_grad():
        rewards = reward(trajectory.states[-1])
        old = torch.stack(
            [
                flow.step_log_prob(trajectory, k, trajectory.velocities[k])
                for k in range(flow.num_steps)
            ]
        )
    advantages = group_advantages(rewards, args.group_size)
    return flow, grpo_objective(flow, trajectory, old, advantages), trajectory, cond


def measure_agreement(
    args: argparse.Namespace, specs: Sequence[str]
) -> dict[str, dict[str, float]]:
    """On one minibatch at the initial model: agreement with exact (cosine, Adam cosine,
    sign agreement; means over draws), and retained bytes relative to exact."""
    model = load_pretrained_dit(device=args.device)
    reward = ClassifierReward(load_digit_classifier(device=args.device), args.target)
    flow, objective, trajectory, cond = _agreement_problem(args, model, reward)
    exact = gradest.estimator("exact").estimate(
        model, flow, objective, trajectory=trajectory, cond=cond
    )
    reference = exact.flat()
    moment = second_moment([reference], TensorLayout.of(exact.grads))
    # Retained activations when the estimator samples itself (terminal) or works on the
    # recorded path (stepwise), as in the harness.
    inputs = (
        {"noise": trajectory.states[0]} if args.mode == "reward" else {"trajectory": trajectory}
    )
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        est = gradest.estimator(spec)
        results = [
            est.estimate(
                model,
                flow,
                objective,
                trajectory=trajectory,
                cond=cond,
                generator=torch.Generator().manual_seed(d),
            )
            for d in range(args.draws)
        ]
        draws = [r.flat() for r in results]
        retained = retained_activation_bytes(
            functools.partial(
                est.estimate,
                model,
                flow,
                objective,
                cond=cond,
                generator=torch.Generator().manual_seed(0),
                **inputs,
            )
        )
        out[spec] = {
            "cosine": statistics.fmean(_cosine(d, reference) for d in draws),
            "adam_cosine": mean_of(adam_cosine(d, reference, moment) for d in draws),
            "sign_agreement": mean_of(sign_agreement(d, reference) for d in draws),
            "cosine_of_mean": _cosine(torch.stack(draws).mean(0), reference),
            # jagg: the fraction of groups the gate sent back to exact on this minibatch
            "fallback_fraction": results[0].info.get("fallback_fraction"),
            "retained_bytes": retained,
        }
    base = out["exact"]["retained_bytes"]
    for row in out.values():
        row["retained_ratio"] = row["retained_bytes"] / base
    return out


def forward_flops(args: argparse.Namespace) -> int:
    """``F``: FLOPs of one forward of the DiT on a training batch (FlopCounterMode)."""
    model = load_pretrained_dit(device=args.device)
    z = torch.zeros(args.batch, 1, 8, 8, device=args.device)
    t = torch.full((args.batch,), 0.5, device=args.device)
    with torch.no_grad():
        return count_flops(lambda: model(z, t, **(_cond(args, args.batch) or {})))


def run_seed(
    args: argparse.Namespace,
    specs: Sequence[str],
    seed: int,
    reference: torch.Tensor,
    prior: torch.Tensor | None,
    flops: int,
) -> dict[str, dict[str, Any]]:
    """Every estimator's fine-tuning on this seed, advanced in lockstep (see the module)."""
    # Each seed is a training run of its own: start_run builds each run's estimator, so
    # auto probes (and pays for it) in each.
    reward = ClassifierReward(load_digit_classifier(device=args.device), args.target)
    runs = {}
    for spec in specs:
        runs[spec] = start_run(
            load_pretrained_dit(device=args.device),
            reward,
            estimator=spec,
            mode=args.mode,
            steps=args.steps,
            batch_size=args.batch,
            lr=args.lr,
            seed=seed,
            sampler_steps=args.sampler_steps,
            labels=args.target if args.labels == "target" else None,
            group_size=args.group_size,
            prior_weight=args.prior_weight,
            prior_data=prior,
        )
    for step in range(args.steps):
        # Rotate the order so that no estimator always runs first (warm caches) or last.
        shift = (step + seed) % len(specs)
        for spec in [*specs[shift:], *specs[:shift]]:
            run, sampler = runs[spec]
            run.step(step, sampler)
    out = {}
    gen = torch.Generator().manual_seed(777)
    noise = torch.randn(args.eval_samples, 1, 8, 8, generator=gen).to(args.device)
    cond = _cond(args, args.eval_samples)
    for spec, (run, _) in runs.items():
        samples = gradest.rollout(
            run.model, gradest.RectifiedFlow(steps=args.sampler_steps), noise, cond=cond
        ).states[-1]
        with torch.no_grad():
            eval_reward = float(reward(samples).mean())
        initial, final = float(run.initial.mean()), float(run.evaluate().mean())
        seconds = sum(h["backward_seconds"] for h in run.history)
        backward_flops = flops * sum(h["cost"]["model_units"] for h in run.history)
        out[spec] = {
            "seed": seed,
            "initial_reward": initial,
            "final_reward": final,
            "eval_reward": eval_reward,
            "backward_seconds": seconds,
            "backward_flops": backward_flops,
            "reward_gain_per_backward_second": (final - initial) / seconds,
            "reward_gain_per_backward_gflop": (final - initial) / (backward_flops / 1e9),
            # What a delegating estimator (auto) ran in each step's last backward (exact on
            # a probe; GRPO takes several backwards per step).
            "selected": [h["info"].get("auto_choice") for h in run.history],
            **(
                fid_kid(samples.float().cpu(), reference, seed=seed)
                if fid_reference_is_adequate(reference)
                else {"fid": None, "kid_mean": None, "kid_std": None}
            ),
        }
    return out


def fid_reference_is_adequate(reference: torch.Tensor) -> bool:
    """Whether FID/KID against ``reference`` mean anything: at least twice as many images
    as the classifier's feature dimension, so the reference covariance is not singular
    (the held-out set has 37 of each digit against 64 features: not adequate, and the
    benchmark then leaves FID/KID out instead of printing a number)."""
    return reference.shape[0] >= 2 * load_digit_classifier().fc.out_features


def _paired(values: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    from scipy import stats

    diffs = [a - b for a, b in zip(values, baseline, strict=True)]
    wins = sum(d > 0 for d in diffs)
    if all(d == 0 for d in diffs):
        return {
            "wins": wins,
            "ties": len(diffs),
            "wilcoxon_p": 1.0,
            "ttest_p": 1.0,
            "mean_diff": 0.0,
        }
    return {
        "wins": wins,
        "ties": sum(d == 0 for d in diffs),
        "wilcoxon_p": float(stats.wilcoxon(values, baseline).pvalue),
        "ttest_p": float(stats.ttest_rel(values, baseline).pvalue),
        "mean_diff": statistics.fmean(diffs),
    }


def summarize(
    runs: dict[str, list[dict[str, Any]]], agreement: dict[str, dict[str, float]]
) -> dict[str, Any]:
    exact = runs["exact"]
    exact_mean = statistics.fmean(r["final_reward"] for r in exact)

    def paired(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
        return _paired([r[key] for r in rows], [r[key] for r in exact])

    exact_gain = exact_mean - statistics.fmean(r["initial_reward"] for r in exact)
    summary = {}
    for spec, rows in runs.items():
        rewards = [r["final_reward"] for r in rows]
        gain_per_gflop = paired(rows, "reward_gain_per_backward_gflop")
        # The share of exact's reward gain this estimator reached (rewards are log-probs
        # near 0 at the end, so a ratio of final rewards would say nothing).
        gain_fraction = (statistics.fmean(rewards) - exact_mean + exact_gain) / exact_gain
        summary[spec] = {
            "final_reward_mean": statistics.fmean(rewards),
            "final_reward_std": statistics.stdev(rewards) if len(rows) > 1 else 0.0,
            "reward_gain_fraction_of_exact": gain_fraction,
            # The goal of issue 12: >= 7/8 paired wins on reward per backward cost at
            # p < 0.05, with the reward within 1% of exact's (gain).
            "meets_goal": spec != "exact"
            and gain_per_gflop["wins"] >= 7 / 8 * len(rows)
            and gain_per_gflop["wilcoxon_p"] < 0.05
            and gain_fraction >= 0.99,
            "selected": dict(
                collections.Counter(c for r in rows for c in r.get("selected", []) if c)
            ),
            "fid_mean": _mean_or_none(r["fid"] for r in rows),
            "kid_mean": _mean_or_none(r["kid_mean"] for r in rows),
            "backward_time_ratio": statistics.median(
                r["backward_seconds"] / e["backward_seconds"]
                for r, e in zip(rows, exact, strict=True)
            ),
            "backward_flops_ratio": statistics.fmean(r["backward_flops"] for r in rows)
            / statistics.fmean(e["backward_flops"] for e in exact),
            "reward_vs_exact": paired(rows, "final_reward"),
            "gain_per_gflop_vs_exact": gain_per_gflop,
            "gain_per_second_vs_exact": paired(rows, "reward_gain_per_backward_second"),
            **agreement.get(spec, {}),
        }
    return summary


def distinct_estimators(summary: dict[str, Any]) -> list[list[str]]:
    """Estimators grouped by identical training: same agreement metrics and the same
    final reward (mean and spread over the seeds), as when jagg falls back everywhere and
    takes exact's gradient. Identical gradients give bitwise identical runs, so exact
    float equality is the test. Delegating estimators (``auto``) are left out."""
    groups: dict[tuple, list[str]] = {}
    for spec, row in summary.items():
        if row.get("selected"):
            continue
        key = tuple(
            row.get(name, math.nan)
            for name in ("final_reward_mean", "final_reward_std", "cosine", "adam_cosine",
                         "sign_agreement")
        )  # fmt: skip
        key = tuple("nan" if v != v else v for v in key)
        groups.setdefault(key, []).append(spec)
    return list(groups.values())


def metric_rank_correlations(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Spearman's rho (and p) across estimators between each agreement metric measured on
    one minibatch and the final reward after fine-tuning: does the metric predict training?

    Estimators that trained identically (:func:`distinct_estimators`) count once, so a
    gradient that several rows share does not inflate the correlation; delegating
    estimators (``auto``) are left out. ``rows`` says how many distinct rows remain."""
    from scipy import stats

    groups = distinct_estimators(summary)
    rows = [summary[group[0]] for group in groups]
    rewards = [row["final_reward_mean"] for row in rows]
    out: dict[str, dict[str, float]] = {}
    for metric in ("cosine", "adam_cosine", "sign_agreement"):
        values = [row.get(metric, math.nan) for row in rows]
        if len(values) < 3 or any(v != v for v in values):
            continue
        result = stats.spearmanr(values, rewards)
        out[metric] = {"rho": float(result.statistic), "p": float(result.pvalue), "rows": len(rows)}
    return out


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean_or_none(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def to_markdown(config: dict[str, Any], summary: dict[str, Any]) -> str:
    sampling = "unconditional sampling" if config["labels"] == "none" else "conditioned on it"
    prior = (
        f", prior preservation weight {config['prior_weight']} (flow matching on the real "
        f"training digits)"
        if config.get("prior_weight")
        else ""
    )
    lines = [
        f"# Digits fine-tuning, paired benchmark ({config['mode']})",
        "",
        f"`{config['command']}` — {config['date']}, {config['machine']}, torch {config['torch']}.",
        f"{config['seeds']} seeds; each seed gives every estimator the same initial model "
        f"(shipped checkpoint) and seed, and the estimators' runs advance in lockstep (each "
        f"takes its training step in turn, the order rotating), so machine load hits all "
        f"alike. Target digit {config['target']} ({sampling}), {config['steps']} steps, batch "
        f"{config['batch']}, lr {config['lr']}, N={config['sampler_steps']}{prior}. Reward = "
        f"classifier log-probability of the target (higher is better), on a fixed evaluation "
        f"batch. Backward FLOPs = model units (each estimator's `Cost`) x one forward's FLOPs "
        f"({config['forward_flops'] / 1e6:.1f} MFLOP). FID/KID: {config['eval_samples']} "
        f"samples vs the held-out digits of the target class, on the digit classifier's "
        f"features (torch-fidelity); '-' where that reference has fewer images than twice "
        f"the feature dimension (a singular covariance: no meaningful FID). Agreement "
        f"columns: one minibatch at the initial model. "
        f"\"gain / exact's\": the estimator's reward gain (final - initial, mean over seeds) "
        f"as a share of exact's. Goal (issue 12): >= 7/8 paired wins on reward gain per "
        f"backward-GFLOP at Wilcoxon p < 0.05 with >= 99% of exact's gain.",
        "",
        "| estimator | final reward | gain / exact's | reward wins (p W, t) "
        "| gain/backward-GFLOP wins (p) | gain/backward-s wins (p) | goal | FID | KID | FLOPs × "
        "| time × | retained × | cos | Adam cos | sign agree | fallback |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    n = config["seeds"]
    for spec, s in summary.items():
        rw, fw, gw = (
            s["reward_vs_exact"],
            s["gain_per_gflop_vs_exact"],
            s["gain_per_second_vs_exact"],
        )
        lines.append(
            f"| `{spec}` | {s['final_reward_mean']:.4f} ± {s['final_reward_std']:.4f} "
            f"| {100 * s['reward_gain_fraction_of_exact']:.1f}% "
            f"| {rw['wins']}/{n} ({rw['wilcoxon_p']:.3g}, {rw['ttest_p']:.3g}) "
            f"| {fw['wins']}/{n} ({fw['wilcoxon_p']:.3g}) "
            f"| {gw['wins']}/{n} ({gw['wilcoxon_p']:.3g}) "
            f"| {'met' if s['meets_goal'] else '-'} "
            f"| {_number(s['fid_mean'], '.2f')} | {_number(s['kid_mean'], '.4f')} "
            f"| {s['backward_flops_ratio']:.2f} "
            f"| {s['backward_time_ratio']:.2f} | {s.get('retained_ratio', math.nan):.3f} "
            f"| {s.get('cosine', math.nan):.4f} | {s.get('adam_cosine', math.nan):.4f} "
            f"| {s.get('sign_agreement', math.nan):.3f} "
            f"| {_fraction(s.get('fallback_fraction'))} |"
        )
    for spec, s in summary.items():
        if s.get("selected"):
            picks = ", ".join(
                f"`{c}` ({k} steps)" for c, k in sorted(s["selected"].items(), key=lambda x: -x[1])
            )
            lines += [
                "",
                f"`{spec}` ran, in each training step's last backward over all seeds (exact "
                f"where that backward was a probe): {picks}.",
            ]
    correlations = config.get("metric_rank_correlations") or {}
    if correlations:
        lines += [
            "",
            "Does a one-minibatch agreement metric predict the final reward? Spearman rank "
            f"correlation across the {len(distinct_estimators(summary))} distinct rows of "
            f"the {sum(not s.get('selected') for s in summary.values())} estimators "
            "(estimators that trained identically, e.g. a jagg that fell back to exact "
            "everywhere, count once; auto's rows are left out: they repeat the estimators "
            "they ran):",
            "",
            "| metric | rho | p |",
            "|---|---|---|",
            *(
                f"| {metric} | {c['rho']:+.2f} | {c['p']:.3g} |"
                for metric, c in correlations.items()
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="reward", choices=("reward", "grpo"))
    parser.add_argument(
        "--estimators",
        default=DEFAULT_ESTIMATORS,
        help="estimator specs in the one list syntax of gradest.plugin.split_spec_list, e.g. "
        "'exact,jagg:window=4,tau=0.9,sdo'",
    )
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--sampler-steps", type=int, default=16)
    parser.add_argument("--target", type=int, default=3)
    parser.add_argument(
        "--labels",
        default="none",
        choices=("none", "target"),
        help="sample unconditionally (default: the reward steers the model to the target) "
        "or conditioned on the target",
    )
    parser.add_argument(
        "--prior-weight",
        type=float,
        default=0.0,
        help="prior preservation: weight of a flow-matching loss on the real training digits",
    )
    parser.add_argument("--eval-samples", type=int, default=128)
    parser.add_argument(
        "--draws", type=int, default=4, help="draws for the agreement of stochastic estimators"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/digits_paired")
    parser.add_argument(
        "--agreement-only",
        action="store_true",
        help="keep the fine-tuning runs in --out/results.json and recompute only the "
        "minibatch agreement (cosines, fallback, retained bytes) and the summary",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = split_spec_list(args.estimators, what="--estimators")
    if "exact" not in specs:
        specs.insert(0, "exact")
    kind = "terminal" if args.mode == "reward" else "stepwise"
    # Estimators for the other objective kind (draft_lv, refl in GRPO mode) are left out.
    left_out = [s for s in specs if not supports(gradest.estimator(s), kind)]
    specs = [s for s in specs if s not in left_out]
    if left_out:
        print(f"left out (no {kind} objectives): {', '.join(left_out)}")
    out = Path(args.out)
    if args.agreement_only:
        saved = json.loads((out / "results.json").read_text())
        config = saved["config"]
        specs = list(saved["runs"])
        for key in ("mode", "batch", "sampler_steps", "target", "labels", "group_size"):
            setattr(args, key, config[key])
        summary = summarize(saved["runs"], measure_agreement(args, specs))
        config["metric_rank_correlations"] = metric_rank_correlations(summary)
        _write(out, config, summary, saved["runs"])
        return 0
    images, labels = DIGITS.load("heldout")
    reference = images[labels == args.target]
    prior = DIGITS.load("train")[0] if args.prior_weight else None
    flops = forward_flops(args)
    runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
    # One untimed step first: the first calls of a process pay one-off costs (allocator
    # and kernel warm-up) that would otherwise land on seed 0's first estimator.
    run_seed(argparse.Namespace(**{**vars(args), "steps": 1}), specs, 0, reference, prior, flops)
    for seed in tqdm(range(args.seeds), desc="digits paired (seeds)"):
        for spec, row in run_seed(args, specs, seed, reference, prior, flops).items():
            runs[spec].append(row)
    agreement = measure_agreement(args, specs)
    config = {
        "command": "python -m gradest_digits.paired_benchmark "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {args.device}",
        "torch": torch.__version__,
        "forward_flops": flops,
        **{k: v for k, v in vars(args).items() if k not in ("estimators", "out")},
    }
    summary = summarize(runs, agreement)
    config["metric_rank_correlations"] = metric_rank_correlations(summary)
    _write(out, config, summary, runs)
    return 0


def _write(
    out: Path, config: dict[str, Any], summary: dict[str, Any], runs: dict[str, Any]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "summary": summary, "runs": runs}
    atomic_write_text(out / "results.json", json.dumps(payload, indent=2))
    atomic_write_text(out / "results.md", to_markdown(config, summary))
    print(to_markdown(config, summary))


if __name__ == "__main__":
    raise SystemExit(main())
