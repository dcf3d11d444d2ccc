"""A recipe's settings: one frozen attrs class, a TOML file, command-line overrides.

Every setting is a field of :class:`RecipeConfig`. Where a value comes from, lowest first:

1. the field's default, then the family's default (``FAMILY_DEFAULTS``: SD3 samples 28
   steps at 1024 px, SD 1.x/2.x 50 DDIM steps at 512 px, ...), then with ``tiny = true``
   the tiny defaults (16 px, 3 steps);
2. a resumed run's saved settings (``--resume DIR``);
3. the TOML file of ``--config FILE`` (keys are the field names; stdlib ``tomllib``);
4. the command line: one option per field (``--lr 1e-4``, ``--lora-rank 8``,
   ``--estimator jagg:window=4``, ``--tiny`` / ``--no-tiny``), or ``--set key=value``
   (the value read as a TOML value, else as a string).

Every name has both spellings (``_``, ``-``), and diffusers' training-script names are
aliases of the same settings (:data:`ALIASES`: ``--learning_rate`` is ``lr``,
``--output_dir`` is ``out``, ...), on the command line, in TOML files and in ``--set``.

Every value is validated when the config is built; a bad one raises
:class:`RecipeConfigError` naming the setting, the value and the fix.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from gradest_lab.errors import MissingFile
from gradest_lab.storage.files import read_text

from gradest import InvalidValue
from gradest.plugin import INT64_MAX
from gradest_recipes.errors import RecipeConfigError  # re-exported: settings raise it

__all__ = [
    "ALIASES",
    "FAMILIES",
    "FAMILY_DEFAULTS",
    "MIXED_PRECISION",
    "RecipeConfig",
    "RecipeConfigError",
    "build_parser",
    "config_from_argv",
    "load_config",
    "run_settings",
    "saved_setting_problem",
    "to_toml",
]

FAMILIES = ("sd3", "flux", "sd_unet", "sdxl")
MIXED_PRECISION = ("no", "fp16", "bf16")


def _fail(key: str, value: Any, need: str, fix: str = "") -> RecipeConfigError:
    message = f"setting {key}={value!r} is invalid: {need}"
    if fix:
        message += f"; {fix}"
    return RecipeConfigError(message)


@attrs.frozen(kw_only=True)
class RecipeConfig:
    """Every setting of a reward fine-tuning recipe (docs/recipes.md lists them).

    ``None`` for ``pretrained`` / ``embeddings`` is only valid with ``tiny = true``.
    """

    tiny: bool = attrs.field(default=False, metadata={"doc": "tiny random model, VAE, prompts"})
    pretrained: str | None = attrs.field(
        default=None, metadata={"doc": "local diffusers model folder (from_pretrained)"}
    )
    variant: str | None = attrs.field(
        default=None, metadata={"doc": "weight file variant, e.g. fp16 (from_pretrained)"}
    )
    embeddings: str | None = attrs.field(
        default=None, metadata={"doc": ".pt file of precomputed prompt embeddings"}
    )
    out: str = attrs.field(default="runs/recipe", metadata={"doc": "output folder"})
    resume: str | None = attrs.field(
        default=None, metadata={"doc": "run or checkpoint folder to continue from"}
    )
    seed: int = attrs.field(default=0, metadata={"doc": "seed of the noise, prompts, LoRA init"})
    steps: int = attrs.field(default=100, metadata={"doc": "optimizer steps in all"})
    batch_size: int = attrs.field(default=1, metadata={"doc": "samples per process per micro-step"})
    gradient_accumulation: int = attrs.field(default=1, metadata={"doc": "micro-steps per step"})
    lr: float = attrs.field(default=1e-4, metadata={"doc": "AdamW learning rate"})
    lr_scheduler: str = attrs.field(
        default="constant",
        metadata={"doc": "diffusers.optimization.get_scheduler schedule: " + ", ".join(
            ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
             "polynomial", "piecewise_constant"))},
    )  # fmt: skip
    lr_warmup_steps: int = attrs.field(default=0, metadata={"doc": "learning-rate warmup steps"})
    lr_num_cycles: int = attrs.field(default=1, metadata={"doc": "cycles of cosine_with_restarts"})
    lr_power: float = attrs.field(default=1.0, metadata={"doc": "power of the polynomial schedule"})
    lr_step_rules: str | None = attrs.field(
        default=None,
        metadata={"doc": "piecewise_constant rules, e.g. '1:10,0.1:20,0.01' (factor:until step)"},
    )
    weight_decay: float = attrs.field(default=0.0, metadata={"doc": "AdamW weight decay"})
    adam_beta1: float = attrs.field(default=0.9, metadata={"doc": "AdamW beta1"})
    adam_beta2: float = attrs.field(default=0.999, metadata={"doc": "AdamW beta2"})
    adam_epsilon: float = attrs.field(default=1e-8, metadata={"doc": "AdamW epsilon"})
    use_ema: bool = attrs.field(
        default=False,
        metadata={"doc": "keep an EMA of the LoRA weights (diffusers EMAModel; checkpointed)"},
    )
    ema_decay: float = attrs.field(
        default=0.9999,
        metadata={"doc": "EMA decay: at optimizer step s the EMA moves by 1 - min((1 + s) / "
                         "(10 + s), ema_decay) (Flow-GRPO's EMAModuleWrapper)"},
    )  # fmt: skip
    ema_every: int = attrs.field(
        default=1,
        metadata={"doc": "update the EMA every n-th optimizer step, after the steps s with "
                         "(s + 1) % n == 0 (Flow-GRPO's update_step_interval; grpo: 8)"},
    )  # fmt: skip
    max_grad_norm: float = attrs.field(
        default=1.0, metadata={"doc": "gradient clipping norm (0: no clipping)"}
    )
    lora_rank: int = attrs.field(default=8, metadata={"doc": "LoRA rank"})
    lora_alpha: float | None = attrs.field(
        default=None, metadata={"doc": "LoRA alpha (default: the rank, scale 1)"}
    )
    lora_init: str = attrs.field(
        default="default",
        metadata={"doc": "LoRA A's initialisation: default (peft's Kaiming-uniform) or "
                         "gaussian (N(0, 1/rank), Flow-GRPO's); B starts at zero"},
    )  # fmt: skip
    lora_path: str | None = attrs.field(
        default=None,
        metadata={"doc": "warm start from a LoRA: a diffusers LoRA file or folder (a recipe's "
                         "lora/ export) or a peft adapter folder (Flow-GRPO's "
                         "train.lora_path); the run's lora_rank and lora_targets must be its"},
    )  # fmt: skip
    lora_targets: tuple[str, ...] = attrs.field(
        default=("to_q", "to_k", "to_v", "to_out.0"),
        converter=lambda value: tuple(value) if isinstance(value, list | tuple) else value,
        metadata={"doc": "module names that get adapters (comma-separated on the CLI)"},
    )
    estimator: str = attrs.field(
        default="sdo", metadata={"doc": "gradest estimator spec, e.g. jagg:window=4"}
    )
    detach_unconditional: bool = attrs.field(
        default=False,
        metadata={"doc": "CFG in training: the unconditional half detached, gradient through "
                         "the conditional one only (Flow-GRPO's noise_pred_uncond.detach(); "
                         "grpo: true); false trains through both halves"},
    )  # fmt: skip
    num_inference_steps: int = attrs.field(default=28, metadata={"doc": "sampling steps N"})
    guidance_scale: float = attrs.field(
        default=7.0, metadata={"doc": "CFG scale (Flux: the guidance embedding's value)"}
    )
    true_cfg_scale: float = attrs.field(
        default=1.0,
        metadata={"doc": "flux: true CFG around the guidance embedding (FluxPipeline's "
                         "true_cfg_scale; > 1 runs the negative prompt's half too, 2B rows "
                         "per call; 1: off)"},
    )  # fmt: skip
    eta: float = attrs.field(default=0.0, metadata={"doc": "DDIM noise (sd_unet, sdxl)"})
    resolution: int = attrs.field(default=1024, metadata={"doc": "image side in pixels"})
    mixed_precision: str = attrs.field(
        default="no", metadata={"doc": "accelerate mixed precision: no, fp16, bf16"}
    )
    fsdp: bool = attrs.field(
        default=False,
        metadata={"doc": "shard the denoiser with torch's FSDP2 fully_shard (2+ processes)"},
    )
    gradient_checkpointing: bool = attrs.field(
        default=False, metadata={"doc": "diffusers enable_gradient_checkpointing()"}
    )
    decoder_checkpointing: bool = attrs.field(
        default=True,
        metadata={"doc": "the VAE's enable_gradient_checkpointing() for the reward's decode: "
                         "its blocks recompute in backward, the same gradient bit for bit, "
                         "a fraction of the ~11 GiB an SD3 decode holds at 1024 px"},
    )  # fmt: skip
    reward: str = attrs.field(
        default="brightness",
        metadata={"doc": "brightness, contrast, color:r=..,g=..,b=.., a learned reward "
                         "(aesthetic:model=PATH, ...), module:function, or a weighted sum "
                         "of them: '0.7*pickscore:model=PATH + 0.3*brightness'"},
    )  # fmt: skip
    objective: str = attrs.field(
        default="reward",
        metadata={"doc": "reward (backprop through the sampler), grpo (Flow-GRPO with KL) or "
                         "adjoint_matching; set by the script (docs/recipes.md)"},
    )  # fmt: skip
    group_size: int = attrs.field(
        default=4, metadata={"doc": "grpo: samples per prompt (advantages within a group)"}
    )
    noise_level: float = attrs.field(
        default=0.7, metadata={"doc": "grpo: FlowSDE noise level a (Flow-GRPO's 0.7)"}
    )
    clip_range: float = attrs.field(
        default=1e-4, metadata={"doc": "grpo: PPO clip range of the ratio (Flow-GRPO's 1e-4)"}
    )
    adv_clip_max: float = attrs.field(
        default=5.0, metadata={"doc": "grpo: advantages clipped to [-max, max] (Flow-GRPO's 5)"}
    )
    kl_weight: float = attrs.field(
        default=0.04,
        metadata={"doc": "grpo: KL weight beta to the adapters-off model (Flow-GRPO SD3's 0.04; "
                         "0: no KL term)"},
    )  # fmt: skip
    num_inner_epochs: int = attrs.field(
        default=1,
        metadata={"doc": "grpo: passes over each step's rollout, each reshuffled (Flow-GRPO's "
                         "train.num_inner_epochs)"},
    )  # fmt: skip
    rollout_batches: int = attrs.field(
        default=2,
        metadata={"doc": "grpo: batches of batch_size each process samples per step, an "
                         "optimizer step every gradient_accumulation of them (Flow-GRPO's "
                         "sample.num_batches_per_epoch)"},
    )  # fmt: skip
    timestep_fraction: float = attrs.field(
        default=0.99,
        metadata={"doc": "grpo: train on the first int(N * fraction) steps of each rollout "
                         "(Flow-GRPO SD3's train.timestep_fraction)"},
    )  # fmt: skip
    global_std: bool = attrs.field(
        default=True,
        metadata={"doc": "grpo: advantages divided by the std of every process's rewards "
                         "(true) or of the prompt's (false) (Flow-GRPO's sample.global_std)"},
    )  # fmt: skip
    reward_multiplier: float = attrs.field(
        default=1.0,
        metadata={"doc": "adjoint_matching: terminal loss = -multiplier * reward (the tilt "
                         "exp(multiplier * reward) of the base model)"},
    )  # fmt: skip
    report_to: str = attrs.field(
        default="tensorboard",
        metadata={"doc": "accelerate trackers: tensorboard, wandb, all (both) or none"},
    )
    validation_prompt: str | None = attrs.field(
        default=None,
        metadata={"doc": "prompt of the sample grids (default: the first training prompts)"},
    )
    log_every: int = attrs.field(default=1, metadata={"doc": "steps between log records"})
    sample_every: int = attrs.field(
        default=50, metadata={"doc": "steps between PNG sample grids (0: at the end only)"}
    )
    sample_count: int = attrs.field(default=4, metadata={"doc": "images per sample grid"})
    save_every: int = attrs.field(
        default=50, metadata={"doc": "steps between checkpoints (0: at the end only)"}
    )
    keep_checkpoints: int = attrs.field(
        default=2, metadata={"doc": "newest checkpoints kept (0: keep all)"}
    )
    eval_prompts: int = attrs.field(
        default=0,
        metadata={"doc": "prompts held out of the embeddings for evaluation: the file's last "
                         "n, never trained on (0: none)"},
    )  # fmt: skip
    eval_every: int = attrs.field(
        default=0,
        metadata={"doc": "steps between evaluations on the held-out prompts, also at step 0 "
                         "and at the end (0: no evaluation)"},
    )  # fmt: skip
    eval_num_inference_steps: int = attrs.field(
        default=40,
        metadata={"doc": "deterministic sampling steps of an evaluation (Flow-GRPO's "
                         "sample.eval_num_steps)"},
    )  # fmt: skip
    eval_batch_size: int = attrs.field(
        default=8, metadata={"doc": "held-out prompts a process samples at once in an evaluation"}
    )

    def __attrs_post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Every setting (tuples as lists): what checkpoints record, ``resume`` included."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in attrs.fields(RecipeConfig)
        }


#: Settings that differ between families (the field defaults are SD3's).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"num_inference_steps": 28, "guidance_scale": 7.0, "resolution": 1024},
    # FLUX.1-dev: guidance-distilled, guidance_scale is the guidance embedding (no CFG).
    "flux": {
        "num_inference_steps": 28,
        "guidance_scale": 3.5,
        "resolution": 1024,
    },
    "sd_unet": {"num_inference_steps": 50, "guidance_scale": 7.5, "resolution": 512},
    # StableDiffusionXLPipeline's defaults.
    "sdxl": {"num_inference_steps": 50, "guidance_scale": 5.0, "resolution": 1024},
}
#: With ``tiny = true``: sizes a CPU runs in a few seconds.
TINY_DEFAULTS: dict[str, Any] = {
    "resolution": 16,
    "num_inference_steps": 3,
    "batch_size": 2,
    "steps": 2,
    "lora_rank": 2,
    "sample_every": 0,
    "save_every": 0,
    "sample_count": 2,
    "eval_num_inference_steps": 3,
    "eval_batch_size": 2,
}

#: Flow-GRPO's LoRA targets (``scripts/train_sd3.py``): the joint attention's image-stream
#: and context-stream projections.
FLOW_GRPO_LORA_TARGETS = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)  # fmt: skip
#: ``lora_init``'s values.
LORA_INITS = ("default", "gaussian")
#: The objectives (``objective``): the reward recipes and the RL recipes.
OBJECTIVES = ("reward", "grpo", "adjoint_matching")
#: Settings that differ between objectives (after the family's, before the tiny defaults).
#: grpo: Flow-GRPO's optimizer settings (config/base.py's train.learning_rate and
#: train.adam_weight_decay).
#: Its gradient is the exact one (``exact``, one backward per trained timestep:
#: gradest_recipes.grpo_epoch.backward_per_timestep). Its LoRA (rank 32, alpha 64, gaussian
#: init on the 8 attention projections of both streams), EMA (decay 0.9, every 8 optimizer
#: steps) and CFG (the unconditional half detached) are ``scripts/train_sd3.py``'s.
OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {
        "estimator": "exact",
        "batch_size": 4,
        "lr": 3e-4,
        "weight_decay": 1e-4,
        "lora_rank": 32,
        "lora_alpha": 64.0,
        "lora_init": "gaussian",
        "lora_targets": FLOW_GRPO_LORA_TARGETS,
        "use_ema": True,
        "ema_decay": 0.9,
        "ema_every": 8,
        "detach_unconditional": True,
    }
}
#: With ``tiny = true``, per objective (after :data:`TINY_DEFAULTS`): the LoRA keeps
#: Flow-GRPO's alpha / rank of 2.
TINY_OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"batch_size": 2, "group_size": 2, "rollout_batches": 1, "lora_alpha": 4.0}
}

#: Settings a resumed run may change (how far it goes and what it writes, not the math).
MAY_CHANGE_ON_RESUME = frozenset(
    {"steps", "out", "resume", "log_every", "sample_every", "sample_count", "save_every",
     "keep_checkpoints", "report_to", "validation_prompt", "eval_every", "eval_batch_size"}
)  # fmt: skip

#: Settings never written into a run's saved config (``config.toml``, the checkpoints'
#: ``recipe_state.json``): reusing a saved config as ``--config`` starts a run.
NOT_SAVED = frozenset({"resume"})


def run_settings(config: RecipeConfig) -> dict[str, Any]:
    """The settings a run folder records as its run's (``run.json``,
    gradest_lab.storage.run_folder):
    every setting a resumed run must share, that is all but :data:`MAY_CHANGE_ON_RESUME`
    and :data:`NOT_SAVED`. A float setting given as an integer is recorded as a float, so
    that a run read back from TOML or JSON records the same value."""
    values: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if key in MAY_CHANGE_ON_RESUME or key in NOT_SAVED:
            continue
        number = isinstance(value, int) and not isinstance(value, bool)
        if number and _base_type(FIELDS[key].type) is float:
            value = float(value)
        values[key] = value
    return values


LR_SCHEDULERS = (
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
    "polynomial", "piecewise_constant",
)  # fmt: skip
REPORT_TO = ("tensorboard", "wandb", "all", "none")

#: diffusers' training-script names of settings (and a few older recipe names), as
#: aliases: every name of a setting, in either spelling (``_`` or ``-``), is one setting
#: (one ``dest``) on the command line, in a TOML file and in ``--set``.
ALIASES: dict[str, str] = {
    "pretrained_model_name_or_path": "pretrained",
    "output_dir": "out",
    "train_batch_size": "batch_size",
    "max_train_steps": "steps",
    "learning_rate": "lr",
    "gradient_accumulation_steps": "gradient_accumulation",
    "checkpointing_steps": "save_every",
    "checkpoints_total_limit": "keep_checkpoints",
    "resume_from_checkpoint": "resume",
    "rank": "lora_rank",
    "lora_layers": "lora_targets",
    "validation_steps": "sample_every",
    "num_validation_images": "sample_count",
    "adam_weight_decay": "weight_decay",
}


def canonical(key: str) -> str:
    """The setting a name means: hyphens as underscores, diffusers' names as the recipe's."""
    key = key.strip().replace("-", "_")
    return ALIASES.get(key, key)


def _positive_int(config: RecipeConfig, key: str, minimum: int = 1) -> None:
    value = getattr(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(key, value, f"must be an integer >= {minimum}")
    if value > INT64_MAX:  # gradest.integers: the largest integer torch holds
        raise _fail(key, value, f"must be an integer from {minimum} to 2**63 - 1")


def _finite(config: RecipeConfig, key: str, minimum: float, strict: bool = False) -> None:
    value = getattr(config, key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise _fail(key, value, f"must be a finite number {bound}")


def validate(config: RecipeConfig) -> None:
    """Raise :class:`RecipeConfigError` for the first value the recipe cannot use."""
    for field in attrs.fields(RecipeConfig):
        value = getattr(config, field.name)
        expected = _base_type(field.type)
        if value is None and _optional(field.type):
            continue
        if expected is bool and not isinstance(value, bool):
            raise _fail(field.name, value, "must be true or false")
        if expected is str and not isinstance(value, str):
            raise _fail(field.name, value, "must be a string")
        if isinstance(value, str) and not _is_text(value):
            # Undecodable command-line bytes arrive as lone surrogates: the saved
            # config.toml (UTF-8) could not hold them.
            raise _fail(
                field.name, value, "holds bytes that are not UTF-8 text",
                "pass the setting as UTF-8 text",
            )  # fmt: skip
    for key in ("steps", "batch_size", "gradient_accumulation", "lora_rank",
                "num_inference_steps", "log_every", "sample_count"):  # fmt: skip
        _positive_int(config, key)
    _positive_int(config, "ema_every")
    if config.lora_init not in LORA_INITS:
        raise _fail("lora_init", config.lora_init, f"must be one of {list(LORA_INITS)}")
    for key in ("sample_every", "save_every", "keep_checkpoints", "eval_prompts", "eval_every"):
        _positive_int(config, key, minimum=0)
    for key in ("eval_num_inference_steps", "eval_batch_size"):
        _positive_int(config, key)
    if config.eval_every and not config.eval_prompts:
        raise _fail(
            "eval_every", config.eval_every, "an evaluation needs held-out prompts",
            "set eval_prompts = n to hold out the embeddings' last n prompts, or eval_every = 0",
        )  # fmt: skip
    _positive_int(config, "seed", minimum=0)
    _finite(config, "lr", 0.0, strict=True)
    _finite(config, "weight_decay", 0.0)
    _positive_int(config, "lr_warmup_steps", minimum=0)
    _positive_int(config, "lr_num_cycles")
    _finite(config, "lr_power", 0.0, strict=True)
    if config.lr_scheduler not in LR_SCHEDULERS:
        raise _fail(
            "lr_scheduler", config.lr_scheduler, f"must be one of {list(LR_SCHEDULERS)}",
            "(the schedules of diffusers.optimization.get_scheduler)",
        )  # fmt: skip
    if config.lr_scheduler == "piecewise_constant":
        _check_step_rules(config.lr_step_rules)
    for key in ("adam_beta1", "adam_beta2", "ema_decay"):
        _finite(config, key, 0.0)
        if getattr(config, key) >= 1:
            raise _fail(key, getattr(config, key), "must be in [0, 1)")
    _finite(config, "adam_epsilon", 0.0, strict=True)
    if config.report_to not in REPORT_TO:
        raise _fail("report_to", config.report_to, f"must be one of {list(REPORT_TO)}")
    if config.validation_prompt is not None and not config.validation_prompt.strip():
        raise _fail("validation_prompt", config.validation_prompt, "must not be empty")
    if config.use_ema and config.fsdp:
        raise _fail(
            "use_ema", True, "an EMA of FSDP-sharded LoRA weights is not supported",
            "set fsdp = false (DDP) or use_ema = false",
        )  # fmt: skip
    _finite(config, "max_grad_norm", 0.0)
    _finite(config, "guidance_scale", 0.0)
    _finite(config, "true_cfg_scale", 1.0)
    _finite(config, "eta", 0.0)
    if config.eta > 1:
        raise _fail("eta", config.eta, "DDIM's eta must be in [0, 1]")
    if config.lora_alpha is not None:
        _finite(config, "lora_alpha", 0.0, strict=True)
    targets = config.lora_targets
    if (
        not isinstance(targets, tuple)
        or not targets
        or not all(isinstance(t, str) and t.strip() for t in targets)
    ):
        raise _fail(
            "lora_targets", targets, "must be a non-empty list of module names",
            'e.g. lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]',
        )  # fmt: skip
    _positive_int(config, "resolution", minimum=8)
    if config.resolution % 8:
        raise _fail(
            "resolution", config.resolution, "must be a multiple of 8 (the VAE's 8x "
            "downsampling times the transformer's 2x2 patches need it)",
            f"use {max(8, config.resolution // 8 * 8)}",
        )  # fmt: skip
    if config.mixed_precision not in MIXED_PRECISION:
        raise _fail(
            "mixed_precision", config.mixed_precision, f"must be one of {list(MIXED_PRECISION)}"
        )
    if not config.estimator.strip():
        raise _fail("estimator", config.estimator, "must name a gradest estimator, e.g. 'sdo'")
    if not config.reward.strip():
        raise _fail("reward", config.reward, "must name a reward, e.g. 'brightness'")
    _validate_objective(config)
    if not config.tiny and config.pretrained is None:
        raise _fail(
            "pretrained", None, "a local diffusers model folder is needed",
            "pass --pretrained /path/to/model (or --tiny for a tiny random model)",
        )  # fmt: skip
    if not config.tiny and config.embeddings is None:
        raise _fail(
            "embeddings", None, "a .pt file of precomputed prompt embeddings is needed",
            "pass --embeddings prompts.pt (gradest_recipes.prompts writes one; --tiny makes "
            "random ones)",
        )  # fmt: skip


def _validate_objective(config: RecipeConfig) -> None:
    """The RL objectives' settings (checked whatever the objective, so a saved config is
    valid under every objective)."""
    if config.objective not in OBJECTIVES:
        raise _fail("objective", config.objective, f"must be one of {list(OBJECTIVES)}")
    _positive_int(config, "group_size", minimum=2)
    _finite(config, "noise_level", 0.0, strict=True)
    _finite(config, "clip_range", 0.0, strict=True)
    if config.clip_range >= 1:
        raise _fail("clip_range", config.clip_range, "must be in (0, 1)", "Flow-GRPO uses 1e-4")
    _finite(config, "adv_clip_max", 0.0, strict=True)
    _finite(config, "kl_weight", 0.0)
    _finite(config, "reward_multiplier", 0.0, strict=True)
    _positive_int(config, "num_inner_epochs")
    _positive_int(config, "rollout_batches")
    _finite(config, "timestep_fraction", 0.0, strict=True)
    steps, fraction = config.num_inference_steps, config.timestep_fraction
    if fraction > 1:
        raise _fail("timestep_fraction", fraction, "must be in (0, 1]", "Flow-GRPO's SD3 uses 0.99")
    if config.objective != "grpo":
        return
    if int(steps * fraction) < 1:
        raise _fail(
            "timestep_fraction", fraction,
            f"trains on int(num_inference_steps * fraction) = 0 of the {steps} steps",
            f"use a fraction >= {1 / steps:.4g} (Flow-GRPO's SD3 uses 0.99)",
        )  # fmt: skip
    processes = _launched_processes()
    if (config.batch_size * processes) % config.group_size:
        fixed = max(1, config.batch_size // config.group_size) * config.group_size
        raise _fail(
            "batch_size", config.batch_size,
            f"objective 'grpo' with {processes} process(es) needs batch_size * processes to "
            f"be a multiple of group_size={config.group_size} (each sampled batch holds "
            f"whole groups of one prompt, spread over the processes)",
            f"use batch_size = {fixed}",
        )  # fmt: skip
    if config.rollout_batches % config.gradient_accumulation:
        raise _fail(
            "rollout_batches", config.rollout_batches,
            f"must be a multiple of gradient_accumulation={config.gradient_accumulation} "
            f"(an optimizer step every gradient_accumulation batches of the rollout, none "
            f"across rollouts)",
            f"use rollout_batches = {2 * config.gradient_accumulation} (Flow-GRPO's "
            f"configs: two optimizer steps per rollout)",
        )  # fmt: skip


def _launched_processes() -> int:
    """The process count a launcher set (``WORLD_SIZE``; 1 without one), as the run reads it."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _check_step_rules(rules: str | None) -> None:
    """``piecewise_constant``'s rules as get_scheduler reads them: ``f:s,...,f_last``."""
    fix = (
        "e.g. lr_step_rules = '1:10,0.1:20,0.01' (factor 1 until step 10, 0.1 until 20, then 0.01)"
    )
    if not rules:
        raise _fail("lr_step_rules", rules, "lr_scheduler='piecewise_constant' needs rules", fix)
    *pairs, last = rules.split(",")
    try:
        float(last)
        for pair in pairs:
            factor, until = pair.split(":")
            float(factor)
            int(until)
    except ValueError:
        raise _fail("lr_step_rules", rules, "must read 'factor:step,...,factor'", fix) from None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _optional(kind: Any) -> bool:
    return isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)


