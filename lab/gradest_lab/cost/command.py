"""``gradest cost``: what a training step of each estimator costs on a model, without a GPU.

The model is built on the meta device (no weights, no data): a shipped preset
(``sd3-medium``, ``sd3.5-large``, ``flux-dev``, ``sdxl-unet``), a diffusers config folder,
or one of gradest's embedded models (``mlp``, ``dit``). One training step per estimator is
traced (:func:`gradest_lab.cost.training_cost.training_step_cost`) and the FLOPs, the
retained activation bytes and the peak bytes are printed, with whether the step fits
each ``--memory``. :func:`predict_costs` is the same as a Python call.

With a pixel ``--reward`` (a learned reward's model, default ``aesthetic`` for a diffusers
model) the step decodes with the family's VAE and scores with the reward model: each is
priced as its own line (:mod:`gradest_lab.cost.pixel_cost`) beside the transformer's, and
the whole step is traced with all of them (:func:`predict_step_costs`); ``--reward
latent`` is the transformer's step alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from gradest import (
    FlowSDE,
    InvalidValue,
    RectifiedFlow,
    StepwiseObjective,
    TerminalObjective,
    estimator,
)
from gradest.plugin import (
    Command,
    WholeNumber,
    format_spec_list,
    line_up,
    map_tensors,
    spec_list_text,
    split_spec_list,
    whole_number_problem,
)
from gradest.rl import separable_over_steps
from gradest_lab.cost.call_replay import ReplayCalls
from gradest_lab.cost.pixel_cost import PartCost, PixelSetup, part_cost, pixel_setup
from gradest_lab.cost.training_cost import (
    TrainingCost,
    decisions_vary,
    prepare_optimizer,
    training_step_cost,
)
from gradest_lab.storage.files import atomic_write_text, check_output_file

__all__ = [
    "COMMAND",
    "ModelSetup",
    "add_arguments",
    "command_line",
    "default_estimators",
    "format_report",
    "given_options",
    "report_header",
    "resolve_options",
    "model_setup",
    "parse_bytes",
    "StepCosts",
    "predict_costs",
    "predict_step_costs",
    "run",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MEMORY = "24GiB,48GiB,80GiB"
#: The SDE a stepwise (GRPO-like) step samples its path with: Flow-GRPO's noise level.
STEPWISE_NOISE_LEVEL = 0.7
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def default_estimators() -> list[str]:
    """``gradest cost``'s default estimators: each built-in's ``cost_specs`` (the registry
    asks the estimators, :func:`gradest.plugin.line_up`)."""
    return line_up("cost")


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
    family: str | None = None  # sd3 / flux / unet (its VAE decodes); None: embedded


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
    true_cfg: float | None = None,
    lora_targets: str | None = None,
) -> ModelSetup:
    """Build ``model`` (a preset, a diffusers config folder or ``mlp`` / ``dit``) on meta.

    ``cfg`` is the model's guidance as its pipeline's ``guidance_scale``: classifier-free
    guidance (every call on ``2B`` rows; off at 1) or, for a model with a guidance
    embedding (flux-dev), the embedding's value (``B`` rows); ``true_cfg`` is Flux's true
    CFG around the embedding (``2B`` rows). ``settings["guidance"]`` says which, in words
    (:func:`gradest_lab.cost.diffusers_presets.guidance_plan`). ``lora_targets``: the
    module names that get adapters, comma-separated (default
    :data:`~gradest_lab.cost.diffusers_presets.LORA_TARGETS`).
    """
    from gradest_lab.compare.problems import MODELS, embedded_problem

    if dtype not in DTYPES:
        raise InvalidValue(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    # The command line's rule for its integers (gradest.integers), for Python callers too.
    for flag, value in (("--steps", steps), ("--batch", batch), ("--lora-rank", lora_rank)):
        refused = None if value is None else whole_number_problem(value, minimum=1)
        if refused is not None:
            raise InvalidValue(f"{flag} {refused}")
    for flag, scale in (("--cfg", cfg), ("--true-cfg", true_cfg)):
        number = isinstance(scale, int | float) and not isinstance(scale, bool)
        if scale is not None and not (number and math.isfinite(scale) and scale >= 0):
            raise InvalidValue(
                f"{flag} must be a guidance scale (a finite number >= 0), got {scale!r}"
            )
    targets = None
    if lora_targets is not None:
        targets = tuple(name.strip() for name in str(lora_targets).split(","))
        if lora_rank is None or not all(targets):
            raise InvalidValue(
                f"--lora-targets {lora_targets!r}: module names separated by ',' (none "
                f"empty), with --lora-rank; e.g. --lora-rank 16 --lora-targets to_q,to_v"
            )
    settings: dict[str, Any] = {
        "batch": batch,
        "dtype": dtype,
        "lora_rank": lora_rank,
        "gradient_checkpointing": gradient_checkpointing,
        "cfg": cfg,
        "true_cfg": true_cfg,
        "guidance": "none (1 row per sample)",
        "rows_per_sample": 1,
    }
    if model in MODELS:
        extra = {
            "height": height,
            "width": width,
            "prompt_tokens": prompt_tokens,
            "cfg": cfg,
            "true_cfg": true_cfg,
            "lora_rank": lora_rank,
            "lora_targets": lora_targets,
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
    from gradest_lab.cost.diffusers_presets import diffusers_shapes, load_config

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
        prompt_tokens=tokens, cfg_scale=cfg, true_cfg_scale=true_cfg, lora_rank=lora_rank,
        gradient_checkpointing=gradient_checkpointing, source=f"--model {model!r}",
        lora_targets=targets,
    )  # fmt: skip
    if targets is not None:
        settings["lora_targets"] = ",".join(targets)
    settings.update(
        guidance=shapes.guidance, rows_per_sample=shapes.rows_per_sample, height=height,
        width=width, steps=n, prompt_tokens=tokens, model_class=config["_class_name"],
    )  # fmt: skip
    return ModelSetup(
        model, shapes.velocity, shapes.latent_shape, shapes.cond, n, torch_dtype, settings,
        shapes.family,
    )  # fmt: skip


@attrs.frozen
class StepCosts:
    """One estimator's training step: the transformer alone (a reward on the latents) and,
    with a pixel reward, the whole step (decoder and reward model included) and how many
    times the step evaluated them (with and without a graph)."""

    transformer: TrainingCost
    whole: TrainingCost | None = None
    calls: dict[str, int] | None = None


def predict_costs(
    setup: ModelSetup,
    estimators: Sequence[Any],
    *,
    objective: str = "terminal",
    draws: int = 4,
    attention: str = "fused",
    show_progress: bool = False,
    per_timestep: bool = False,
) -> dict[str, TrainingCost]:
    """One traced training step per estimator on ``setup``'s model (spec -> cost)."""
    return {
        spec: cost.transformer
        for spec, cost in predict_step_costs(
            setup, estimators, objective=objective, draws=draws, attention=attention,
            show_progress=show_progress, per_timestep=per_timestep,
        ).items()
    }  # fmt: skip


