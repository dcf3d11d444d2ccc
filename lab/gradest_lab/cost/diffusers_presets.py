"""Diffusers models as shapes only: presets, config folders, and synthetic inputs.

``gradest cost`` predicts what a training step of an estimator costs on SD3, Flux or
SDXL without a GPU, weights or data: the model is built on the meta device from its
architecture hyperparameters (a shipped preset, or the ``config.json`` of a diffusers
model folder), and its inputs are synthesised from the config. Nothing here downloads
anything; diffusers is imported only when a model is built.

A preset is the ``config.json`` of the public checkpoint's transformer / UNet (its
architecture fields; no weights), with the resolution, step count and prompt length the
model's pipeline uses by default.

Every config, a preset's or a user's, is checked field by field before anything is built
(:func:`checked_config`), by principle rather than per field: the types and defaults are
those of the diffusers class's own ``__init__`` (read with :mod:`inspect`), so a field a
config leaves out gets diffusers' default, as ``from_config`` would give it, and a given
one must have the annotated type (``int``, ``float``, ``bool``, ``str``, tuples of them,
``None`` only where the annotation allows it). An integer is a size or a count, ``>= 1``
(``num_layers=-1`` would build a model without layers and price it), except the few
offsets and indices (:data:`NON_NEGATIVE_FIELDS`, ``>= 0``). Then the relations each
family's constructor and forward need (widths divisible by heads, rope axes summing to
the head size, per-block lists as long as the blocks). Each refusal is one line naming
the field, the value and the fix.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from gradest import InvalidValue, MissingDependency
from gradest.plugin import repeat_per_sample, whole_number_problem
from gradest_lab.storage.files import read_json

__all__ = [
    "PRESETS",
    "DiffusersShapes",
    "ModelPreset",
    "checked_config",
    "diffusers_shapes",
    "family_of",
    "guidance_plan",
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


def family_of(config: Mapping[str, Any]) -> str:
    """The model family of a diffusers config: ``sd3``, ``flux`` or ``unet``."""
    return _FAMILIES[config["_class_name"]]


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
    config = read_json(path, what="model config")
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


# -- the config, checked against its diffusers class ------------------------------------

#: Integer fields that are offsets or indices, where 0 is meaningful: every other integer
#: field of the three families is a size or a count (>= 1).
NON_NEGATIVE_FIELDS = frozenset(
    {
        "freq_shift",  # UNet: the sinusoidal time embedding's offset
        "downsample_padding",  # UNet: padding of the downsampling convolutions
        "dual_attention_layers",  # SD3.5: indices of the blocks with a second attention
    }
)


def _init_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """``{field: (default, annotation)}`` of a diffusers class's ``__init__``: what it takes
    and what it gives a field a config leaves out (``inspect.Parameter.empty``: none)."""
    init = cls.__init__  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # noqa: BLE001 - an annotation this Python cannot evaluate
        hints = {}
    fields = {}
    for name, param in inspect.signature(init).parameters.items():
        if name == "self" or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        annotation = hints.get(name, param.annotation)
        fields[name] = (param.default, None if isinstance(annotation, str) else annotation)
    return fields


def _arms(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _fits(value: Any, annotation: Any, minimum: int) -> bool:
    """Whether ``value`` (as JSON gives it: lists for tuples) has the annotated type, its
    integers ``>= minimum`` and within int64, its floats finite. An annotation this does
    not know (``None`` when unreadable, a class) accepts anything: diffusers checks it."""
    if annotation is None or annotation is inspect.Parameter.empty or annotation is Any:
        return True
    arms = _arms(annotation)
    if len(arms) > 1:
        return any(_fits(value, arm, minimum) for arm in arms)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return whole_number_problem(value, minimum=minimum) is None
    if annotation is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if annotation is str:
        return isinstance(value, str)
    origin = typing.get_origin(annotation) or annotation
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            return False
        args = typing.get_args(annotation)
        if not args or args == ((),):
            return True
        # tuple[int, ...] and diffusers' loose tuple[int] (per-block lists of any length)
        # take any number of items; tuple[int, int, int] exactly three (Flux's rope axes).
        if len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis):
            return all(_fits(item, args[0], minimum) for item in value)
        return len(value) == len(args) and all(
            _fits(item, arm, minimum) for item, arm in zip(value, args, strict=True)
        )
    return True


def _describe(annotation: Any, minimum: int, *, plural: bool = False) -> str:
    """The annotated type in words, for the message (``plural``: as a list's items)."""
    arms = _arms(annotation)
    if len(arms) > 1:
        return " or ".join(dict.fromkeys(_describe(arm, minimum, plural=plural) for arm in arms))
    words = {
        type(None): ("null", "nulls"),
        bool: ("true or false", "true / false values"),
        int: (f"a whole number >= {minimum}", f"whole numbers >= {minimum}"),
        float: ("a finite number", "finite numbers"),
        str: ("a string", "strings"),
    }
    if annotation in words:
        return words[annotation][plural]
    args = typing.get_args(annotation)
    if (typing.get_origin(annotation) or annotation) in (tuple, list):
        if len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis):
            inner = f"a list of {_describe(args[0], minimum, plural=True)}"
        elif args and len(set(args)) == 1:
            inner = f"a list of {len(args)} {_describe(args[0], minimum, plural=True)}"
        elif args:
            inner = f"a list of ({', '.join(_describe(a, minimum) for a in args)})"
        else:
            inner = "a list"
        return inner.replace("a list", "lists", 1) if plural else inner
    return getattr(annotation, "__name__", str(annotation))