def _base_type(kind: Any) -> Any:
    if _optional(kind):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return typing.get_origin(kind) or kind


attrs.resolve_types(RecipeConfig)  # the annotations as types, not strings
FIELDS = {f.name: f for f in attrs.fields(RecipeConfig)}


def _coerce(key: str, value: Any) -> Any:
    """A TOML or command-line value as the field's type (type errors name the key)."""
    field = FIELDS[key]
    kind = _base_type(field.type)
    if value is None or (isinstance(value, str) and value.lower() == "none" and kind is not str):
        if _optional(field.type):
            return None
        raise _fail(key, value, f"must be set (a {kind.__name__})")
    if isinstance(value, str) and value.lower() == "none" and _optional(field.type):
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise _fail(key, value, "must be true or false")
    if kind is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise _fail(key, value, "must be an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(key, value, "must be an integer")
        return value
    if kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _fail(key, value, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(key, value, "must be a number")
        return float(value)
    if kind is tuple:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list | tuple):
            return tuple(value)
        raise _fail(key, value, "must be a list of strings (comma-separated on the CLI)")
    if not isinstance(value, str):
        raise _fail(key, value, "must be a string")
    return value


#: How a saved setting of each type is written in JSON (``recipe_state.json``).
_SAVED_KINDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple: "a list of strings",
}