def predict_step_costs(
    setup: ModelSetup,
    estimators: Sequence[Any],
    *,
    pixels: PixelSetup | None = None,
    objective: str = "terminal",
    draws: int = 4,
    attention: str = "fused",
    show_progress: bool = False,
    replay: bool = True,
    per_timestep: bool = False,
) -> dict[str, StepCosts]:
    """Each estimator's step on ``setup``'s model, and with ``pixels`` the whole step.

    The transformer's calls, the optimizer's step and the pixel loss (decode and reward
    as one call) are each traced once and replayed in every estimator's step
    (``replay=False`` traces everything, for the tests that compare the two). A stepwise
    objective samples its path with :class:`gradest.FlowSDE` (Flow-GRPO's SDE, noise
    level 0.7); with ``per_timestep`` it trains one step at a time, as Flow-GRPO and the
    grpo recipe with ``exact`` do (``training_step_cost(per_timestep=True)``).
    """
    if objective not in ("terminal", "stepwise"):
        raise InvalidValue(f"--objective must be 'terminal' or 'stepwise', got {objective!r}")
    if pixels is not None and objective != "terminal":
        raise InvalidValue(
            "--objective stepwise scores sampled paths without a graph through the reward; "
            "a pixel --reward is priced for the terminal objective: pass --reward latent"
        )
    if per_timestep and objective != "stepwise":
        raise InvalidValue(
            "--per-timestep trains a stepwise objective one step at a time (Flow-GRPO's "
            "loop); pass --objective stepwise, or drop --per-timestep"
        )
    sampler: Any = (
        RectifiedFlow(steps=setup.steps)
        if objective == "terminal"
        else FlowSDE(steps=setup.steps, noise_level=STEPWISE_NOISE_LEVEL)
    )
    # A reward on the final latents / a per-step loss on the velocities: their own cost is
    # elementwise (no FLOPs), so every estimator is priced for the model's work alone.
    goal = (
        TerminalObjective(lambda z: z.float().square().mean())
        if objective == "terminal"
        else StepwiseObjective(lambda k, v, trajectory: v.float().square().mean())
    )
    noise = torch.zeros(setup.noise_shape, dtype=setup.dtype, device="meta")
    built = {spec if isinstance(spec, str) else repr(spec): estimator(spec) for spec in estimators}
    if per_timestep:
        # Before any tracing: a step at a time keeps exact's gradient only (one line).
        others = [spec for spec, est in built.items() if not separable_over_steps(est)]
        if others:
            raise InvalidValue(
                f"--per-timestep prices exact's loop of one backward per step; "
                f"{', '.join(others)} {'chooses' if len(others) == 1 else 'choose'} among "
                f"the steps, which one step at a time would take away: pass --estimators "
                f"exact (or exact:checkpoint=true)"
            )
    # Every estimator is tried on a stand-in first: one that cannot be traced (jagg's
    # gate, auto) fails now, not after minutes of tracing the others.
    varies = {spec: decisions_vary(est, sampler, goal) for spec, est in built.items()}
    # One replaying wrapper for every estimator: each call signature is traced once; one
    # optimizer, its state made and its step traced once (the same in every step).
    model: torch.nn.Module = ReplayCalls(setup.velocity) if replay else setup.velocity
    optimizer = prepare_optimizer(model)
    pixel_goal = None
    if pixels is not None:
        loss = pixels.loss()
        # The decode and the reward are one call of fixed shapes: traced once too.
        traced_loss: torch.nn.Module = ReplayCalls(loss) if replay else loss
        when = torch.zeros((), device=noise.device)

        def pixel_loss(z: torch.Tensor) -> torch.Tensor:
            loss.count(z)
            return traced_loss(z, when)

        pixel_goal = TerminalObjective(pixel_loss)
    costs: dict[str, StepCosts] = {}
    # Every step collects garbage before it is measured: with the model's objects frozen
    # out of the collector's walk that takes milliseconds, not a second per step.
    gc.collect()
    gc.freeze()
    try:
        for spec, est in tqdm(
            built.items(), desc="gradest cost", disable=not show_progress, leave=False
        ):
            common: dict[str, Any] = dict(
                noise=noise, cond=setup.cond, optimizer=optimizer, draws=draws,
                attention=attention, varies=varies[spec], replay=replay,
            )  # fmt: skip
            if per_timestep:
                common["per_timestep"] = True
            transformer = training_step_cost(est, model, sampler, goal, **common)
            if pixel_goal is None or pixels is None:
                costs[spec] = StepCosts(transformer)
                continue
            loss.calls.update(graph=0, no_graph=0)
            whole = training_step_cost(
                est, model, sampler, pixel_goal, frozen=[pixels.decoder, *_present(pixels.reward)],
                **common,
            )  # fmt: skip
            # Calls per step: the draws' mean (each draw evaluates the same number here).
            calls = {k: round(v / whole.draws) for k, v in loss.calls.items()}
            costs[spec] = StepCosts(transformer, whole, calls)
    finally:
        gc.unfreeze()
    return costs


