"""``gradest.integrations.from_pipeline`` and the guidance wrappers, on tiny pipelines.

Tiny random SD3, Flux and SDXL pipelines built from configs (tests/tiny_pipelines.py,
nothing downloaded). Checked:

* Sampling: ``gradest.rollout(velocity, sampler, noise, cond=cond)`` from the helper's
  ``noise(generator)`` equals the pipeline's own ``output_type="latent"`` result for the
  same generator and steps (SD3 with CFG and a negative prompt, Flux with its guidance
  embedding and with true CFG, SDXL with CFG, nested ``added_cond_kwargs`` and
  ``guidance_rescale``; float32).
* Gradients: every built-in estimator (from the registry) differentiates through the
  batched CFG wrapper (SD3), CFG over SDXL's nested conditioning under DDIM and Flux's
  guidance embedding, giving the gradient it gives through a model that evaluates the two
  halves in separate calls (Flux: that takes ``guidance`` from the caller);
  ``exact`` equals a hand-written loop's ``loss.backward()`` (float64).
* ``ClassifierFreeGuidance(rescale=)`` is diffusers' ``rescale_noise_cfg``.
* Bad input at the boundary: one line naming the argument, the value and the fix.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import gradest  # noqa: E402
from gradest.integrations import (  # noqa: E402
    ClassifierFreeGuidance,
    EmbeddedGuidance,
    from_pipeline,
)
from gradest.integrations.guidance import NEGATIVE_PREFIX  # noqa: E402
from gradest.protocol import check_steps  # noqa: E402
from gradest.reference import relative_error  # noqa: E402
from gradest.registry import builtin_estimators  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:There are modules in .* that should be kept in float32"),
]

try:
    from tiny_pipelines import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sdxl_pipeline
except TypeError:  # pragma: no cover - transformers < 5 reads tokenizer files
    pytest.skip("needs transformers >= 5 to build tokenizers in memory", allow_module_level=True)

PROMPTS = ["a red cat", "blue sky"]
STEPS, SIDE = 3, 16
# float32: the same operations as the pipeline's loop, but DDIM's step is written another
# way (measured: 0 for SD3 and Flux, 3e-6 of 15 for SDXL).
FLOAT32 = 1e-5
# Two separate calls against one batched call: float64 round-off.
AGREEMENT = 1e-10
HANDWRITTEN = 1e-10

CASES = {
    "sd3 cfg, negative prompt": (tiny_sd3_pipeline, {"guidance_scale": 4.5,
                                                     "negative_prompt": "dark"}),
    "flux guidance embedding": (tiny_flux_pipeline, {"guidance_scale": 2.5}),
    "flux true cfg": (tiny_flux_pipeline, {"true_cfg_scale": 2.0, "negative_prompt": "dark"}),
    "sdxl cfg, rescale": (tiny_sdxl_pipeline, {"guidance_scale": 5.0, "guidance_rescale": 0.5,
                                               "negative_prompt": ["dark", "grey"]}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_helper_samples_what_the_pipeline_samples(case):
    build, options = CASES[case]
    pipe = build()
    parts = from_pipeline(pipe, PROMPTS, num_inference_steps=STEPS, height=SIDE, width=SIDE,
                          **options)  # fmt: skip
    velocity, sampler, cond = parts  # unpacks as the three
    noise = parts.noise(torch.Generator().manual_seed(0))
    assert tuple(noise.shape) == parts.latent_shape
    with torch.no_grad():
        ours = gradest.rollout(velocity, sampler, noise, cond=cond).states[-1]
        theirs = pipe(
            PROMPTS, num_inference_steps=STEPS, height=SIDE, width=SIDE, output_type="latent",
            generator=torch.Generator().manual_seed(0), **options,
        ).images  # fmt: skip
    assert ours.shape == theirs.shape
    assert float((ours - theirs).abs().max()) <= FLOAT32 * float(theirs.abs().max())
    assert parts.to_vae_latents(ours).shape[1] == pipe.vae.config.latent_channels


# -- gradients through the guidance ---------------------------------------------------------


class TwoCalls(nn.Module):
    """CFG written out: the unconditional and the conditional half in separate calls."""

    def __init__(self, model: nn.Module, scale: float):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, z, t, **cond):
        plain = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE_PREFIX)}
        uncond = dict(plain)
        uncond.update({k[len(NEGATIVE_PREFIX) :]: v for k, v in cond.items()
                       if k.startswith(NEGATIVE_PREFIX)})  # fmt: skip
        v_u, v_c = self.model(z, t, **uncond), self.model(z, t, **plain)
        return v_u + self.scale * (v_c - v_u)


MULTI_STEP = (
    "sdo:samples=2",
    "sdo:full_sum=true",
    "jagg:window=2",
    "draft_lv",
    "auto:candidates=(exact,sdo:samples=2,jagg:window=2),draws=2",
    "truncated:k=2",
)


def specs() -> list[str]:
    """Every registered estimator with its defaults (``auto``'s default probes would take
    minutes here: its small form stands in) and the stacked-call forms."""
    names = [n for n in sorted(builtin_estimators()) if n != "auto"]
    runnable = []
    for spec in dict.fromkeys([*names, *MULTI_STEP]):
        try:
            check_steps(gradest.estimator(spec), STEPS)
        except ValueError:
            continue
        runnable.append(spec)
    return runnable


class GuidanceInCond(nn.Module):
    """Flux's guidance embedding written out: ``cond['guidance']`` passed by the caller."""

    def __init__(self, model: nn.Module, scale: float):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, z, t, **cond):
        guidance = torch.full((z.shape[0],), self.scale, dtype=torch.float32)
        return self.model(z, t, **cond, guidance=guidance)


