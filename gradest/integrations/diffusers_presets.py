"""Diffusers models as shapes only: presets, config folders, and synthetic inputs.

``gradest cost`` predicts what a training step of an estimator costs on SD3, Flux or
SDXL without a GPU, weights or data: the model is built on the meta device from its
architecture hyperparameters (a shipped preset, or the ``config.json`` of a diffusers
model folder), and its inputs are synthesised from the config. Nothing here downloads
anything; diffusers is imported only when a model is built.

A preset is the ``config.json`` of the public checkpoint's transformer / UNet (its
architecture fields; no weights), with the resolution, step count and prompt length the
model's pipeline uses by default.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from gradest.conditioning import repeat_per_sample
from gradest.errors import InvalidValue, MissingDependency

__all__ = [
    "PRESETS",
    "DiffusersShapes",
    "ModelPreset",
    "diffusers_shapes",
    "load_config",
]

# LoRA targets of the diffusers training scripts: the attention projections, which every
# SD3 / Flux transformer block and every SDXL transformer block names alike.
LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")


@attrs.frozen
class ModelPreset:
    """A public model's architecture and its pipeline's default sampling settings.

    Attributes:
        config: the model's ``config.json`` (with ``_class_name``), architecture only.
        height, width: the default image size in pixels.
        steps: the pipeline's default number of sampling steps.
        prompt_tokens: text tokens per prompt the pipeline encodes by default.
        source: the checkpoint the config describes.
    """

    config: Mapping[str, Any]
    height: int
    width: int
    steps: int
    prompt_tokens: int
    source: str


PRESETS: dict[str, ModelPreset] = {
    "sd3-medium": ModelPreset(
        config={
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
        },
        height=1024,
        width=1024,
        steps=28,
        # 77 CLIP tokens + 256 T5 tokens, as StableDiffusion3Pipeline concatenates them.
        prompt_tokens=333,
        source="stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json",
    ),
    "sd3.5-large": ModelPreset(
        config={
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 38,
            "attention_head_dim": 64,
            "num_attention_heads": 38,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 2432,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
        },
        height=1024,
        width=1024,
        steps=28,
        prompt_tokens=333,
        source="stabilityai/stable-diffusion-3.5-large, transformer/config.json",
    ),
    "flux-dev": ModelPreset(
        config={
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        },
        height=1024,
        width=1024,
        steps=28,
        prompt_tokens=512,  # FluxPipeline's max_sequence_length
        source="black-forest-labs/FLUX.1-dev, transformer/config.json",
    ),
    "sdxl-unet": ModelPreset(
        config={
            "_class_name": "UNet2DConditionModel",
            "act_fn": "silu",
            "addition_embed_type": "text_time",
            "addition_embed_type_num_heads": 64,
            "addition_time_embed_dim": 256,
            "attention_head_dim": [5, 10, 20],
            "block_out_channels": [320, 640, 1280],
            "center_input_sample": False,
            "cross_attention_dim": 2048,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "downsample_padding": 1,
            "flip_sin_to_cos": True,
            "freq_shift": 0,
            "in_channels": 4,
            "layers_per_block": 2,
            "mid_block_type": "UNetMidBlock2DCrossAttn",
            "norm_eps": 1e-05,
            "norm_num_groups": 32,
            "out_channels": 4,
            "projection_class_embeddings_input_dim": 2816,
            "sample_size": 128,
            "transformer_layers_per_block": [1, 2, 10],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "use_linear_projection": True,
        },
        height=1024,
        width=1024,
        steps=50,
        prompt_tokens=77,
        source="stabilityai/stable-diffusion-xl-base-1.0, unet/config.json",
    ),
}

# The families gradest can synthesise inputs for, by diffusers class name.
_FAMILIES = {
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "UNet2DConditionModel": "unet",
}
# Default prompt length per family when a config folder is given (the pipelines' defaults).
_DEFAULT_PROMPT_TOKENS = {"sd3": 333, "flux": 512, "unet": 77}
# Pixels per latent pixel of the families' VAEs (SD3, Flux and SDXL all use 8).
VAE_SCALE = 8


def load_config(source: str | Path) -> tuple[dict[str, Any], ModelPreset | None]:
    """The model config of a preset name or a diffusers folder / ``config.json`` file.

    Returns ``(config, preset)``; ``preset`` is None for a folder. A pipeline folder
    (with ``transformer/`` or ``unet/``) is accepted too.

    Raises:
        InvalidValue: an unknown name, a folder without a readable ``config.json``, or a
            config of a class gradest cannot synthesise inputs for.
    """
    text = str(source)
    if text in PRESETS:
        preset = PRESETS[text]
        return dict(preset.config), preset
    path = Path(text)
    if path.is_dir():
        for candidate in (
            path / "config.json",
            path / "transformer" / "config.json",
            path / "unet" / "config.json",
        ):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise InvalidValue(
                f"model folder {text!r} has no config.json (nor transformer/config.json or "
                f"unet/config.json); pass a diffusers model folder or a preset: "
                f"{', '.join(PRESETS)}"
            )
    elif not path.is_file():
        raise InvalidValue(
            f"model={text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
            f"diffusers config folder or config.json file"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidValue(f"cannot read {path} as JSON: {err}") from err
    if not isinstance(config, dict):
        raise InvalidValue(f"{path} must hold a JSON object (a diffusers config), got {config!r}")
    name = config.get("_class_name")
    if name not in _FAMILIES:
        raise InvalidValue(
            f"{path} describes _class_name={name!r}; gradest cost synthesises inputs for "
            f"{', '.join(_FAMILIES)}"
        )
    return config, None


def _diffusers_class(name: str) -> type[nn.Module]:
    try:
        import diffusers
    except ImportError as err:
        raise MissingDependency(
            f"building {name} needs diffusers: pip install diffusers "
            f"(or gradest's integrations extra)"
        ) from err
    return getattr(diffusers, name)


def _init_kwargs(cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    # config.json files carry bookkeeping fields (_class_name, _diffusers_version, ...) and
    # sometimes fields an older or newer diffusers does not take.
    accepted = set(getattr(cls, "_get_init_keys", lambda c: set())(cls)) or None
    return {
        key: value
        for key, value in config.items()
        if not key.startswith("_") and (accepted is None or key in accepted)
    }


@contextlib.contextmanager
def _quiet_diffusers() -> Iterator[None]:
    from diffusers.utils import logging as diffusers_logging

    previous = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(previous)


class _GuidedBatch(nn.Module):
    """Classifier-free guidance's compute: every model call runs on both halves.

    ``v = v_u + scale (v_c - v_u)`` with the conditional and unconditional rows in one
    call of ``2B`` rows, as the diffusers pipelines batch them. For cost prediction only:
    the unconditional half gets a copy of the conditioning (an empty prompt's encoding
    has the same shape, so the work is the same).
    """

    def __init__(self, velocity: nn.Module, scale: float):
        super().__init__()
        self.velocity = velocity
        self.scale = float(scale)

    def forward(self, z: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        rows = z.shape[0]
        # Both halves get the rows' conditioning, nested (SDXL's added_cond_kwargs) too:
        # gradest's one rule for per-sample values (gradest.conditioning).
        both = self.velocity(
            torch.cat([z, z]),
            repeat_per_sample(t, rows, 2),
            **repeat_per_sample(cond, rows, 2),
        )
        unconditional, conditional = both.chunk(2)
        return unconditional + self.scale * (conditional - unconditional)


@attrs.frozen(eq=False)
class DiffusersShapes:
    """A diffusers model on the meta device with inputs that fit it.

    Attributes:
        velocity: ``velocity(z, t, **cond)``, the gradest model (a
            :class:`~gradest.integrations.diffusers.DiffusersVelocity`, possibly wrapped).
        model: the diffusers model inside (parameters and LoRA layers live here).
        latent_shape: the shape of the noise ``z_0`` for the batch (packed for Flux).
        cond: per-sample conditioning tensors, meta (SDXL's ``added_cond_kwargs`` a nested
            dict, repeated in stacked calls like the top-level tensors).
        family: ``sd3``, ``flux`` or ``unet``.
        diffusion: True for an epsilon-prediction UNet (sampled with DDIM), False for a
            flow-matching transformer (sampled with rectified flow).
    """

    velocity: nn.Module
    model: nn.Module
    latent_shape: tuple[int, ...]
    cond: dict[str, Any]
    family: str
    diffusion: bool


def diffusers_shapes(
    config: Mapping[str, Any],
    *,
    batch: int,
    height: int,
    width: int,
    dtype: torch.dtype,
    prompt_tokens: int | None = None,
    cfg_scale: float | None = None,
    lora_rank: int | None = None,
    gradient_checkpointing: bool = False,
    device: str | torch.device = "meta",
) -> DiffusersShapes:
    """Build the model of ``config`` on ``device`` and synthesise its inputs.

    Args:
        config: a diffusers ``config.json`` (with ``_class_name``).
        batch, height, width: images per training step and their size in pixels; the
            latents are ``height / 8 x width / 8`` (packed 2x2 for Flux).
        dtype: the model's parameter and input dtype.
        prompt_tokens: text tokens per prompt (default: 333 for SD3, 512 for Flux, 77
            for SDXL).
        cfg_scale: classifier-free guidance in every call (the model runs on ``2B``
            rows), or None.
        lora_rank: LoRA on the attention projections (``to_q``, ``to_k``, ``to_v``,
            ``to_out.0``) with the base model frozen; None trains every parameter.
        gradient_checkpointing: diffusers' own ``enable_gradient_checkpointing()``.
        device: ``"meta"`` to trace costs; a real device builds a randomly initialised
            model (the tests compare both).
    """
    from gradest.integrations.diffusers import DiffusersVelocity

    name = config.get("_class_name")
    family = _FAMILIES.get(name)  # type: ignore[arg-type]
    if family is None:
        raise InvalidValue(
            f"config _class_name={name!r}: gradest cost synthesises inputs for "
            f"{', '.join(_FAMILIES)}"
        )
    for label, value in (("batch", batch), ("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(f"{label} must be an int >= 1, got {label}={value!r}")
    patch = int(config.get("patch_size") or 1)
    # Flux packs 2x2 latent pixels into one token on top of the VAE's factor 8.
    multiple = VAE_SCALE * (2 if family == "flux" else patch)
    if family == "unet":
        # Three down blocks halve the latents twice: the latent size must divide by 4.
        multiple = VAE_SCALE * 2 ** (len(config.get("down_block_types", ())) - 1)
    if height % multiple or width % multiple:
        raise InvalidValue(
            f"height={height} and width={width} must be multiples of {multiple} for "
            f"{name} (VAE factor {VAE_SCALE} x the model's patching / downsampling)"
        )
    tokens = _DEFAULT_PROMPT_TOKENS[family] if prompt_tokens is None else prompt_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise InvalidValue(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
    cls = _diffusers_class(name)  # type: ignore[arg-type]
    with torch.device(device), _quiet_diffusers():
        # (diffusers warns on .to(dtype) that some modules should stay float32; the
        # model is built here in one dtype, as --dtype asks.)
        model = cls(**_init_kwargs(cls, config)).to(dtype)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()  # type: ignore[operator]  # a diffusers method
    if lora_rank is not None:
        from gradest.integrations.peft import add_lora

        with torch.device(device):
            add_lora(model, rank=lora_rank, target_modules=LORA_TARGETS)
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.train()

    def tensor(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    latent_h, latent_w = height // VAE_SCALE, width // VAE_SCALE
    fixed: dict[str, Any] = {}
    cond: dict[str, Any]
    if family == "sd3":
        latent_shape: tuple[int, ...] = (batch, int(config["in_channels"]), latent_h, latent_w)
        cond = {
            "encoder_hidden_states": tensor(batch, tokens, int(config["joint_attention_dim"])),
            "pooled_projections": tensor(batch, int(config["pooled_projection_dim"])),
        }
    elif family == "flux":
        grid = (latent_h // 2) * (latent_w // 2)
        latent_shape = (batch, grid, int(config["in_channels"]))
        cond = {
            "encoder_hidden_states": tensor(batch, tokens, int(config["joint_attention_dim"])),
            "pooled_projections": tensor(batch, int(config["pooled_projection_dim"])),
        }
        if config.get("guidance_embeds"):
            cond["guidance"] = tensor(batch)
        # Position ids have no batch dimension (FluxPipeline passes them that way).
        fixed = {"img_ids": tensor(grid, 3), "txt_ids": tensor(tokens, 3)}
    else:
        latent_shape = (batch, int(config["in_channels"]), latent_h, latent_w)
        cond = {"encoder_hidden_states": tensor(batch, tokens, int(config["cross_attention_dim"]))}
    velocity: nn.Module = DiffusersVelocity(model, fixed_kwargs=fixed)
    if family == "unet" and config.get("addition_embed_type") == "text_time":
        # SDXL: the pooled text embedding and six size / crop ids per sample, nested as
        # the UNet takes them (gradest repeats nested per-sample tensors like any other).
        time_ids = 6
        pooled = int(config["projection_class_embeddings_input_dim"]) - time_ids * int(
            config["addition_time_embed_dim"]
        )
        cond["added_cond_kwargs"] = {
            "text_embeds": tensor(batch, pooled),
            "time_ids": tensor(batch, time_ids),
        }
    if cfg_scale is not None:
        velocity = _GuidedBatch(velocity, cfg_scale)
    return DiffusersShapes(
        velocity=velocity,
        model=model,
        latent_shape=latent_shape,
        cond=cond,
        family=family,
        diffusion=family == "unet",
    )
