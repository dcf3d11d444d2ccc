"""Digits: ``gradest finetune`` in several modes with the same seeds and settings.

Each (mode, seed) is one ``gradest finetune`` command (recorded verbatim); the final
checkpoint is then sampled with the Euler ODE on a fixed batch of noise (unconditional,
the default ``--labels null``) and scored: the mean reward ``log p(target | x)``, the
fraction the classifier assigns to the target, FID / KID against the held-out digits
of the target class (:func:`gradest_digits.metrics.fid_kid`), and the path KL to the
pretrained model (what a KL penalty controls; see :func:`path_kl`). The pretrained model
is scored the same way as the baseline.

A mode is ``NAME[:key=value,...]`` with ``NAME`` a ``gradest finetune --mode`` and keys
``kl`` (``--kl-weight``) and ``lr`` (``--lr``, else the common ``--lr``), e.g.
``grpo:kl=0.1,lr=3e-4``.

    python -m gradest_digits.rl_objectives_benchmark --steps 15 --seeds 0 1 2 \
        --out docs/results/digits_rl_objectives
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gradest_lab.storage.files import atomic_write_text

import gradest
from gradest_digits.assets import load_digit_classifier, load_pretrained_dit
from gradest_digits.datasets import DIGITS
from gradest_digits.file_schema import require_state_dict
from gradest_digits.finetune_cli import read_result
from gradest_digits.metrics import fid_kid
from gradest_digits.run_state import load_checkpoint, read_log

# The SDE whose path KL :func:`path_kl` reports: Flow-GRPO's sampler in ``gradest finetune``
# (its default --noise-level), so GRPO's KL penalty acts on exactly this quantity.
KL_NOISE_LEVEL = 0.7
MODE_KEYS = {"kl": "--kl-weight", "lr": "--lr", "est": "--estimator"}


def parse_mode(spec: str) -> tuple[str, dict[str, str]]:
    """``"grpo:kl=0.1,lr=3e-4"`` -> ``("grpo", {"kl": "0.1", "lr": "3e-4"})``; an
    ``est=`` estimator spec may hold ``:`` and ``=`` but no ``,``."""
    name, _, rest = spec.partition(":")
    options: dict[str, str] = {}
    for key, _, value in (item.partition("=") for item in rest.split(",") if item):
        if not value or key not in MODE_KEYS:
            raise SystemExit(
                f"--modes {spec!r}: keys must be {', '.join(MODE_KEYS)} with values, "
                f"e.g. grpo:kl=0.1,lr=3e-4,est=sdo"
            )
        if key in options:  # never the last one silently: the run would not be the one written
            raise SystemExit(
                f"--modes {spec!r} sets {key!r} twice ({key}={options[key]} and {key}={value}); "
                f"give each key once"
            )
        options[key] = value
    return name, options


def path_kl(model: torch.nn.Module, base: torch.nn.Module, args: argparse.Namespace) -> float:
    """``KL(p_model || p_base)`` of FlowSDE paths, averaged over ``args.eval_samples`` paths.

    Both path measures share the step variances, so the KL is the sum of the per-step
    Gaussian KLs along the model's own rollouts (:func:`gradest.rl.step_kl`); the
    pretrained model scores 0. The ODE sampler has no finite path KL, hence the SDE.
    """
    flow = gradest.FlowSDE(steps=args.sampler_steps, noise_level=KL_NOISE_LEVEL)
    noise = torch.randn(args.eval_samples, 1, 8, 8, generator=torch.Generator().manual_seed(778))
    with torch.no_grad():
        trajectory = gradest.rollout(
            model, flow, noise, generator=torch.Generator().manual_seed(779)
        )
        ours = gradest.rl.reference_velocities(model, flow, trajectory)
        theirs = gradest.rl.reference_velocities(base, flow, trajectory)
        total = torch.stack(
            [gradest.rl.step_kl(flow, k, ours[k], theirs[k]) for k in range(flow.num_steps)]
        ).sum(0)
    return float(total.mean())


def score(model: torch.nn.Module, args: argparse.Namespace, reference: torch.Tensor) -> dict:
    """Reward, target fraction, FID/KID of ``args.eval_samples`` ODE samples, path KL."""
    noise = torch.randn(args.eval_samples, 1, 8, 8, generator=torch.Generator().manual_seed(777))
    with torch.no_grad():
        flow = gradest.RectifiedFlow(steps=args.sampler_steps)
        samples = gradest.rollout(model, flow, noise).states[-1]
        logits = load_digit_classifier()(samples)
    log_probs = torch.log_softmax(logits, -1)[:, args.target]
    hits = (logits.argmax(-1) == args.target).float()
    # Adjoint matching's target p_base(x) exp(reward(x)), estimated from these samples by
    # self-normalised importance weights exp(reward) = p(target | x) (meaningful for the
    # pretrained model's samples: what an exact fine-tuning to the tilt would score).
    weights = log_probs.exp() / log_probs.exp().sum()
    return {
        "eval_reward": float(log_probs.mean()),
        "target_fraction": float(hits.mean()),
        "tilted_reward": float((weights * log_probs).sum()),
        "tilted_target_fraction": float((weights * hits).sum()),
        **fid_kid(samples.float(), reference, seed=0),
        "path_kl": path_kl(model, args.base, args),
    }


def run(mode: str, seed: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    name, options = parse_mode(mode)
    flags = [
        "--mode", name, "--steps", str(args.steps), "--seed", str(seed),
        "--lr", options.get("lr", str(args.lr)), "--batch-size", str(args.batch_size),
        "--sampler-steps", str(args.sampler_steps), "--target", str(args.target),
    ]  # fmt: skip
    for key in ("kl", "est"):
        if key in options:
            flags += [MODE_KEYS[key], options[key]]
    out = folder / f"{re.sub(r'[^A-Za-z0-9.]+', '_', mode)}_seed{seed}"
    command = ["gradest", "finetune", *flags, "--out", str(out), "--quiet"]
    subprocess.run([sys.executable, "-m", "gradest.cli", *command[1:]], check=True)
    # The run's files through their readers: a damaged one is one line naming it.
    result = read_result(out / "result.json")
    costs = [record["cost"] for record in read_log(out / "log.jsonl")]
    model = load_pretrained_dit()
    final = load_checkpoint(result.checkpoints[-1])
    require_state_dict(final.model, model.state_dict(), final.refuse, "model")
    model.load_state_dict(final.model)
    shown = " ".join(shlex.quote(part) for part in [*command[:-3], "--out", "RUN_DIR", "--quiet"])
    return {
        "mode": mode,
        "seed": seed,
        "command": shown,
        "initial_reward": result.initial_reward,
        "final_reward": result.final_reward,
        # Model calls of the whole run in forward-equivalents (docs/design.md#cost-model):
        # the estimator's backward work, and the base model's work for the objective.
        "estimator_units": sum(cost["model_units"] for cost in costs),
        "objective_units": sum(cost["objective_model_units"] for cost in costs),
        **score(model, args, args.reference),
    }


def to_markdown(args: argparse.Namespace, base: dict, rows: list[dict]) -> str:
    lines = [
        "# Digits: RL objectives (adjoint matching, Flow-GRPO with and without KL) and "
        "direct reward backpropagation",
        "",
        f"Shipped digits DiT, reward `log p({args.target} | x)` of the shipped classifier, "
        f"unconditional sampling (`--labels null`), {args.steps} outer steps, batch "
        f"{args.batch_size}, {args.sampler_steps} sampler steps, AdamW (lr {args.lr} unless "
        f"the mode says `lr=`), seeds {', '.join(map(str, args.seeds))}; estimator `exact` "
        f"unless the mode says `est=`; other settings are `gradest finetune`'s defaults "
        f"(GRPO: group 4, 2 inner epochs, clip 0.2, FlowSDE noise level 0.7, log-prob "
        f"reduction `sum`). CPU "
        f"run, produced by `python -m gradest_digits.rl_objectives_benchmark "
        f"{' '.join(sys.argv[1:])}`.",
        "",
        "`final_reward`: the workload's own evaluation (mean reward of its fixed batch of "
        f"{args.batch_size} ODE samples). `eval_reward`, `target_fraction`, FID and KID: "
        f"{args.eval_samples} ODE samples from fixed noise, FID/KID against the "
        f"{len(args.reference)} held-out digits {args.target} on the classifier's features "
        "(small sets: FID is biased upwards and noisy; compare runs, not absolute values). "
        f"`path KL`: `KL(p_theta || p_pretrained)` of FlowSDE paths (noise level "
        f"{KL_NOISE_LEVEL}, the sampler GRPO trains on), the sum of per-step Gaussian KLs "
        f"along {args.eval_samples} of the fine-tuned model's own rollouts; the quantity "
        "GRPO's `kl=` penalises (at every step with weight `kl`). `units`: model calls of "
        "the whole run in forward-equivalents (a parameter VJP counts 2, a state VJP 1): "
        "the estimator's backward work, plus (after `+`) the base model's work for the "
        "objective (GRPO's KL reference, adjoint matching's lean adjoint); the sampling "
        f"rollouts ({args.sampler_steps} forwards per step) come on top in every mode.",
        "",
        "| mode | seed | final_reward (start) | eval_reward | target fraction | FID | KID "
        "| path KL |",
        "|---|---|---|---|---|---|---|---|",
        f"| pretrained | - | - | {base['eval_reward']:.3f} | {base['target_fraction']:.3f} | "
        f"{base['fid']:.2f} | {base['kid_mean']:.4f} | {base['path_kl']:.3f} |",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['seed']} | {row['final_reward']:.3f} "
            f"({row['initial_reward']:.3f}) | {row['eval_reward']:.3f} | "
            f"{row['target_fraction']:.3f} | {row['fid']:.2f} | {row['kid_mean']:.4f} | "
            f"{row['path_kl']:.3f} |"
        )
    columns = ("eval_reward", "target_fraction", "fid", "path_kl")
    lines += ["", "Means over seeds (min–max in brackets):", ""]
    lines += ["| mode | eval_reward | target fraction | FID | path KL | units |"]
    lines += ["|---|---|---|---|---|---|"]
    for mode in args.modes:
        mine = [row for row in rows if row["mode"] == mode]
        cells = []
        for column in columns:
            values = [row[column] for row in mine]
            cells.append(f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
        # The same every seed: the work is fixed by the settings (sdo's draw aside).
        units = sum(row["estimator_units"] for row in mine) / len(mine)
        extra = sum(row["objective_units"] for row in mine) / len(mine)
        cells.append(f"{units:g}" + (f" + {extra:g}" if extra else ""))
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    lines += [
        "",
        "What each mode optimises: `reward` the reward alone (backprop through the ODE "
        "sampler); `grpo` the reward's policy gradient on FlowSDE paths (clipped surrogate), "
        "with `kl=w` plus `w` times the path KL to the initial model; `adjoint_matching` "
        f"regresses towards `p_base(x) exp(reward(x)) = p_base(x) p({args.target} | x)`, a "
        "KL-regularised target. That target's reward and target fraction, estimated from the "
        f"pretrained model's {args.eval_samples} samples with self-normalised importance "
        "weights `p(target | x)` (few samples carry the weight: a rough estimate): "
        f"{base['tilted_reward']:.3f} and {base['tilted_target_fraction']:.3f}. The modes' "
        "losses have different scales; nothing was tuned, and "
        f"{args.steps} steps need not have converged.",
        "",
        "Commands (`RUN_DIR` a fresh folder per run):",
        "",
    ]
    lines += [f"    {row['command']}" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["reward", "adjoint_matching", "grpo:lr=3e-4", "grpo:kl=0.1,lr=3e-4"],
        help="NAME[:kl=W,lr=LR] per mode (default: %(default)s)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sampler-steps", type=int, default=10)
    parser.add_argument("--target", type=int, default=3)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--out", default="docs/results/digits_rl_objectives")
    args = parser.parse_args(argv)
    for mode in args.modes:
        parse_mode(mode)  # refuse a bad spec before the first run
    images, labels = DIGITS.load("heldout")
    args.reference = images[labels == args.target]
    args.base = load_pretrained_dit()
    base = score(args.base, args, args.reference)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            for mode in args.modes:
                rows.append(run(mode, seed, args, Path(folder)))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # gradest's writer: atomic, and never onto a device, pipe or folder (gradest_lab.storage.files).
    atomic_write_text(
        out / "results.json", json.dumps({"pretrained": base, "runs": rows}, indent=2)
    )
    atomic_write_text(out / "results.md", to_markdown(args, base, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