def _present(module: torch.nn.Module | None) -> list[torch.nn.Module]:
    return [] if module is None else [module]


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


def _part_flops(part: PartCost, calls: dict[str, int]) -> int:
    return calls["graph"] * part.flops + calls["no_graph"] * part.forward_flops


def format_step_table(
    costs: dict[str, StepCosts],
    parts: dict[str, PartCost],
    memories: Sequence[tuple[str, int]],
) -> str:
    """Markdown, per estimator: the transformer's line (its step with a reward on the
    latents), one line per pixel part (its FLOPs over the step's calls; retained and peak
    of one call, its own parameters included) and the whole step's (its peak: everything
    resident and live at once), which is what must fit."""
    exact = costs.get("exact")
    exact_whole = exact.whole if exact is not None else None
    header = ["estimator", "part", "FLOPs / step", "x exact", "retained", "peak"]
    header += [f"fits {label}" for label, _ in memories]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    dash = ["-"] * len(memories)
    for spec, step in costs.items():
        t = step.transformer
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{spec}`",
                    "transformer",
                    _with_range(t.flops, *t.flops_range, _fmt_flops),
                    "-",
                    _with_range(t.retained_bytes, *t.retained_range, _fmt_bytes),
                    _with_range(t.peak_bytes, *t.peak_range, _fmt_bytes),
                    *dash,
                ]
            )
            + " |"
        )
        assert step.whole is not None and step.calls is not None
        for name, part in parts.items():
            row = [
                "",
                f"{name} (x{step.calls['graph']}"
                + (f", +{step.calls['no_graph']} no graph" if step.calls["no_graph"] else "")
                + ")",
                _fmt_flops(_part_flops(part, step.calls)),
                "-",
                _fmt_bytes(part.retained_bytes),
                _fmt_bytes(part.peak_bytes),
                *dash,
            ]
            lines.append("| " + " | ".join(row) + " |")
        w = step.whole
        ratio = f"{w.flops / exact_whole.flops:.3f}" if exact_whole and exact_whole.flops else "-"
        row = [
            "",
            "**whole step**",
            _with_range(w.flops, *w.flops_range, _fmt_flops),
            ratio,
            _with_range(w.retained_bytes, *w.retained_range, _fmt_bytes),
            "**" + _with_range(w.peak_bytes, *w.peak_range, _fmt_bytes) + "**",
        ]
        row += ["yes" if w.fits(limit) else "no" for _, limit in memories]
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
    parser.add_argument(
        "--recipe-defaults",
        nargs="?",
        const="reward",
        default=None,
        choices=("reward", "grpo"),
        help="price what the recipe of the model's family runs by default: reward (the "
        "default: the sdo estimator, LoRA rank 8, no transformer checkpointing, the VAE "
        "checkpointed, fp32 as mixed_precision='no', a pixel reward, the family's steps, "
        "resolution and guidance: SD3 CFG 7, SDXL CFG 5, Flux its guidance embedding at "
        "3.5) or grpo (SD3, Flux: the stepwise objective, exact one timestep at a time, "
        "LoRA rank 32 on the 8 projections of both streams, batch 4); any option given "
        "overrides its default",
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
    parser.add_argument("--batch", type=count, default=None, help="images per step (default 1)")
    parser.add_argument(
        "--dtype", default=None, help="bf16 (default; fp32 with --recipe-defaults), fp16 or fp32"
    )
    parser.add_argument(
        "--estimators",
        default=None,  # default_estimators(), read from the registry when the command runs
        type=spec_list_text,
        help="estimator specs separated by ',' (default: the built-ins' cost line-up, e.g. "
        "exact,sdo; with --recipe-defaults the recipes' sdo; jagg's gate reads values, so "
        "give jagg:gate=off: its cost when every group interpolates)",
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
        help="the model's guidance at this scale (the pipeline's guidance_scale; optional "
        "scale, default 4.5): classifier-free guidance in every call, 2B rows (conditional "
        "and unconditional), off at 1; for a model with a guidance embedding (flux-dev) the "
        "embedding's value, B rows (true CFG is --true-cfg). Default: no CFG (a guidance "
        "embedding is still one row per sample)",
    )
    parser.add_argument(
        "--true-cfg",
        type=float,
        nargs="?",
        const=4.0,
        default=None,
        help="Flux's true CFG (FluxPipeline's true_cfg_scale; optional scale, default 4): "
        "classifier-free guidance around the guidance embedding, 2B rows, off at 1 "
        "(refused for SD3 and UNets: their CFG is --cfg)",
    )
    parser.add_argument(
        "--lora-rank",
        type=count,
        default=None,
        help="train LoRA adapters of this rank on the attention projections "
        "(default: full fine-tuning; 8 with --recipe-defaults)",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora-rank: the module names that get adapters, comma-separated "
        "(default to_q,to_k,to_v,to_out.0, the recipes'; the grpo recipes' adds the "
        "context stream's attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="diffusers' enable_gradient_checkpointing() of the transformer / UNet "
        "(default off, as the recipes' gradient_checkpointing)",
    )
    parser.add_argument(
        "--objective",
        default=None,
        help="terminal (a reward on the sample, default) or stepwise (GRPO-like)",
    )
    parser.add_argument(
        "--per-timestep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --objective stepwise: one surrogate and one backward per step, as "
        "Flow-GRPO and the grpo recipe with exact train (one step's graph held at a time; "
        "exact only, whose gradient it keeps; default estimators: exact)",
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
    parser.add_argument(
        "--reward",
        default=None,
        help="what the terminal reward scores: a learned reward's model (aesthetic, "
        "pickscore, hpsv2, imagereward) or a reward config .json, on the VAE-decoded images; "
        "pixels (an elementwise reward on the decoded images: the decoder alone); latent "
        "(on the latents: the transformer alone). Default aesthetic for diffusers models "
        "with the terminal objective (pixels with --recipe-defaults), else latent",
    )
    parser.add_argument(
        "--decoder",
        default=None,
        help="the VAE that decodes for a pixel reward: an AutoencoderKL folder (or a "
        "pipeline folder with vae/) or config.json (default: the family's published VAE)",
    )
    parser.add_argument(
        "--decoder-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the VAE's enable_gradient_checkpointing() for a pixel reward's decode: its "
        "blocks recompute in backward (default on, as the recipes' decoder_checkpointing; "
        "--no-decoder-checkpointing holds the whole decode's graph)",
    )
    parser.add_argument(
        "--decoder-tile",
        type=WholeNumber(8),
        default=None,
        help="decode in tiles of this many pixels (the VAE's enable_tiling()); with "
        "decoder checkpointing one tile's block is the largest graph held",
    )
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


#: Options that are not settings of the step (where the output goes, its display).
_NOT_SETTINGS = ("json", "quiet")


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``args`` that differ from the command's defaults (what the command
    line gave), in the parser's order, without ``--json`` and ``--quiet``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = {action.dest: action.default for action in parser._actions}
    return {
        dest: getattr(args, dest)
        for dest, default in defaults.items()
        if dest not in _NOT_SETTINGS and hasattr(args, dest) and getattr(args, dest) != default
    }


def command_line(options: dict[str, Any]) -> str:
    """``gradest cost ...`` with ``options`` (as :func:`given_options` gives them)."""
    words = ["gradest", "cost"]
    for dest, value in options.items():
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            words.append("--no-" + dest.replace("_", "-"))
        else:
            words += [flag, str(value)]
    return " ".join(words)


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every default filled in: with ``--recipe-defaults`` the recipe's (of
    the model's family, :mod:`gradest_lab.cost.recipe_defaults`) where no option was
    given, then the command's own. ``recipe_defaults`` becomes the family or None,
    ``recipe_objective`` the recipe's objective (``reward``, ``grpo``) or None."""
    from gradest_lab.cost.recipe_defaults import cost_options, recipe_family

    values = dict(vars(args))
    family = None
    if values.get("recipe_defaults"):
        from gradest_lab.compare.problems import MODELS

        if args.model in MODELS:
            raise InvalidValue(
                f"--recipe-defaults prices a recipe's diffusers model (sd3-medium, "
                f"sd3.5-large, flux-dev, sdxl-unet or a config folder); {args.model!r} is "
                f"gradest's embedded model: drop --recipe-defaults"
            )
        objective = values["recipe_defaults"]
        wanted = "stepwise" if objective == "grpo" else "terminal"
        if args.objective not in (None, wanted):
            raise InvalidValue(
                f"--recipe-defaults {objective} prices the {objective} recipes (the {wanted} "
                f"objective); --objective {args.objective} is not what they run: drop one of "
                f"them"
            )
        from gradest_lab.cost.diffusers_presets import load_config

        family = recipe_family(load_config(args.model)[0])
        recipe = cost_options(family, objective)
        if values.get("reward") == "latent":  # no decode: the VAE's setting does not apply
            recipe.pop("decoder_checkpointing", None)
        if values.get("estimators") is not None and objective == "grpo":
            # The recipe trains one timestep at a time with exact only (its own rule).
            recipe["per_timestep"] = all(
                separable_over_steps(estimator(spec))
                for spec in split_spec_list(values["estimators"], what="--estimators")
            )
        for key, value in recipe.items():
            if values.get(key) is None:
                values[key] = value
    values["recipe_objective"] = args.recipe_defaults if family is not None else None
    values["recipe_defaults"] = family
    for key, value in (
        ("dtype", "bf16"), ("batch", 1), ("gradient_checkpointing", False),
        ("objective", "terminal"), ("per_timestep", False),
    ):  # fmt: skip
        if values.get(key) is None:
            values[key] = value
    return argparse.Namespace(**values)


def run(args: argparse.Namespace) -> int:
    """``gradest cost``: trace, print the table, write ``--json``."""
    options = given_options(args)
    args = resolve_options(args)
    memories = [(text.strip(), parse_bytes(text)) for text in args.memory.split(",")]
    default = "exact" if args.per_timestep else format_spec_list(default_estimators())
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
        true_cfg=args.true_cfg, lora_targets=args.lora_targets,
    )  # fmt: skip
    reward, decoder_checkpointing = _reward_choice(args, setup)
    pixels = None
    parts: dict[str, PartCost] = {}
    if reward != "latent":
        assert setup.family is not None
        pixels = pixel_setup(
            family=setup.family, latent_shape=setup.noise_shape,
            height=setup.settings["height"], width=setup.settings["width"], dtype=setup.dtype,
            reward=reward, decoder=args.decoder, checkpointing=bool(decoder_checkpointing),
            tile=args.decoder_tile,
        )  # fmt: skip
        latents = torch.zeros(setup.noise_shape, dtype=setup.dtype, device="meta")
        images = torch.zeros(pixels.image_shape, device="meta")
        parts["decoder"] = part_cost(pixels.decoder, latents, attention=args.attention)
        if pixels.reward is not None:
            parts["reward"] = part_cost(pixels.reward, images, attention=args.attention)
    steps = predict_step_costs(
        setup,
        specs,
        pixels=pixels,
        objective=args.objective,
        draws=args.draws,
        attention=args.attention,
        show_progress=not args.quiet,
        per_timestep=args.per_timestep,
    )
    seconds = time.perf_counter() - started

    def entry(step: StepCosts) -> dict[str, Any]:
        cost = step.whole or step.transformer
        out = cost.as_dict() | {"fits": {label: cost.fits(limit) for label, limit in memories}}
        if step.whole is not None and step.calls is not None:
            out["transformer"] = step.transformer.as_dict()
            out["calls"] = step.calls
            out["parts_flops"] = {n: _part_flops(p, step.calls) for n, p in parts.items()}
        return out

    labels = {}
    if pixels is not None:
        labels = {"decoder": pixels.decoder_name, "reward": pixels.reward_name}
    payload = {
        "model": args.model,
        "command": command_line(options),
        "options": options,
        "settings": setup.settings
        | {
            "objective": args.objective,
            "per_timestep": args.per_timestep,
            "attention": args.attention,
            "reward": reward,
            "decoder": pixels.decoder_name if pixels is not None else None,
            "decoder_checkpointing": decoder_checkpointing,
            "decoder_tile": args.decoder_tile,
            "recipe_defaults": args.recipe_defaults,
            "recipe_objective": args.recipe_objective,
        },
        "memory": {label: limit for label, limit in memories},
        "parts": {name: part.as_dict() | {"label": labels[name]} for name, part in parts.items()},
        "estimators": {spec: entry(step) for spec, step in steps.items()},
        "seconds": seconds,
        "torch": torch.__version__,
    }
    print(format_report(payload))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


#: Settings the header leaves out (the guidance's words hold them) or shows at its end.
_HEADER_AFTER = frozenset(
    {"cfg", "true_cfg", "rows_per_sample", "objective", "per_timestep", "attention", "reward",
     "decoder", "decoder_checkpointing", "decoder_tile", "recipe_defaults", "recipe_objective"}
)  # fmt: skip


def _training_cost(entry: dict[str, Any]) -> TrainingCost:
    values: dict[str, Any] = {
        key: tuple(value) if key.endswith("_range") else value
        for key, value in entry.items()
        if key in attrs.fields_dict(TrainingCost)
    }
    return TrainingCost(**values)


def report_header(payload: dict[str, Any]) -> str:
    """The first line the command prints: the model and every setting of the step (the
    guidance in words, the decoder's checkpointing with a pixel reward)."""
    settings = payload["settings"]
    shown = ", ".join(
        f"{key}={value}"
        for key, value in settings.items()
        if value is not None and key not in _HEADER_AFTER
    )
    tail = [f"objective={settings['objective']}"]
    if settings.get("per_timestep"):
        tail.append("one backward per timestep")
    tail.append(f"reward={settings['reward']}")
    if settings.get("decoder") is not None:
        tail.append(f"decoder_checkpointing={settings['decoder_checkpointing']}")
    tail.append(f"attention={settings['attention']}")
    if settings.get("recipe_defaults"):
        recipe = " ".join(
            word for word in (settings["recipe_defaults"], settings.get("recipe_objective"))
            if word not in (None, "reward")
        )  # fmt: skip
        tail.append(f"the {recipe} recipe's defaults")
    return (
        f"# gradest cost: {payload['model']} ({shown}), {', '.join(tail)}, traced in "
        f"{payload['seconds']:.0f} s"
    )


def format_report(payload: dict[str, Any]) -> str:
    """What the command prints, from what ``--json`` writes (so a page can quote a run's
    output from its JSON): the header, each pixel part's line and the table."""
    memories = list(payload["memory"].items())
    lines = [report_header(payload), ""]
    estimators = payload["estimators"]
    if not payload["parts"]:
        costs = {spec: _training_cost(entry) for spec, entry in estimators.items()}
        return "\n".join([*lines, format_table(costs, memories)])
    parts = {
        name: PartCost(**{k: v for k, v in part.items() if k != "label"})
        for name, part in payload["parts"].items()
    }
    for name, part in parts.items():
        lines.append(
            f"- {name}: {payload['parts'][name]['label']}, {part.parameters / 1e6:,.1f} M "
            f"parameters ({_fmt_bytes(part.parameter_bytes)}), one call "
            f"{_fmt_flops(part.flops)} forward and backward"
        )
    steps = {
        spec: StepCosts(_training_cost(entry["transformer"]), _training_cost(entry), entry["calls"])
        for spec, entry in estimators.items()
    }
    return "\n".join([*lines, "", format_step_table(steps, parts, memories)])


def _reward_choice(args: argparse.Namespace, setup: ModelSetup) -> tuple[str, bool | None]:
    """``--reward`` as given, or its default: a learned reward on the decoded images for
    a diffusers model's terminal objective, the latents otherwise; and the decoder's
    checkpointing (on unless ``--no-decoder-checkpointing``; None without a decoder)."""
    checkpointing = args.decoder_checkpointing
    pixel_flags = args.decoder is not None or checkpointing is not None or args.decoder_tile
    if args.reward is None:
        reward = (
            "aesthetic" if setup.family is not None and args.objective == "terminal" else ("latent")
        )
    else:
        reward = args.reward
    if reward != "latent" and setup.family is None:
        raise InvalidValue(
            f"--reward {reward!r} decodes with a VAE; the embedded model {args.model!r} has "
            f"none: pass --reward latent (or a diffusers model)"
        )
    if reward == "latent":
        if pixel_flags:
            raise InvalidValue(
                "--decoder, --decoder-checkpointing and --decoder-tile price the VAE decode "
                "of a pixel reward; --reward latent has none (drop them, or pass --reward "
                "aesthetic)"
            )
        return reward, None
    return reward, True if checkpointing is None else checkpointing


COMMAND = Command(
    help="FLOPs, retained activations and peak memory of a training step per estimator, "
    "traced on the meta device (SD3, Flux, SDXL presets or a diffusers config; no GPU)",
    add_arguments=add_arguments,
    run=run,
)
