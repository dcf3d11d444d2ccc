"""A diffusers pipeline and prompts as gradest's velocity, sampler and cond.

::

    velocity, sampler, cond = gradest.integrations.from_pipeline(
        pipe, ["a red cat", "a blue sky"], guidance_scale=4.5, num_inference_steps=28
    )
    est.surrogate(velocity, sampler, objective, noise=noise, cond=cond)

:func:`from_pipeline` does what the pipeline's ``__call__`` does before its denoising
loop, with the pipeline's own pieces: ``encode_prompt`` (under ``no_grad``: the text
encoders are constants), the timesteps (SD3's and Flux's ``mu``, Flux's sigmas), SDXL's
size / crop ``time_ids``, Flux's position ids; and what the loop does at every step, as a
gradest model: classifier-free guidance on one doubled batch
(:class:`~gradest.integrations.guidance.ClassifierFreeGuidance`, SDXL's
``guidance_rescale`` too), Flux's guidance embedding
(:class:`~gradest.integrations.guidance.EmbeddedGuidance`) and Flux's "true CFG". Its
sampler takes the scheduler's own steps, so ``gradest.rollout(velocity, sampler, noise,
cond=cond)`` is the pipeline's ``output_type="latent"`` result for the same initial
latents (:meth:`PipelineSampling.noise` draws them as the pipeline does from a
generator), and every estimator differentiates through it.

Pipelines: ``StableDiffusion3Pipeline`` (``FlowMatchEulerDiscreteScheduler``),
``FluxPipeline`` (packed latents), ``StableDiffusionXLPipeline`` and
``StableDiffusionPipeline`` (``DDIMScheduler`` / ``DDPMScheduler``: SDXL's default
``EulerDiscreteScheduler`` is not one of gradest's samplers; swap it with
``pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)``). Subclasses count
as their base. Tested on tiny random pipelines built from configs
(``tests/test_pipelines.py``).

The latent helpers the Flux pipeline uses (:func:`pack_latents`, :func:`unpack_latents`,
:func:`flux_image_ids`) and the dynamic-shift ``mu`` (:func:`dynamic_shift_mu`) are here
too, for loops that start from precomputed prompt embeddings (the recipes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest._checks import check_allocation, finite_number
from gradest.errors import InvalidType, InvalidValue, MissingDependency
from gradest.integers import INT64_MAX
from gradest.integrations.diffusers_schedulers import check_num_inference_steps
from gradest.integrations.guidance import NEGATIVE_PREFIX, ClassifierFreeGuidance, EmbeddedGuidance
from gradest.samplers import as_int

__all__ = [
    "PIPELINES",
    "PipelineSampling",
    "dynamic_shift_mu",
    "flux_image_ids",
    "from_pipeline",
    "pack_latents",
    "pipeline_family",
    "sdxl_time_ids",
    "unpack_latents",
]

#: The pipeline classes :func:`from_pipeline` knows, and their family.
PIPELINES = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusionPipeline": "sd",
}
#: The pipelines' ``__call__`` defaults: ``(num_inference_steps, guidance_scale)``.
DEFAULTS = {"sd3": (28, 7.0), "flux": (28, 3.5), "sdxl": (50, 5.0), "sd": (50, 7.5)}
_DDIM_SCHEDULERS = ("DDIMScheduler", "DDPMScheduler")
#: The most T5 tokens ``StableDiffusion3Pipeline`` and ``FluxPipeline`` take: their
#: ``check_inputs`` refuse a longer ``max_sequence_length`` (and the T5 tokenizers they
#: ship have ``model_max_length=512``).
T5_MAX_TOKENS = 512
# CLIP's context when a pipeline has no tokenizer to read it from.
_CLIP_TOKENS = 77


# -- sizes ------------------------------------------------------------------------------------


def _size(name: str, value: Any, example: int) -> int:
    """``value`` as a Python int in ``[1, 2**63 - 1]``: one rule for every size and count.

    numpy and torch integer scalars (and 0-d integer arrays) count as ints, as wherever
    gradest takes a number (:func:`gradest.samplers.as_int`). A bool, a float (``16.0``
    too), a string or None is a type error: diffusers would take a float size as far as
    ``range`` or ``torch.zeros`` and fail there. ``example``: a value to suggest.

    Raises:
        InvalidType: not an integer.
        InvalidValue: below 1, or above int64 (what torch's sizes and numpy's hold).
    """
    number = as_int(value)
    if isinstance(number, bool) or not isinstance(number, int):
        if isinstance(number, float) and number.is_integer() and number >= 1:
            example = int(number)
        raise InvalidType(
            f"{name} must be an int >= 1, got {name}={value!r} (a {type(value).__name__}); "
            f"pass a whole number, e.g. {name}={example}"
        )
    if number < 1:
        raise InvalidValue(
            f"{name} must be an int >= 1 (a size or a count), got {name}={value!r}; "
            f"e.g. {name}={example}"
        )
    if number > INT64_MAX:
        raise InvalidValue(
            f"{name}={value!r} is above 2**63 - 1, the largest integer torch holds (and far "
            f"more than any tensor fits); e.g. {name}={example}"
        )
    return number


def _even_side(name: str, value: Any, example: int) -> int:
    """A latent side of Flux's packed latents: a size, and even (2 x 2 patches)."""
    side = _size(name, value, example)
    if side % 2:
        raise InvalidValue(
            f"{name}={value!r} must be even: Flux packs latents in 2 x 2 patches, so each "
            f"latent side is even; make the image's height and width multiples of "
            f"2 x vae_scale_factor (16 for Flux's 8x VAE), e.g. {name}={side + 1}"
        )
    return side


