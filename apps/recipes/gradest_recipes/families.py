"""Model families: the denoiser, VAE, scheduler, sampler and conditioning of each recipe.

* ``sd3``: ``SD3Transformer2DModel`` + ``FlowMatchEulerDiscreteScheduler`` (through
  :func:`~gradest.integrations.diffusers.sampler_from_scheduler`, dynamic shifting as the
  SD3 pipeline computes it), conditioning ``encoder_hidden_states`` +
  ``pooled_projections``, classifier-free guidance.
* ``flux``: ``FluxTransformer2DModel`` on packed latents ``[B, (H/2)(W/2), 4C]`` with
  ``img_ids`` / ``txt_ids``, ``pooled_projections``, the sigmas and ``mu`` FluxPipeline
  uses; a guidance-distilled model (``guidance_embeds``, FLUX.1-dev) gets
  ``guidance_scale`` through its guidance embedding instead of CFG, and with
  ``true_cfg_scale > 1`` true CFG around it (FluxPipeline's ``true_cfg_scale``:
  ``ClassifierFreeGuidance(EmbeddedGuidance(...))`` with the negative prompt's
  embeddings, every call on ``2B`` rows).
* ``sd_unet``: ``UNet2DConditionModel`` + ``DDIMScheduler`` (through
  :func:`gradest.integrations.diffusers.sampler_from_scheduler`, ``eta`` from the config),
  ``encoder_hidden_states``, classifier-free guidance.
* ``sdxl``: SDXL's ``UNet2DConditionModel`` (``addition_embed_type="text_time"``) +
  ``DDIMScheduler`` built from the model's scheduler config (SDXL ships
  ``EulerDiscreteScheduler``, which gradest's samplers do not take), conditioning
  ``encoder_hidden_states`` and the nested ``added_cond_kwargs={"text_embeds",
  "time_ids"}`` (the size / crop ids of ``resolution``, as StableDiffusionXLPipeline
  builds them), classifier-free guidance.

Guidance (:mod:`gradest.integrations.guidance`) and the Flux latent helpers
(:mod:`gradest.integrations.pipelines`) are the library's: a user's own loop and
``gradest.integrations.from_pipeline`` build the same model.

With ``tiny = true`` every piece is a tiny random model built here (seeded); otherwise
each is loaded from the local folder ``pretrained`` with ``from_pretrained(subfolder=...)``
(``transformer`` or ``unet``, ``vae``, ``scheduler``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest import InvalidValue, MissingDependency
from gradest.integrations.diffusers import (
    DiffusersVelocity,
    sampler_from_scheduler,
)
from gradest.integrations.guidance import (
    NEGATIVE_PREFIX,
    ClassifierFreeGuidance,
    EmbeddedGuidance,
)
from gradest.integrations.peft import add_lora
from gradest.integrations.pipelines import (
    dynamic_shift_mu,
    flux_image_ids,
    pack_latents,
    sdxl_time_ids,
    unpack_latents,
)
from gradest.plugin import map_tensors
from gradest_recipes.config import RecipeConfig, check_true_cfg
from gradest_recipes.embeddings import (
    TINY_POOLED_DIM,
    TINY_TEXT_DIM,
    PromptEmbeddings,
)
from gradest_recipes.errors import RecipeConfigError
from gradest_recipes.lora_start import load_lora_start

__all__ = [
    "UNET_FAMILIES",
    "Family",
    "build_family",
    "guided",
    "pack_latents",
    "shard_denoiser",
    "unpack_latents",
]

#: The families sampled with DDIM through a ``UNet2DConditionModel``.
UNET_FAMILIES = ("sd_unet", "sdxl")
#: SDXL's six size / crop ids per sample, each embedded in ``addition_time_embed_dim``.
SDXL_TIME_IDS = 6


def flux_sigmas(steps: int) -> Any:
    """FluxPipeline's default ``sigmas`` for ``steps`` steps, ``linspace(1, 1/steps,
    steps)`` (before the scheduler's shift): what the Flux family samples on, for any
    number of steps (training, sample grids and evaluations alike)."""
    import numpy as np

    return np.linspace(1.0, 1 / steps, steps)


def guided(family: str, config: RecipeConfig) -> bool:
    """Whether ``family`` runs classifier-free guidance: ``guidance_scale != 1``, or for
    Flux (whose ``guidance_scale`` is its guidance embedding's value) ``true_cfg_scale >
    1``, true CFG around the embedding."""
    if family == "flux":
        return config.true_cfg_scale > 1.0
    return config.guidance_scale != 1.0


@attrs.define(eq=False)
class Family:
    """Everything family-specific a recipe's loop needs.

    Attributes:
        name: ``"sd3"``, ``"flux"``, ``"sd_unet"`` or ``"sdxl"``.
        denoiser: the diffusers transformer / UNet, LoRA injected (the trainable part).
        velocity: the gradest model ``model(z, t, **cond)`` around it (CFG included).
        vae: the frozen ``AutoencoderKL``.
        sampler: the gradest sampler taking the scheduler's steps.
        latent_shape: one sample's state ``z`` (Flux: packed ``[tokens, 4C]``).
        to_vae_latents: ``z [B, *latent_shape] -> [B, C, h, w]`` (Flux unpacks).
        lora_prefix: the pipeline's name for the denoiser (``"transformer"`` / ``"unet"``).
        make_cond: ``(embeddings, index [B], device) -> cond`` for ``model(z, t, **cond)``.
        scheduler: the diffusers scheduler the sampler was built from.
        schedule_options: the ``set_timesteps`` keywords the sampler was built with (Flux:
            ``sigmas``, ``mu``), so another sampler on the same grid can be built from
            ``scheduler`` (``sampler_from_scheduler(scheduler, N, **schedule_options)``).
    """

    name: str
    denoiser: nn.Module
    velocity: nn.Module
    vae: nn.Module
    sampler: Any
    latent_shape: tuple[int, ...]
    to_vae_latents: Callable[[Tensor], Tensor]
    lora_prefix: str
    make_cond: Callable[[PromptEmbeddings, Tensor, torch.device], dict[str, Any]]
    scheduler: Any = None
    schedule_options: dict[str, Any] = attrs.field(factory=dict)


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as err:
        raise MissingDependency(
            "the recipes need diffusers, peft and accelerate: pip install 'gradest[integrations]'"
        ) from err
    return diffusers


# -- tiny random models (tests, --tiny) ------------------------------------------------------


def tiny_vae() -> nn.Module:
    """A seeded micro ``AutoencoderKL``: 3 -> 4 latent channels, 2x downsampling."""
    diffusers = _diffusers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=16,
            scaling_factor=1.5,
            shift_factor=0.1,
        )


def tiny_denoiser(family: str) -> nn.Module:
    """A seeded micro denoiser matching :func:`tiny_vae` and the tiny embeddings."""
    diffusers = _diffusers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        if family == "sd3":
            return diffusers.SD3Transformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=1,
                attention_head_dim=8,
                num_attention_heads=2,
                joint_attention_dim=TINY_TEXT_DIM,
                caption_projection_dim=16,
                pooled_projection_dim=TINY_POOLED_DIM,
                pos_embed_max_size=8,
            )
        if family == "flux":
            return diffusers.FluxTransformer2DModel(
                patch_size=1,
                in_channels=16,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=8,
                num_attention_heads=2,
                joint_attention_dim=TINY_TEXT_DIM,
                pooled_projection_dim=TINY_POOLED_DIM,
                guidance_embeds=True,
                axes_dims_rope=(2, 2, 4),
            )
        # The two UNet families share one tiny UNet; they differ in where cross-attention
        # sits and in SDXL's extra embedding.
        unet: dict[str, Any] = {
            "sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
            "block_out_channels": (8, 16), "cross_attention_dim": TINY_TEXT_DIM,
            "attention_head_dim": 2, "norm_num_groups": 4,
        }  # fmt: skip
        if family == "sdxl":
            # SDXL's layout (cross-attention in the lower blocks) and its text_time
            # embedding: the pooled text embedding + 6 size / crop ids.
            return diffusers.UNet2DConditionModel(
                **unet,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                addition_embed_type="text_time",
                addition_time_embed_dim=4,
                projection_class_embeddings_input_dim=SDXL_TIME_IDS * 4 + TINY_POOLED_DIM,
            )
        return diffusers.UNet2DConditionModel(
            **unet,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )


def tiny_scheduler(family: str) -> Any:
    """The scheduler configuration the real family ships with (SD3, FLUX.1, SD 1.5; SDXL's
    as DDIM: its config with ``DDIMScheduler``, as :func:`load_parts` loads it)."""
    diffusers = _diffusers()
    if family == "sd3":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    if family == "flux":
        return diffusers.FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    return diffusers.DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


# -- loading real weights ----------------------------------------------------------------------


def _load(cls: Any, config: RecipeConfig, subfolder: str, **kwargs: Any) -> Any:
    try:
        return cls.from_pretrained(
            config.pretrained, subfolder=subfolder, variant=config.variant, **kwargs
        )
    except (OSError, ValueError) as err:
        raise _cannot_load(config, cls.__name__, subfolder, str(err)) from err


# The diffusers class of each family's denoiser, and the subfolder of a model folder it
# is loaded from.
DENOISERS = {
    "sd3": ("SD3Transformer2DModel", "transformer"),
    "flux": ("FluxTransformer2DModel", "transformer"),
    "sd_unet": ("UNet2DConditionModel", "unet"),
    "sdxl": ("UNet2DConditionModel", "unet"),
}


def _cannot_load(config: RecipeConfig, what: str, subfolder: str, why: str) -> InvalidValue:
    return InvalidValue(
        f"setting pretrained={config.pretrained!r}: cannot load {what} from its {subfolder!r} "
        f"subfolder ({why}); pass the local folder of a diffusers model (it holds "
        f"{subfolder}/config.json)"
    )


def check_pretrained_folder(family: str, config: RecipeConfig) -> None:
    """Refuse a ``pretrained`` that is not a diffusers model folder before anything is
    loaded (or the run folder looked at): each part :func:`load_parts` reads must have its
    config file there.

    Raises:
        InvalidValue: naming the setting, the part, the missing file and the fix.
    """
    folder = Path(config.pretrained or "")
    denoiser, subfolder = DENOISERS[family]
    parts = (
        (denoiser, subfolder, "config.json"),
        ("AutoencoderKL", "vae", "config.json"),
        ("its scheduler", "scheduler", "scheduler_config.json"),
    )
    for what, part, name in parts:
        if not (folder / part / name).is_file():
            raise _cannot_load(config, what, part, f"{part}/{name} is not there")


def load_parts(family: str, config: RecipeConfig, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """``(denoiser, vae, scheduler)``: tiny random ones, or from ``config.pretrained``."""
    diffusers = _diffusers()
    if config.tiny:
        denoiser, vae = tiny_denoiser(family), tiny_vae()
        if dtype != torch.float32:  # built in float32
            denoiser, vae = denoiser.to(dtype), vae.to(dtype)
        return denoiser, vae, tiny_scheduler(family)
    class_name, subfolder = DENOISERS[family]
    denoiser_cls = getattr(diffusers, class_name)
    denoiser = _load(denoiser_cls, config, subfolder, torch_dtype=dtype)
    vae = _load(diffusers.AutoencoderKL, config, "vae", torch_dtype=dtype)
    scheduler_cls = (
        diffusers.DDIMScheduler
        if family in UNET_FAMILIES
        else diffusers.FlowMatchEulerDiscreteScheduler
    )
    try:
        scheduler = scheduler_cls.from_pretrained(config.pretrained, subfolder="scheduler")
    except (OSError, ValueError) as err:
        raise InvalidValue(
            f"setting pretrained={config.pretrained!r}: cannot load its scheduler ({err})"
        ) from err
    return denoiser, vae, scheduler


# -- the family -----------------------------------------------------------------------------------


def build_family(
    family: str,
    config: RecipeConfig,
    embeddings: PromptEmbeddings,
    *,
    weight_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Family:
    """Load (or build tiny) the denoiser, VAE and scheduler; add LoRA; wrap for gradest.

    The base weights and the VAE are frozen in ``weight_dtype`` (the mixed-precision dtype,
    as diffusers' training scripts keep them); LoRA matrices are float32 and the only
    trainable parameters.
    """
    check_true_cfg(family, config)
    denoiser, vae, scheduler = load_parts(family, config, weight_dtype)
    denoiser.requires_grad_(False)
    vae.requires_grad_(False)
    vae.eval()
    if config.decoder_checkpointing:
        # Only a decode with a graph recomputes (the reward's backward); sampling and
        # validation decodes run without one and are unchanged.
        vae.enable_gradient_checkpointing()
    denoiser_config: Any = denoiser.config
    vae_config: Any = vae.config
    vae_factor = 2 ** (len(vae_config.block_out_channels) - 1)
    if family in UNET_FAMILIES:
        grid = 2 ** (len(denoiser_config.block_out_channels) - 1)
    else:
        grid = 2 if family == "flux" else int(denoiser_config.patch_size)
    if config.resolution % (vae_factor * grid):
        raise RecipeConfigError(
            f"setting resolution={config.resolution} is invalid: this model needs a multiple "
            f"of {vae_factor * grid} (the VAE downsamples {vae_factor}x, the "
            f"{'UNet' if family in UNET_FAMILIES else 'transformer'} {grid}x more); use "
            f"{max(1, config.resolution // (vae_factor * grid)) * vae_factor * grid}"
        )
    side = config.resolution // vae_factor
    channels = int(vae_config.latent_channels)
    from gradest_recipes.embeddings import check_fits

    check_fits(embeddings, denoiser_config, config.embeddings or "<tiny>")
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    add_lora(
        denoiser,
        config.lora_rank,
        target_modules=config.lora_targets,
        alpha=config.lora_alpha,
        init=config.lora_init,
    )
    if config.lora_path is not None:
        load_lora_start(
            denoiser,
            config.lora_path,
            prefix="unet" if family in UNET_FAMILIES else "transformer",
            rank=config.lora_rank,
            alpha=config.lora_alpha,
        )
    for name, parameter in denoiser.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
            parameter.requires_grad_(True)
    denoiser.train()

    fixed: dict[str, Any] = {}
    options: dict[str, Any] = {}
    sampler: Any
    if family in UNET_FAMILIES:
        sampler = sampler_from_scheduler(scheduler, config.num_inference_steps, eta=config.eta)
        inner: nn.Module = DiffusersVelocity.for_sampler(denoiser, sampler)
    else:
        if config.eta:
            raise RecipeConfigError(
                f"setting eta={config.eta!r} is invalid for the {family} recipe: eta is DDIM's "
                f"noise (sd_unet, sdxl); flow-matching Euler sampling is deterministic. Set eta = 0"
            )
        if family == "flux":
            if not getattr(scheduler.config, "use_flow_sigmas", False):
                options["sigmas"] = flux_sigmas(config.num_inference_steps)
            seq_len = (side // 2) ** 2
        else:
            seq_len = (side // int(denoiser_config.patch_size)) ** 2
        if getattr(scheduler.config, "use_dynamic_shifting", False):
            options["mu"] = dynamic_shift_mu(scheduler, seq_len)
        sampler = sampler_from_scheduler(scheduler, config.num_inference_steps, **options)
        if family == "flux":
            fixed = {
                "img_ids": flux_image_ids(side, side).to(device),
                "txt_ids": _text_ids(embeddings).to(device),
            }
        inner = DiffusersVelocity(denoiser, fixed_kwargs=fixed)
    if family == "flux":
        if not denoiser_config.guidance_embeds and config.guidance_scale != 1.0:
            raise RecipeConfigError(
                f"setting guidance_scale={config.guidance_scale!r} is invalid for this Flux "
                f"model: it has no guidance embedding (config.guidance_embeds=False, e.g. "
                f"FLUX.1-schnell) and takes no guidance value; set guidance_scale = 1 (CFG is "
                f"true_cfg_scale)"
            )
        if denoiser_config.guidance_embeds:
            inner = EmbeddedGuidance(inner, config.guidance_scale)
    # Flux's CFG is true CFG around its guidance embedding (FluxPipeline's true_cfg_scale).
    scale = config.true_cfg_scale if family == "flux" else config.guidance_scale
    velocity = (
        ClassifierFreeGuidance(inner, scale, detach_unconditional=config.detach_unconditional)
        if guided(family, config)
        else inner
    )
    if family == "flux":
        latent_shape: tuple[int, ...] = ((side // 2) ** 2, channels * 4)

        def to_vae_latents(z: Tensor) -> Tensor:
            return unpack_latents(z, side, side)
    else:
        latent_shape = (channels, side, side)

        def to_vae_latents(z: Tensor) -> Tensor:
            return z

    def make_cond(emb: PromptEmbeddings, index: Tensor, device: torch.device) -> dict[str, Any]:
        batch = index.shape[0]
        cond: dict[str, Any] = {"encoder_hidden_states": emb.rows("prompt_embeds", index)}
        if family in ("sd3", "flux"):
            cond["pooled_projections"] = emb.rows("pooled_prompt_embeds", index)
        if family == "sdxl":
            cond["added_cond_kwargs"] = {
                "text_embeds": emb.rows("pooled_prompt_embeds", index),
                "time_ids": sdxl_time_ids(config.resolution, config.resolution, batch),
            }
        if guided(family, config):
            cond[NEGATIVE_PREFIX + "encoder_hidden_states"] = emb.negative("prompt_embeds", batch)
            if family in ("sd3", "flux"):
                cond[NEGATIVE_PREFIX + "pooled_projections"] = emb.negative(
                    "pooled_prompt_embeds", batch
                )
            if family == "sdxl":
                cond[NEGATIVE_PREFIX + "added_cond_kwargs"] = {
                    "text_embeds": emb.negative("pooled_prompt_embeds", batch),
                    "time_ids": sdxl_time_ids(config.resolution, config.resolution, batch),
                }
        return map_tensors(cond, lambda v: v.to(device=device, dtype=_cond_dtype(v)))

    return Family(
        name=family,
        denoiser=denoiser,
        velocity=velocity,
        vae=vae,
        sampler=sampler,
        latent_shape=latent_shape,
        to_vae_latents=to_vae_latents,
        lora_prefix="unet" if family in UNET_FAMILIES else "transformer",
        make_cond=make_cond,
        scheduler=scheduler,
        schedule_options=options,
    )


def shard_denoiser(denoiser: nn.Module) -> nn.Module:
    """Shard ``denoiser`` with torch's FSDP2 ``fully_shard``, in place: each transformer
    block (SD3, Flux) or UNet block first, then the root, over the default process group
    (every process must hold the same weights: they are built or loaded identically).

    Its parameters become DTensors; the trainable ones (the LoRA matrices) must share one
    dtype, as FSDP2 requires (they are float32; the frozen base weights may differ).
    """
    from torch.distributed.fsdp import fully_shard

    for name in ("transformer_blocks", "single_transformer_blocks", "down_blocks", "up_blocks"):
        for block in getattr(denoiser, name, None) or ():
            fully_shard(block)
    mid = getattr(denoiser, "mid_block", None)
    if isinstance(mid, nn.Module):
        fully_shard(mid)
    fully_shard(denoiser)
    return denoiser


def _cond_dtype(value: Tensor) -> torch.dtype:
    # Embeddings enter in float32; autocast (mixed precision) lowers them inside the model.
    return torch.float32 if value.is_floating_point() else value.dtype


def _text_ids(embeddings: PromptEmbeddings) -> Tensor:
    ids = embeddings.tensors.get("text_ids")
    tokens = embeddings.tensors["prompt_embeds"].shape[1]
    if ids is None:
        return torch.zeros(tokens, 3)
    return ids.reshape(-1, 3).float()
