"""What a diffusers scheduler's ``step()`` takes, read as plain schedule data.

The reading half of :func:`gradest.integrations.diffusers.sampler_from_scheduler`: it
checks the scheduler and returns its grid (:func:`flow_match_schedule`,
:func:`ddim_schedule`), from which the adapter builds the sampler. ``diffusers`` itself is
imported only when a function here is called. See :mod:`gradest.integrations.diffusers`
for the conventions.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import check_allocation
from gradest.errors import InvalidType, InvalidValue, MissingDependency
from gradest.samplers import _GRID_BYTES_PER_STEP, as_int


@attrs.frozen
class FlowMatchSchedule:
    """The steps of a ``FlowMatchEulerDiscreteScheduler`` after ``set_timesteps``.

    Attributes:
        sigmas: ``[N+1]`` float64 CPU, the grid (not yet validated as a gradest grid).
        stochastic: the scheduler's ``config.stochastic_sampling`` (its steps are then
            :class:`gradest.samplers.StochasticFlowMatch`'s, else Euler's).
        scheduler: the scheduler's class name, for messages.
        num_inference_steps: ``N``, for messages.
    """

    sigmas: Tensor
    stochastic: bool
    scheduler: str
    num_inference_steps: int


@attrs.frozen
class DDIMSchedule:
    """The steps of a ``DDIMScheduler`` / ``DDPMScheduler``: the arguments of
    :class:`gradest.DDIM` (``times`` .. ``timestep_shift``), and what messages name.

    Attributes:
        times: ``[N+1]`` float64, ``timestep / num_train_timesteps`` (shifted; see
            :func:`gradest.integrations.diffusers.sampler_from_scheduler`), then 0.
        alphas_cumprod: ``[N+1]`` float64, the level at every grid point.
        prediction: the scheduler's ``prediction_type``.
        eta: DDIM's noise ratio (1 for DDPM).
        num_train_timesteps: the scheduler's ``num_train_timesteps``.
        timestep_shift: 0, or -1 when the last timestep is 0.
        scheduler: the scheduler's class name, for messages.
        num_inference_steps: ``N``, for messages.
        timesteps: the scheduler's timesteps, for messages.
    """

    times: Tensor
    alphas_cumprod: Tensor
    prediction: str
    eta: float
    num_train_timesteps: int
    timestep_shift: float
    scheduler: str
    num_inference_steps: int
    timesteps: list[int]

    def sampler_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :class:`gradest.DDIM` this schedule gives."""
        return {
            "times": self.times,
            "alphas_cumprod": self.alphas_cumprod,
            "prediction": self.prediction,
            "eta": self.eta,
            "num_train_timesteps": self.num_train_timesteps,
            "timestep_shift": self.timestep_shift,
        }


def diffusers_module() -> Any:
    """The ``diffusers`` package, imported when a scheduler is read (it is optional)."""
    try:
        import diffusers
    except ImportError as err:
        raise MissingDependency(
            "sampler_from_scheduler needs diffusers: pip install diffusers "
            "(or gradest's integrations extra)"
        ) from err
    return diffusers


def is_ddpm_family(scheduler: Any) -> bool:
    """Whether ``scheduler`` is a ``DDIMScheduler`` or ``DDPMScheduler`` (a DDIM sampler's)."""
    diffusers = diffusers_module()
    return isinstance(scheduler, diffusers.DDIMScheduler | diffusers.DDPMScheduler)


# Bytes per sampling step that building a sampler holds at once: the float64 sigmas a
# caller may pass (Flux), diffusers' ``set_timesteps`` (float64 sigmas and timesteps and
# their float32 tensors), the float64 copies the schedules here compare, and the sampler's
# float64 grid and coefficients (``gradest.samplers``). A lower bound, so that a refusal is
# certain.
SCHEDULE_BYTES_PER_STEP = 8 + 2 * 8 + 2 * 4 + 2 * 8 + _GRID_BYTES_PER_STEP