def _itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (a torch dtype); 4 for anything else."""
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


def _token_limit(tokenizer: Any) -> int | None:
    """A tokenizer's ``model_max_length``, or None where it has none (transformers sets
    ``int(1e30)`` when a tokenizer was saved without one)."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= INT64_MAX:
        return None
    return limit


# -- latents and schedule pieces --------------------------------------------------------------


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: ``FluxPipeline._pack_latents``.

    Raises:
        InvalidType: ``latents`` is not a tensor.
        InvalidValue: not ``[B, C, H, W]`` with every dimension >= 1 and ``H``, ``W`` even.
    """
    if not isinstance(latents, Tensor):
        raise InvalidType(
            f"latents must be a torch.Tensor [B, C, H, W], got a {type(latents).__name__}"
        )
    shape = tuple(latents.shape)
    if len(shape) != 4 or min(shape) < 1:
        raise InvalidValue(
            f"latents has shape {shape}; pack_latents takes [B, C, H, W] latents with every "
            f"dimension >= 1 (one sample: latents[None])"
        )
    b, c, h, w = shape
    if h % 2 or w % 2:
        raise InvalidValue(
            f"latents has shape {shape}: H={h} and W={w} must be even, since Flux packs 2 x 2 "
            f"patches; make the image's height and width multiples of 2 x vae_scale_factor "
            f"(16 for Flux's 8x VAE)"
        )
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: Tensor, height: int, width: int) -> Tensor:
    """The inverse of :func:`pack_latents` for ``[B, C, height, width]`` latents.

    Raises:
        InvalidType: ``packed`` is not a tensor, or a size is not an int.
        InvalidValue: a size below 1 or odd, or ``packed`` not ``[B, (height/2)(width/2),
            4C]`` (the result has its elements: nothing more is allocated).
    """
    h, w = _even_side("height", height, 64), _even_side("width", width, 64)
    if not isinstance(packed, Tensor):
        raise InvalidType(
            f"packed must be a torch.Tensor [B, (height/2)(width/2), 4C], got a "
            f"{type(packed).__name__}"
        )
    shape, positions = tuple(packed.shape), (h // 2) * (w // 2)
    if len(shape) != 3 or shape[1] != positions or shape[2] % 4 or min(shape) < 1:
        raise InvalidValue(
            f"packed has shape {shape}; for height={h}, width={w} unpack_latents takes "
            f"[B, (height/2)(width/2), 4C] = [B, {positions}, a multiple of 4] (pass the "
            f"latent sides the latents were packed from)"
        )
    b, _, channels = shape
    latents = packed.view(b, h // 2, w // 2, channels // 4, 2, 2)
    return latents.permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, h, w)


def flux_image_ids(height: int, width: int) -> Tensor:
    """``FluxPipeline._prepare_latent_image_ids`` for ``[*, *, height, width]`` latents.

    Raises:
        InvalidType: a size is not an int.
        InvalidValue: a size below 1 or odd (the latents are packed in 2 x 2 patches), or
            ids that would not fit in the machine's memory.
    """
    h, w = _even_side("height", height, 64), _even_side("width", width, 64)
    # Three ids of the default dtype per packed position, refused before torch.zeros.
    check_allocation(
        f"flux_image_ids(height={height!r}, width={width!r})",
        (h // 2) * (w // 2),
        3 * _itemsize(torch.get_default_dtype()),
        name="(height / 2) * (width / 2)",
        detail="3 ids per packed position",
    )
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def dynamic_shift_mu(scheduler: Any, image_seq_len: int, max_shift: float = 1.15) -> float:
    """``mu`` for a scheduler with dynamic shifting: the pipelines' ``calculate_shift``
    with the scheduler's config (``max_shift``: the default where the config has none;
    SD3's pipeline uses 1.16, Flux's 1.15).

    Raises:
        InvalidType: ``image_seq_len`` is not an int.
        InvalidValue: ``image_seq_len`` below 1 or above int64.
    """
    seq_len = _size("image_seq_len", image_seq_len, 4096)
    c = scheduler.config
    base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    base_shift, top = c.get("base_shift", 0.5), c.get("max_shift", max_shift)
    slope = (top - base_shift) / (max_len - base_len)
    return seq_len * slope + (base_shift - slope * base_len)


def sdxl_time_ids(height: int, width: int, rows: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """SDXL's ``add_time_ids`` as its pipeline builds them by default: ``(original h, w,
    crop top, left, target h, w) = (height, width, 0, 0, height, width)``, one row per
    sample (``[rows, 6]``).

    Raises:
        InvalidType: a size is not an int, or ``dtype`` not a torch dtype.
        InvalidValue: a size below 1 or above int64, or ``rows`` whose ids would not fit
            in the machine's memory.
    """
    h, w = _size("height", height, 1024), _size("width", width, 1024)
    count = _size("rows", rows, 1)
    if not isinstance(dtype, torch.dtype):
        raise InvalidType(f"dtype must be a torch.dtype, got dtype={dtype!r}")
    check_allocation(f"sdxl_time_ids(rows={rows!r})", count, 6 * _itemsize(dtype), name="rows")
    return torch.tensor([[h, w, 0, 0, h, w]], dtype=dtype).repeat(count, 1)


# -- the helper ---------------------------------------------------------------------------------


def pipeline_family(pipe: Any) -> str:
    """``"sd3"``, ``"flux"``, ``"sdxl"`` or ``"sd"`` for a pipeline (or a subclass of one).

    Raises:
        InvalidType: a pipeline :func:`from_pipeline` does not know, naming the ones it does.
    """
    for cls in type(pipe).__mro__:
        if cls.__name__ in PIPELINES:
            return PIPELINES[cls.__name__]
    raise InvalidType(
        f"pipe is a {type(pipe).__name__}, which from_pipeline does not know; it takes "
        f"{', '.join(PIPELINES)} (or build velocity, sampler and cond yourself: "
        f"docs/integrations.md)"
    )


@attrs.frozen(eq=False)
class PipelineSampling:
    """What :func:`from_pipeline` returns; unpacks as ``velocity, sampler, cond``.

    Attributes:
        velocity: the gradest model ``velocity(z, t, **cond)`` (guidance included).
        sampler: the gradest sampler taking the scheduler's steps.
        cond: the encoded prompts, one row per sample (``negative_*``: CFG's
            unconditional rows; SDXL's ``added_cond_kwargs`` nested).
        latent_shape: the initial noise's shape ``[B, ...]`` (Flux: packed).
        family: ``"sd3"``, ``"flux"``, ``"sdxl"`` or ``"sd"``.
        height, width: the image size in pixels.
        pipe: the pipeline.
    """

    velocity: nn.Module
    sampler: Any
    cond: dict[str, Any]
    latent_shape: tuple[int, ...]
    family: str
    height: int
    width: int
    pipe: Any = attrs.field(repr=False)

    def __iter__(self) -> Any:
        return iter((self.velocity, self.sampler, self.cond))

    def noise(
        self, generator: torch.Generator | None = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The initial latents the pipeline draws from ``generator`` (its own
        ``prepare_latents``; ``dtype``: the prompt embeddings', as the pipeline's)."""
        pipe, batch = self.pipe, self.latent_shape[0]
        if dtype is None:
            dtype = self.cond["encoder_hidden_states"].dtype
        device = pipe._execution_device
        if self.family == "flux":
            channels = pipe.transformer.config.in_channels // 4
            latents, _ = pipe.prepare_latents(
                batch, channels, self.height, self.width, dtype, device, generator
            )
            return latents
        denoiser = pipe.transformer if self.family == "sd3" else pipe.unet
        channels = denoiser.config.in_channels
        return pipe.prepare_latents(
            batch, channels, self.height, self.width, dtype, device, generator
        )

    def to_vae_latents(self, z: Tensor) -> Tensor:
        """``z`` as the VAE's ``[B, C, h, w]`` latents (Flux unpacks; the others are)."""
        if self.family != "flux":
            return z
        factor = self.pipe.vae_scale_factor
        side_h, side_w = 2 * (self.height // (factor * 2)), 2 * (self.width // (factor * 2))
        return unpack_latents(z, side_h, side_w)


def _prompts(name: str, value: Any, count: int | None = None) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(p, str) for p in value)
    ):
        raise InvalidValue(f"{name} must be a string or a non-empty list of strings, got {value!r}")
    if count is not None and len(value) != count:
        if len(value) == 1:
            return list(value) * count
        raise InvalidValue(
            f"{name} has {len(value)} prompts but prompt has {count}; give one negative "
            f"prompt, or one per prompt"
        )
    return list(value)