BUILD = {"sd3": tiny_sd3_pipeline, "sdxl": tiny_sdxl_pipeline, "flux": tiny_flux_pipeline}


def _float64_setup(family: str) -> dict:
    pipe = BUILD[family]().to(torch.float64)
    if family == "sdxl":
        # float64 tables, so that DDIMScheduler.step is float64-accurate (tests/test_ddim.py).
        pipe.scheduler.alphas_cumprod = pipe.scheduler.alphas_cumprod.to(torch.float64)
        pipe.scheduler.final_alpha_cumprod = pipe.scheduler.final_alpha_cumprod.to(torch.float64)
    scale = 3.0
    parts = from_pipeline(pipe, PROMPTS, num_inference_steps=STEPS, height=SIDE, width=SIDE,
                          guidance_scale=scale)  # fmt: skip
    wrapper = EmbeddedGuidance if family == "flux" else ClassifierFreeGuidance
    assert isinstance(parts.velocity, wrapper)
    written_out = (GuidanceInCond if family == "flux" else TwoCalls)(parts.velocity.model, scale)
    noise = parts.noise(torch.Generator().manual_seed(5), dtype=torch.float64)
    weights = torch.randn(noise.shape, generator=torch.Generator().manual_seed(6)).double()
    objective = gradest.TerminalObjective(
        lambda z: torch.sin(weights * z).pow(2).sum() + 0.1 * z.pow(2).sum()
    )
    return {"pipe": pipe, "parts": parts, "noise": noise, "objective": objective,
            "written_out": written_out, "scale": scale}  # fmt: skip


def _handwritten_gradient(family: str, setup: dict) -> torch.Tensor:
    """The pipeline's loop written out with autograd: two denoiser calls per step, the
    guidance formula, the scheduler's own ``step`` (Flux: one call with the guidance
    embedding's input, FluxPipeline's ``timestep / 1000``)."""
    pipe, parts, scale = setup["pipe"], setup["parts"], setup["scale"]
    cond = parts.cond
    denoiser = pipe.unet if family == "sdxl" else pipe.transformer
    if family == "flux":
        fixed = parts.velocity.model.fixed_kwargs
        guidance = torch.full((setup["noise"].shape[0],), scale, dtype=torch.float32)
        times, z = parts.sampler.times.tolist(), setup["noise"]
        for k in range(STEPS):
            timestep = torch.full((z.shape[0],), times[k], dtype=torch.float64)
            out = denoiser(hidden_states=z, timestep=timestep, guidance=guidance, **cond,
                           **fixed, return_dict=False)[0]  # fmt: skip
            z = z + (times[k + 1] - times[k]) * out
        denoiser.zero_grad(set_to_none=True)
        setup["objective"].loss_fn(z).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in denoiser.parameters() if p.grad is not None])
        denoiser.zero_grad(set_to_none=True)
        return grad
    scheduler = pipe.scheduler
    scheduler.set_timesteps(STEPS)
    z = setup["noise"]
    halves = {
        "cond": {k: v for k, v in cond.items() if not k.startswith(NEGATIVE_PREFIX)},
        "uncond": {
            k[len(NEGATIVE_PREFIX) :]: v for k, v in cond.items() if k.startswith(NEGATIVE_PREFIX)
        },  # fmt: skip
    }
    times = parts.sampler.times.tolist()
    for k, t in enumerate(scheduler.timesteps):
        if family == "sd3":
            timestep = torch.full((z.shape[0],), times[k] * 1000, dtype=torch.float64)
            calls = {name: denoiser(hidden_states=z, timestep=timestep, **kw,
                                    return_dict=False)[0]
                     for name, kw in halves.items()}  # fmt: skip
        else:
            calls = {name: denoiser(sample=z, timestep=t, **kw, return_dict=False)[0]
                     for name, kw in halves.items()}  # fmt: skip
        out = calls["uncond"] + scale * (calls["cond"] - calls["uncond"])
        if family == "sd3":
            # The Euler step on the scheduler's sigmas (its step() casts to float32).
            z = z + (times[k + 1] - times[k]) * out
        else:
            z = scheduler.step(out, t, z, eta=0.0).prev_sample
    denoiser.zero_grad(set_to_none=True)
    setup["objective"].loss_fn(z).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in denoiser.parameters() if p.grad is not None])
    denoiser.zero_grad(set_to_none=True)
    return grad


