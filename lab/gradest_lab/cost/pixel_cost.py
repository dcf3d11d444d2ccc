"""What the pixel side of a training step costs: the VAE decode and the reward model.

A pixel-space reward is ``-mean(reward(decode(z_N)))``: the decoder and the reward model
are frozen, run forward with a graph, and their backward carries the reward's gradient
to the latents. :func:`part_cost` measures one such call of one part (FLOPs forward and
backward into its input, the bytes it saves for backward, its peak), as
:func:`gradest_lab.cost.training_cost.measure_step` measures a step. :class:`PixelLoss`
is the two together as a model call ``(z, t) -> loss`` that
:class:`~gradest_lab.cost.call_replay.ReplayCalls` traces once and replays in every
estimator's step (the objective of ``gradest cost --reward``), and counts its calls.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from gradest.harness import FlopCounter, StorageTracker
from gradest_lab.cost.fused_attention import MODEL_FLOP_FORMULAS, fused_attention
from gradest_lab.cost.repeated_blocks import Measurement, measure_with_short_runs
from gradest_lab.cost.training_cost import measure_step

__all__ = [
    "PartCost",
    "PixelLoss",
    "PixelSetup",
    "part_cost",
    "pixel_setup",
    "resident_bytes",
]


def resident_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (resident for the whole step)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@attrs.frozen
class PartCost:
    """One call of a frozen part (decoder or reward model), forward and backward.

    Attributes:
        flops: forward and backward into the input (no weight gradients: it is frozen).
        forward_flops: the forward alone (a call without a graph).
        retained_bytes: peak bytes the call's saved tensors hold (weights excluded).
        peak_bytes: the part's parameters and buffers plus the peak of the storages the
            call creates (its activations, its input's gradient), forward and backward.
        parameter_bytes: the part's parameters and buffers.
        parameters: the part's parameter count.
    """

    flops: int
    forward_flops: int
    retained_bytes: int
    peak_bytes: int
    parameter_bytes: int
    parameters: int

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def part_cost(module: nn.Module, example: Tensor, *, attention: str = "fused") -> PartCost:
    """Measure ``module(x).float().sum().backward()`` with ``x`` like ``example``.

    ``attention`` as for :func:`~gradest_lab.cost.training_cost.training_step_cost`
    (``"fused"`` traces a GPU's fused attention kernel on the meta device).
    """
    persistent = [*module.parameters(), *module.buffers()]
    mode = fused_attention if attention == "fused" else contextlib.nullcontext

    def forward_and_backward() -> None:
        x = example.detach().requires_grad_(True)
        module(x).float().sum().backward()

    def once() -> Measurement:
        with mode():
            # The model's FLOPs, as the step's counters count them (a fused attention
            # backward without its recomputation of the scores).
            counters = (FlopCounter(MODEL_FLOP_FORMULAS), StorageTracker(count_meta=True))
            step = measure_step(forward_and_backward, excluded=persistent, counters=counters)
            counter = FlopCounter(MODEL_FLOP_FORMULAS)
            with torch.no_grad(), StorageTracker(count_meta=True), counter:
                module(example.detach())
        numbers = (step.flops, step.retained_bytes, step.step_peak_bytes, counter.total)
        return Measurement(numbers, ())

    # A reward model's long stack of identical layers is measured on short stacks (on
    # the meta device; real tensors are measured as they are).
    measured = measure_with_short_runs(module, once) if example.device.type == "meta" else once()
    flops, retained, step_peak, forward_flops = measured.numbers
    nbytes = resident_bytes(module)
    return PartCost(
        flops=flops,
        forward_flops=forward_flops,
        retained_bytes=retained,
        peak_bytes=nbytes + step_peak,
        parameter_bytes=nbytes,
        parameters=sum(p.numel() for p in module.parameters()),
    )


class PixelLoss(nn.Module):
    """``(z, t) -> -mean(reward(decoder(z)))`` as a model call (``t`` unused), counting
    its calls with and without a graph (what the parts' FLOPs per step are made of).

    ``reward`` None is an elementwise reward on the pixels (the recipes' brightness,
    contrast, colour: no model, no FLOPs), priced for the decoder alone.
    """

    def __init__(self, decoder: nn.Module, reward: nn.Module | None):
        super().__init__()
        self.decoder = decoder
        self.reward = reward
        self.calls = {"graph": 0, "no_graph": 0}

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        images = self.decoder(z)
        score = images.mean(dim=(1, 2, 3)) if self.reward is None else self.reward(images)
        return -score.float().mean()

    def count(self, z: Tensor) -> None:
        """Record one evaluation on ``z`` (called by the objective, replayed or not)."""
        self.calls["graph" if torch.is_grad_enabled() and z.requires_grad else "no_graph"] += 1


@attrs.frozen(eq=False)
class PixelSetup:
    """The pixel side of a step: the decoder, the reward model (None: an elementwise
    reward on the pixels) and how each is described."""

    decoder: nn.Module
    reward: nn.Module | None
    decoder_name: str
    reward_name: str
    image_shape: tuple[int, ...]  # [B, 3, H, W]

    def loss(self) -> PixelLoss:
        return PixelLoss(self.decoder, self.reward)


def pixel_setup(
    *,
    family: str,
    latent_shape: tuple[int, ...],
    height: int,
    width: int,
    dtype: torch.dtype,
    reward: str,
    decoder: str | None = None,
    checkpointing: bool = False,
    tile: int | None = None,
    device: str | torch.device = "meta",
) -> PixelSetup:
    """The family's VAE (or ``decoder``'s config) and the reward ``reward`` (a learned
    reward's name, a reward config file, or ``pixels``: an elementwise reward) on meta.

    Both configs are checked before any model is built
    (:func:`gradest_lab.cost.config_checks.check_config`: every size and count a whole
    number >= 1, the reward's kind one :mod:`~gradest_lab.cost.reward_presets` knows).

    Raises:
        InvalidValue: a config that cannot build its model, in one line naming the option,
            the file, the field and the fix.
    """
    from gradest_lab.cost.decoder_presets import decoder_config, pixel_decoder
    from gradest_lab.cost.diffusers_presets import VAE_SCALE
    from gradest_lab.cost.reward_presets import reward_config, reward_model

    latent_size = (height // VAE_SCALE, width // VAE_SCALE)
    channels = int(latent_shape[-1]) // 4 if family == "flux" else int(latent_shape[1])
    # The reward's config is read and checked first: a mistake in it is reported before
    # the VAE is built (seconds for a full-size one).
    reward_fields: dict[str, Any] | None = None
    reward_name = "elementwise on the pixels"
    if reward != "pixels":
        reward_fields, reward_name = reward_config(reward)
    config, decoder_name = decoder_config(family, decoder)  # a file's config checked there
    vae = pixel_decoder(
        config, family=family, latent_size=latent_size, latent_channels=channels,
        dtype=dtype, checkpointing=checkpointing, tile=tile, device=device,
    )  # fmt: skip
    notes = [n for n, on in (("checkpointing", checkpointing), (f"tiles {tile} px", tile)) if on]
    decoder_name += f" ({', '.join(notes)})" if notes else ""
    model = None
    if reward_fields is not None:
        model = reward_model(reward_fields, dtype=dtype, device=device)
    image_shape = (int(latent_shape[0]), 3, height, width)
    return PixelSetup(vae, model, decoder_name, reward_name, image_shape)
