"""Setups that used to run silently with wrong numbers, refused in one line instead.

* A flow-matching transformer (SD3, Flux) under a diffusion sampler (``DDIM``): the
  sampler would read the velocity as an epsilon / v prediction. Refused through every
  wrapper (``ClassifierFreeGuidance``, ``EmbeddedGuidance``), naming the sampler to use.
* Classifier-free guidance whose negative keys do not mirror the prompt keys the model
  takes (``negative_encoder_hidden_states`` without ``negative_pooled_projections``): the
  unconditional half would use the prompt's pooled embedding. The missing key is named.
* A conditioning tensor without one row per sample under CFG: the tensor that is wrong is
  named (it used to be blamed on the negative value, with the wrong fix).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")

from diffusers_support import tiny_sdxl_unet, tiny_transformer  # noqa: E402

import gradest  # noqa: E402
from gradest.integrations import (  # noqa: E402
    ClassifierFreeGuidance,
    DiffusersVelocity,
    EmbeddedGuidance,
    sampler_from_scheduler,
)

BATCH, STEPS = 2, 3


def ddim_sampler() -> gradest.DDIM:
    sampler = sampler_from_scheduler(
        diffusers.DDIMScheduler(num_train_timesteps=1000, clip_sample=False), STEPS
    )
    assert isinstance(sampler, gradest.DDIM)
    return sampler


def sd3_cond(negative_pooled: bool = True, rows: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cond = {
        "encoder_hidden_states": torch.randn(rows, 3, 6, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
        "negative_encoder_hidden_states": torch.randn(
            BATCH, 3, 6, generator=g, dtype=torch.float64
        ),
    }
    if negative_pooled:
        cond["negative_pooled_projections"] = torch.zeros(BATCH, 5, dtype=torch.float64)
    return cond


def sd3_noise() -> torch.Tensor:
    return torch.randn(BATCH, 2, 4, 4, generator=torch.Generator().manual_seed(1)).double()


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- a flow-matching model under a diffusion sampler ------------------------------------------


def _flow_models() -> dict[str, nn.Module]:
    sd3 = DiffusersVelocity(tiny_transformer("sd3"))
    return {
        "sd3": sd3,
        "sd3 under for_sampler": DiffusersVelocity.for_sampler(
            tiny_transformer("sd3"), ddim_sampler()
        ),
        "sd3 under CFG": ClassifierFreeGuidance(sd3, 4.5),
        "flux-dev under embedded guidance and CFG": ClassifierFreeGuidance(
            EmbeddedGuidance(
                DiffusersVelocity(tiny_transformer("flux", guidance_embeds=True)), 3.5
            ),
            2.0,
        ),
    }


@pytest.mark.parametrize("name", list(_flow_models()))
def test_a_flow_matching_transformer_under_ddim_is_refused(name):
    model = _flow_models()[name]
    with pytest.raises(gradest.InvalidValue) as caught:
        gradest.rollout(model, ddim_sampler(), torch.zeros(1))
    one_line(
        caught,
        "is a flow-matching model",
        "DDIM",
        "'epsilon' prediction",
        "sampler_from_scheduler(FlowMatchEulerDiscreteScheduler(",
        "gradest.RectifiedFlow",
    )


def test_the_refusal_comes_before_any_model_call_in_estimate_and_surrogate():
    calls = []
    transformer = tiny_transformer("sd3")
    transformer.register_forward_hook(lambda *args: calls.append(1))
    model = ClassifierFreeGuidance(DiffusersVelocity(transformer), 4.5)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).sum())
    for verb in ("estimate", "surrogate"):
        with pytest.raises(gradest.InvalidValue, match="flow-matching"):
            getattr(gradest.estimator("exact"), verb)(
                model, ddim_sampler(), objective, noise=sd3_noise(), cond=sd3_cond()
            )
    assert calls == []


def test_the_samplers_a_model_is_made_for_still_run():
    # SD3 on its flow-matching grid, and a DDPM-family DiT (also trained as a flow by some:
    # not refused under either) on DDIM.
    flow = sampler_from_scheduler(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), STEPS)
    model = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 4.5)
    path = gradest.rollout(model, flow, sd3_noise(), cond=sd3_cond())
    assert torch.isfinite(path.states).all()
    dit = tiny_transformer("dit")
    sampler = ddim_sampler()
    labels = torch.tensor([0, 1])
    path = gradest.rollout(
        DiffusersVelocity.for_sampler(dit, sampler),
        sampler,
        torch.randn(BATCH, 2, 4, 4, dtype=torch.float64),
        cond={"class_labels": labels},
    )
    assert torch.isfinite(path.states).all()


# -- CFG's negative keys mirror the prompt keys -----------------------------------------------


def test_the_prompt_keys_are_what_the_model_takes_from_the_prompt():
    assert DiffusersVelocity(tiny_transformer("sd3")).prompt_keys == (
        "encoder_hidden_states",
        "pooled_projections",
    )
    assert DiffusersVelocity(tiny_transformer("dit")).prompt_keys == ("class_labels",)
    unet = DiffusersVelocity(tiny_sdxl_unet(pooled=4))
    assert unet.prompt_keys == ("encoder_hidden_states", "added_cond_kwargs")
    # Given once for every call in fixed_kwargs: not from the prompt.
    fixed = DiffusersVelocity(
        tiny_transformer("sd3"), fixed_kwargs={"pooled_projections": torch.zeros(1, 5)}
    )
    assert fixed.prompt_keys == ("encoder_hidden_states",)
    # The wrappers pass their model's on.
    wrapped = ClassifierFreeGuidance(
        EmbeddedGuidance(DiffusersVelocity(tiny_transformer("sd3")), 2.0), 3.0
    )
    assert wrapped.prompt_keys == ("encoder_hidden_states", "pooled_projections")


def test_a_missing_negative_pooled_projection_is_named():
    model = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 4.5)
    z, t = sd3_noise(), torch.full((BATCH,), 0.5, dtype=torch.float64)
    with pytest.raises(gradest.InvalidValue) as caught:
        model(z, t, **sd3_cond(negative_pooled=False))
    one_line(
        caught,
        "cond has 'pooled_projections' but no 'negative_pooled_projections'",
        "unconditional half would use the conditional prompt's",
        "pass cond['negative_pooled_projections']",
        "'negative_encoder_hidden_states'",
    )
    # Mirrored, the same call runs; and scale 1 needs no negative values at all.
    assert model(z, t, **sd3_cond()).shape == z.shape
    unguided = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 1.0)
    assert unguided(z, t, **sd3_cond(negative_pooled=False)).shape == z.shape


def test_a_missing_negative_is_refused_through_an_estimate_too():
    model = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 4.5)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).sum())
    with pytest.raises(gradest.InvalidValue, match="no 'negative_pooled_projections'"):
        gradest.estimator("sdo:samples=2").estimate(
            model, flow, objective, noise=sd3_noise(), cond=sd3_cond(negative_pooled=False)
        )


class Linear(nn.Module):
    """A model that does not say which keys carry its prompt."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4, dtype=torch.float64))

    def forward(self, z, t, y, extra=None):
        out = z @ self.weight + y
        return out if extra is None else out + extra