@pytest.fixture(scope="module", params=["sd3", "sdxl", "flux"])
def guided(request):
    setup = _float64_setup(request.param)
    setup["family"] = request.param
    setup["grad"] = _handwritten_gradient(request.param, setup)
    return setup


@pytest.mark.parametrize("spec", specs())
def test_every_estimator_differentiates_through_the_guidance(guided, spec):
    parts, noise, objective = guided["parts"], guided["noise"], guided["objective"]
    est = gradest.estimator(spec)
    got = est.estimate(parts.velocity, parts.sampler, objective, noise=noise, cond=parts.cond,
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    want = est.estimate(guided["written_out"], parts.sampler, objective, noise=noise,
                        cond=parts.cond, generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert torch.isfinite(got.flat()).all() and float(got.flat().norm()) > 0
    assert relative_error(got.flat(), want.flat()) <= AGREEMENT, spec
    if spec in ("exact", f"truncated:k={STEPS}"):
        assert relative_error(got.flat(), guided["grad"]) <= HANDWRITTEN


def test_the_surrogate_through_the_guidance_is_the_handwritten_gradient(guided):
    parts = guided["parts"]
    denoiser = parts.velocity.model
    denoiser.zero_grad(set_to_none=True)
    gradest.estimator("exact").surrogate(
        parts.velocity, parts.sampler, guided["objective"], noise=guided["noise"],
        cond=parts.cond,
    ).loss.backward()  # fmt: skip
    got = torch.cat([p.grad.reshape(-1) for p in denoiser.parameters() if p.grad is not None])
    denoiser.zero_grad(set_to_none=True)
    assert relative_error(got, guided["grad"]) <= HANDWRITTEN


# -- the wrappers -----------------------------------------------------------------------------


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, z, t, *, y, extra=None, guidance=None):
        out = z @ self.weight + y * t[:, None]
        if extra is not None:
            out = out + extra["a"]
        if guidance is not None:
            out = out * guidance[:, None]
        return out


def test_rescale_is_diffusers_rescale_noise_cfg():
    from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import (
        rescale_noise_cfg,
    )

    model = Linear()
    z, t = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    y, y_neg = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        v_c, v_u = model(z, t, y=y), model(z, t, y=y_neg)
        want = rescale_noise_cfg(v_u + 5 * (v_c - v_u), v_c, guidance_rescale=0.7)
        got = ClassifierFreeGuidance(model, 5, rescale=0.7)(z, t, y=y, negative_y=y_neg)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_nested_negatives_and_shared_values_are_doubled_by_the_one_rule():
    model = Linear()
    z, t = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    y, y_neg = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    a, a_neg = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    cond = {"y": y, "negative_y": y_neg, "extra": {"a": a}, "negative_extra": {"a": a_neg}}
    with torch.no_grad():
        got = ClassifierFreeGuidance(model, 2.0)(z, t, **cond)
        v_c = model(z, t, y=y, extra={"a": a})
        v_u = model(z, t, y=y_neg, extra={"a": a_neg})
        torch.testing.assert_close(got, v_u + 2.0 * (v_c - v_u), rtol=1e-12, atol=1e-12)
        # A shared nested value (no negative): the same rows in both halves.
        shared = ClassifierFreeGuidance(model, 2.0)(z, t, y=y, negative_y=y_neg, extra={"a": a})
        v_u = model(z, t, y=y_neg, extra={"a": a})
        torch.testing.assert_close(shared, v_u + 2.0 * (v_c - v_u), rtol=1e-12, atol=1e-12)
        embedded = EmbeddedGuidance(model, 3.5)(z, t, y=y)
        torch.testing.assert_close(embedded, model(z, t, y=y) * 3.5, rtol=0, atol=0)


def _one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_bad_input_is_one_line_naming_the_argument_and_the_fix():
    model = Linear()
    z, t = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    y = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as caught:
        ClassifierFreeGuidance(model, 4.0)(z, t, y=y)
    _one_line(caught, "scale=4", "no 'negative_*' key", "scale=1")
    with pytest.raises(ValueError) as caught:
        ClassifierFreeGuidance(model, 4.0)(z, t, y=y, negative_y=y[:1])
    _one_line(caught, "cond['negative_y']", "(1, 4)", "(3, 4)", "expand")
    with pytest.raises(ValueError) as caught:
        ClassifierFreeGuidance(model, 4.0)(
            z, t, y=y, negative_y=y, extra={"a": y}, negative_extra={"a": y, "b": y}
        )
    _one_line(caught, "cond['negative_extra'] has 2 tensors", "nesting")
    for bad in (-1.0, float("nan"), True, "4"):
        with pytest.raises(ValueError) as caught:
            ClassifierFreeGuidance(model, bad)
        _one_line(caught, f"scale={bad!r}", ">= 0")
    with pytest.raises(ValueError) as caught:
        ClassifierFreeGuidance(model, 2.0, rescale=1.5)
    _one_line(caught, "rescale=1.5", "[0, 1]")
    with pytest.raises(TypeError) as caught:
        ClassifierFreeGuidance(lambda z, t: z, 2.0)  # type: ignore[arg-type]
    _one_line(caught, "nn.Module", "DiffusersVelocity")
    with pytest.raises(ValueError) as caught:
        EmbeddedGuidance(model, 3.5)(z, t, y=y, guidance=torch.ones(3))
    _one_line(caught, "'guidance'", "once")


@pytest.fixture(scope="module")
def sd3_pipe():
    return tiny_sd3_pipeline()


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"guidance_scale": 1.0, "negative_prompt": "dark"},
         ["negative_prompt", "guidance_scale=1.0", "guidance_scale > 1"]),
        ({"guidance_scale": -2.0}, ["guidance_scale=-2.0", ">= 0"]),
        ({"negative_prompt": ["a", "b", "c"]}, ["negative_prompt has 3", "prompt has 2"]),
        ({"num_inference_steps": 0}, ["num_inference_steps=0", ">= 1"]),
        ({"height": 18}, ["height=18", "multiple of 4", "use 16"]),
        ({"eta": 0.5}, ["eta=0.5", "DDIM pipelines", "leave it unset"]),
        ({"true_cfg_scale": 3.0}, ["true_cfg_scale=3.0", "guidance_scale=3.0"]),
    ],
)  # fmt: skip
def test_bad_helper_arguments_are_one_line(sd3_pipe, options, fragments):
    with pytest.raises(ValueError) as caught:
        from_pipeline(sd3_pipe, PROMPTS, **options)
    _one_line(caught, *fragments)