def from_pipeline(
    pipe: Any,
    prompt: str | Sequence[str],
    *,
    negative_prompt: str | Sequence[str] | None = None,
    guidance_scale: float | None = None,
    num_inference_steps: int | None = None,
    height: int | None = None,
    width: int | None = None,
    num_images_per_prompt: int = 1,
    max_sequence_length: int | None = None,
    guidance_rescale: float = 0.0,
    true_cfg_scale: float = 1.0,
    eta: float = 0.0,
) -> PipelineSampling:
    """``velocity, sampler, cond`` of ``pipe`` for ``prompt``: what ``pipe(prompt, ...)``
    samples with, as gradest's model, sampler and conditioning.

    Args:
        pipe: a diffusers ``StableDiffusion3Pipeline``, ``FluxPipeline``,
            ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline`` (its transformer
            / UNet may carry LoRA adapters: they are what the estimators train).
        prompt: one prompt or a list; the batch is ``len(prompt) * num_images_per_prompt``.
        negative_prompt: CFG's unconditional prompt (default: the empty prompt, as the
            pipelines), one or one per prompt; needs guidance on.
        guidance_scale: the pipeline's ``guidance_scale`` and default (SD3 7.0, SDXL 5.0,
            SD 7.5: CFG when > 1; Flux 3.5: its guidance embedding, for a model with
            ``guidance_embeds``).
        num_inference_steps: the pipeline's default (SD3 / Flux 28, SDXL / SD 50).
        height: pixels (default: the pipeline's ``default_sample_size *
            vae_scale_factor``).
        width: pixels (default as ``height``).
        num_images_per_prompt: samples per prompt.
        max_sequence_length: T5 tokens (SD3: 256, Flux: 512 by default; at most 512, the
            pipelines' limit, and the T5 tokenizer's ``model_max_length``).
        guidance_rescale: SDXL / SD's ``guidance_rescale`` (in [0, 1]).
        true_cfg_scale: Flux's "true CFG" with ``negative_prompt`` (> 1 to use it).
        eta: DDIM's noise (SDXL / SD).

    Every size (``num_inference_steps``, ``num_images_per_prompt``, ``height``,
    ``width``, ``max_sequence_length``) is an int (numpy and torch integers too) >= 1,
    checked before any model call or allocation against what it would allocate: the
    schedule (on the CPU), the initial latents and the prompt embeddings (on the
    pipeline's device), each against that device's memory; DDIM's steps against the
    scheduler's ``num_train_timesteps``, T5's tokens against the tokenizer's.

    Raises:
        TypeError: a pipeline it does not know, a scheduler gradest cannot take, a size
            that is not an int (:class:`~gradest.errors.InvalidType`).
        ValueError: a bad argument (one line naming it, its value and the fix;
            :class:`~gradest.errors.InvalidValue`).
    """
    family = pipeline_family(pipe)
    prompts = _prompts("prompt", prompt)
    default_steps, default_scale = DEFAULTS[family]
    # Every size is an int >= 1 here; what it would allocate is bounded below, once the
    # pipeline's shapes are read, and all before the first model call (encode_prompt).
    copies = _size("num_images_per_prompt", num_images_per_prompt, 1)
    steps = _size(
        "num_inference_steps",
        default_steps if num_inference_steps is None else num_inference_steps,
        default_steps,
    )
    scale = finite_number(
        "guidance_scale", default_scale if guidance_scale is None else guidance_scale, 0
    )
    rescale = finite_number("guidance_rescale", guidance_rescale, 0.0, 1.0)
    true_cfg = finite_number("true_cfg_scale", true_cfg_scale, 0.0)
    eta = finite_number("eta", eta, 0.0, 1.0)
    if family not in ("sdxl", "sd"):
        for name, value, default in (("guidance_rescale", rescale, 0.0), ("eta", eta, 0.0)):
            if value != default:
                raise InvalidValue(
                    f"{name}={value!r} is for the DDIM pipelines (SDXL, SD); the {family} "
                    f"pipeline samples with flow-matching Euler steps: leave it unset"
                )
    if family != "flux" and true_cfg != 1.0:
        raise InvalidValue(
            f"true_cfg_scale={true_cfg!r} is Flux's; the {family} pipeline's CFG scale is "
            f"guidance_scale: pass guidance_scale={true_cfg!r}"
        )
    if max_sequence_length is not None and family not in ("sd3", "flux"):
        raise InvalidValue(
            f"max_sequence_length={max_sequence_length!r} is T5's (SD3, Flux); the {family} "
            f"pipeline's CLIP tokenizers have a fixed length: leave it unset"
        )
    tokens = _t5_tokens(pipe, family, max_sequence_length)
    denoiser = pipe.transformer if family in ("sd3", "flux") else pipe.unet
    if denoiser is None:
        raise InvalidValue(
            f"pipe.{'transformer' if family in ('sd3', 'flux') else 'unet'} is None: load the "
            f"pipeline with its denoiser"
        )
    config = denoiser.config
    if family == "flux":
        cfg = true_cfg > 1.0 and negative_prompt is not None
        if negative_prompt is not None and not cfg:
            raise InvalidValue(
                f"negative_prompt is given but true_cfg_scale={true_cfg!r} turns Flux's true "
                f"CFG off, so it would be unused; pass true_cfg_scale > 1 or drop negative_prompt"
            )
        if guidance_scale is not None and not config.guidance_embeds:
            raise InvalidValue(
                f"guidance_scale={guidance_scale!r}: this Flux transformer has "
                f"config.guidance_embeds=False (e.g. FLUX.1-schnell) and takes no guidance; "
                f"leave guidance_scale unset (or use true_cfg_scale with a negative_prompt)"
            )
    else:
        cfg = scale > 1.0
        if negative_prompt is not None and not cfg:
            raise InvalidValue(
                f"negative_prompt is given but guidance_scale={scale!r} turns classifier-free "
                f"guidance off (it needs guidance_scale > 1), so it would be unused; pass "
                f"guidance_scale > 1 or drop negative_prompt"
            )
        if family == "sdxl" and getattr(config, "time_cond_proj_dim", None) is not None:
            raise InvalidValue(
                f"pipe.unet.config.time_cond_proj_dim={config.time_cond_proj_dim} (an LCM / "
                f"guidance-embedded UNet): from_pipeline does not build its timestep_cond; "
                f"use a UNet without it"
            )
    negatives = (
        None
        if negative_prompt is None
        else _prompts("negative_prompt", negative_prompt, len(prompts))
    )
    factor = int(pipe.vae_scale_factor)
    sample = int(getattr(pipe, "default_sample_size", None) or config.sample_size)
    multiple = factor * (2 if family == "flux" else int(getattr(config, "patch_size", 1) or 1))
    if family in ("sdxl", "sd"):
        multiple = factor * 2 ** (len(config.block_out_channels) - 1)
    sizes: dict[str, int] = {}
    for name, given in (("height", height), ("width", width)):
        size = sample * factor if given is None else _size(name, given, sample * factor)
        if size % multiple:
            raise InvalidValue(
                f"{name}={size} must be a multiple of {multiple} for this pipeline (the VAE's "
                f"{factor}x times the denoiser's downsampling); use "
                f"{max(1, size // multiple) * multiple}"
            )
        sizes[name] = size
    h, w = sizes["height"], sizes["width"]
    batch = len(prompts) * copies
    device = pipe._execution_device
    check_num_inference_steps(pipe.scheduler, steps)
    _check_memory(
        pipe, family, denoiser, device, prompts=len(prompts), copies=copies, height=h,
        width=w, cfg=cfg, tokens=tokens,
    )  # fmt: skip
    with torch.no_grad():
        cond = _encode(pipe, family, prompts, negatives, copies, device, cfg, tokens)
    return _assemble(
        pipe, family, denoiser, cond, batch=batch, height=h, width=w, steps=steps,
        scale=scale, cfg=cfg, rescale=rescale, true_cfg=true_cfg, eta=eta,
    )  # fmt: skip