def saved_setting_problem(key: str, value: Any) -> str | None:
    """Why ``value``, read from a run's JSON record, cannot be the saved value of the
    setting ``key`` (``"is 'x', not a number"``), or None. A saved setting has the JSON kind
    :meth:`RecipeConfig.to_dict` writes for its type; strings are not parsed, as they are
    on the command line and in TOML files."""
    field = FIELDS.get(key)
    if field is None:
        return "is not a setting of this version of the recipes"
    kind = _base_type(field.type)
    wanted = _SAVED_KINDS.get(kind, kind.__name__)
    if value is None:
        return None if _optional(field.type) else f"is None, not {wanted}"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    fits = {
        bool: isinstance(value, bool),
        int: number and isinstance(value, int),
        float: number,
        str: isinstance(value, str),
        tuple: isinstance(value, list) and all(isinstance(item, str) for item in value),
    }.get(kind, False)
    if fits:
        return None
    shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    return f"is {shown}, not {wanted}" + (" or None" if _optional(field.type) else "")


def _canonical_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values`` under the settings' own names (aliases and hyphens resolved); two names
    of one setting are refused, even with one value (``lr`` and ``learning-rate``: each
    setting is given once, as the lab's ``--config`` files and every option list)."""
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for key, value in values.items():
        name = canonical(key)
        if name in out:
            raise RecipeConfigError(
                f"setting {name} is given twice in {source}, as {named[name]!r}={out[name]!r} "
                f"and {key!r}={value!r}; give it once"
            )
        out[name], named[name] = value, key
    _check_keys(out, source)
    return out


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for key in values:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RecipeConfigError(
                f"unknown setting {key!r} in {source}{hint} (settings: {', '.join(FIELDS)})"
            )


def read_toml(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML config file (top-level keys, or a ``[recipe]`` table).

    Read by gradest's one rule for files read back (:func:`gradest_lab.storage.files.read_text`): a
    regular file of UTF-8 text, else one line naming it. Every key must be a setting and
    every value of a kind its setting takes (checked here, so that the error names the
    file and the setting); the values are returned as written.
    """
    file = Path(path)
    source = f"config file {str(file)!r}"
    try:
        data = tomllib.loads(read_text(file, what="config file"))
    except MissingFile:
        raise RecipeConfigError(f"{source} does not exist") from None
    except InvalidValue as err:  # a folder, a pipe, a device, bytes that are not UTF-8
        raise RecipeConfigError(str(err)) from None
    except tomllib.TOMLDecodeError as err:
        why = " ".join(str(err).split())
        raise RecipeConfigError(f"{source} is not valid TOML: {why}") from None
    if set(data) == {"recipe"} and isinstance(data["recipe"], dict):
        data = data["recipe"]
    values = _canonical_keys(data, source)
    for key, value in values.items():
        try:
            _coerce(key, value)
        except RecipeConfigError as err:
            raise RecipeConfigError(f"{source}: {err}") from None
    return values


def load_config(
    family: str,
    *,
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    saved: Mapping[str, Any] | None = None,
) -> RecipeConfig:
    """The config of ``family``: defaults < ``saved`` (a resumed run) < ``file`` < overrides."""
    if family not in FAMILIES:
        raise RecipeConfigError(f"unknown recipe family {family!r}; one of {list(FAMILIES)}")
    user: dict[str, Any] = {}
    if file is not None:
        user.update(read_toml(file))
    if overrides:
        user.update(_canonical_keys(overrides, "the overrides"))
    user = {key: _coerce(key, value) for key, value in user.items()}
    base: dict[str, Any] = {k: v for k, v in (saved or {}).items() if k not in NOT_SAVED}
    _check_keys(base, "the resumed run's saved settings")
    tiny = user.get("tiny", base.get("tiny", False))
    objective = user.get("objective", base.get("objective", "reward"))
    if saved is not None and objective != base.get("objective", "reward"):
        raise RecipeConfigError(
            f"setting objective={objective!r} differs from the resumed run's "
            f"{base.get('objective', 'reward')!r}; resume a run with the script of its own "
            f"objective (examples/recipes/{family}_{base.get('objective', 'reward')}.py)"
        )
    if objective != "reward" and family in ("sd_unet", "sdxl"):
        raise RecipeConfigError(
            f"setting objective={objective!r} is invalid for the {family} recipe: the RL "
            f"objectives run on flow-matching models (sd3, flux); use objective = 'reward'"
        )
    values: dict[str, Any] = {**FAMILY_DEFAULTS[family]}
    values.update(OBJECTIVE_DEFAULTS.get(objective, {}))
    if tiny:
        values.update(TINY_DEFAULTS)
        values.update(TINY_OBJECTIVE_DEFAULTS.get(objective, {}))
    values.update({key: _coerce(key, value) for key, value in base.items()})
    values.update(user)
    config = RecipeConfig(**values)
    check_true_cfg(family, config)
    return config


def check_true_cfg(family: str, config: RecipeConfig) -> None:
    """``true_cfg_scale`` is the Flux recipe's (its CFG around the guidance embedding); the
    other families' CFG is ``guidance_scale``."""
    if family != "flux" and config.true_cfg_scale != 1.0:
        raise _fail(
            "true_cfg_scale", config.true_cfg_scale,
            f"true CFG is the flux recipe's (around its guidance embedding); the {family} "
            f"recipe's CFG scale is guidance_scale",
            f"set guidance_scale = {config.true_cfg_scale!r} and true_cfg_scale = 1",
        )  # fmt: skip


def _parse_set(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = canonical(key) if key.strip() else ""
    if not sep or not key:
        raise RecipeConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set lr=1e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def _set_values(texts: Sequence[str], *, flags: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--set KEY=VALUE`` overrides, each setting once: a key given by two ``--set``
    (in any of its names: ``lr``, ``learning-rate``), or by ``--set`` and its own flag
    (``--set lr=1e-4 --lr 2e-4``), is refused rather than letting one of them win
    silently. ``flags``: the settings the command line's flags gave, by setting name."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # setting -> the --set text that gave it
    for text in texts:
        key, value = _parse_set(text)
        if key in given or key in flags:
            first = f"--set {given[key]}" if key in given else f"--set {text}"
            second = f"--set {text}" if key in given else f"its flag --{key}"
            raise RecipeConfigError(
                f"setting {key} is given twice on the command line, as {first} and "
                f"{second}; give it once"
            )
        values[key], given[key] = value, text
    return values


def _spellings(name: str) -> list[str]:
    """``--a_b`` and ``--a-b`` (one spelling when the name has no underscore)."""
    return list(dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"]))


def build_parser(family: str, description: str = "") -> argparse.ArgumentParser:
    """The command line of a recipe: ``--config``, ``--set`` and one option per field.

    Every setting takes its own name and its diffusers training-script name
    (:data:`ALIASES`), each with ``_`` or ``-``; a boolean setting ``x`` is the flag
    ``--x`` and ``--no-x`` (``--no_x``). All names of a setting write one ``dest``.
    """
    parser = argparse.ArgumentParser(
        description=description or f"gradest {family} reward fine-tuning recipe",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings")
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        dest="set_values",
        help="override any setting (value read as TOML, else as a string); repeatable",
    )
    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    for field in attrs.fields(RecipeConfig):
        names = [n for base in (field.name, *aliases.get(field.name, [])) for n in _spellings(base)]
        is_bool = _base_type(field.type) is bool
        doc = field.metadata.get("doc", "")
        default = FAMILY_DEFAULTS[family].get(field.name, field.default)
        if isinstance(default, tuple):
            default = ",".join(default)
        help_text = f"{doc} (default: {default})"
        if is_bool:
            parser.add_argument(*names, dest=field.name, action="store_const", const=True,
                                help=help_text)  # fmt: skip
            negated = [n for base in (field.name, *aliases.get(field.name, []))
                       for n in _spellings(f"no_{base}")]  # fmt: skip
            parser.add_argument(*negated, dest=field.name, action="store_const", const=False,
                                help=argparse.SUPPRESS)  # fmt: skip
        else:
            parser.add_argument(*names, dest=field.name, metavar="VALUE", help=help_text)
    return parser


def _reward_is_code(spec: Any) -> bool:
    """Whether a ``reward`` setting names code to import (``module:fn``, ``file.py:fn``),
    itself or in a term of a weighted sum (``brightness + contrast`` names none)."""
    from gradest_recipes.rewards import reward_names_code

    return isinstance(spec, str) and reward_names_code(spec)


def resolve_latest(out: str | Path) -> str | None:
    """``resume = "latest"``: the newest complete checkpoint in ``out``, or ``None``."""
    from gradest_recipes.checkpoints import checkpoint_dirs

    found = checkpoint_dirs(Path(out) / "checkpoints")
    return str(found[0][1]) if found else None


def config_from_argv(
    family: str,
    argv: Sequence[str] | None,
    saved_from: Any = None,
    *,
    objective: str | None = None,
    script: str = "",
) -> tuple[RecipeConfig, dict[str, Any]]:
    """Parse ``argv``; returns the config and the user's own settings (file + CLI).

    ``saved_from(resume) -> dict`` supplies a resumed run's saved settings: a resumed run
    takes every setting from them, and the user's own (file, command line) on top, which
    the recipe then compares with the run's. ``objective``: the script's objective, set
    as if given on the command line (a file or option naming another one is refused, and
    so is resuming a run of another objective). ``resume = "latest"`` is the newest
    checkpoint in ``out`` (none there: a new run, as diffusers' scripts do). A saved
    reward that names code (``module:function``) is never imported from the run's files:
    the user names it again.
    """
    parser = build_parser(family)
    args = vars(parser.parse_args(argv))
    file = args.pop("config", None)
    overrides = _set_values(args.pop("set_values", None) or [], flags=args)
    overrides.update(args)
    user: dict[str, Any] = {}
    if file is not None:
        user.update(read_toml(file))
    user.update(_canonical_keys(overrides, "the command line"))
    if objective is not None:
        given = user.get("objective", objective)
        if given != objective:
            raise RecipeConfigError(
                f"setting objective={given!r} is invalid for {script or 'this script'}, which "
                f"runs objective {objective!r}; run examples/recipes/{family}_"
                f"{given if given in OBJECTIVES else '<objective>'}.py instead"
            )
        user["objective"] = objective
    resume = user.get("resume")
    if isinstance(resume, str) and resume.strip().lower() == "latest":
        out = _coerce("out", user.get("out", FIELDS["out"].default))
        resume = user["resume"] = resolve_latest(out)
        if resume is None:
            import sys

            print(
                f"resume_from_checkpoint=latest: no checkpoint in {out}; starting a new run",
                file=sys.stderr,
            )
    saved = saved_from(resume) if (saved_from is not None and resume) else None
    if saved is not None and "reward" not in user and _reward_is_code(saved.get("reward")):
        import shlex  # a weighted sum has spaces: the option is shown ready to paste

        raise RecipeConfigError(
            f"setting reward: the resumed run's reward {saved['reward']!r} is code, which a "
            f"resume does not import from the run's files; pass --reward "
            f"{shlex.quote(saved['reward'])} (the same reward) to continue the run"
        )
    config = load_config(family, overrides=user, saved=saved)
    return config, user


def to_toml(config: RecipeConfig) -> str:
    """``config`` as a TOML file that :func:`load_config` reads back (``None`` and
    :data:`NOT_SAVED` are left out: as ``--config`` it starts a run)."""
    lines = []
    for key, value in config.to_dict().items():
        if value is None or key in NOT_SAVED:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        elif isinstance(value, list):
            text = "[" + ", ".join(_toml_string(v) for v in value) + "]"
        else:
            text = _toml_string(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# TOML's short escapes; every other control character (U+0000-U+001F, U+007F) is \uXXXX.
_TOML_ESCAPES = {
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
    '"': '\\"',
    "\\": "\\\\",
}


def _toml_string(value: str) -> str:
    """``value`` as a TOML basic string that reads back as ``value``: a basic string may
    hold no raw control character (a newline in a validation prompt would end the line
    and make the file invalid TOML), so each is escaped, as are quotes and backslashes."""
    escaped = "".join(
        _TOML_ESCAPES.get(char)
        or (f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F else char)
        for char in value
    )
    return f'"{escaped}"'
