"""``gradest cost``: what a training step of each estimator costs on a model, without a GPU.

The model is built on the meta device (no weights, no data): a shipped preset
(``sd3-medium``, ``sd3.5-large``, ``flux-dev``, ``sdxl-unet``), a diffusers config folder,
or one of gradest's embedded models (``mlp``, ``dit``). One training step per estimator is
traced (:func:`gradest.harness.training_cost.training_step_cost`) and the FLOPs, the
retained activation bytes and the peak bytes are printed, with whether the step fits
each ``--memory``. :func:`predict_costs` is the same as a Python call.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from gradest import registry
from gradest.conditioning import map_tensors
from gradest.errors import InvalidValue
from gradest.files import atomic_write_text, check_output_file
from gradest.harness.call_replay import ReplayCalls
from gradest.harness.training_cost import TrainingCost, decisions_vary, training_step_cost
from gradest.integers import WholeNumber, whole_number_problem
from gradest.objectives import StepwiseObjective, TerminalObjective
from gradest.samplers import RectifiedFlow
from gradest.specs import format_spec_list, spec_list_text, split_spec_list

__all__ = [
    "ModelSetup",
    "add_arguments",
    "default_estimators",
    "model_setup",
    "parse_bytes",
    "predict_costs",
    "run",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MEMORY = "24GiB,48GiB,80GiB"
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def default_estimators() -> list[str]:
    """``gradest cost``'s default estimators: each built-in's ``cost_specs`` (the registry
    asks the estimators, :func:`gradest.registry.line_up`)."""
    return registry.line_up("cost")


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> bytes. Units: B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidValue(
            f"--memory {text!r} is not a size with a unit; write e.g. 80GiB, 24GB or 512MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise InvalidValue(f"--memory {text!r} must be > 0")
    return int(value)


@attrs.frozen(eq=False)
class ModelSetup:
    """A model on the meta device with everything one training step needs."""

    name: str
    velocity: torch.nn.Module
    noise_shape: tuple[int, ...]
    cond: dict[str, Any]
    steps: int
    dtype: torch.dtype
    settings: dict[str, Any]


def model_setup(
    model: str,
    *,
    steps: int | None = None,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    dtype: str = "bf16",
    prompt_tokens: int | None = None,
    cfg: float | None = None,
    lora_rank: int | None = None,
    gradient_checkpointing: bool = False,
) -> ModelSetup:
    """Build ``model`` (a preset, a diffusers config folder or ``mlp`` / ``dit``) on meta."""
    from gradest.harness.embedded import MODELS, embedded_problem

    if dtype not in DTYPES:
        raise InvalidValue(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    # The command line's rule for its integers (gradest.integers), for Python callers too.
    for flag, value in (("--steps", steps), ("--batch", batch), ("--lora-rank", lora_rank)):
        refused = None if value is None else whole_number_problem(value, minimum=1)
        if refused is not None:
            raise InvalidValue(f"{flag} {refused}")
    if cfg is not None and not (isinstance(cfg, int | float) and cfg == cfg):
        raise InvalidValue(f"--cfg must be a guidance scale (a number), got {cfg!r}")
    settings: dict[str, Any] = {
        "batch": batch,
        "dtype": dtype,
        "lora_rank": lora_rank,
        "gradient_checkpointing": gradient_checkpointing,
        "cfg": cfg,
    }
    if model in MODELS:
        extra = {
            "height": height,
            "width": width,
            "prompt_tokens": prompt_tokens,
            "cfg": cfg,
            "lora_rank": lora_rank,
        }
        given = [k for k, v in extra.items() if v is not None]
        if given or gradient_checkpointing:
            names = ", ".join("--" + k.replace("_", "-") for k in given) or (
                "--gradient-checkpointing"
            )
            raise InvalidValue(
                f"{names} apply to diffusers models; the embedded model {model!r} has a "
                f"fixed state shape (drop them, or pass a preset or a config folder)"
            )
        n = 50 if steps is None else steps
        problem = embedded_problem(
            model, steps=n, objective="terminal", batch=batch, dtype=torch_dtype
        )
        velocity = problem.model.to("meta")
        noise = problem.noise_fn(0)
        cond = map_tensors(dict(problem.cond_fn(0)), lambda v: v.to("meta"))
        settings.update(steps=n)
        return ModelSetup(model, velocity, tuple(noise.shape), cond, n, torch_dtype, settings)
    from gradest.integrations.diffusers_presets import diffusers_shapes, load_config

    config, preset = load_config(model)
    if preset is None and (height is None or width is None or steps is None):
        raise InvalidValue(
            f"--model {model!r} is a config folder: pass --height, --width and --steps "
            f"(presets carry their pipeline's defaults)"
        )
    height = height if height is not None else preset.height  # type: ignore[union-attr]
    width = width if width is not None else preset.width  # type: ignore[union-attr]
    n = steps if steps is not None else preset.steps  # type: ignore[union-attr]
    tokens = (
        prompt_tokens
        if prompt_tokens is not None
        else (preset.prompt_tokens if preset is not None else None)
    )
    shapes = diffusers_shapes(
        config, batch=batch, height=height, width=width, dtype=torch_dtype,
        prompt_tokens=tokens, cfg_scale=cfg, lora_rank=lora_rank,
        gradient_checkpointing=gradient_checkpointing, source=f"--model {model!r}",
    )  # fmt: skip
    settings.update(
        height=height, width=width, steps=n, prompt_tokens=tokens, model_class=config["_class_name"]
    )
    return ModelSetup(
        model, shapes.velocity, shapes.latent_shape, shapes.cond, n, torch_dtype, settings
    )


def predict_costs(
    setup: ModelSetup,
    estimators: Sequence[Any],
    *,
    objective: str = "terminal",
    draws: int = 4,
    attention: str = "fused",
    show_progress: bool = False,
) -> dict[str, TrainingCost]:
    """One traced training step per estimator on ``setup``'s model (spec -> cost)."""
    if objective not in ("terminal", "stepwise"):
        raise InvalidValue(f"--objective must be 'terminal' or 'stepwise', got {objective!r}")
    sampler = RectifiedFlow(steps=setup.steps)
    # A reward on the final latents / a per-step loss on the velocities: their own cost is
    # elementwise (no FLOPs), so every estimator is priced for the model's work alone.
    goal = (
        TerminalObjective(lambda z: z.float().square().mean())
        if objective == "terminal"
        else StepwiseObjective(lambda k, v, trajectory: v.float().square().mean())
    )
    noise = torch.zeros(setup.noise_shape, dtype=setup.dtype, device="meta")
    built = {
        spec if isinstance(spec, str) else repr(spec): registry.estimator(spec)
        for spec in estimators
    }
    # Every estimator is tried on a stand-in first: one that cannot be traced (jagg's
    # gate, auto) fails now, not after minutes of tracing the others.
    varies = {spec: decisions_vary(est, sampler, goal) for spec, est in built.items()}
    # One replaying wrapper for every estimator: each call signature is traced once.
    model = ReplayCalls(setup.velocity)
    costs: dict[str, TrainingCost] = {}
    for spec, est in tqdm(
        built.items(), desc="gradest cost", disable=not show_progress, leave=False
    ):
        costs[spec] = training_step_cost(
            est,
            model,
            sampler,
            goal,
            noise=noise,
            cond=setup.cond,
            draws=draws,
            attention=attention,
            varies=varies[spec],
        )
    return costs