def _t5_tokens(pipe: Any, family: str, value: Any) -> int | None:
    """``max_sequence_length`` checked against the T5 tokenizer's ``model_max_length`` and
    the pipelines' own limit (:data:`T5_MAX_TOKENS`); None: the pipeline's default."""
    if value is None or family not in ("sd3", "flux"):
        return None
    default = 256 if family == "sd3" else 512
    tokens = _size("max_sequence_length", value, default)
    attribute = "tokenizer_3" if family == "sd3" else "tokenizer_2"
    limit = _token_limit(getattr(pipe, attribute, None))
    if limit is not None and limit < T5_MAX_TOKENS:
        source = f"pipe.{attribute}.model_max_length={limit}"
    else:
        limit, source = T5_MAX_TOKENS, f"the {family} pipeline takes at most {T5_MAX_TOKENS}"
    if tokens > limit:
        raise InvalidValue(
            f"max_sequence_length={value!r} is more T5 tokens than this pipeline takes "
            f"({source}); use max_sequence_length <= {limit} (default {min(default, limit)})"
        )
    return tokens


def _check_memory(
    pipe: Any,
    family: str,
    denoiser: Any,
    device: Any,
    *,
    prompts: int,
    copies: int,
    height: int,
    width: int,
    cfg: bool,
    tokens: int | None,
) -> None:
    """Refuse sizes whose tensors cannot fit on the pipeline's device, before any is
    allocated: the initial latents (:meth:`PipelineSampling.noise`) and the prompt
    embeddings ``encode_prompt`` returns (CFG: twice), in the denoiser's dtype.

    A lower bound on what sampling holds (the text encoders' activations and the
    ``repeat`` copies ``encode_prompt`` makes are left out), so that a refusal is certain:
    first ``height`` / ``width`` for ``len(prompt)`` samples, then every image more.
    """
    config = denoiser.config
    factor = int(pipe.vae_scale_factor)
    item = _itemsize(getattr(denoiser, "dtype", None))
    # Latent channels per latent pixel (Flux's packed in_channels hold 2 x 2 pixels).
    channels = int(config.in_channels) // (4 if family == "flux" else 1)
    pixels = (height // factor) * (width // factor)
    check_allocation(
        f"height={height}, width={width}",
        pixels,
        prompts * channels * item,
        name=f"(height / {factor}) * (width / {factor})",
        device=device,
        detail=f"the initial latents of {prompts} prompt(s), {channels} channels of {item} "
        f"bytes per latent pixel",
    )
    clip = _token_limit(getattr(pipe, "tokenizer", None)) or _CLIP_TOKENS
    if family == "sd3":  # CLIP's tokens and T5's, side by side
        sequence = clip + (256 if tokens is None else tokens)
    elif family == "flux":
        sequence = 512 if tokens is None else tokens
    else:
        sequence = clip
    text_width = (
        config.joint_attention_dim if family in ("sd3", "flux") else config.cross_attention_dim
    )
    if isinstance(text_width, list | tuple):  # a UNet's per-block widths: the narrowest
        text_width = min(text_width)
    embeddings = (2 if cfg else 1) * sequence * int(text_width) * item
    check_allocation(
        f"num_images_per_prompt={copies}",
        copies,
        prompts * (pixels * channels * item + embeddings),
        name="num_images_per_prompt",
        device=device,
        detail=f"per image of each of {prompts} prompt(s): the initial latents and "
        f"{'both halves of the CFG' if cfg else 'the'} prompt embeddings",
    )


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as err:
        raise MissingDependency(
            "from_pipeline needs diffusers: pip install 'gradest[integrations]'"
        ) from err
    return diffusers


def _encode(
    pipe: Any,
    family: str,
    prompts: list[str],
    negatives: list[str] | None,
    copies: int,
    device: Any,
    cfg: bool,
    max_sequence_length: int | None,
) -> dict[str, Any]:
    """The pipeline's own ``encode_prompt``, as its ``__call__`` calls it."""
    cond: dict[str, Any] = {}
    neg = NEGATIVE_PREFIX
    if family == "sd3":
        extra = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            num_images_per_prompt=copies, do_classifier_free_guidance=cfg,
            negative_prompt=negatives, **extra,
        )  # fmt: skip
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        if cfg:
            cond[neg + "encoder_hidden_states"] = negative
            cond[neg + "pooled_projections"] = negative_pooled
    elif family == "flux":
        extra = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, num_images_per_prompt=copies, **extra
        )
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        if cfg:
            negative, negative_pooled, _ = pipe.encode_prompt(
                prompt=negatives, prompt_2=None, device=device, num_images_per_prompt=copies,
                **extra,
            )  # fmt: skip
            cond[neg + "encoder_hidden_states"] = negative
            cond[neg + "pooled_projections"] = negative_pooled
        cond["_txt_ids"] = text_ids  # a fixed keyword of the transformer (no batch dimension)
    elif family == "sdxl":
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, num_images_per_prompt=copies,
            do_classifier_free_guidance=cfg, negative_prompt=negatives,
        )  # fmt: skip
        cond = {"encoder_hidden_states": embeds, "_pooled": pooled}
        if cfg:
            cond[neg + "encoder_hidden_states"] = negative
            cond["_negative_pooled"] = negative_pooled
    else:
        embeds, negative = pipe.encode_prompt(
            prompts, device, copies, cfg, negative_prompt=negatives
        )
        cond = {"encoder_hidden_states": embeds}
        if cfg:
            cond[neg + "encoder_hidden_states"] = negative
    return cond


