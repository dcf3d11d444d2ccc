"""diffusers interop: schedulers as gradest samplers, transformers and UNets as gradest models.

diffusers' rectified-flow models (SD3, Flux, and flow-matching DiTs) sample with
``FlowMatchEulerDiscreteScheduler``. Its conventions are gradest's with time called
sigma: the state at noise level ``sigma`` is ``z = (1 - sigma) x + sigma eps``, the model
predicts the velocity ``v = eps - x``, and ``step()`` takes the Euler step
``z_next = z + (sigma_next - sigma) v`` on the grid ``scheduler.sigmas`` (1 -> 0, after
any ``shift``; see ``FlowMatchEulerDiscreteScheduler.step``). So:

* :func:`sampler_from_scheduler` turns a scheduler's sigma grid into a gradest sampler
  (a ``RectifiedFlow`` on ``times = sigmas``, or, with ``stochastic_sampling=True``, the
  equivalent affine sampler with noise, ``StochasticFlowMatch``; with
  ``sde_noise_level=a``, Flow-GRPO's ``FlowSDE`` on the same grid).
* :class:`DiffusersVelocity` wraps a diffusers transformer so that gradest can call it as
  ``model(z, t, **cond)``: ``timestep = t * 1000`` (``num_train_timesteps``; Flux takes
  ``t`` and scales inside), conditioning by keyword, output ``.sample``.

Then every gradest estimator differentiates through the scheduler's sampling loop.

DDPM-family models (Stable Diffusion 1.x/2.x UNets, DDPM DiTs) sample with
``DDIMScheduler`` or ``DDPMScheduler``; their steps are affine in the model's epsilon (or
v) prediction, so :func:`sampler_from_scheduler` returns a :class:`gradest.DDIM` taking
exactly ``step()``'s steps for them too, and
:meth:`DiffusersVelocity.for_sampler` calls a ``UNet2DConditionModel`` (``sample=``,
``timestep=``, ``encoder_hidden_states=``) at the scheduler's integer timesteps.

One precision note: ``FlowMatchEulerDiscreteScheduler.step`` casts the sample to float32
before stepping, so a diffusers loop in float64 is only float32-accurate; gradest steps in
the latents' own dtype. In float32 the two loops agree to a few ulps.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, overload

import torch
from torch import Tensor, nn

from gradest.diffusion_samplers import DDIM
from gradest.errors import InvalidType, InvalidValue
from gradest.integrations.diffusers_schedulers import (
    DDIMSchedule,
    FlowMatchSchedule,
    ddim_schedule,
    flow_match_schedule,
    is_ddpm_family,
)
from gradest.samplers import FlowSDE, RectifiedFlow, StochasticFlowMatch
from gradest.symbolic import outside_fake_mode

# DDIM and StochasticFlowMatch are re-exported for convenience (their home is gradest's
# sampler modules).
__all__ = [
    "DDIM",
    "FLOW_MATCHING_MODELS",
    "DiffusersVelocity",
    "StochasticFlowMatch",
    "sampler_from_scheduler",
    "unwrap_model",
]

NUM_TRAIN_TIMESTEPS = 1000

# The diffusers model classes published only as flow-matching models (their pipelines
# sample them with FlowMatchEulerDiscreteScheduler): their output is a rectified-flow
# velocity, which a diffusion sampler (DDIM / DDPM) would read as an epsilon or v
# prediction, silently. Architectures also trained as diffusion models (DiT, UNets, PixArt)
# are not listed: their objective cannot be read from the class.
FLOW_MATCHING_MODELS = frozenset(
    {
        "SD3Transformer2DModel",
        "FluxTransformer2DModel",
        "ChromaTransformer2DModel",
        "AuraFlowTransformer2DModel",
        "SanaTransformer2DModel",
        "Lumina2Transformer2DModel",
        "CogView4Transformer2DModel",
        "HiDreamImageTransformer2DModel",
        "QwenImageTransformer2DModel",
        "WanTransformer3DModel",
        "HunyuanVideoTransformer3DModel",
        "LTXVideoTransformer3DModel",
        "MochiTransformer3DModel",
    }
)


@overload
def sampler_from_scheduler(
    scheduler: Any,
    num_inference_steps: int,
    *,
    eta: None = None,
    sde_noise_level: float,
    **set_timesteps_kwargs: Any,
) -> FlowSDE: ...


@overload
def sampler_from_scheduler(
    scheduler: Any,
    num_inference_steps: int,
    *,
    eta: float | None = None,
    sde_noise_level: None = None,
    **set_timesteps_kwargs: Any,
) -> RectifiedFlow | StochasticFlowMatch | DDIM: ...


def sampler_from_scheduler(
    scheduler: Any,
    num_inference_steps: int,
    *,
    eta: float | None = None,
    sde_noise_level: float | None = None,
    **set_timesteps_kwargs: Any,
) -> RectifiedFlow | StochasticFlowMatch | FlowSDE | DDIM:
    """The gradest sampler that takes exactly the steps ``scheduler.step()`` takes.

    Runs ``set_timesteps`` on a copy of the scheduler (yours is left as it is), so every
    schedule option is honoured: ``shift``, dynamic shifting (pass ``mu=``),
    ``shift_terminal``, Karras / exponential / beta sigmas, custom ``sigmas=``; DDPM's
    ``timesteps=``.

    * ``FlowMatchEulerDiscreteScheduler`` (SD3, Flux): ``gradest.RectifiedFlow(times=
      sigmas)`` (deterministic Euler), or a :class:`StochasticFlowMatch` when the scheduler
      samples stochastically; with ``sde_noise_level=a``, Flow-GRPO's
      :class:`gradest.FlowSDE` (``noise_level=a``, Flow-GRPO uses 0.7) on the same grid
      (``sde_step_with_logprob`` on the pipeline's sigmas; only the grid is read from the
      scheduler). Call the model with ``DiffusersVelocity(transformer)``.
    * ``DDIMScheduler`` / ``DDPMScheduler`` (SD 1.x/2.x, SDXL): a :class:`gradest.DDIM`.
      The grid: ``t_k = timestep_k / num_train_timesteps`` and ``t_N = 0`` (the final
      level: ``final_alpha_cumprod`` for DDIM, 1 for DDPM). When the last timestep is 0
      (the default ``timestep_spacing="leading"`` with ``steps_offset=0``) there is no room
      below it in ``[0, 1]``, so the whole grid is shifted by one training step,
      ``t_k = (timestep_k + 1) / num_train_timesteps``, and the sampler records
      ``timestep_shift = -1``. Call the model through
      :meth:`DiffusersVelocity.for_sampler`, which applies the sampler's mapping
      (``timestep = round(t * num_train_timesteps + timestep_shift)``).

    Args:
        scheduler: a diffusers ``FlowMatchEulerDiscreteScheduler``, ``DDIMScheduler`` or
            ``DDPMScheduler``.
        num_inference_steps: ``N``, the number of sampling steps.
        eta: DDIM's noise ratio (``DDIMScheduler.step(eta=...)``; default 0). A
            ``DDPMScheduler`` samples with ``eta = 1`` (its ``"fixed_small"`` posterior
            variance), the only value accepted for it. DDPM-family schedulers only.
        sde_noise_level: Flow-GRPO's SDE on a flow-matching grid, with this noise level.
            Flow-matching schedulers only.
        **set_timesteps_kwargs: passed to ``scheduler.set_timesteps`` (``mu``, ``sigmas``,
            DDPM's ``timesteps``).

    Raises:
        MissingDependency: diffusers is not installed.
        TypeError: another scheduler class.
        ValueError: a schedule gradest's affine samplers cannot take (inverted sigmas,
            timesteps that are not ``sigma * num_train_timesteps``, ``clip_sample=True``,
            ``thresholding=True``, a learned or "large" DDPM variance, an unknown
            ``prediction_type``), or an option of the other family.
    """
    if is_ddpm_family(scheduler):
        if sde_noise_level is not None:
            raise InvalidValue(
                f"sde_noise_level={sde_noise_level!r} is Flow-GRPO's SDE on a flow-matching "
                f"grid; {type(scheduler).__name__} samples a DDPM-family process: pass eta= "
                f"(DDIM's noise ratio) instead"
            )
        return _ddim_sampler(
            ddim_schedule(scheduler, num_inference_steps, eta=eta, **set_timesteps_kwargs)
        )
    if eta is not None:
        raise InvalidValue(
            f"eta={eta!r} is DDIM's noise ratio, for a DDIMScheduler or DDPMScheduler; a "
            f"flow-matching scheduler samples with noise through sde_noise_level= (Flow-GRPO's "
            f"SDE) or its own stochastic_sampling=True"
        )
    euler = _flow_match_sampler(
        flow_match_schedule(scheduler, num_inference_steps, **set_timesteps_kwargs)
    )
    if sde_noise_level is None:
        return euler
    return FlowSDE(times=euler.times, noise_level=sde_noise_level)


def _flow_match_sampler(schedule: FlowMatchSchedule) -> RectifiedFlow | StochasticFlowMatch:
    """The sampler that takes a flow-matching scheduler's steps, from its grid as
    :func:`~gradest.integrations.diffusers_schedulers.flow_match_schedule` read it:
    :class:`StochasticFlowMatch` when the scheduler samples stochastically, else
    :class:`~gradest.RectifiedFlow`."""
    try:
        euler = RectifiedFlow(times=schedule.sigmas)
    except ValueError as err:
        raise InvalidValue(
            f"the sigmas of {schedule.scheduler} with num_inference_steps="
            f"{schedule.num_inference_steps} are not a gradest time grid: {err}"
        ) from err
    return StochasticFlowMatch(times=euler.times) if schedule.stochastic else euler


def _ddim_sampler(schedule: DDIMSchedule) -> DDIM:
    """The :class:`~gradest.DDIM` that takes a DDIM / DDPM scheduler's steps, from its
    levels as :func:`~gradest.integrations.diffusers_schedulers.ddim_schedule` read them."""
    try:
        return DDIM(**schedule.sampler_arguments())
    except ValueError as err:
        raise InvalidValue(
            f"the schedule of {schedule.scheduler} with num_inference_steps="
            f"{schedule.num_inference_steps} (timesteps {schedule.timesteps[:4]}...) is "
            f"not a gradest DDIM sampler: {err}"
        ) from err


class DiffusersVelocity(nn.Module):
    """A diffusers transformer or UNet as a gradest model ``model(z, t, **cond)``.

    The call is ``transformer(hidden_states=z, timestep=t * timestep_scale +
    timestep_shift, **fixed_kwargs, **cond, return_dict=False)[0]``; models whose forward
    takes ``sample`` instead of ``hidden_states`` (``UNet2DConditionModel``,
    ``UNet2DModel``) get ``sample=z``. Parameters keep the model's names behind a
    ``transformer.`` prefix (``result.grads["transformer.proj_out.weight"]``), for UNets too.
    The output is whatever the model predicts (a flow velocity, or epsilon / v for a
    DDPM-family model sampled with :func:`sampler_from_scheduler`'s ``DDIM``); for the latter build
    the
    wrapper with :meth:`for_sampler`, which calls the model at the scheduler's timesteps.

    Conditioning (``cond`` of ``estimate`` / ``rollout``; tensors with a batch dimension):

    * ``SD3Transformer2DModel``: ``encoder_hidden_states [B, S, joint_attention_dim]``,
      ``pooled_projections [B, pooled_projection_dim]``.
    * ``DiTTransformer2DModel``: ``class_labels [B]``.
    * ``FluxTransformer2DModel``: ``encoder_hidden_states``, ``pooled_projections`` (and
      ``guidance [B]`` with ``guidance_embeds``); the position ids ``img_ids [S, 3]`` and
      ``txt_ids [S_text, 3]`` have no batch dimension and go in ``fixed_kwargs``. Latents
      are packed, ``[B, S, in_channels]``.
    * ``UNet2DConditionModel``: ``encoder_hidden_states [B, S, cross_attention_dim]``;
      configured like SDXL (``addition_embed_type="text_time"``) also the nested
      ``added_cond_kwargs={"text_embeds": [B, D], "time_ids": [B, 6]}``, repeated in
      stacked calls like the top-level tensors (:mod:`gradest.conditioning`).

    Args:
        transformer: the diffusers model (any ``*Transformer2DModel`` with a diffusers
            ``config``).
        timestep_scale: the model's timestep per unit of sigma. Default: 1 for Flux (its
            forward multiplies by 1000 itself), else 1000 (``num_train_timesteps`` of
            ``FlowMatchEulerDiscreteScheduler``, what SD3 and DiT pipelines pass).
        timestep_shift: added after scaling (the ``DDIM`` grids of :func:`sampler_from_scheduler`
            whose last
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
        inner = unwrap_model(transformer) if isinstance(transformer, nn.Module) else transformer
        if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
            raise InvalidType(
                f"transformer must be a diffusers model (an nn.Module with a .config, or one "
                f"wrapped by DDP / FSDP / accelerator.prepare), got {type(inner).__name__}"
            )
        # Called as given (a DDP wrapper's hooks fire); read through the wrappers.
        self.transformer = transformer
        self._inner = (inner,)  # a tuple: not registered as a second submodule
        self.is_flux = type(inner).__name__.startswith("Flux")
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
        parameters = inspect.signature(inner.forward).parameters
        unet = "sample" in parameters and "hidden_states" not in parameters
        self.input_name = "sample" if unet else "hidden_states"
        self.required_cond = _required_conditioning(inner, parameters, self.input_name)
        self.required_added_cond = _required_added_conditions(inner, parameters)

    @classmethod
    def for_sampler(
        cls,
        model: nn.Module,
        sampler: Any,
        *,
        fixed_kwargs: Mapping[str, Any] | None = None,
    ) -> DiffusersVelocity:
        """The wrapper that calls ``model`` at the timesteps ``sampler``'s scheduler uses.

        ``sampler`` is a :class:`~gradest.diffusion_samplers.DDIM` (from
        :func:`sampler_from_scheduler`): the model is called at ``timestep = t *
        num_train_timesteps + timestep_shift``, rounded to an integer when every grid
        timestep is one (as ``DDIMScheduler.timesteps`` are).
        """
        scale = getattr(sampler, "num_train_timesteps", None)
        if scale is None or not callable(getattr(sampler, "model_timesteps", None)):
            raise InvalidType(
                f"DiffusersVelocity.for_sampler needs a sampler that records how its model "
                f"is called (a gradest.DDIM from sampler_from_scheduler), got "
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
    def model(self) -> nn.Module:
        """The diffusers model itself (inside any DDP / FSDP / accelerate wrapper)."""
        return self._inner[0]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def prompt_keys(self) -> tuple[str, ...]:
        """The ``cond`` keys that carry the prompt (the model's required conditioning
        not given in ``fixed_kwargs``): under
        :class:`~gradest.integrations.guidance.ClassifierFreeGuidance` each needs its
        ``negative_`` counterpart."""
        keys = tuple(k for k in self.required_cond if k not in self.fixed_kwargs)
        if self.required_added_cond and _ADDED not in self.fixed_kwargs:
            keys += (_ADDED,)
        return keys

    def check_latents(self, z: Tensor) -> None:
        """Raise a ValueError naming the config field when ``z`` cannot fit the transformer."""
        name, config = type(self.model).__name__, self.model.config
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

    def check_cond(self, cond: Mapping[str, Any]) -> None:
        """Raise a ValueError naming the conditioning keys the model needs and lacks (also
        those inside ``added_cond_kwargs`` that an SDXL-style UNet's config asks for)."""
        missing = [k for k in self.required_cond if k not in cond and k not in self.fixed_kwargs]
        if missing:
            raise InvalidValue(
                f"{type(self.model).__name__} needs {', '.join(missing)} in cond (got keys "
                f"{sorted(cond)}); pass cond={{{', '.join(repr(k) + ': ...' for k in missing)}}} "
                f"(the prompt encodings, one row per sample) to estimate / surrogate / rollout"
            )
        if self.required_added_cond:
            self._check_added_cond(cond.get("added_cond_kwargs", self.fixed_kwargs.get(_ADDED)))

    def _check_added_cond(self, added: Any) -> None:
        needed = self.required_added_cond
        kind = self.config.addition_embed_type
        example = ", ".join(f"{key!r}: ..." for key in needed)
        if not isinstance(added, Mapping):
            got = "nothing" if added is None else type(added).__name__
            raise InvalidValue(
                f"{type(self.model).__name__} has config.addition_embed_type={kind!r} and "
                f"needs cond['added_cond_kwargs'], a dict with {', '.join(needed)}; got {got}; "
                f"pass cond={{..., 'added_cond_kwargs': {{{example}}}}} (one row per sample)"
            )
        missing = [key for key in needed if key not in added]
        if missing:
            raise InvalidValue(
                f"{type(self.model).__name__} has config.addition_embed_type={kind!r} and "
                f"needs {', '.join(missing)} in cond['added_cond_kwargs'] (got keys "
                f"{sorted(added)}); pass cond['added_cond_kwargs'] = {{{example}}}"
            )

    def check_sampler(self, sampler: Any) -> None:
        """Raise a ValueError when ``sampler`` cannot drive this model: a
        :class:`~gradest.DDIM` (a diffusion sampler, reading the output as epsilon or v)
        on a flow-matching model (:data:`FLOW_MATCHING_MODELS`: SD3, Flux, ...), or a
        ``DDIM`` whose scheduler calls the model at other timesteps than this wrapper does
        at its grid (a wrapper built without :meth:`for_sampler`): either way the steps
        would be wrong, silently. gradest calls it once per estimate and rollout."""
        if not isinstance(sampler, DDIM):
            return
        name = type(self.model).__name__
        if name in FLOW_MATCHING_MODELS:
            raise InvalidValue(
                f"{name} is a flow-matching model (it predicts a rectified-flow velocity) "
                f"but the sampler is a DDIM, a diffusion sampler that would read that "
                f"velocity as a {sampler.prediction!r} prediction; sample it on its own "
                f"scheduler's grid with gradest.integrations.diffusers.sampler_from_scheduler("
                f"FlowMatchEulerDiscreteScheduler(...), num_inference_steps) (or "
                f"gradest.RectifiedFlow(steps=N))"
            )
        with outside_fake_mode():  # the grid is a host object
            times = sampler.times[:-1].tolist()
            wanted = sampler.model_timesteps().tolist()
        for k, (t, want) in enumerate(zip(times, wanted, strict=True)):
            got = t * self.timestep_scale + self.timestep_shift
            if self.integer_timesteps:
                got = float(round(got))
            if abs(got - want) > 1e-3:
                raise InvalidValue(
                    f"DiffusersVelocity calls {type(self.model).__name__} at timestep "
                    f"{got:g} at step {k} (timestep_scale={self.timestep_scale:g}, "
                    f"timestep_shift={self.timestep_shift:g}) where the sampler's scheduler "
                    f"calls it at {want:g}; build the wrapper with "
                    f"DiffusersVelocity.for_sampler(model, sampler)"
                )

    def forward(self, z: Tensor, t: Tensor, **cond: Any) -> Tensor:
        self.check_latents(z)
        self.check_cond(cond)
        if self.is_flux and self.config.guidance_embeds and "guidance" not in cond:
            raise InvalidValue(
                f"{type(self.model).__name__} has config.guidance_embeds=True and needs "
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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers and what
    ``accelerator.prepare`` returns (``model`` itself otherwise)."""
    try:
        from accelerate.utils import extract_model_from_parallel
    except ImportError:
        extract_model_from_parallel = None
    for _ in range(8):
        if extract_model_from_parallel is not None:
            inner = extract_model_from_parallel(model)
        else:
            inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
            known = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
            if type(model).__name__ not in known and not hasattr(model, "_orig_mod"):
                inner = None
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


_ADDED = "added_cond_kwargs"

# What UNet2DConditionModel's ``get_aug_embed`` reads from ``added_cond_kwargs`` for each
# ``config.addition_embed_type`` (diffusers raises deep inside its forward without them).
_ADDED_CONDITIONS = {
    "text_time": ("text_embeds", "time_ids"),  # SDXL
    "text_image": ("image_embeds",),
    "image": ("image_embeds",),
    "image_hint": ("image_embeds", "hint"),
}


def _required_added_conditions(
    model: nn.Module, parameters: Mapping[str, inspect.Parameter]
) -> tuple[str, ...]:
    """The keys ``added_cond_kwargs`` must hold for ``model`` (none for other models)."""
    if _ADDED not in parameters:
        return ()
    kind = getattr(getattr(model, "config", None), "addition_embed_type", None)
    return _ADDED_CONDITIONS.get(kind, ()) if isinstance(kind, str) else ()


def _required_conditioning(
    model: nn.Module, parameters: Mapping[str, inspect.Parameter], input_name: str
) -> tuple[str, ...]:
    """The ``cond`` keys ``model``'s forward cannot run without: the forward's required
    arguments, and what the config says (text-conditioned SD3 / Flux transformers need
    the prompt encodings, a class-conditional DiT its labels)."""
    required = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in ("self", input_name, "timestep")
    ]
    config = getattr(model, "config", None)
    if getattr(config, "joint_attention_dim", None) and "encoder_hidden_states" in parameters:
        required.append("encoder_hidden_states")
    if getattr(config, "pooled_projection_dim", None) and "pooled_projections" in parameters:
        required.append("pooled_projections")
    if (
        type(model).__name__.startswith("DiT")
        and getattr(config, "norm_type", None) == "ada_norm_zero"
        and "class_labels" in parameters
    ):
        required.append("class_labels")
    return tuple(dict.fromkeys(required))
