"""DDIM / DDPM samplers (epsilon, v and x0 prediction) as gradest affine samplers.

Checked, in float64 unless said:

* ``gradest.rollout`` on ``sampler_from_scheduler(...)`` (a ``DDIM``) reproduces diffusers' own
  ``DDIMScheduler.step`` / ``DDPMScheduler.step`` loop step by step (a tiny random
  ``UNet2DConditionModel`` called by the scheduler at its integer timesteps, and by gradest
  through ``DiffusersVelocity.for_sampler``), deterministic and stochastic (gradest's
  recorded step noise fed to ``step()``), including the default grid whose last timestep
  is 0 (shifted grid) and a zero-terminal-SNR v-prediction schedule. DDPM is checked
  to be DDIM with ``eta = 1`` by running the DDPM scheduler itself.
* The interpolant: ``noised`` is ``scheduler.add_noise``; ``jump_to_end`` is the
  scheduler's x0 prediction (re-noised to the final level when that is below 1).
* Every registered estimator (and ``gradest check``'s pinned configurations) makes the
  decisions it must and matches its dense definition on DDIM samplers; ``exact`` matches
  the dense exact gradient; ``refl`` from the last step is DRaFT-1 (``a != 1`` there).
* Bad input: names the argument, the value and the fix.
* The UNet end to end in float32: ``jagg`` surrogate and estimate in a few seconds.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")

pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

from diffusers_support import tiny_unet  # noqa: E402

import gradest  # noqa: E402
from gradest import check  # noqa: E402
from gradest.diffusion_samplers import DDIM  # noqa: E402
from gradest.errors import InvalidValue  # noqa: E402
from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler  # noqa: E402
from gradest.protocol import supports  # noqa: E402
from gradest.reference import dense_chain, exact_gradient, relative_error  # noqa: E402
from gradest.reference.decisions import decisions_mismatch  # noqa: E402
from gradest.reference.definitions import definition_at, expected_decisions  # noqa: E402
from gradest.strategies.adjoint import Adjoint  # noqa: E402
from gradest.testing.problems import (  # noqa: E402
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

BATCH, STEPS = 2, 4
# float64 round-off of a few steps through a UNet, relative to the states' size.
EXACTNESS = 1e-12
DEFINITION = 1e-10


def unet_inputs(dtype=torch.float64):
    noise = seeded_normal((BATCH, 2, 8, 8), 11, dtype)
    cond = {"encoder_hidden_states": seeded_normal((BATCH, 3, 6), 12, dtype)}
    return noise, cond


def make_scheduler(kind: str, **options):
    cls = diffusers.DDPMScheduler if kind == "ddpm" else diffusers.DDIMScheduler
    return cls(clip_sample=False, **options)


def in_float64(sched):
    """The scheduler's tables in float64, so that its step() is float64-accurate.

    (diffusers keeps ``alphas_cumprod`` in float32 and forms the step's scalars from it;
    gradest's sampler reads the same float32 values into float64.)"""
    sched.alphas_cumprod = sched.alphas_cumprod.to(torch.float64)
    if hasattr(sched, "final_alpha_cumprod"):
        sched.final_alpha_cumprod = sched.final_alpha_cumprod.to(torch.float64)
    if hasattr(sched, "one"):
        sched.one = sched.one.to(torch.float64)
    return sched


def scheduler_loop(unet, sched, noise, cond, eta, step_noise, monkeypatch):
    """The denoising loop as diffusers' DDIM / DDPM pipelines write it, replaying
    gradest's recorded step noise ``xi_k`` into step()."""
    sched.set_timesteps(STEPS)
    z, states = noise, [noise]
    ddpm = isinstance(sched, diffusers.DDPMScheduler)
    for k, t in enumerate(sched.timesteps):
        out = unet(sample=z, timestep=t, **cond, return_dict=False)[0]
        xi = None if step_noise is None else step_noise[k]
        if ddpm:
            module = __import__(type(sched).__module__, fromlist=["randn_tensor"])
            monkeypatch.setattr(module, "randn_tensor", lambda *args, _xi=xi, **kw: _xi)
            z = sched.step(out, t, z).prev_sample
        else:
            z = sched.step(out, t, z, eta=eta, variance_noise=xi).prev_sample
        states.append(z)
    return torch.stack(states)


# -- 1. the scheduler's own step() loop == gradest.rollout ----------------------------------

CONFIGS = {
    # default DDIM: timestep_spacing="leading", steps_offset=0 -> last timestep 0
    "ddim-eps": ("ddim", {}, 0.0),
    "ddim-eps-eta": ("ddim", {}, 0.6),
    # Stable Diffusion's settings: last timestep 1, final level alphas_cumprod[0]
    "ddim-v-sd": (
        "ddim",
        {
            "prediction_type": "v_prediction",
            "steps_offset": 1,
            "set_alpha_to_one": False,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "beta_end": 0.012,
        },
        0.8,
    ),
    "ddim-sample-trailing": (
        "ddim",
        {"prediction_type": "sample", "timestep_spacing": "trailing"},
        0.3,
    ),
    # zero terminal SNR: alpha 0 at timestep 999, where only v (or x0) prediction works
    "ddim-v-zero-snr": (
        "ddim",
        {
            "prediction_type": "v_prediction",
            "rescale_betas_zero_snr": True,
            "timestep_spacing": "trailing",
        },
        0.0,
    ),
    "ddpm-eps": ("ddpm", {}, None),
    "ddpm-v-offset": ("ddpm", {"prediction_type": "v_prediction", "steps_offset": 1}, None),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_rollout_is_the_schedulers_step_loop(config, monkeypatch):
    kind, options, eta = CONFIGS[config]
    sampler = sampler_from_scheduler(make_scheduler(kind, **options), STEPS, eta=eta)
    assert isinstance(sampler, DDIM)
    unet = tiny_unet()
    noise, cond = unet_inputs()
    model = DiffusersVelocity.for_sampler(unet, sampler)
    trajectory = gradest.rollout(
        model, sampler, noise, cond, generator=torch.Generator().manual_seed(3)
    )
    stochastic = kind == "ddpm" or eta > 0
    assert (trajectory.step_noise is not None) == stochastic
    with torch.no_grad():
        reference = scheduler_loop(
            unet,
            in_float64(make_scheduler(kind, **options)),
            noise,
            cond,
            eta,
            trajectory.step_noise,
            monkeypatch,
        )
    # The model sees the scheduler's integer timesteps.
    sched = make_scheduler(kind, **options)
    sched.set_timesteps(STEPS)
    assert torch.equal(sampler.model_timesteps(), sched.timesteps.to(torch.float64))
    if kind == "ddpm" and int(sched.timesteps[-1]) > 0:
        # DDPMScheduler clamps the last step's variance (0: the step ends at alpha 1) to
        # 1e-20 and adds its square root times the noise; gradest's step is exact there.
        reference[-1] -= 1e-10 * trajectory.step_noise[-1]
    scale = float(reference.abs().max())
    for k in range(STEPS + 1):
        assert float((trajectory.states[k] - reference[k]).abs().max()) <= EXACTNESS * scale, k
    assert float((reference[-1] - reference[0]).abs().max()) > 0.1  # the sampler moved z


def test_ddpm_is_ddim_with_eta_one():
    """The identity the DDPM sampler rests on, coefficient by coefficient: the DDPM
    posterior mean and "fixed_small" variance are DDIM's eta=1 step."""
    ddpm = sampler_from_scheduler(make_scheduler("ddpm"), 10)
    ddim = sampler_from_scheduler(make_scheduler("ddim"), 10, eta=1.0)
    assert ddpm.eta == 1.0 and torch.equal(ddpm.alphas_cumprod, ddim.alphas_cumprod)
    sched = in_float64(make_scheduler("ddpm"))
    sched.set_timesteps(10)
    alpha, beta, sigma = ddpm.coefficients()
    for k, t in enumerate(sched.timesteps):
        # DDPMScheduler.step with model output e at state z is affine: read its coefficients
        # off three evaluations (z, e) = (0, 0), (1, 0), (0, 1) with zero noise.
        def step(z, e, t=t):
            zero = torch.zeros(1, 1, dtype=torch.float64)
            module = __import__(type(sched).__module__, fromlist=["randn_tensor"])
            original = module.randn_tensor
            module.randn_tensor = lambda *a, **kw: zero
            try:
                return float(sched.step(e + zero, t, z + zero).prev_sample)
            finally:
                module.randn_tensor = original

        offset = step(0.0, 0.0)
        assert offset == 0.0
        assert step(1.0, 0.0) == pytest.approx(float(alpha[k]), rel=1e-13, abs=1e-15)
        assert step(0.0, 1.0) == pytest.approx(float(beta[k]), rel=1e-13, abs=1e-15)
        variance = float(sched._get_variance(int(t))) if int(t) > 0 else 0.0
        assert variance**0.5 == pytest.approx(float(sigma[k]), rel=1e-12, abs=1e-9)


def test_float32_unet_rollout_is_the_scheduler_loop_to_float32_roundoff(monkeypatch):
    sampler = sampler_from_scheduler(make_scheduler("ddim"), STEPS)
    unet = tiny_unet(torch.float32)
    noise, cond = unet_inputs(torch.float32)
    trajectory = gradest.rollout(DiffusersVelocity.for_sampler(unet, sampler), sampler, noise, cond)
    with torch.no_grad():
        reference = scheduler_loop(
            unet, make_scheduler("ddim"), noise, cond, 0.0, None, monkeypatch
        )
    # diffusers forms its step scalars in float32, gradest in float64: float32 round-off,
    # amplified by the UNet over the steps (measured: 1.1e-5, 3% of this bound).
    tolerance = 16 * STEPS * torch.finfo(torch.float32).eps * float(reference.abs().max())
    assert float((trajectory.states - reference).abs().max()) <= tolerance


# -- 2. the interpolant ----------------------------------------------------------------------


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("set_alpha_to_one", [True, False])
def test_noised_and_jump_to_end_are_the_schedulers(prediction, set_alpha_to_one):
    options = {
        "prediction_type": prediction,
        "set_alpha_to_one": set_alpha_to_one,
        "steps_offset": 1,
    }
    sampler = sampler_from_scheduler(make_scheduler("ddim", **options), 5)
    sched = in_float64(make_scheduler("ddim", **options))
    sched.set_timesteps(5)
    data, eps, z, out = (seeded_normal((3, 4), seed) for seed in range(4))
    final = float(sampler.alphas_cumprod[-1])
    assert final == (1.0 if set_alpha_to_one else pytest.approx(float(sched.alphas_cumprod[0])))
    for k, t in enumerate(sched.timesteps):
        expected = sched.add_noise(data, eps, t.reshape(1))
        assert torch.allclose(sampler.noised(data, k, eps), expected, rtol=0, atol=1e-14)
        # step() reports its x0 prediction; the final state is x0 noised to the final level
        # with the step's own epsilon (eta 0), exactly what jump_to_end predicts.
        x0 = sched.step(out, t, z).pred_original_sample
        a_t = float(sched.alphas_cumprod[t])
        eps_pred = (z - a_t**0.5 * x0) / (1 - a_t) ** 0.5
        target = final**0.5 * x0 + (1 - final) ** 0.5 * eps_pred
        scale, jump = sampler.jump_to_end(k)
        assert torch.allclose(scale * z + jump * out, target, rtol=1e-12, atol=1e-12)
    # The last step's jump is the last step (eta 0).
    alpha, beta, _ = sampler.coefficients()
    assert sampler.jump_to_end(4) == pytest.approx((float(alpha[4]), float(beta[4])), rel=1e-14)


def test_rectified_flow_jump_is_unit_scale():
    flow = gradest.RectifiedFlow(times=[1.0, 0.6, 0.25, 0.05])
    assert flow.jump_to_end(1) == (1.0, pytest.approx(0.05 - 0.6))


# -- 3. every estimator against its dense definition -----------------------------------------

DIM, MLP_BATCH, MLP_STEPS = 3, 4, 6


def hand_built(prediction: str, eta: float) -> DDIM:
    """A 6-step DDPM linear schedule (timesteps 999 .. 166, final level 1)."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas = torch.cumprod(1 - betas, 0)
    timesteps = torch.tensor([999, 832, 666, 499, 333, 166])
    return DDIM(
        times=torch.cat([timesteps / 1000, torch.zeros(1, dtype=torch.float64)]),
        alphas_cumprod=torch.cat([alphas[timesteps], torch.ones(1, dtype=torch.float64)]),
        prediction=prediction,
        eta=eta,
    )


SAMPLERS = {
    "eps-eta0": ("epsilon", 0.0),
    "v-eta0.5": ("v_prediction", 0.5),
    "eps-ddpm": ("epsilon", 1.0),
}


@pytest.fixture(scope="module", params=list(SAMPLERS))
def ddim_problem(request):
    sampler = hand_built(*SAMPLERS[request.param])
    model = tiny_mlp(DIM, hidden=8, num_classes=3)
    noise = seeded_normal((MLP_BATCH, DIM), 11)
    cond = {"y": torch.tensor([0, 2, 1, 3])}
    trajectory = gradest.rollout(
        model, sampler, noise, cond, generator=torch.Generator().manual_seed(3)
    )
    chain = dense_chain(model, sampler, trajectory, cond)
    objectives = {
        "terminal": smooth_terminal_objective(DIM),
        "stepwise": random_stepwise_objective(MLP_STEPS, (MLP_BATCH, DIM)),
    }
    return sampler, model, noise, cond, trajectory, chain, objectives


def test_registry_is_what_this_file_covers():
    # A new built-in estimator should be checked on DDIM too: default_specs covers every
    # registered name, so this only documents which ones exist today.
    assert {"exact", "jagg", "sdo", "truncated", "telescope", "draft_lv", "refl"} <= set(
        gradest.available_estimators()
    )


@pytest.mark.parametrize("spec", check.default_specs(MLP_STEPS))
def test_every_estimator_matches_its_definition_on_ddim(ddim_problem, spec):
    sampler, model, noise, cond, trajectory, chain, objectives = ddim_problem
    est = gradest.estimator(spec)
    kinds = [kind for kind in objectives if supports(est, kind)]
    assert kinds, spec
    if isinstance(est, Adjoint) and (sampler.eta > 0 or est.solver == "backsolve"):
        # It rebuilds the states by inverting the steps: a step with noise is refused, and
        # the Euler backsolve refuses DDIM's steps (alpha_k != 1).
        fix = "exact:checkpoint=true" if sampler.eta > 0 else "solver=inverse"
        with pytest.raises(InvalidValue, match=fix):
            est.estimate(model, sampler, objectives["terminal"], trajectory=trajectory, cond=cond)
        return
    for kind in kinds:
        objective = objectives[kind]
        for seed in range(3):
            result = est.estimate(
                model,
                sampler,
                objective,
                trajectory=trajectory,
                cond=cond,
                generator=torch.Generator().manual_seed(seed),
            )
            expected = expected_decisions(
                est, chain, objective, torch.Generator().manual_seed(seed)
            )
            if expected is not None:
                assert not decisions_mismatch(result.decisions, expected), (kind, seed)
            definition = definition_at(est, chain, objective, expected or result.decisions)
            assert definition is not None, spec
            assert relative_error(result.flat(), definition.grad) <= DEFINITION, (kind, seed)


@pytest.mark.parametrize("source", ["trajectory", "noise"])
def test_exact_is_the_dense_exact_gradient_on_ddim(ddim_problem, source):
    sampler, model, noise, cond, trajectory, chain, objectives = ddim_problem
    for kind, objective in objectives.items():
        truth, truth_noise = exact_gradient(
            model, sampler, objective, trajectory, cond, chain=chain
        )
        inputs = {"trajectory": trajectory} if source == "trajectory" else {"noise": noise}
        result = gradest.estimator("exact").estimate(
            model,
            sampler,
            objective,
            cond=cond,
            generator=torch.Generator().manual_seed(3),  # replays the recorded step noise
            noise_grad=kind == "terminal",
            **inputs,
        )
        assert relative_error(result.grads, truth) <= EXACTNESS, kind
        if kind == "terminal":
            assert relative_error(result.noise_grad, truth_noise) <= EXACTNESS


def test_refl_from_the_last_step_is_draft_1_on_ddim():
    # jump_to_end(N-1) is the last (eta 0) step itself, with a != 1: refl must scale z.
    sampler = hand_built("v_prediction", 0.0)
    assert sampler.jump_to_end(MLP_STEPS - 1)[0] != 1.0
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((MLP_BATCH, DIM), 11)
    objective = smooth_terminal_objective(DIM)
    refl = gradest.estimator("refl:last_steps=1").estimate(model, sampler, objective, noise=noise)
    draft = gradest.estimator("truncated:k=1").estimate(model, sampler, objective, noise=noise)
    assert relative_error(refl.flat(), draft.flat()) <= 1e-12
    assert refl.info["loss"] == pytest.approx(draft.info["loss"], rel=1e-12)


def test_step_log_prob_is_the_ddim_gaussian():
    sampler = hand_built("epsilon", 0.7)
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((MLP_BATCH, DIM), 11)
    trajectory = gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(0))
    k = 2
    a, a_next = (float(sampler.alphas_cumprod[i]) for i in (k, k + 1))
    std = 0.7 * ((1 - a_next) / (1 - a) * (1 - a / a_next)) ** 0.5
    eps = trajectory.velocities[k]
    z = trajectory.states[k]
    x0 = (z - (1 - a) ** 0.5 * eps) / a**0.5
    mean = a_next**0.5 * x0 + (1 - a_next - std**2) ** 0.5 * eps
    expected = torch.distributions.Normal(mean, std).log_prob(trajectory.states[k + 1]).sum(-1)
    assert torch.allclose(sampler.step_log_prob(trajectory, k, eps), expected, rtol=1e-12)
    # With a final level of 1 the last step is deterministic: no log-density.
    with pytest.raises(ValueError, match="deterministic"):
        sampler.step_log_prob(trajectory, MLP_STEPS - 1, trajectory.velocities[-1])


@pytest.mark.parametrize("config", ["ddim-eps", "ddim-v-sd"])
def test_exact_through_the_unet_is_the_dense_reference(config):
    kind, options, eta = CONFIGS[config]
    sampler = sampler_from_scheduler(make_scheduler(kind, **options), 3, eta=eta)
    unet = tiny_unet()
    # Dense Jacobians on a subset (594 parameters): the output conv and cross-attention queries.
    for name, param in unet.named_parameters():
        param.requires_grad_(name.startswith("conv_out") or "attn2.to_q" in name)
    model = DiffusersVelocity.for_sampler(unet, sampler)
    noise, cond = unet_inputs()
    objective = gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).sum())
    trajectory = gradest.rollout(
        model, sampler, noise, cond, generator=torch.Generator().manual_seed(3)
    )
    truth, truth_noise = exact_gradient(model, sampler, objective, trajectory, cond)
    result = gradest.estimator("exact").estimate(
        model, sampler, objective, trajectory=trajectory, cond=cond, noise_grad=True
    )
    assert relative_error(result.grads, truth) <= EXACTNESS
    assert relative_error(result.noise_grad, truth_noise) <= EXACTNESS


# -- 4. bad input ----------------------------------------------------------------------------


def test_bad_sampler_input_names_the_argument_and_the_fix():
    times = [1.0, 0.5, 0.0]
    with pytest.raises(
        ValueError, match=r"alphas_cumprod must have one entry per grid point.*got shape \(2,\)"
    ):
        DDIM(times=times, alphas_cumprod=[0.1, 0.5])
    with pytest.raises(
        ValueError,
        match=r"must increase along the grid.*alphas_cumprod\[0\]=0.5 > alphas_cumprod\[1\]=0.1",
    ):
        DDIM(times=times, alphas_cumprod=[0.5, 0.1, 1.0])
    with pytest.raises(ValueError, match=r"alphas_cumprod\[1\]=1 must lie in \(0, 1\)"):
        DDIM(times=times, alphas_cumprod=[0.5, 1.0, 1.0])
    with pytest.raises(
        ValueError, match=r"alphas_cumprod\[0\]=0 must lie in \(0, 1\).*use v_prediction"
    ):
        DDIM(times=times, alphas_cumprod=[0.0, 0.5, 1.0])
    DDIM(times=times, alphas_cumprod=[0.0, 0.5, 1.0], prediction="v_prediction")  # fine
    with pytest.raises(ValueError, match="eta must be a finite float >= 0, got -0.1"):
        DDIM(times=times, alphas_cumprod=[0.1, 0.5, 1.0], eta=-0.1)
    with pytest.raises(ValueError, match=r"eta=3 is too large for step 0.*use eta <= 1"):
        DDIM(times=times, alphas_cumprod=[0.1, 0.5, 0.6], eta=3)
    with pytest.raises(TypeError, match="eta must be a float"):
        DDIM(times=times, alphas_cumprod=[0.1, 0.5, 1.0], eta="1")
    with pytest.raises(
        ValueError,
        match="prediction must be one of 'epsilon', 'v_prediction', 'sample'.*got 'flow'",
    ):
        DDIM(times=times, alphas_cumprod=[0.1, 0.5, 1.0], prediction="flow")
    with pytest.raises(ValueError, match="times must be strictly decreasing"):
        DDIM(times=[0.0, 0.5, 1.0], alphas_cumprod=[0.1, 0.5, 1.0])
    assert repr(DDIM(times=times, alphas_cumprod=[0.1, 0.5, 1.0], eta=0.5)) == (
        "DDIM(steps=2, prediction='epsilon', eta=0.5)"
    )


def test_unsupported_scheduler_configurations_are_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"clip_sample=True clamps.*non-affine.*"
        r"DDIMScheduler.from_config\(scheduler.config, clip_sample=False\)",
    ):
        sampler_from_scheduler(diffusers.DDIMScheduler(), 4)  # clip_sample defaults to True
    with pytest.raises(ValueError, match="thresholding=True.*non-affine.*thresholding=False"):
        sampler_from_scheduler(make_scheduler("ddim", thresholding=True), 4)
    with pytest.raises(
        ValueError, match="variance_type='learned_range' is not supported.*fixed_small"
    ):
        sampler_from_scheduler(make_scheduler("ddpm", variance_type="learned_range"), 4)
    with pytest.raises(
        ValueError, match=r"eta=0.5 with a DDPMScheduler.*DDIMScheduler.from_config"
    ):
        sampler_from_scheduler(make_scheduler("ddpm"), 4, eta=0.5)
    with pytest.raises(ValueError, match=r"eta=0.5 is DDIM's noise ratio.*sde_noise_level="):
        sampler_from_scheduler(diffusers.FlowMatchEulerDiscreteScheduler(), 4, eta=0.5)
    with pytest.raises(
        TypeError,
        match="takes a diffusers FlowMatchEulerDiscreteScheduler.*DDIMScheduler or "
        "DDPMScheduler, got EulerDiscreteScheduler.*DDIMScheduler.from_config",
    ):
        sampler_from_scheduler(diffusers.EulerDiscreteScheduler(), 4)
    # trailing spacing with 3 steps: DDIM steps 666 -> 333 but calls the model at 332
    with pytest.raises(
        ValueError,
        match=r"step 1 from timestep 666 to 333 but the next model call is at timestep 332",
    ):
        sampler_from_scheduler(make_scheduler("ddim", timestep_spacing="trailing"), 3)
    # an epsilon model cannot step from zero terminal SNR
    with pytest.raises(ValueError, match=r"alphas_cumprod\[0\]=0 must lie in \(0, 1\)"):
        sampler_from_scheduler(
            make_scheduler("ddim", rescale_betas_zero_snr=True, timestep_spacing="trailing"), 4
        )
    with pytest.raises(ValueError, match="num_inference_steps must be an int >= 1"):
        sampler_from_scheduler(make_scheduler("ddim"), 0)
    sched = make_scheduler("ddim")
    sched.register_to_config(prediction_type="flow")
    with pytest.raises(ValueError, match="prediction_type='flow' is not supported"):
        sampler_from_scheduler(sched, 4)
    with pytest.raises(TypeError, match="for_sampler needs a sampler that records"):
        DiffusersVelocity.for_sampler(tiny_unet(), gradest.RectifiedFlow(steps=2))


def test_the_callers_scheduler_is_untouched():
    sched = make_scheduler("ddim")
    before = sched.timesteps.clone()
    sampler_from_scheduler(sched, 7)
    assert torch.equal(sched.timesteps, before) and sched.num_inference_steps is None


# -- 5. a UNet end to end in float32 ---------------------------------------------------------


def test_jagg_through_a_float32_unet_end_to_end():
    sampler = sampler_from_scheduler(make_scheduler("ddim"), 6)
    unet = tiny_unet(torch.float32)
    model = DiffusersVelocity.for_sampler(unet, sampler)
    noise, cond = unet_inputs(torch.float32)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).mean())
    est = gradest.estimator("jagg", window=3)
    start = time.perf_counter()
    sur = est.surrogate(model, sampler, objective, noise=noise, cond=cond)
    sur.loss.backward()
    result = est.estimate(model, sampler, objective, noise=noise, cond=cond)
    elapsed = time.perf_counter() - start
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(result.grads) == set(grads) and all(n.startswith("transformer.") for n in grads)
    # The surrogate's autograd gradient is the estimate (float32 round-off).
    assert relative_error(grads, result.grads) <= 1e-4
    assert float(result.flat().norm()) > 0 and torch.isfinite(result.flat()).all()
    assert elapsed < 30, f"{elapsed:.1f}s"
