"""GPU check: estimators on a ~300M-parameter DiT in bf16, plus a dense-reference check.

    python -m benchmarks.gpu_dit --device cuda --out $OUT/gpu_dit          # the H200 run
    python -m benchmarks.gpu_dit --device cpu --config tiny --dtype float32  # runs anywhere

For exact, jagg (window 4), sdo and truncated(k=1), on a terminal reward-like objective
(sampling from noise, each estimator's cheapest path) and on a stepwise GRPO-like
objective (a recorded path): the time of the gradient computation (CUDA events on CUDA,
``perf_counter`` on CPU) and the peak memory (``torch.cuda.max_memory_allocated`` on
CUDA; retained activation bytes on CPU) as ratios to exact, and the gradient's cosine to
exact. First, a small DiT (config ``micro``, float64) is checked against
``gradest.reference`` on the same device. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import gradest
from gradest.harness.cost import retained_activation_bytes
from gradest.models.dit import DiT
from gradest.reference import exact_gradient, relative_error
from gradest.testing import problems

ESTIMATORS = ("exact", "jagg:window=4", "jagg:window=4,shared_knots=true", "sdo", "truncated:k=1")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def perturbed_dit(config: str, seed: int, device: str, dtype: torch.dtype, classes: int) -> DiT:
    """A DiT whose adaLN-Zero layers are re-drawn small, so it is not the zero map."""
    model = problems.perturbed_dit(config, seed, num_classes=classes)
    return model.to(device=device, dtype=dtype)  # type: ignore[return-value]


def reference_check(device: str) -> dict[str, float]:
    """``exact`` vs the dense reference for a micro DiT in float64 on ``device``."""
    model = perturbed_dit("micro", 0, device, torch.float64, classes=3)
    flow = gradest.RectifiedFlow(steps=4)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 1, 4, 4, generator=gen, dtype=torch.float64).to(device)
    cond = {"y": torch.tensor([0, 3], device=device)}
    objective = gradest.TerminalObjective(lambda z: (z.sin() ** 2).sum())
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    truth, truth_noise = exact_gradient(
        model.cpu(), flow, objective, _to_cpu(trajectory), {"y": cond["y"].cpu()}
    )
    model.to(device)
    result = gradest.estimator("exact").estimate(
        model, flow, objective, noise=noise, cond=cond, noise_grad=True
    )
    return {
        "grad_relative_error": relative_error({k: v.cpu() for k, v in result.grads.items()}, truth),
        "noise_grad_relative_error": relative_error(result.noise_grad.cpu(), truth_noise),
    }


def _to_cpu(trajectory: gradest.Trajectory) -> gradest.Trajectory:
    return gradest.Trajectory(
        times=trajectory.times,
        states=trajectory.states.cpu(),
        velocities=trajectory.velocities.cpu(),
        step_noise=None if trajectory.step_noise is None else trajectory.step_noise.cpu(),
    )


def _timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA events on CUDA)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _peak_memory(fn: Callable[[], Any], device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return retained_activation_bytes(fn)


def measure(args: argparse.Namespace, specs: Sequence[str]) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    model = perturbed_dit(
        args.config, 0, args.device, dtype, classes=1000 if args.config != "tiny" else 10
    )
    size, channels = model.config.input_size, model.config.in_channels
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(args.batch, channels, size, size, generator=gen).to(args.device, dtype)
    cond = {
        "y": torch.randint(0, model.config.num_classes, (args.batch,), generator=gen).to(
            args.device
        )
    }
    flow = gradest.RectifiedFlow(steps=args.steps)
    target = torch.randn(noise.shape, generator=gen).to(args.device, dtype)
    terminal = gradest.TerminalObjective(lambda z: (z.float() - target.float()).pow(2).mean())
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    centres = torch.randn((args.steps, *noise.shape), generator=gen).to(args.device, dtype)
    stepwise = gradest.StepwiseObjective(
        lambda k, v, traj: (v.float() - centres[k].float()).pow(2).mean() / args.steps
    )
    results: dict[str, Any] = {}
    for kind, objective, inputs in (
        ("terminal", terminal, {"noise": noise}),
        ("stepwise", stepwise, {"trajectory": trajectory}),
    ):
        rows = {}
        exact_flat = None
        for spec in specs:
            est = gradest.estimator(spec)

            def call(est: Any = est, objective: Any = objective, inputs: Any = inputs) -> Any:
                return est.estimate(
                    model,
                    flow,
                    objective,
                    cond=cond,
                    generator=torch.Generator().manual_seed(0),
                    **inputs,
                )

            flat = call().flat().double()
            exact_flat = flat if spec == "exact" else exact_flat
            rows[spec] = {
                "seconds": _timed(call, args.device, args.repeats),
                "peak_bytes": _peak_memory(call, args.device),
                "cosine": float(
                    flat @ exact_flat / (flat.norm() * exact_flat.norm()).clamp_min(1e-30)
                ),
            }
        for row in rows.values():
            row["time_ratio"] = row["seconds"] / rows["exact"]["seconds"]
            row["memory_ratio"] = row["peak_bytes"] / max(rows["exact"]["peak_bytes"], 1)
        results[kind] = rows
    results["parameters"] = sum(p.numel() for p in model.parameters())
    return results


def to_markdown(
    config: dict[str, Any], results: dict[str, Any], reference: dict[str, float]
) -> str:
    memory = (
        "max_memory_allocated"
        if config["device"].startswith("cuda")
        else "retained activation bytes"
    )
    lines = [
        f"# gradest on a {results['parameters'] / 1e6:.0f}M-parameter DiT "
        f"({config['dtype']}, {config['device_name']})",
        "",
        f"`{config['command']}` — {config['date']}, torch {config['torch']}. "
        f"Config `{config['config']}`, batch {config['batch']}, N={config['steps']}, "
        f"median of {config['repeats']} repeats.",
        "",
        f"Dense-reference check (micro DiT, float64, same device): gradient relative error "
        f"{reference['grad_relative_error']:.2e}, "
        f"noise gradient {reference['noise_grad_relative_error']:.2e}.",
        "",
    ]
    for kind in ("terminal", "stepwise"):
        lines += [
            f"## {kind}",
            "",
            f"| estimator | seconds | time / exact | {memory} / exact | cosine to exact |",
            "|---|---|---|---|---|",
        ]
        for spec, row in results[kind].items():
            lines.append(
                f"| `{spec}` | {row['seconds']:.3f} | {row['time_ratio']:.3f} "
                f"| {row['memory_ratio']:.3f} | {row['cosine']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="gpu300m", help="DiT config (gpu300m, L, B, S, tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--out", default="runs/gpu_dit")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(
            "--device cuda requested but CUDA is not available; use --device cpu --config tiny"
        )
    from gradest.specs import split_spec_list

    specs = split_spec_list(args.estimators, what="--estimators")
    if specs[0] != "exact":
        specs = ["exact", *[s for s in specs if s != "exact"]]
    reference = reference_check(args.device)
    results = measure(args, specs)
    config = {
        "command": "python -m benchmarks.gpu_dit "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        **vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"config": config, "reference": reference, "results": results}, indent=2)
    )
    markdown = to_markdown(config, results, reference)
    (out / "results.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