def check_num_inference_steps(scheduler: Any, num_inference_steps: Any) -> int:
    """``num_inference_steps`` as a Python int the scheduler can take and its schedule
    fits in memory (built on the CPU), checked before ``set_timesteps`` allocates it:
    an integer (numpy / torch integers too) >= 1; for ``DDIMScheduler`` /
    ``DDPMScheduler`` at most ``num_train_timesteps`` (their ``set_timesteps`` refuses
    more).

    Raises:
        InvalidType: not an integer (a bool, a float, a string).
        InvalidValue: below 1, more steps than the scheduler takes, or a schedule larger
            than the memory.
    """
    steps = as_int(num_inference_steps)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise InvalidType(
            f"num_inference_steps must be an int >= 1, got num_inference_steps="
            f"{num_inference_steps!r} (a {type(num_inference_steps).__name__}); pass a whole "
            f"number, e.g. num_inference_steps=28"
        )
    if steps < 1:
        raise InvalidValue(
            f"num_inference_steps must be an int >= 1, got num_inference_steps={steps}; "
            f"e.g. num_inference_steps=28"
        )
    name = type(scheduler).__name__
    if is_ddpm_family(scheduler):
        train = scheduler.config.get("num_train_timesteps")
        if isinstance(train, int) and steps > train:
            raise InvalidValue(
                f"num_inference_steps={steps} is more than the scheduler's "
                f"num_train_timesteps={train} ({name} takes at most one step per training "
                f"timestep); use num_inference_steps <= {train}"
            )
    check_allocation(
        f"num_inference_steps={steps}",
        steps + 1,
        SCHEDULE_BYTES_PER_STEP,
        name="num_inference_steps",
        detail="the schedule's sigmas, timesteps and grid alone",
    )
    return steps


def flow_match_schedule(
    scheduler: Any, num_inference_steps: int, **set_timesteps_kwargs: Any
) -> FlowMatchSchedule:
    """The grid of a ``FlowMatchEulerDiscreteScheduler``: what
    :func:`gradest.integrations.diffusers.sampler_from_scheduler` builds its sampler on
    (documented there; the same arguments and refusals).
    """
    if not isinstance(scheduler, diffusers_module().FlowMatchEulerDiscreteScheduler):
        raise InvalidType(
            f"sampler_from_scheduler takes a diffusers FlowMatchEulerDiscreteScheduler (the "
            f"Euler sampler of rectified-flow models such as SD3 and Flux), DDIMScheduler or "
            f"DDPMScheduler, got {type(scheduler).__name__}, which samples a different "
            f"process. If the model was trained with flow matching, build "
            f"FlowMatchEulerDiscreteScheduler(...) for it; for another DDPM-family scheduler "
            f"build DDIMScheduler.from_config(scheduler.config) (docs/integrations.md)"
        )
    num_inference_steps = check_num_inference_steps(scheduler, num_inference_steps)
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
    return FlowMatchSchedule(
        sigmas=sigmas,
        # absent in older diffusers
        stochastic=bool(getattr(config, "stochastic_sampling", False)),
        scheduler=type(scheduler).__name__,
        num_inference_steps=num_inference_steps,
    )


DDPM_VARIANCES = ("fixed_small", "fixed_small_log")


def ddim_schedule(
    scheduler: Any,
    num_inference_steps: int,
    *,
    eta: float | None = None,
    **set_timesteps_kwargs: Any,
) -> DDIMSchedule:
    """The grid and levels of a ``DDIMScheduler`` / ``DDPMScheduler``: what
    :func:`gradest.integrations.diffusers.sampler_from_scheduler` builds its DDIM from
    (documented there; the same arguments and refusals)."""
    is_ddpm = isinstance(scheduler, diffusers_module().DDPMScheduler)
    if not is_ddpm_family(scheduler):
        raise InvalidType(
            f"a DDIM sampler needs a diffusers DDIMScheduler or DDPMScheduler, got "
            f"{type(scheduler).__name__}; for FlowMatchEulerDiscreteScheduler use "
            f"sampler_from_scheduler, for another DDPM-family scheduler build "
            f"DDIMScheduler.from_config(scheduler.config)"
        )
    num_inference_steps = check_num_inference_steps(scheduler, num_inference_steps)
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
            f"DDIM sampler takes 'epsilon', 'v_prediction' or 'sample'"
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
    return DDIMSchedule(
        times=times,
        alphas_cumprod=levels,
        prediction=prediction,
        eta=eta,
        num_train_timesteps=train_steps,
        timestep_shift=float(shift),
        scheduler=name,
        num_inference_steps=num_inference_steps,
        timesteps=timesteps,
    )