def _assemble(
    pipe: Any,
    family: str,
    denoiser: nn.Module,
    cond: dict[str, Any],
    *,
    batch: int,
    height: int,
    width: int,
    steps: int,
    scale: float,
    cfg: bool,
    rescale: float,
    true_cfg: float,
    eta: float,
) -> PipelineSampling:
    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler

    _diffusers()
    config: Any = denoiser.config
    factor = int(pipe.vae_scale_factor)
    scheduler = pipe.scheduler
    velocity: nn.Module
    if family in ("sd3", "flux"):
        options: dict[str, Any] = {}
        if family == "flux":
            side_h, side_w = 2 * (height // (factor * 2)), 2 * (width // (factor * 2))
            seq_len = (side_h // 2) * (side_w // 2)
            latent_shape: tuple[int, ...] = (batch, seq_len, int(config.in_channels))
            if not scheduler.config.get("use_flow_sigmas", False):
                import numpy as np

                options["sigmas"] = np.linspace(1.0, 1 / steps, steps)
            options["mu"] = dynamic_shift_mu(scheduler, seq_len, max_shift=1.15)
        else:
            side_h, side_w = height // factor, width // factor
            latent_shape = (batch, int(config.in_channels), side_h, side_w)
            if scheduler.config.get("use_dynamic_shifting", False):
                patch = int(config.patch_size)
                seq_len = (side_h // patch) * (side_w // patch)
                options["mu"] = dynamic_shift_mu(scheduler, seq_len, max_shift=1.16)
        if type(scheduler).__name__ in _DDIM_SCHEDULERS:
            raise InvalidType(
                f"pipe.scheduler is a {type(scheduler).__name__}, a DDPM-family scheduler; the "
                f"{family} pipeline samples with FlowMatchEulerDiscreteScheduler"
            )
        try:
            sampler: Any = sampler_from_scheduler(scheduler, steps, **options)
        except TypeError as err:
            raise InvalidType(
                f"pipe.scheduler is a {type(scheduler).__name__}: {err}; the {family} pipeline "
                f"samples with FlowMatchEulerDiscreteScheduler"
            ) from err
        fixed: dict[str, Any] = {}
        if family == "flux":
            dtype = cond["encoder_hidden_states"].dtype
            fixed = {
                "img_ids": flux_image_ids(side_h, side_w).to(cond["_txt_ids"].device, dtype),
                "txt_ids": cond.pop("_txt_ids"),
            }
        velocity = DiffusersVelocity(denoiser, fixed_kwargs=fixed)
        if family == "flux" and config.guidance_embeds:
            velocity = EmbeddedGuidance(velocity, scale)
        if cfg:
            velocity = ClassifierFreeGuidance(velocity, true_cfg if family == "flux" else scale)
    else:
        name = type(scheduler).__name__
        if name not in _DDIM_SCHEDULERS:
            raise InvalidType(
                f"pipe.scheduler is a {name}, which gradest's samplers do not take; set "
                f"pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config) "
                f"(gradest.DDIM takes DDIMScheduler's and DDPMScheduler's steps)"
            )
        ddpm = name == "DDPMScheduler"
        sampler = sampler_from_scheduler(scheduler, steps, eta=None if ddpm else eta)
        velocity = DiffusersVelocity.for_sampler(denoiser, sampler)
        latent_shape = (batch, int(config.in_channels), height // factor, width // factor)
        if family == "sdxl":
            embeds, pooled = cond["encoder_hidden_states"], cond["_pooled"]
            encoder_2 = getattr(pipe, "text_encoder_2", None)
            projection = (
                int(pooled.shape[-1]) if encoder_2 is None else encoder_2.config.projection_dim
            )
            try:  # the pipeline's own ids, and its check of the UNet's embedding width
                ids = pipe._get_add_time_ids(
                    (height, width), (0, 0), (height, width), dtype=embeds.dtype,
                    text_encoder_projection_dim=projection,
                )  # fmt: skip
            except ValueError as err:
                raise InvalidValue(
                    f"pipe.unet does not fit the pipeline's text encoders: "
                    f"{' '.join(str(err).split())}"
                ) from err
            time_ids = ids.to(embeds.device).repeat(batch, 1)
            cond["added_cond_kwargs"] = {"text_embeds": cond.pop("_pooled"), "time_ids": time_ids}
            if cfg:
                cond[NEGATIVE_PREFIX + "added_cond_kwargs"] = {
                    "text_embeds": cond.pop("_negative_pooled"),
                    "time_ids": time_ids,
                }
        if cfg:
            velocity = ClassifierFreeGuidance(velocity, scale, rescale=rescale)
    return PipelineSampling(
        velocity=velocity, sampler=sampler, cond=cond, latent_shape=latent_shape,
        family=family, height=height, width=width, pipe=pipe,
    )  # fmt: skip