def _mentions_int(annotation: Any) -> bool:
    return annotation is int or any(
        _mentions_int(arg)
        for arg in (*_arms(annotation), *typing.get_args(annotation))
        if arg is not annotation
    )


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def checked_config(config: Mapping[str, Any], *, source: str | None = None) -> dict[str, Any]:
    """``config`` checked field by field against its diffusers class, before building.

    Every field the class's ``__init__`` takes is checked by the type its annotation
    states (module docstring); a field the config leaves out is filled with the default of
    that ``__init__`` (what diffusers itself gives it); then the family's own relations
    (:data:`_RELATIONS`). Keys the class does not take (``_class_name``,
    ``_diffusers_version``, fields of another diffusers version) are kept as they are.

    Args:
        source: how messages name the config (``--model 'path/config.json'``).

    Raises:
        InvalidValue: naming the field, its value and the fix.
    """
    name = config.get("_class_name")
    family = _FAMILIES.get(name)  # type: ignore[arg-type]
    where = f"{source} ({name})" if source else f"{name} config"
    if family is None:
        raise InvalidValue(
            f"{where}: _class_name={name!r}: gradest cost synthesises inputs for "
            f"{', '.join(_FAMILIES)}"
        )
    fields = _init_fields(_diffusers_class(name))  # type: ignore[arg-type]
    filled: dict[str, Any] = dict(config)
    for key, (default, annotation) in fields.items():
        if key not in config:
            if default is inspect.Parameter.empty:
                raise InvalidValue(
                    f"{where}: field {key} is missing and {name} has no default for it; "
                    f"add {key} to the config"
                )
            filled[key] = default
            continue
        value = config[key]
        minimum = 0 if key in NON_NEGATIVE_FIELDS else 1
        if _fits(value, annotation, minimum):
            continue
        example = (
            f", e.g. {key}={_json(default)} (diffusers' default)"
            if default is not inspect.Parameter.empty and _fits(default, annotation, minimum)
            else ""
        )
        kind = "an offset or index" if minimum == 0 else "a size or a count"
        note = f" ({key} is {kind})" if _mentions_int(annotation) else ""
        raise InvalidValue(
            f"{where}: field {key}={_json(value)} is invalid: expected "
            f"{_describe(annotation, minimum)}{note}; fix it in the config{example}"
        )
    _RELATIONS[family](filled, where)
    return filled


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise InvalidValue(f"{where}: {message}")


def _sd3_relations(config: Mapping[str, Any], where: str) -> None:
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    width = heads * head_dim
    # The caption projection feeds the joint blocks, whose context norms are width wide.
    _require(
        config["caption_projection_dim"] == width,
        where,
        f"caption_projection_dim={config['caption_projection_dim']} must equal "
        f"num_attention_heads x attention_head_dim = {heads} x {head_dim} = {width} (the "
        f"width of the joint blocks the caption projection feeds); set "
        f"caption_projection_dim={width}",
    )
    layers = config["num_layers"]
    beyond = [i for i in config["dual_attention_layers"] if i >= layers]
    _require(
        not beyond,
        where,
        f"dual_attention_layers={_json(list(config['dual_attention_layers']))} names "
        f"blocks {beyond} of a model with num_layers={layers} (blocks 0..{layers - 1}); "
        f"drop them or raise num_layers",
    )