def _fmt_flops(value: float) -> str:
    for unit, scale in (
        ("PFLOP", 1e15),
        ("TFLOP", 1e12),
        ("GFLOP", 1e9),
        ("MFLOP", 1e6),
        ("kFLOP", 1e3),
    ):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP"


def _fmt_bytes(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _with_range(mean: float, low: int, high: int, fmt: Any) -> str:
    return fmt(mean) if low == high else f"{fmt(mean)} ({fmt(low)} to {fmt(high)})"


def format_table(costs: dict[str, TrainingCost], memories: Sequence[tuple[str, int]]) -> str:
    """A markdown table: FLOPs (and ratio to exact), retained and peak bytes, fits."""
    exact = costs.get("exact")
    header = ["estimator", "FLOPs / step", "x exact", "retained", "peak"]
    header += [f"fits {label}" for label, _ in memories]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for spec, cost in costs.items():
        ratio = f"{cost.flops / exact.flops:.3f}" if exact and exact.flops else "-"
        row = [
            f"`{spec}`",
            _with_range(cost.flops, *cost.flops_range, _fmt_flops),
            ratio,
            _with_range(cost.retained_bytes, *cost.retained_range, _fmt_bytes),
            _with_range(cost.peak_bytes, *cost.peak_range, _fmt_bytes),
        ]
        row += ["yes" if cost.fits(limit) else "no" for _, limit in memories]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gradest cost`` options."""
    parser.add_argument(
        "--model",
        required=True,
        help="a preset (sd3-medium, sd3.5-large, flux-dev, sdxl-unet), a diffusers model "
        "folder with config.json (SD3, Flux, UNet2DCondition), or an embedded model "
        "(mlp, dit)",
    )
    # Every integer flag is a whole number >= 1 within int64 (gradest.integers).
    count = WholeNumber(1)
    parser.add_argument(
        "--steps",
        type=count,
        default=None,
        help="sampling steps N (default: the preset's pipeline default; 50 for mlp / dit)",
    )
    parser.add_argument("--height", type=count, default=None, help="image height in pixels")
    parser.add_argument("--width", type=count, default=None, help="image width in pixels")
    parser.add_argument("--batch", type=count, default=1, help="images per step (default 1)")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    parser.add_argument(
        "--estimators",
        default=None,  # default_estimators(), read from the registry when the command runs
        type=spec_list_text,
        help="estimator specs separated by ',' (default: the built-ins' cost line-up, e.g. "
        "exact,sdo; jagg's gate reads values, so give jagg:gate=off: its cost when every "
        "group interpolates)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=count,
        default=None,
        help="text tokens per prompt (default 333 SD3, 512 Flux, 77 SDXL)",
    )
    parser.add_argument(
        "--cfg",
        type=float,
        nargs="?",
        const=4.5,
        default=None,
        help="classifier-free guidance in every call (2B rows); optional scale",
    )
    parser.add_argument(
        "--lora-rank",
        type=count,
        default=None,
        help="train LoRA adapters of this rank on the attention projections "
        "(default: full fine-tuning)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="diffusers' enable_gradient_checkpointing()",
    )
    parser.add_argument(
        "--objective",
        default="terminal",
        help="terminal (a reward on the sample, default) or stepwise (GRPO-like)",
    )
    parser.add_argument(
        "--memory",
        default=DEFAULT_MEMORY,
        help=f"device memory sizes to check, comma-separated (default {DEFAULT_MEMORY})",
    )
    parser.add_argument(
        "--draws",
        type=count,
        default=4,
        help="draws averaged for stochastic estimators (default 4)",
    )
    parser.add_argument(
        "--attention",
        default="fused",
        help="fused (a GPU's flash / memory-efficient kernel, default) or math",
    )
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """``gradest cost``: trace, print the table, write ``--json``."""
    memories = [(text.strip(), parse_bytes(text)) for text in args.memory.split(",")]
    default = format_spec_list(default_estimators())
    given = default if args.estimators is None else args.estimators
    specs = split_spec_list(given, what="--estimators")
    if not specs:
        raise InvalidValue(f"--estimators is empty; e.g. --estimators {default}")
    if args.json is not None:
        check_output_file(args.json, what="--json")  # before minutes of tracing
    started = time.perf_counter()
    setup = model_setup(
        args.model, steps=args.steps, height=args.height, width=args.width, batch=args.batch,
        dtype=args.dtype, prompt_tokens=args.prompt_tokens, cfg=args.cfg,
        lora_rank=args.lora_rank, gradient_checkpointing=args.gradient_checkpointing,
    )  # fmt: skip
    costs = predict_costs(
        setup,
        specs,
        objective=args.objective,
        draws=args.draws,
        attention=args.attention,
        show_progress=not args.quiet,
    )
    seconds = time.perf_counter() - started
    settings = ", ".join(f"{k}={v}" for k, v in setup.settings.items() if v is not None)
    print(
        f"# gradest cost: {args.model} ({settings}), objective={args.objective}, "
        f"attention={args.attention}, traced in {seconds:.0f} s\n"
    )
    print(format_table(costs, memories))
    if args.json is not None:
        payload = {
            "model": args.model,
            "settings": setup.settings | {"objective": args.objective, "attention": args.attention},
            "memory": {label: limit for label, limit in memories},
            "estimators": {
                spec: cost.as_dict()
                | {"fits": {label: cost.fits(limit) for label, limit in memories}}
                for spec, cost in costs.items()
            },
            "seconds": seconds,
            "torch": torch.__version__,
        }
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
    return 0
