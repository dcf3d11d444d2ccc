"""diffusers interop: flow-matching schedulers as gradest samplers, transformers as velocity models.

diffusers' rectified-flow models (SD3, Flux, and flow-matching DiTs) sample with
``FlowMatchEulerDiscreteScheduler``. Its conventions are gradest's with time called
sigma: the state at noise level ``sigma`` is ``z = (1 - sigma) x + sigma eps``, the model
predicts the velocity ``v = eps - x``, and ``step()`` takes the Euler step
``z_next = z + (sigma_next - sigma) v`` on the grid ``scheduler.sigmas`` (1 -> 0, after
any ``shift``; see ``FlowMatchEulerDiscreteScheduler.step``). So:

* :func:`flow_from_scheduler` turns a scheduler's sigma grid into a gradest sampler
  (a ``RectifiedFlow`` on ``times = sigmas``, or, with ``stochastic_sampling=True``, the
  equivalent affine sampler with noise).
* :class:`DiffusersVelocity` wraps a diffusers transformer so that gradest can call it as
  ``model(z, t, **cond)``: ``timestep = t * 1000`` (``num_train_timesteps``; Flux takes
  ``t`` and scales inside), conditioning by keyword, output ``.sample``.

Then every gradest estimator differentiates through the scheduler's sampling loop.

One precision note: ``FlowMatchEulerDiscreteScheduler.step`` casts the sample to float32
before stepping, so a diffusers loop in float64 is only float32-accurate; gradest steps in
the latents' own dtype. In float32 the two loops agree to a few ulps.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradest.errors import InvalidType, InvalidValue, MissingDependency
from gradest.samplers import RectifiedFlow, StochasticFlowMatchSampler

__all__ = ["DiffusersVelocity", "StochasticFlowMatchSampler", "flow_from_scheduler"]

NUM_TRAIN_TIMESTEPS = 1000


def flow_from_scheduler(
    scheduler: Any, num_inference_steps: int, **set_timesteps_kwargs: Any
) -> RectifiedFlow | StochasticFlowMatchSampler:
    """The gradest sampler that takes exactly the steps ``scheduler.step()`` takes.

    Runs ``set_timesteps`` on a copy of the scheduler (yours is left as it is), so every
    schedule option is honoured: ``shift``, dynamic shifting (pass ``mu=``),
    ``shift_terminal``, Karras / exponential / beta sigmas, custom ``sigmas=``.

    Args:
        scheduler: a diffusers ``FlowMatchEulerDiscreteScheduler``.
        num_inference_steps: ``N``, the number of sampling steps.
        **set_timesteps_kwargs: passed to ``scheduler.set_timesteps`` (``mu``, ``sigmas``).

    Returns:
        ``gradest.RectifiedFlow(times=sigmas)`` (deterministic Euler), or a
        :class:`StochasticFlowMatchSampler` when the scheduler samples stochastically.

    Raises:
        TypeError: ``scheduler`` is not a flow-matching Euler scheduler (e.g. DDIM).
        ValueError: the schedule cannot be expressed on gradest's time grid (inverted
            sigmas, timesteps that are not ``sigma * num_train_timesteps``).
    """
    try:
        from diffusers import FlowMatchEulerDiscreteScheduler
    except ImportError as err:
        raise MissingDependency(
            "flow_from_scheduler needs diffusers: pip install diffusers "
            "(or gradest's integrations extra)"
        ) from err
    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        raise InvalidType(
            f"flow_from_scheduler needs a diffusers FlowMatchEulerDiscreteScheduler (the Euler "
            f"sampler of rectified-flow models such as SD3 and Flux), got "
            f"{type(scheduler).__name__}, which samples a different process. If the model was "
            f"trained with flow matching, build FlowMatchEulerDiscreteScheduler(...) for it; "
            f"for a DDPM/DDIM model write a gradest AffineSampler for its steps "
            f"(docs/integrations.md)"
        )
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int):
        raise InvalidType(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}")
    if num_inference_steps < 1:
        raise InvalidValue(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    # diffusers' config-registered attributes are invisible to type checkers.
    source: Any = scheduler
    config = source.config
    if getattr(config, "invert_sigmas", False):
        raise InvalidValue(
            "scheduler.config.invert_sigmas=True runs sigma from 0 up to 1, the reverse of "
            "gradest's grid (t=1 noise -> t=0 data); build the scheduler with "
            "invert_sigmas=False"
        )
    schedule: Any = copy.deepcopy(source)
    schedule.set_timesteps(num_inference_steps, device="cpu", **set_timesteps_kwargs)
    sigmas = schedule.sigmas.detach().to(device="cpu", dtype=torch.float64)
    # gradest calls the model at timestep = sigma * num_train_timesteps; diffusers pipelines
    # pass scheduler.timesteps. They agree unless custom timesteps were given.
    expected = sigmas[:-1] * config.num_train_timesteps
    timesteps = schedule.timesteps.detach().to(device="cpu", dtype=torch.float64)
    if timesteps.shape != expected.shape or not torch.allclose(
        timesteps, expected, rtol=1e-6, atol=1e-3
    ):
        raise InvalidValue(
            "scheduler.timesteps are not sigmas * num_train_timesteps (custom timesteps= were "
            "passed to set_timesteps?); DiffusersVelocity calls the model at "
            "timestep = sigma * num_train_timesteps, so pass sigmas= instead"
        )
    try:
        flow = RectifiedFlow(times=sigmas)
    except ValueError as err:
        raise InvalidValue(
            f"the sigmas of {type(scheduler).__name__} with num_inference_steps="
            f"{num_inference_steps} are not a gradest time grid: {err}"
        ) from err
    if getattr(config, "stochastic_sampling", False):  # absent in older diffusers
        return StochasticFlowMatchSampler(times=flow.times)
    return flow


class DiffusersVelocity(nn.Module):
    """A diffusers transformer as a gradest velocity model ``model(z, t, **cond)``.

    The call is ``transformer(hidden_states=z, timestep=t * timestep_scale, **fixed_kwargs,
    **cond, return_dict=False)[0]``. Parameters keep the transformer's names behind a
    ``transformer.`` prefix (``result.grads["transformer.proj_out.weight"]``).

    Conditioning (``cond`` of ``estimate`` / ``rollout``; tensors with a batch dimension):

    * ``SD3Transformer2DModel``: ``encoder_hidden_states [B, S, joint_attention_dim]``,
      ``pooled_projections [B, pooled_projection_dim]``.
    * ``DiTTransformer2DModel``: ``class_labels [B]``.
    * ``FluxTransformer2DModel``: ``encoder_hidden_states``, ``pooled_projections`` (and
      ``guidance [B]`` with ``guidance_embeds``); the position ids ``img_ids [S, 3]`` and
      ``txt_ids [S_text, 3]`` have no batch dimension and go in ``fixed_kwargs``. Latents
      are packed, ``[B, S, in_channels]``.

    Args:
        transformer: the diffusers model (any ``*Transformer2DModel`` with a diffusers
            ``config``).
        timestep_scale: the model's timestep per unit of sigma. Default: 1 for Flux (its
            forward multiplies by 1000 itself), else 1000 (``num_train_timesteps`` of
            ``FlowMatchEulerDiscreteScheduler``, what SD3 and DiT pipelines pass).
        fixed_kwargs: keyword arguments passed on every call, not repeated per batch row.

    A transformer in training mode may keep its dropout or label dropout (diffusers' DiT
    drops class labels with probability 0.1): estimators evaluate a step several times and
    replay its random numbers each time (:mod:`gradest.replay`), so every evaluation of a
    step sees the same masks.
    """

    def __init__(
        self,
        transformer: nn.Module,
        *,
        timestep_scale: float | None = None,
        fixed_kwargs: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        if not isinstance(transformer, nn.Module) or not hasattr(transformer, "config"):
            raise InvalidType(
                f"transformer must be a diffusers model (an nn.Module with a .config), got "
                f"{type(transformer).__name__}"
            )
        self.transformer = transformer
        self.is_flux = type(transformer).__name__.startswith("Flux")
        if timestep_scale is None:
            timestep_scale = 1.0 if self.is_flux else float(NUM_TRAIN_TIMESTEPS)
        if not timestep_scale > 0:
            raise InvalidValue(f"timestep_scale must be > 0, got {timestep_scale!r}")
        self.timestep_scale = float(timestep_scale)
        self.fixed_kwargs = dict(fixed_kwargs or {})

    @property
    def config(self) -> Any:
        return self.transformer.config

    def check_latents(self, z: Tensor) -> None:
        """Raise a ValueError naming the config field when ``z`` cannot fit the transformer."""
        name, config = type(self.transformer).__name__, self.transformer.config
        shape = tuple(z.shape)
        in_channels = getattr(config, "in_channels", None)
        out_channels = getattr(config, "out_channels", None) or in_channels
        if in_channels is not None and out_channels != in_channels:
            raise InvalidValue(
                f"{name}.config.out_channels={out_channels} differs from in_channels="
                f"{in_channels}: a velocity has the latents' shape. (A learned-variance DiT "
                f"with out_channels=2*in_channels predicts noise, not a flow velocity.)"
            )
        if self.is_flux:
            if z.ndim != 3:
                raise InvalidValue(
                    f"{name} takes packed latents [B, tokens, in_channels], got shape {shape}; "
                    f"pack [B, C, H, W] latents into 2x2 patches first (as FluxPipeline does)"
                )
            if in_channels is not None and shape[-1] != in_channels:
                raise InvalidValue(
                    f"{name}.config.in_channels={in_channels} but the packed latents of "
                    f"shape {shape} have {shape[-1]} channels per token"
                )
            img_ids = self.fixed_kwargs.get("img_ids")
            if img_ids is not None and img_ids.shape[-2] != shape[1]:
                raise InvalidValue(
                    f"fixed_kwargs['img_ids'] has {img_ids.shape[-2]} rows but the latents "
                    f"of shape {shape} have {shape[1]} tokens"
                )
            return
        if z.ndim != 4:
            raise InvalidValue(f"{name} takes latents [B, C, H, W], got shape {shape}")
        if in_channels is not None and shape[1] != in_channels:
            raise InvalidValue(
                f"{name}.config.in_channels={in_channels} but the latents of shape {shape} "
                f"have {shape[1]} channels; pass latents with {in_channels} channels or a "
                f"transformer built with in_channels={shape[1]}"
            )
        patch = getattr(config, "patch_size", None) or 1
        if shape[2] % patch or shape[3] % patch:
            raise InvalidValue(
                f"{name}.config.patch_size={patch} does not divide the latents' height and "
                f"width (shape {shape})"
            )
        max_grid = getattr(config, "pos_embed_max_size", None)
        if max_grid and max(shape[2], shape[3]) > max_grid * patch:
            raise InvalidValue(
                f"latents of shape {shape} are larger than {name} supports: "
                f"config.pos_embed_max_size={max_grid} x patch_size={patch} = "
                f"{max_grid * patch} pixels per side (config.sample_size="
                f"{getattr(config, 'sample_size', None)})"
            )

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        self.check_latents(z)
        if self.is_flux and self.config.guidance_embeds and "guidance" not in cond:
            raise InvalidValue(
                f"{type(self.transformer).__name__} has config.guidance_embeds=True and needs "
                f"cond['guidance'] (a [B] tensor of guidance scales)"
            )
        output = self.transformer(
            hidden_states=z,
            timestep=t * self.timestep_scale,
            **self.fixed_kwargs,
            **cond,
            return_dict=False,
        )
        return output[0]
