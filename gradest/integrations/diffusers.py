"""diffusers interop: schedulers as gradest samplers, transformers and UNets as gradest models.

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

DDPM-family models (Stable Diffusion 1.x/2.x UNets, DDPM DiTs) sample with
``DDIMScheduler`` or ``DDPMScheduler``; their steps are affine in the model's epsilon (or
v) prediction, so :func:`ddim_from_scheduler` returns a
:class:`gradest.diffusion_samplers.DDIMSampler` taking exactly ``step()``'s steps, and
:meth:`DiffusersVelocity.for_sampler` calls a ``UNet2DConditionModel`` (``sample=``,
``timestep=``, ``encoder_hidden_states=``) at the scheduler's integer timesteps.

One precision note: ``FlowMatchEulerDiscreteScheduler.step`` casts the sample to float32
before stepping, so a diffusers loop in float64 is only float32-accurate; gradest steps in
the latents' own dtype. In float32 the two loops agree to a few ulps.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradest.diffusion_samplers import DDIMSampler
from gradest.errors import InvalidType, InvalidValue, MissingDependency
from gradest.samplers import RectifiedFlow, StochasticFlowMatchSampler

__all__ = [
    "DDIMSampler",
    "DiffusersVelocity",
    "StochasticFlowMatchSampler",
    "ddim_from_scheduler",
    "flow_from_scheduler",
]

NUM_TRAIN_TIMESTEPS = 1000


def _check_num_inference_steps(num_inference_steps: Any) -> None:
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int):
        raise InvalidType(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}")
    if num_inference_steps < 1:
        raise InvalidValue(f"num_inference_steps must be >= 1, got {num_inference_steps}")


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
            f"for a DDPM/DDIM model use ddim_from_scheduler (docs/integrations.md)"
        )
    _check_num_inference_steps(num_inference_steps)
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


DDPM_VARIANCES = ("fixed_small", "fixed_small_log")


def ddim_from_scheduler(
    scheduler: Any,
    num_inference_steps: int,
    *,
    eta: float | None = None,
    **set_timesteps_kwargs: Any,
) -> DDIMSampler:
    """The gradest sampler that takes exactly the steps ``DDIMScheduler`` / ``DDPMScheduler``
    ``.step()`` takes.

    Runs ``set_timesteps`` on a copy of the scheduler (yours is left as it is) and reads
    ``timesteps``, ``alphas_cumprod``, the final level and ``prediction_type``. The grid:
    ``t_k = timestep_k / num_train_timesteps`` and ``t_N = 0`` (the final level:
    ``final_alpha_cumprod`` for DDIM, 1 for DDPM). When the last timestep is 0 (the default
    ``timestep_spacing="leading"`` with ``steps_offset=0``) there is no room below it in
    ``[0, 1]``, so the whole grid is shifted by one training step,
    ``t_k = (timestep_k + 1) / num_train_timesteps`` (``t`` counts the noising steps
    applied; ``t = 0`` is clean data), and the sampler records ``timestep_shift = -1``.
    Call the model through :meth:`DiffusersVelocity.for_sampler`, which applies the
    sampler's mapping (``timestep = round(t * num_train_timesteps + timestep_shift)``), so
    the model sees the scheduler's timesteps either way.

    Args:
        scheduler: a diffusers ``DDIMScheduler`` or ``DDPMScheduler``.
        num_inference_steps: ``N``, the number of sampling steps.
        eta: DDIM's noise ratio (``DDIMScheduler.step(eta=...)``; default 0). A
            ``DDPMScheduler`` samples with ``eta = 1`` (its ``"fixed_small"`` posterior
            variance), the only value accepted for it.
        **set_timesteps_kwargs: passed to ``scheduler.set_timesteps`` (DDPM: ``timesteps=``).

    Returns:
        A :class:`~gradest.diffusion_samplers.DDIMSampler`.

    Raises:
        TypeError: another scheduler class (flow matching: :func:`flow_from_scheduler`).
        ValueError: a configuration whose step is not affine in the model output
            (``clip_sample=True``, ``thresholding=True``), a learned or "large" DDPM
            variance, an unknown ``prediction_type``, or DDIM timesteps whose steps do
            not end where the next model call starts.
    """
    try:
        from diffusers import DDIMScheduler, DDPMScheduler
    except ImportError as err:
        raise MissingDependency(
            "ddim_from_scheduler needs diffusers: pip install diffusers "
            "(or gradest's integrations extra)"
        ) from err
    is_ddpm = isinstance(scheduler, DDPMScheduler)
    if not (is_ddpm or isinstance(scheduler, DDIMScheduler)):
        raise InvalidType(
            f"ddim_from_scheduler needs a diffusers DDIMScheduler or DDPMScheduler, got "
            f"{type(scheduler).__name__}; for FlowMatchEulerDiscreteScheduler use "
            f"flow_from_scheduler, for another DDPM-family scheduler build "
            f"DDIMScheduler.from_config(scheduler.config)"
        )
    _check_num_inference_steps(num_inference_steps)
    name = type(scheduler).__name__
    source: Any = scheduler
    config = source.config
    fix = f"{name}.from_config(scheduler.config, {{option}}=False)"
    if getattr(config, "thresholding", False):
        raise InvalidValue(
            f"scheduler.config.thresholding=True clips each predicted x0 at a per-sample "
            f"quantile, which makes the step non-affine in the model output; gradest's "
            f"samplers take affine steps. Build {fix.format(option='thresholding')}"
        )
    if getattr(config, "clip_sample", False):
        raise InvalidValue(
            f"scheduler.config.clip_sample=True clamps the predicted x0 to "
            f"[-{config.clip_sample_range:g}, {config.clip_sample_range:g}], which makes the "
            f"step non-affine in the model output (gradest's samplers take affine steps). "
            f"Build {fix.format(option='clip_sample')} (latent diffusion models such as "
            f"Stable Diffusion sample with clip_sample=False)"
        )
    prediction = config.prediction_type
    if prediction not in ("epsilon", "v_prediction", "sample"):
        raise InvalidValue(
            f"scheduler.config.prediction_type={prediction!r} is not supported; gradest's "
            f"DDIMSampler takes 'epsilon', 'v_prediction' or 'sample'"
        )
    if is_ddpm:
        if config.variance_type not in DDPM_VARIANCES:
            raise InvalidValue(
                f"DDPMScheduler.config.variance_type={config.variance_type!r} is not "
                f"supported: gradest's DDPM step is DDIM with eta=1, the posterior variance "
                f"'fixed_small' ('fixed_small_log' is the same); learned variances are not an "
                f"affine step in one model output. Build "
                f"DDPMScheduler.from_config(scheduler.config, variance_type='fixed_small')"
            )
        if eta is not None and eta != 1:
            raise InvalidValue(
                f"eta={eta!r} with a DDPMScheduler: DDPM ancestral sampling is eta=1; for "
                f"another eta use DDIMScheduler.from_config(scheduler.config)"
            )
        eta = 1.0
    elif eta is None:
        eta = 0.0
    schedule: Any = copy.deepcopy(source)
    schedule.set_timesteps(num_inference_steps, device="cpu", **set_timesteps_kwargs)
    timesteps = [int(t) for t in schedule.timesteps]
    alphas = schedule.alphas_cumprod.detach().to(device="cpu", dtype=torch.float64)
    train_steps = int(config.num_train_timesteps)
    # The level each step ends at, as step() computes it.
    ends = []
    for t in timesteps:
        if is_ddpm:
            previous = int(schedule.previous_timestep(t))
            final = 1.0  # DDPMScheduler.one
        else:
            previous = t - train_steps // schedule.num_inference_steps
            final = float(schedule.final_alpha_cumprod)
        ends.append(previous)
    for k in range(len(timesteps) - 1):
        if ends[k] != timesteps[k + 1]:
            raise InvalidValue(
                f"{name}.step() takes step {k} from timestep {timesteps[k]} to "
                f"{ends[k]} but the next model call is at timestep {timesteps[k + 1]} "
                f"(timestep_spacing={config.timestep_spacing!r} with num_train_timesteps="
                f"{train_steps} and num_inference_steps={num_inference_steps}); gradest's "
                f"grid needs each step to end where the next starts: use "
                f"timestep_spacing='leading', or a num_inference_steps that divides "
                f"{train_steps}"
            )
    final_level = float(alphas[ends[-1]]) if ends[-1] >= 0 else final
    shift = 0 if timesteps[-1] > 0 else -1
    steps = torch.tensor(timesteps, dtype=torch.float64)
    times = torch.cat([(steps - shift) / train_steps, torch.zeros(1, dtype=torch.float64)])
    levels = torch.cat([alphas[timesteps], torch.tensor([final_level], dtype=torch.float64)])
    try:
        return DDIMSampler(
            times=times,
            alphas_cumprod=levels,
            prediction=prediction,
            eta=eta,
            num_train_timesteps=train_steps,
            timestep_shift=float(shift),
        )
    except ValueError as err:
        raise InvalidValue(
            f"the schedule of {name} with num_inference_steps={num_inference_steps} "
            f"(timesteps {timesteps[:4]}...) is not a gradest DDIM sampler: {err}"
        ) from err


class DiffusersVelocity(nn.Module):
    """A diffusers transformer or UNet as a gradest model ``model(z, t, **cond)``.

    The call is ``transformer(hidden_states=z, timestep=t * timestep_scale +
    timestep_shift, **fixed_kwargs, **cond, return_dict=False)[0]``; models whose forward
    takes ``sample`` instead of ``hidden_states`` (``UNet2DConditionModel``,
    ``UNet2DModel``) get ``sample=z``. Parameters keep the model's names behind a
    ``transformer.`` prefix (``result.grads["transformer.proj_out.weight"]``), for UNets too.
    The output is whatever the model predicts (a flow velocity, or epsilon / v for a
    DDPM-family model sampled with :func:`ddim_from_scheduler`); for the latter build the
    wrapper with :meth:`for_sampler`, which calls the model at the scheduler's timesteps.

    Conditioning (``cond`` of ``estimate`` / ``rollout``; tensors with a batch dimension):

    * ``SD3Transformer2DModel``: ``encoder_hidden_states [B, S, joint_attention_dim]``,
      ``pooled_projections [B, pooled_projection_dim]``.
    * ``DiTTransformer2DModel``: ``class_labels [B]``.
    * ``FluxTransformer2DModel``: ``encoder_hidden_states``, ``pooled_projections`` (and
      ``guidance [B]`` with ``guidance_embeds``); the position ids ``img_ids [S, 3]`` and
      ``txt_ids [S_text, 3]`` have no batch dimension and go in ``fixed_kwargs``. Latents
      are packed, ``[B, S, in_channels]``.
    * ``UNet2DConditionModel``: ``encoder_hidden_states [B, S, cross_attention_dim]``.

    Args:
        transformer: the diffusers model (any ``*Transformer2DModel`` with a diffusers
            ``config``).
        timestep_scale: the model's timestep per unit of sigma. Default: 1 for Flux (its
            forward multiplies by 1000 itself), else 1000 (``num_train_timesteps`` of
            ``FlowMatchEulerDiscreteScheduler``, what SD3 and DiT pipelines pass).
        timestep_shift: added after scaling (``ddim_from_scheduler`` grids whose last
            timestep is 0 use -1; :meth:`for_sampler` sets it).
        integer_timesteps: round the timestep to the nearest integer, as the integer
            timesteps diffusers' DDPM/DDIM pipelines pass (``t * scale`` in float32 can be
            an ulp off the integer).
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
        timestep_shift: float = 0.0,
        integer_timesteps: bool = False,
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
        if isinstance(timestep_shift, bool) or not isinstance(timestep_shift, int | float):
            raise InvalidType(f"timestep_shift must be a float, got {timestep_shift!r}")
        self.timestep_shift = float(timestep_shift)
        self.integer_timesteps = bool(integer_timesteps)
        self.fixed_kwargs = dict(fixed_kwargs or {})
        # Transformers take the latents as hidden_states=, UNets as sample=.
        parameters = inspect.signature(transformer.forward).parameters
        unet = "sample" in parameters and "hidden_states" not in parameters
        self.input_name = "sample" if unet else "hidden_states"

    @classmethod
    def for_sampler(
        cls,
        model: nn.Module,
        sampler: Any,
        *,
        fixed_kwargs: Mapping[str, Any] | None = None,
    ) -> DiffusersVelocity:
        """The wrapper that calls ``model`` at the timesteps ``sampler``'s scheduler uses.

        ``sampler`` is a :class:`~gradest.diffusion_samplers.DDIMSampler` (from
        :func:`ddim_from_scheduler`): the model is called at ``timestep = t *
        num_train_timesteps + timestep_shift``, rounded to an integer when every grid
        timestep is one (as ``DDIMScheduler.timesteps`` are).
        """
        scale = getattr(sampler, "num_train_timesteps", None)
        if scale is None or not callable(getattr(sampler, "model_timesteps", None)):
            raise InvalidType(
                f"DiffusersVelocity.for_sampler needs a sampler that records how its model "
                f"is called (a DDIMSampler from ddim_from_scheduler), got "
                f"{type(sampler).__name__}; for flow-matching samplers use "
                f"DiffusersVelocity(model)"
            )
        steps = sampler.model_timesteps()
        integer = bool(torch.allclose(steps, steps.round(), rtol=0, atol=1e-6))
        return cls(
            model,
            timestep_scale=float(scale),
            timestep_shift=float(sampler.timestep_shift),
            integer_timesteps=integer,
            fixed_kwargs=fixed_kwargs,
        )

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
                f"{in_channels}: a velocity (or epsilon / v prediction) has the latents' "
                f"shape. (A learned-variance DiT or UNet with out_channels=2*in_channels "
                f"also predicts a variance, which gradest's samplers do not use.)"
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
        timestep = t * self.timestep_scale
        if self.timestep_shift:
            timestep = timestep + self.timestep_shift
        if self.integer_timesteps:
            timestep = torch.round(timestep)
        output = self.transformer(
            **{self.input_name: z},
            timestep=timestep,
            **self.fixed_kwargs,
            **cond,
            return_dict=False,
        )
        return output[0]
