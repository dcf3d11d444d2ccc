"""Digits: ``gradest finetune`` in several modes with the same seeds and settings.

Each (mode, seed) is one ``gradest finetune`` command (recorded verbatim); the final
checkpoint is then sampled with the Euler ODE on a fixed batch of noise (unconditional,
the default ``--labels null``) and scored: the mean reward ``log p(target | x)``, the
fraction the classifier assigns to the target, and FID / KID against the held-out digits
of the target class (:func:`gradest.workloads.metrics.fid_kid`). The pretrained model is
scored the same way as the baseline.

    python -m benchmarks.digits_rl_objectives --steps 15 --seeds 0 1 2 \
        --out docs/results/digits_adjoint_matching
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gradest
from gradest.workloads.assets import load_digit_classifier, load_pretrained_dit
from gradest.workloads.digits import load_digits_dataset
from gradest.workloads.metrics import fid_kid


def score(model: torch.nn.Module, args: argparse.Namespace, reference: torch.Tensor) -> dict:
    """Reward, target fraction and FID/KID of ``args.eval_samples`` ODE samples."""
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
    }


def run(mode: str, seed: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    flags = [
        "--mode", mode, "--steps", str(args.steps), "--seed", str(seed),
        "--lr", str(args.lr), "--batch-size", str(args.batch_size),
        "--sampler-steps", str(args.sampler_steps), "--target", str(args.target),
    ]  # fmt: skip
    out = folder / f"{mode}_seed{seed}"
    command = ["gradest", "finetune", *flags, "--out", str(out), "--quiet"]
    subprocess.run([sys.executable, "-m", "gradest.cli", *command[1:]], check=True)
    result = json.loads((out / "result.json").read_text())
    model = load_pretrained_dit()
    model.load_state_dict(torch.load(result["checkpoints"][-1], weights_only=True)["model"])
    shown = " ".join(shlex.quote(part) for part in [*command[:-3], "--out", "RUN_DIR", "--quiet"])
    return {
        "mode": mode,
        "seed": seed,
        "command": shown,
        "initial_reward": result["initial_reward"],
        "final_reward": result["final_reward"],
        **score(model, args, args.reference),
    }


def to_markdown(args: argparse.Namespace, base: dict, rows: list[dict]) -> str:
    lines = [
        "# Digits: adjoint matching vs direct reward backpropagation",
        "",
        f"Shipped digits DiT, reward `log p({args.target} | x)` of the shipped classifier, "
        f"unconditional sampling (`--labels null`), {args.steps} outer steps, batch "
        f"{args.batch_size}, {args.sampler_steps} sampler steps, AdamW lr {args.lr}, seeds "
        f"{', '.join(map(str, args.seeds))}; estimator `exact` in every mode. CPU run, "
        f"produced by `python -m benchmarks.digits_rl_objectives "
        f"{' '.join(sys.argv[1:])}`.",
        "",
        "`final_reward`: the workload's own evaluation (mean reward of its fixed batch of "
        f"{args.batch_size} ODE samples). `eval_reward`, `target_fraction`, FID and KID: "
        f"{args.eval_samples} ODE samples from fixed noise, FID/KID against the "
        f"{len(args.reference)} held-out digits {args.target} on the classifier's features "
        "(small sets: FID is biased upwards and noisy; compare runs, not absolute values).",
        "",
        "| mode | seed | final_reward (start) | eval_reward | target fraction | FID | KID |",
        "|---|---|---|---|---|---|---|",
        f"| pretrained | - | - | {base['eval_reward']:.3f} | {base['target_fraction']:.3f} | "
        f"{base['fid']:.2f} | {base['kid_mean']:.4f} |",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['seed']} | {row['final_reward']:.3f} "
            f"({row['initial_reward']:.3f}) | {row['eval_reward']:.3f} | "
            f"{row['target_fraction']:.3f} | {row['fid']:.2f} | {row['kid_mean']:.4f} |"
        )
    lines += ["", "Means over seeds:", "", "| mode | eval_reward | target fraction | FID |"]
    lines.append("|---|---|---|---|")
    for mode in args.modes:
        mine = [row for row in rows if row["mode"] == mode]
        mean = {
            k: sum(r[k] for r in mine) / len(mine)
            for k in ("eval_reward", "target_fraction", "fid")
        }
        lines.append(
            f"| {mode} | {mean['eval_reward']:.3f} | {mean['target_fraction']:.3f} | "
            f"{mean['fid']:.2f} |"
        )
    lines += [
        "",
        "Reading: `reward` maximises the reward alone; `adjoint_matching` fine-tunes towards "
        f"`p_base(x) exp(reward(x)) = p_base(x) p({args.target} | x)`, a KL-regularised "
        "target: compare its rows with that target rather than with `reward` mode. The "
        "target's reward and target fraction, estimated from the pretrained model's "
        f"{args.eval_samples} samples with self-normalised importance weights "
        f"`p(target | x)` (few samples carry the weight: a rough estimate): "
        f"{base['tilted_reward']:.3f} and {base['tilted_target_fraction']:.3f}. Both modes use "
        "the same lr although their losses have different scales; nothing was tuned, and "
        f"{args.steps} steps need not have converged.",
        "",
        "Commands (`RUN_DIR` a fresh folder per run):",
        "",
    ]
    lines += [f"    {row['command']}" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["reward", "adjoint_matching"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sampler-steps", type=int, default=10)
    parser.add_argument("--target", type=int, default=3)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--out", default="docs/results/digits_adjoint_matching")
    args = parser.parse_args(argv)
    images, labels = load_digits_dataset("heldout")
    args.reference = images[labels == args.target]
    base = score(load_pretrained_dit(), args, args.reference)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            for mode in args.modes:
                rows.append(run(mode, seed, args, Path(folder)))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"pretrained": base, "runs": rows}, indent=2))
    (out / "results.md").write_text(to_markdown(args, base, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