def test_pipelines_and_schedulers_it_cannot_take_are_named():
    with pytest.raises(TypeError) as caught:
        from_pipeline(object(), PROMPTS)
    _one_line(caught, "pipe is a object", "StableDiffusion3Pipeline", "FluxPipeline",
              "StableDiffusionXLPipeline")  # fmt: skip
    with pytest.raises(ValueError) as caught:
        from_pipeline(tiny_sd3_pipeline(), [])
    _one_line(caught, "prompt must be", "non-empty list")
    pipe = tiny_sdxl_pipeline()
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    with pytest.raises(TypeError) as caught:
        from_pipeline(pipe, PROMPTS, height=SIDE, width=SIDE)
    _one_line(caught, "EulerDiscreteScheduler", "DDIMScheduler.from_config")
    schnell = tiny_flux_pipeline(guidance_embeds=False)
    with pytest.raises(ValueError) as caught:
        from_pipeline(schnell, PROMPTS, guidance_scale=3.5, height=SIDE, width=SIDE)
    _one_line(caught, "guidance_scale=3.5", "guidance_embeds=False", "leave guidance_scale unset")
    with pytest.raises(ValueError) as caught:
        from_pipeline(schnell, PROMPTS, negative_prompt="dark", height=SIDE, width=SIDE)
    _one_line(caught, "negative_prompt", "true_cfg_scale > 1")
