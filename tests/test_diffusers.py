"""diffusers interop: scheduler grids, transformer wrappers, and gradients through them.

Tiny randomly initialised transformers are built here (no hub access): diffusers'
``DiTTransformer2DModel``, ``SD3Transformer2DModel`` and ``FluxTransformer2DModel``.
Checked:

* ``sampler_from_scheduler`` takes exactly the scheduler's sigma grid (with ``shift``,
  dynamic shifting, stochastic sampling) and refuses non-flow-matching schedulers.
* The scheduler's own ``step()`` loop, called the way diffusers pipelines call it,
  reproduces ``gradest.rollout`` of ``DiffusersVelocity`` bit for bit in float32.
  (``step()`` casts the sample to float32, so in float64 the diffusers loop itself is
  only float32-accurate; that is checked too.)
* ``exact`` through the wrapped transformers equals the dense reference in float64
  (DiT and SD3 with every parameter trainable; Flux with a subset trainable for the
  dense check and ``truncated(k=N) == exact`` on all of it).
* Latents that do not fit the transformer's config give a ValueError naming the field.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")

pytestmark = [
    # torch's note that sdpa's CPU backward has no vmap rule (the dense reference's jacrev).
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

from diffusers_support import tiny_transformer  # noqa: E402

import gradest  # noqa: E402
from gradest.integrations.diffusers import (  # noqa: E402
    DiffusersVelocity,
    StochasticFlowMatch,
    sampler_from_scheduler,
)
from gradest.objectives import TerminalObjective  # noqa: E402
from gradest.reference import exact_gradient, relative_error  # noqa: E402
from gradest.testing.problems import seeded_normal  # noqa: E402

BATCH, STEPS = 2, 3
EXACTNESS = 1e-10  # float64 round-off through a few thousand parameters is ~1e-14
# Flux's rotary embedding computes in float32 even for a float64 model
# (diffusers.models.embeddings.apply_rotary_emb: ``x.float() * cos ...``), so two float64
# evaluation orders can round its queries and keys differently: agreement to float32
# round-off (~1e-7) is all that is defined there. Measured: ~1e-9.
FLUX_EXACTNESS = 1e-6


def latents_and_cond(kind: str, dtype=torch.float64):
    """Noise, per-sample conditioning and (Flux) the fixed position ids."""
    fixed = {}
    if kind == "dit":
        noise = seeded_normal((BATCH, 2, 4, 4), 11, dtype)
        cond = {"class_labels": torch.tensor([1, 2])}
    else:
        noise = seeded_normal((BATCH, 2, 4, 4) if kind == "sd3" else (BATCH, 4, 4), 11, dtype)
        cond = {
            "encoder_hidden_states": seeded_normal((BATCH, 3, 6), 12, dtype),
            "pooled_projections": seeded_normal((BATCH, 5), 13, dtype),
        }
    if kind == "flux":
        # A 2x2 grid of image tokens and 3 text tokens (as FluxPipeline builds them).
        img_ids = torch.zeros(4, 3, dtype=dtype)
        img_ids[:, 1] = torch.tensor([0.0, 0.0, 1.0, 1.0])
        img_ids[:, 2] = torch.tensor([0.0, 1.0, 0.0, 1.0])
        fixed = {"img_ids": img_ids, "txt_ids": torch.zeros(3, 3, dtype=dtype)}
    return noise, cond, fixed


def scheduler(**options):
    return diffusers.FlowMatchEulerDiscreteScheduler(**{"shift": 3.0, **options})


def terminal_objective(shape) -> TerminalObjective:
    weights = seeded_normal(shape, 1)
    return TerminalObjective(
        lambda z: torch.sin(weights.to(z.dtype) * z).pow(2).sum() + 0.1 * z.pow(2).sum()
    )


# -- 1. the sigma grid ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "kwargs"),
    [
        ({}, {}),
        ({"shift": 1.0}, {}),
        ({"use_dynamic_shifting": True}, {"mu": 0.8}),
        ({"shift_terminal": 0.1}, {}),
        ({"use_karras_sigmas": True}, {}),
    ],
)
def test_flow_takes_the_schedulers_sigma_grid(options, kwargs):
    sched = scheduler(**options)
    timesteps_before = sched.timesteps.clone()
    flow = sampler_from_scheduler(sched, 7, **kwargs)
    assert isinstance(flow, gradest.RectifiedFlow)
    assert torch.equal(sched.timesteps, timesteps_before)  # the caller's scheduler untouched
    sched.set_timesteps(7, **kwargs)
    sigmas = sched.sigmas.to(torch.float64)
    assert flow.num_steps == 7 and torch.equal(flow.times, sigmas)
    # gradest's Euler step is the scheduler's: z + (sigma_next - sigma) v.
    alpha, beta, noise_scale = flow.coefficients()
    assert torch.equal(beta, sigmas[1:] - sigmas[:-1])
    assert torch.all(alpha == 1) and torch.all(noise_scale == 0)


def test_stochastic_sampling_becomes_an_affine_sampler_with_noise():
    flow = sampler_from_scheduler(scheduler(stochastic_sampling=True), 4)
    assert isinstance(flow, StochasticFlowMatch)
    alpha, beta, noise_scale = flow.coefficients()
    sigma, sigma_next = flow.times[:-1], flow.times[1:]
    assert torch.allclose(alpha, 1 - sigma_next) and torch.allclose(noise_scale, sigma_next)
    assert torch.allclose(beta, -(1 - sigma_next) * sigma)


def test_other_schedulers_are_refused_with_the_fix():
    with pytest.raises(
        TypeError,
        match="takes a diffusers FlowMatchEulerDiscreteScheduler.*got EulerDiscreteScheduler"
        ".*DDIMScheduler.from_config",
    ):
        sampler_from_scheduler(diffusers.EulerDiscreteScheduler(), 10)
    with pytest.raises(ValueError, match=r"sde_noise_level=0.7 is Flow-GRPO's SDE.*eta="):
        sampler_from_scheduler(diffusers.DDIMScheduler(clip_sample=False), 10, sde_noise_level=0.7)
    with pytest.raises(ValueError, match="invert_sigmas=True"):
        sampler_from_scheduler(scheduler(invert_sigmas=True), 4)
    with pytest.raises(ValueError, match="num_inference_steps must be an int >= 1"):
        sampler_from_scheduler(scheduler(), 0)


# -- 2. the scheduler's own loop == gradest.rollout ----------------------------------------


def scheduler_loop(transformer, sched, noise, cond, fixed, num_steps, flux=False):
    """The denoising loop as SD3 / DiT / Flux pipelines write it."""
    sched.set_timesteps(num_steps)
    z, states = noise, [noise]
    for t in sched.timesteps:
        timestep = t.expand(z.shape[0]).to(z.dtype)
        if flux:
            timestep = timestep / 1000  # FluxPipeline passes sigma; the model scales by 1000
        v = transformer(hidden_states=z, timestep=timestep, **fixed, **cond, return_dict=False)[0]
        z = sched.step(v, t, z).prev_sample
        states.append(z)
    return torch.stack(states)


def float32_tolerance(states: torch.Tensor) -> float:
    # float32 round-off of the states, allowed to grow linearly over the steps through a
    # smooth model (a generous constant: measured differences are ~0.05 of this).
    return 16 * STEPS * torch.finfo(torch.float32).eps * float(states.abs().max())


@pytest.mark.parametrize("kind", ["dit", "sd3", "flux"])
def test_scheduler_step_loop_reproduces_gradest_rollout(kind):
    transformer = tiny_transformer(kind, dtype=torch.float32)
    noise, cond, fixed = latents_and_cond(kind, dtype=torch.float32)
    with torch.no_grad():
        reference = scheduler_loop(
            transformer, scheduler(), noise, cond, fixed, STEPS, kind == "flux"
        )
    velocity = DiffusersVelocity(transformer, fixed_kwargs=fixed)
    trajectory = gradest.rollout(velocity, sampler_from_scheduler(scheduler(), STEPS), noise, cond)
    # Bit for bit: the model sees the same timesteps (float32 sigma * 1000 both ways), and
    # both steps compute z + round32(sigma_next - sigma) * v, since the float64 difference
    # of two float32 numbers rounds to the float32 difference.
    assert torch.equal(trajectory.states, reference)
    assert float((reference[-1] - reference[0]).abs().max()) > 0.1  # the model did move z


def test_in_float64_the_scheduler_loop_is_only_float32_accurate():
    # FlowMatchEulerDiscreteScheduler.step casts the sample to float32 before stepping;
    # gradest steps in float64. The loops agree to float32 round-off, not better.
    transformer = tiny_transformer("sd3")
    noise, cond, _ = latents_and_cond("sd3")
    with torch.no_grad():
        reference = scheduler_loop(transformer, scheduler(), noise, cond, {}, STEPS)
    trajectory = gradest.rollout(
        DiffusersVelocity(transformer), sampler_from_scheduler(scheduler(), STEPS), noise, cond
    )
    difference = float((trajectory.states - reference).abs().max())
    assert 0 < difference <= float32_tolerance(reference)


def test_stochastic_scheduler_loop_reproduces_gradest_rollout(monkeypatch):
    transformer = tiny_transformer("sd3", dtype=torch.float32)
    noise, cond, _ = latents_and_cond("sd3", dtype=torch.float32)
    flow = sampler_from_scheduler(scheduler(stochastic_sampling=True), STEPS)
    trajectory = gradest.rollout(
        DiffusersVelocity(transformer),
        flow,
        noise,
        cond,
        generator=torch.Generator().manual_seed(5),
    )
    assert trajectory.step_noise is not None
    # Replay gradest's recorded step noise inside the scheduler's step().
    replay = iter(trajectory.step_noise)
    module = __import__(type(scheduler()).__module__, fromlist=["randn_tensor"])
    monkeypatch.setattr(module, "randn_tensor", lambda *args, **kwargs: next(replay))
    with torch.no_grad():
        reference = scheduler_loop(
            transformer, scheduler(stochastic_sampling=True), noise, cond, {}, STEPS
        )
    assert float((trajectory.states - reference).abs().max()) <= float32_tolerance(reference)


# -- 3. exact gradients through wrapped transformers (float64) -----------------------------


def trainable_subset(model, keep: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(any(name.startswith(prefix) for prefix in keep))


@pytest.mark.parametrize("kind", ["dit", "sd3", "flux"])
def test_exact_matches_the_dense_reference(kind):
    transformer = tiny_transformer(kind)
    if kind == "flux":
        # ~19K parameters: dense Jacobians on a subset (one attention and the output).
        trainable_subset(transformer, ("transformer_blocks.0.attn.to_q", "proj_out"))
    noise, cond, fixed = latents_and_cond(kind)
    velocity = DiffusersVelocity(transformer, fixed_kwargs=fixed)
    flow = sampler_from_scheduler(scheduler(), STEPS)
    objective = terminal_objective(tuple(noise.shape))
    trajectory = gradest.rollout(velocity, flow, noise, cond)
    truth, truth_noise = exact_gradient(velocity, flow, objective, trajectory, cond)
    result = gradest.estimator("exact").estimate(
        velocity, flow, objective, noise=noise, cond=cond, noise_grad=True
    )
    names = [n for n, p in velocity.named_parameters() if p.requires_grad]
    assert list(result.grads) == names and all(n.startswith("transformer.") for n in names)
    assert float(torch.cat([g.reshape(-1) for g in truth.values()]).norm()) > 0
    tolerance = FLUX_EXACTNESS if kind == "flux" else EXACTNESS
    assert relative_error(result.grads, truth) <= tolerance
    assert relative_error(result.noise_grad, truth_noise) <= tolerance


def test_truncated_full_depth_equals_exact_on_all_of_flux():
    transformer = tiny_transformer("flux")
    noise, cond, fixed = latents_and_cond("flux")
    velocity = DiffusersVelocity(transformer, fixed_kwargs=fixed)
    flow = sampler_from_scheduler(scheduler(), STEPS)
    objective = terminal_objective(tuple(noise.shape))
    trajectory = gradest.rollout(velocity, flow, noise, cond)
    exact = gradest.estimator("exact").estimate(
        velocity, flow, objective, trajectory=trajectory, cond=cond
    )
    truncated = gradest.estimator("truncated", k=STEPS).estimate(
        velocity, flow, objective, trajectory=trajectory, cond=cond
    )
    assert len(exact.grads) == len(list(transformer.parameters()))
    assert relative_error(truncated.grads, exact.grads) <= EXACTNESS
    # The control: truncating to one step changes the gradient.
    one_step = gradest.estimator("truncated", k=1).estimate(
        velocity, flow, objective, trajectory=trajectory, cond=cond
    )
    assert relative_error(one_step.grads, exact.grads) > 1e-3


# -- 4. bad input ----------------------------------------------------------------------


def test_latents_that_do_not_fit_the_config_name_the_field():
    flow = sampler_from_scheduler(scheduler(), 2)
    dit = DiffusersVelocity(tiny_transformer("dit"))
    three_channels = seeded_normal((BATCH, 3, 4, 4), 0)
    with pytest.raises(ValueError, match=r"in_channels=2 but the latents of shape \(2, 3, 4, 4\)"):
        gradest.rollout(dit, flow, three_channels, {"class_labels": torch.tensor([0, 1])})
    sd3 = DiffusersVelocity(tiny_transformer("sd3"))
    too_large = seeded_normal((BATCH, 2, 16, 16), 0)
    _, cond, _ = latents_and_cond("sd3")
    with pytest.raises(ValueError, match=r"\(2, 2, 16, 16\).*pos_embed_max_size=4.*sample_size=4"):
        gradest.rollout(sd3, flow, too_large, cond)
    learned_sigma = DiffusersVelocity(tiny_transformer("dit", out_channels=4))
    with pytest.raises(ValueError, match="out_channels=4 differs from in_channels=2"):
        gradest.rollout(
            learned_sigma,
            flow,
            seeded_normal((BATCH, 2, 4, 4), 0),
            {"class_labels": torch.tensor([0, 1])},
        )
    _, flux_cond, fixed = latents_and_cond("flux")
    flux = DiffusersVelocity(tiny_transformer("flux"), fixed_kwargs=fixed)
    with pytest.raises(
        ValueError,
        match=r"img_ids'\] has 4 rows but the latents of shape "
        r"\(2, 9, 4\) have 9 tokens",
    ):
        gradest.rollout(flux, flow, seeded_normal((BATCH, 9, 4), 0), flux_cond)


def test_label_dropout_in_training_mode_is_replayed_consistently():
    """diffusers' DiT drops class labels with p=0.1 in training mode. Every evaluation of a
    step must see the same drop: the fused chain, the checkpointed sweep (which recomputes
    each step) and jagg with every step a node give the same gradient for the same torch
    seed, and the dropout is really active (some seed differs from eval mode)."""
    transformer = tiny_transformer("dit").train()
    velocity = DiffusersVelocity(transformer)
    noise, cond, _ = latents_and_cond("dit")
    flow = sampler_from_scheduler(scheduler(), 3)
    objective = terminal_objective(noise.shape)

    def estimate(spec: str, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return gradest.estimator(spec).estimate(velocity, flow, objective, noise=noise, cond=cond)

    transformer.eval()
    deterministic = estimate("exact", 0).flat()
    transformer.train()
    differs = 0
    for seed in range(10):
        fused = estimate("exact", seed).flat()
        for spec in ("exact:checkpoint=true", "jagg:window=2,order=1"):
            assert relative_error(estimate(spec, seed).flat(), fused) < EXACTNESS, (spec, seed)
        differs += relative_error(fused, deterministic) > 1e-6
    assert differs > 0, "label dropout never fired: the test would not catch a mismatch"