def test_a_model_that_names_no_prompt_keys_shares_its_other_keys():
    """The documented rule for other models: keys without a negative are shared."""
    z, t = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    y, extra = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    guided = ClassifierFreeGuidance(Linear(), 2.0)(z, t, y=y, negative_y=0 * y, extra=extra)
    v_cond, v_uncond = z + y + extra, z + extra
    assert torch.allclose(guided, v_uncond + 2.0 * (v_cond - v_uncond))


# -- the wrong number of rows names the tensor that is wrong -----------------------------------


def test_a_prompt_encoding_without_a_row_per_sample_is_named_not_the_negative():
    model = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 4.5)
    z, t = sd3_noise(), torch.full((BATCH,), 0.5, dtype=torch.float64)
    with pytest.raises(gradest.InvalidValue) as caught:
        model(z, t, **sd3_cond(rows=1))
    message = one_line(
        caught,
        "cond['encoder_hidden_states'] has 1 row (shape (1, 3, 6))",
        f"called on {BATCH}",
        "cond['negative_encoder_hidden_states'] of shape (2, 3, 6)",
        "pass cond['encoder_hidden_states'] with one row per sample",
    )
    assert "negative_encoder_hidden_states'] has" not in message


def test_in_stacked_calls_the_wrong_tensor_is_still_named():
    model = ClassifierFreeGuidance(DiffusersVelocity(tiny_transformer("sd3")), 4.5)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = gradest.TerminalObjective(lambda z: z.pow(2).sum())
    with pytest.raises(gradest.InvalidValue) as caught:
        gradest.estimator("sdo:samples=2").estimate(
            model, flow, objective, noise=sd3_noise(), cond=sd3_cond(rows=1)
        )
    one_line(caught, "cond['encoder_hidden_states'] has 1 row")