def _flux_relations(config: Mapping[str, Any], where: str) -> None:
    axes, head_dim = list(config["axes_dims_rope"]), config["attention_head_dim"]
    # The rotary embedding rotates pairs of each head's channels, one block per axis.
    _require(
        sum(axes) == head_dim,
        where,
        f"axes_dims_rope={_json(axes)} sums to {sum(axes)}, but the rotary embedding covers "
        f"each head's attention_head_dim={head_dim} channels; make the axes sum to {head_dim}",
    )
    odd = [a for a in axes if a % 2]
    _require(
        not odd,
        where,
        f"axes_dims_rope={_json(axes)} has odd sizes {odd}; rotary embeddings rotate pairs "
        f"of channels, so each axis must be even",
    )


def _per_block(config: Mapping[str, Any], key: str, blocks: int) -> list[Any]:
    value = config[key]
    return list(value) if isinstance(value, list | tuple) else [value] * blocks


def _unet_relations(config: Mapping[str, Any], where: str) -> None:
    down = list(config["down_block_types"])
    blocks = len(down)
    _require(blocks >= 1, where, "down_block_types is empty; list at least one block")
    for key in ("up_block_types", "block_out_channels"):
        _require(
            len(config[key]) == blocks,
            where,
            f"{key} has {len(config[key])} entries for {blocks} down_block_types; give one "
            f"per block",
        )
    for key in (
        "layers_per_block",
        "attention_head_dim",
        "num_attention_heads",
        "cross_attention_dim",
        "transformer_layers_per_block",
        "only_cross_attention",
    ):
        value = config[key]
        _require(
            not isinstance(value, list | tuple) or len(value) == blocks,
            where,
            f"{key}={_json(value)} has {len(value) if isinstance(value, list | tuple) else 1} "
            f"entries for {blocks} down_block_types; give one per block or a single value",
        )
    channels = list(config["block_out_channels"])
    groups = config["norm_num_groups"]
    if groups is not None:
        bad = [c for c in channels if c % groups]
        _require(
            not bad,
            where,
            f"block_out_channels={_json(channels)} has widths {bad} that norm_num_groups="
            f"{groups} does not divide (each block's GroupNorm splits its channels into "
            f"groups); use multiples of {groups}",
        )
    # diffusers' legacy naming: attention_head_dim is the number of heads when
    # num_attention_heads is not given; each attention block splits its width among them.
    named = config["num_attention_heads"] is not None
    heads_key = "num_attention_heads" if named else "attention_head_dim"
    heads = _per_block(config, heads_key, blocks)
    for index, kind in enumerate(down):
        if "Attn" in kind and channels[index] % heads[index]:
            raise InvalidValue(
                f"{where}: block {index} ({kind}) is block_out_channels[{index}]="
                f"{channels[index]} wide, which {heads_key}={heads[index]} heads do not divide "
                f"(each head gets width / heads channels); use a width divisible by "
                f"{heads[index]} or another number of heads"
            )
    if config["addition_embed_type"] == "text_time":
        time_dim = config["addition_time_embed_dim"]
        projection = config["projection_class_embeddings_input_dim"]
        _require(
            time_dim is not None and projection is not None,
            where,
            "addition_embed_type='text_time' (SDXL) needs addition_time_embed_dim and "
            "projection_class_embeddings_input_dim",
        )
        # Six size / crop ids of addition_time_embed_dim each, the rest the pooled text.
        _require(
            projection > 6 * time_dim,
            where,
            f"projection_class_embeddings_input_dim={projection} must exceed 6 x "
            f"addition_time_embed_dim = {6 * time_dim} (six time ids, then the pooled text "
            f"embedding); SDXL uses 2816 = 6 x 256 + 1280",
        )
    dims = _per_block(config, "cross_attention_dim", blocks)
    _require(
        len(set(dims)) == 1,
        where,
        f"cross_attention_dim={_json(dims)} differs between blocks; gradest cost synthesises "
        f"one text encoding for every block: give one width",
    )


