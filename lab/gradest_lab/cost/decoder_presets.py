"""The VAE decoders of the diffusers families as shapes only, for ``gradest cost``.

A pixel-space reward decodes the final latents with the family's VAE and backpropagates
through the decoder into the sampling chain; at 1024 px that backward holds gigabytes.
:func:`pixel_decoder` builds the family's ``AutoencoderKL`` on the meta device (no
weights) from its published ``config.json`` (:data:`VAE_PRESETS`) or from a user's
config, and wraps it as the recipes decode: ``images = clamp((vae.decode(z /
scaling_factor + shift_factor) + 1) / 2, 0, 1)``, Flux's packed latents unpacked first.

Two ways to hold less, as diffusers offers them: ``checkpointing`` (the decoder's
``enable_gradient_checkpointing()``: the mid block and each up block recompute in
backward, only their inputs are held) and ``tile`` (``enable_tiling()`` with tiles of
``tile`` pixels, overlapping by a quarter and blended; each tile is decoded on its own, so
with checkpointing a tile's block is the largest graph held).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradest import InvalidValue
from gradest.plugin import whole_number_problem
from gradest_lab.cost.config_checks import check_config
from gradest_lab.storage.files import read_json

__all__ = ["VAE_PRESETS", "PixelDecoder", "decoder_config", "pixel_decoder"]

_SD3_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

#: The VAE ``config.json`` (architecture and latent scaling) of each family's public
#: checkpoint: SD3 / SD3.5 (stabilityai/stable-diffusion-3-medium-diffusers, vae/), Flux
#: (black-forest-labs/FLUX.1-dev, vae/: SD3's architecture, its own scaling) and SDXL
#: (stabilityai/stable-diffusion-xl-base-1.0, vae/: 4 latent channels, quant convs).
VAE_PRESETS: dict[str, dict[str, Any]] = {
    "sd3": _SD3_VAE,
    "flux": _SD3_VAE | {"scaling_factor": 0.3611, "shift_factor": 0.1159},
    "unet": _SD3_VAE
    | {
        "latent_channels": 4,
        "scaling_factor": 0.13025,
        "shift_factor": None,
        "use_quant_conv": True,
        "use_post_quant_conv": True,
    },
}


def decoder_config(family: str, source: str | Path | None = None) -> tuple[dict[str, Any], str]:
    """``(config, description)`` of the VAE: ``source`` (a VAE folder, a pipeline folder
    with ``vae/``, or a ``config.json``) or, when None, the family's preset.

    A file's config is checked before anything is built
    (:func:`gradest_lab.cost.config_checks.check_config`: every size and count a whole
    number >= 1; diffusers takes a size of 0 or less without a word), in one line naming
    the file it read, the field and the fix."""
    if source is None:
        return dict(VAE_PRESETS[family]), f"{family} VAE"
    path = Path(source)
    if path.is_dir():
        for candidate in (path / "vae" / "config.json", path / "config.json"):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise InvalidValue(
                f"--decoder {str(source)!r} has no config.json (nor vae/config.json); pass "
                f"an AutoencoderKL folder or config.json, or leave --decoder out for the "
                f"family's VAE"
            )
    elif not path.is_file():
        raise InvalidValue(
            f"--decoder {str(source)!r} is not an AutoencoderKL folder or config.json file"
        )
    config = read_json(path, what="--decoder")
    if not isinstance(config, dict) or config.get("_class_name", "AutoencoderKL") != (
        "AutoencoderKL"
    ):
        raise InvalidValue(
            f"--decoder {str(source)!r}: expected an AutoencoderKL config, got "
            f"_class_name={config.get('_class_name') if isinstance(config, dict) else config!r}"
        )
    check_config(config, where=f"--decoder {str(path)!r}")
    return config, str(source)


class PixelDecoder(nn.Module):
    """``z -> images [B, 3, H, W]`` in ``[0, 1]`` through a frozen ``AutoencoderKL``.

    Attributes:
        vae: the autoencoder (all of it is resident, as a training script loads it; only
            the decoder runs).
        unpack: ``(height, width)`` of the latent image for Flux's packed latents
            ``[B, h/2 * w/2, 4C]``, else None.
    """

    def __init__(self, vae: nn.Module, unpack: tuple[int, int] | None = None):
        super().__init__()
        self.vae = vae
        self.unpack = unpack

    def forward(self, z: Tensor) -> Tensor:
        if self.unpack is not None:  # FluxPipeline._unpack_latents
            height, width = self.unpack
            batch, _, channels = z.shape
            z = z.view(batch, height // 2, width // 2, channels // 4, 2, 2)
            z = z.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels // 4, height, width)
        config: Any = self.vae.config
        scaled = z / config.scaling_factor
        if getattr(config, "shift_factor", None):
            scaled = scaled + config.shift_factor
        parameter = next(self.vae.parameters())
        decoded = self.vae.decode(scaled.to(parameter.dtype), return_dict=False)[0]  # type: ignore[operator]
        return (decoded.float() / 2 + 0.5).clamp(0, 1)


def pixel_decoder(
    config: Mapping[str, Any],
    *,
    family: str,
    latent_size: tuple[int, int],
    latent_channels: int,
    dtype: torch.dtype,
    checkpointing: bool = False,
    tile: int | None = None,
    device: str | torch.device = "meta",
) -> PixelDecoder:
    """The frozen VAE of ``config`` on ``device`` as a :class:`PixelDecoder`.

    Args:
        config: an ``AutoencoderKL`` config (:func:`decoder_config`).
        family: ``sd3``, ``flux`` (packed latents) or ``unet``.
        latent_size: the latent image's ``(height, width)`` (image size / 8).
        latent_channels: the model's latent channels (Flux: its input channels / 4).
        dtype: the VAE's parameter dtype.
        checkpointing: diffusers' ``enable_gradient_checkpointing()`` on the decoder.
        tile: decode in tiles of this many pixels (``enable_tiling()``), or None.
        device: ``"meta"`` for a cost trace; a real device builds random weights.
    """
    import diffusers

    from gradest_lab.cost.diffusers_presets import _init_kwargs, _quiet_diffusers

    if tile is not None and whole_number_problem(tile, minimum=8) is not None:
        raise InvalidValue(f"--decoder-tile must be a whole number of pixels >= 8, got {tile!r}")
    cls: Any = diffusers.AutoencoderKL
    try:
        with torch.device(device), _quiet_diffusers():
            vae = cls(**_init_kwargs(cls, config)).to(dtype)
    except (ValueError, TypeError, AssertionError) as err:
        shown = " ".join(str(err).split()) or type(err).__name__
        raise InvalidValue(f"--decoder: diffusers cannot build AutoencoderKL: {shown}") from err
    vae.requires_grad_(False)
    vae.eval()
    vae_config: Any = vae.config
    channels = int(vae_config.latent_channels)
    if channels != latent_channels:
        raise InvalidValue(
            f"--decoder has latent_channels={channels}; the model's latents have "
            f"{latent_channels} channels: use the VAE the model was trained with"
        )
    if checkpointing:
        vae.enable_gradient_checkpointing()
    if tile is not None:
        vae.enable_tiling()
        factor = 2 ** (len(vae_config.block_out_channels) - 1)
        # diffusers sizes its tiles from sample_size; a tile of `tile` pixels instead.
        vae.tile_sample_min_size = tile
        vae.tile_latent_min_size = max(1, tile // factor)
    return PixelDecoder(vae, unpack=latent_size if family == "flux" else None)