def test_negative_values_of_the_wrong_width_name_both_shapes():
    model = ClassifierFreeGuidance(Linear(), 2.0)
    z, t = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    y = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(gradest.InvalidValue) as caught:
        model(z, t, y=y, negative_y=torch.zeros(3, 5, dtype=torch.float64))
    one_line(caught, "cond['negative_y'] has a tensor of shape (3, 5)", "(3, 4)", "same")
    with pytest.raises(gradest.InvalidValue) as caught:
        model(z, t, y=y[:2], negative_y=y[:1])
    one_line(caught, "cond['y'] (shape (2, 4)) and cond['negative_y'] (shape (1, 4))", "3 in")


# -- the unconditional half detached (Flow-GRPO's training) ------------------------------------


def test_detaching_the_unconditional_half_keeps_the_value_and_drops_its_gradient():
    """``v = sg(v_u) + w (v_c - sg(v_u))``: the same velocity; its parameter VJP is
    ``w J_c^T G``, the conditional branch's alone, where the plain guidance adds the
    unconditional branch's with weight ``1 - w``."""
    scale = 4.5
    transformer = DiffusersVelocity(tiny_transformer("sd3"))
    z, t = sd3_noise(), torch.full((BATCH,), 0.4, dtype=torch.float64)
    cond = sd3_cond()
    plain = {k: v for k, v in cond.items() if not k.startswith("negative_")}
    params = [p for p in transformer.parameters() if p.requires_grad]
    cotangent = torch.randn(z.shape, generator=torch.Generator().manual_seed(2)).double()

    def vjp(v: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad((v * cotangent).sum(), params, allow_unused=True)
        return torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1)
                for p, g in zip(params, grads, strict=True)
            ]
        )

    detached = ClassifierFreeGuidance(transformer, scale, detach_unconditional=True)
    guided = ClassifierFreeGuidance(transformer, scale)
    assert torch.equal(detached(z, t, **cond), guided(z, t, **cond))
    want = scale * vjp(transformer(z, t, **plain))
    got = vjp(detached(z, t, **cond))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # Guards the test: the plain guidance's gradient is another one.
    assert not torch.allclose(vjp(guided(z, t, **cond)), want, rtol=1e-3)
    assert "detach_unconditional=True" in repr(detached)


def test_an_estimate_through_the_detached_guidance_is_a_flow_grpo_hand_loop():
    """exact's stepwise gradient on a recorded path equals the loop Flow-GRPO's
    ``compute_log_prob`` writes: one call on ``[uncond; cond]``, ``noise_pred_uncond
    .detach()``, the guided velocity, a loss per step, ``backward``."""
    scale = 4.5
    transformer = DiffusersVelocity(tiny_transformer("sd3"))
    model = ClassifierFreeGuidance(transformer, scale, detach_unconditional=True)
    flow = gradest.RectifiedFlow(steps=STEPS)
    cond = sd3_cond()
    path = gradest.rollout(model, flow, sd3_noise(), cond=cond)
    targets = torch.randn(path.velocities.shape, generator=torch.Generator().manual_seed(3))

    def loss_fn(k, v, trajectory):
        return (v - targets[k].double()).pow(2).sum()

    objective = gradest.StepwiseObjective(loss_fn)
    got = (
        gradest.estimator("exact")
        .estimate(model, flow, objective, trajectory=path, cond=cond)
        .grads
    )
    params = dict(model.named_parameters())
    total = 0.0
    for k in range(STEPS):
        t = torch.full((BATCH,), float(flow.times[k]), dtype=torch.float64)
        out = transformer(
            torch.cat([path.states[k]] * 2),
            torch.cat([t, t]),
            encoder_hidden_states=torch.cat(
                [cond["negative_encoder_hidden_states"], cond["encoder_hidden_states"]]
            ),
            pooled_projections=torch.cat(
                [cond["negative_pooled_projections"], cond["pooled_projections"]]
            ),
        )
        noise_pred_uncond, noise_pred_text = out.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()
        v = noise_pred_uncond + scale * (noise_pred_text - noise_pred_uncond)
        total = total + loss_fn(k, v, path)
    want = dict(zip(params, torch.autograd.grad(total, list(params.values())), strict=True))
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-9, atol=1e-12)


def test_detach_unconditional_must_be_a_bool():
    with pytest.raises(gradest.InvalidType) as caught:
        ClassifierFreeGuidance(Linear(), 2.0, detach_unconditional="yes")
    one_line(caught, "detach_unconditional must be True or False", "'yes'")