_RELATIONS: dict[str, Callable[[Mapping[str, Any], str], None]] = {
    "sd3": _sd3_relations,
    "flux": _flux_relations,
    "unet": _unet_relations,
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


def _scale(value: float) -> str:
    return f"{value:g}"


def guidance_plan(
    model_class: str,
    family: str,
    embedded: bool,
    cfg_scale: float | None,
    true_cfg_scale: float | None,
) -> tuple[str, float | None]:
    """How a model guides in every call: ``(words, scale)``, ``scale`` the CFG scale when
    every call runs ``2B`` rows (conditional and unconditional), else None.

    ``cfg_scale`` is the pipeline's ``guidance_scale``: the value of a guidance embedding
    (``embedded``: Flux with ``guidance_embeds``; one row per sample, as
    ``EmbeddedGuidance`` and FluxPipeline pass it), otherwise classifier-free guidance, off
    at 1 (``ClassifierFreeGuidance`` then runs the conditional half alone).
    ``true_cfg_scale`` is Flux's true CFG (FluxPipeline's ``true_cfg_scale``: on above 1),
    classifier-free guidance around the embedding.

    Raises:
        InvalidValue: ``true_cfg_scale`` for a family other than Flux, or below 1; a
            ``cfg_scale`` for a Flux model without a guidance embedding (FLUX.1-schnell
            takes no guidance value).
    """
    if true_cfg_scale is not None:
        shown = _scale(true_cfg_scale)
        if family != "flux":
            raise InvalidValue(
                f"true_cfg_scale={shown} (--true-cfg) is Flux's true CFG around its guidance "
                f"embedding (FluxPipeline's true_cfg_scale); {model_class} has no guidance "
                f"embedding and guides with classifier-free guidance: pass --cfg {shown}"
            )
        if true_cfg_scale < 1:
            raise InvalidValue(
                f"true_cfg_scale={shown} (--true-cfg) must be >= 1: true CFG runs above 1 "
                f"and is off at 1, as FluxPipeline's true_cfg_scale"
            )
    if family == "flux" and not embedded and cfg_scale is not None:
        raise InvalidValue(
            f"cfg_scale={_scale(cfg_scale)} (--cfg): this Flux transformer has "
            f"guidance_embeds=False (e.g. FLUX.1-schnell) and takes no guidance value; drop "
            f"--cfg, or price classifier-free guidance with --true-cfg"
        )
    if family == "flux":
        base = "none"
        if embedded:
            base = "embedding" + ("" if cfg_scale is None else f" {_scale(cfg_scale)}")
        if true_cfg_scale is None or true_cfg_scale == 1:
            off = "" if true_cfg_scale is None else ", true cfg 1: off"
            return f"{base}{off} (1 row per sample)", None
        around = f" around the {base}" if embedded else ""
        return (
            f"true cfg {_scale(true_cfg_scale)}{around} (2 rows per sample: conditional and "
            f"unconditional)",
            true_cfg_scale,
        )
    if cfg_scale is None:
        return "none (1 row per sample)", None
    if cfg_scale == 1:
        return "cfg 1: off, the conditional half alone (1 row per sample)", None
    return (
        f"cfg {_scale(cfg_scale)} (2 rows per sample: conditional and unconditional)",
        cfg_scale,
    )


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
        guidance: how every call guides, in words (:func:`guidance_plan`).
        rows_per_sample: 2 when every call runs the conditional and the unconditional
            half (CFG, Flux's true CFG), else 1.
    """

    velocity: nn.Module
    model: nn.Module
    latent_shape: tuple[int, ...]
    cond: dict[str, Any]
    family: str
    diffusion: bool
    guidance: str = "none (1 row per sample)"
    rows_per_sample: int = 1


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
    source: str | None = None,
    true_cfg_scale: float | None = None,
    lora_targets: Sequence[str] | None = None,
) -> DiffusersShapes:
    """Build the model of ``config`` on ``device`` and synthesise its inputs.

    Args:
        config: a diffusers ``config.json`` (with ``_class_name``).
        batch, height, width: images per training step and their size in pixels; the
            latents are ``height / 8 x width / 8`` (packed 2x2 for Flux).
        dtype: the model's parameter and input dtype.
        prompt_tokens: text tokens per prompt (default: 333 for SD3, 512 for Flux, 77
            for SDXL).
        cfg_scale: the model's guidance, as its pipeline's ``guidance_scale``: for a model
            with a guidance embedding (Flux with ``guidance_embeds``, FLUX.1-dev) the
            embedding's value (one row per sample, as ``EmbeddedGuidance``); otherwise
            classifier-free guidance in every call (the model runs on ``2B`` rows), off at
            1 (only the conditional half runs, as ``ClassifierFreeGuidance``); or None.
        true_cfg_scale: Flux's true CFG (FluxPipeline's ``true_cfg_scale``, >= 1, on
            above 1): classifier-free guidance around the guidance embedding
            (``ClassifierFreeGuidance(EmbeddedGuidance(...))``, ``2B`` rows); refused for
            the other families (their CFG is ``cfg_scale``).
        lora_rank: LoRA on the attention projections (``to_q``, ``to_k``, ``to_v``,
            ``to_out.0``) with the base model frozen; None trains every parameter.
        lora_targets: the module names (or dotted name endings) that get adapters instead
            of :data:`LORA_TARGETS`; each must name a module of the model.
        gradient_checkpointing: diffusers' own ``enable_gradient_checkpointing()``.
        device: ``"meta"`` to trace costs; a real device builds a randomly initialised
            model (the tests compare both).
        source: how errors name the config (``--model 'path'``); checked by
            :func:`checked_config` first, whatever its source (presets included).
    """
    from gradest.integrations.diffusers import DiffusersVelocity

    for label, value in (("batch", batch), ("height", height), ("width", width)):
        if whole_number_problem(value, minimum=1) is not None:
            raise InvalidValue(f"{label} must be an int >= 1, got {label}={value!r}")
    # Checked, and completed with diffusers' own defaults, before anything is built.
    config = checked_config(config, source=source)
    name = config["_class_name"]
    family = _FAMILIES[name]
    patch = config.get("patch_size", 1)  # the UNet has none
    # Flux packs 2x2 latent pixels into one token on top of the VAE's factor 8.
    multiple = VAE_SCALE * (2 if family == "flux" else patch)
    if family == "unet":
        # n down blocks halve the latents n - 1 times: the latent size must divide by that.
        multiple = VAE_SCALE * 2 ** (len(config["down_block_types"]) - 1)
    if height % multiple or width % multiple:
        raise InvalidValue(
            f"height={height} and width={width} must be multiples of {multiple} for "
            f"{name} (VAE factor {VAE_SCALE} x the model's patching / downsampling)"
        )
    # How the model guides, refused before anything is built when it cannot.
    guidance, guided = guidance_plan(
        name, family, bool(config.get("guidance_embeds")), cfg_scale, true_cfg_scale
    )
    tokens = _DEFAULT_PROMPT_TOKENS[family] if prompt_tokens is None else prompt_tokens
    if whole_number_problem(tokens, minimum=1) is not None:
        raise InvalidValue(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
    cls = _diffusers_class(name)
    try:
        with torch.device(device), _quiet_diffusers():
            # (diffusers warns on .to(dtype) that some modules should stay float32; the
            # model is built here in one dtype, as --dtype asks.)
            model = cls(**_init_kwargs(cls, config)).to(dtype)
    except (ValueError, TypeError, AssertionError) as err:
        # What diffusers' constructor refuses beyond the checks above (an unknown block
        # type, ...): one line naming the config, not a traceback from inside diffusers.
        shown = " ".join(str(err).split()) or type(err).__name__
        raise InvalidValue(
            f"{source or name + ' config'}: diffusers cannot build {name} from it: {shown}"
        ) from err
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()  # type: ignore[operator]  # a diffusers method
    if lora_rank is not None:
        from gradest.integrations.peft import add_lora

        targets = tuple(LORA_TARGETS if lora_targets is None else lora_targets)
        names = [name for name, _ in model.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise InvalidValue(
                f"lora_targets {', '.join(missing)} name no module of {name} (its attention "
                f"projections are e.g. {', '.join(LORA_TARGETS)})"
            )
        with torch.device(device):
            add_lora(model, rank=lora_rank, target_modules=list(targets))
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
        dims = config["cross_attention_dim"]  # one width (checked_config), maybe per block
        width = dims[0] if isinstance(dims, list | tuple) else dims
        cond = {"encoder_hidden_states": tensor(batch, tokens, int(width))}
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
    if guided is not None:
        velocity = _GuidedBatch(velocity, guided)
    return DiffusersShapes(
        velocity=velocity,
        model=model,
        latent_shape=latent_shape,
        cond=cond,
        family=family,
        diffusion=family == "unet",
        guidance=guidance,
        rows_per_sample=1 if guided is None else 2,
    )
