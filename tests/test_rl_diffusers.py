"""RL on diffusers models, and the value of stepwise objectives.

* ``sampler_from_scheduler(..., sde_noise_level=a)`` takes the scheduler's sigma grid (with
  ``shift``) and its steps are Flow-GRPO's ``sde_step_with_logprob`` on those sigmas.
* ``adapters_disabled`` switches LoRA adapters off and back on for a diffusers model, a
  peft ``PeftModel``, a model from ``add_lora``, and any of them inside
  ``DiffusersVelocity`` / ``DataParallel``; it refuses, in one line, a model without.
* ``value`` of a stepwise objective is the full sum over all steps, the same for every
  estimator on the same trajectory; ``info["evaluated_value"]`` is the evaluated part.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradest  # noqa: E402
from gradest.errors import InvalidValue  # noqa: E402
from gradest.models import MLPVelocity  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There are modules:UserWarning")


def test_flow_sde_from_scheduler_is_flow_grpos_step():
    diffusers = pytest.importorskip("diffusers")
    from gradest.integrations.diffusers import sampler_from_scheduler

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow = sampler_from_scheduler(scheduler, 6, sde_noise_level=0.7)
    assert isinstance(flow, gradest.FlowSDE) and flow.noise_level == 0.7
    assert torch.equal(flow.times, sampler_from_scheduler(scheduler, 6).times)
    sigmas = copy.deepcopy(scheduler)
    sigmas.set_timesteps(6)
    sigmas = sigmas.sigmas.double()
    assert torch.allclose(flow.times, sigmas)
    alpha, beta, scale = flow.coefficients()
    for k in range(6):  # Flow-GRPO's sde_step_with_logprob, written out
        sigma, sigma_next, sigma_max = sigmas[k], sigmas[k + 1], sigmas[1]
        dt = sigma_next - sigma
        std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * 0.7
        assert torch.allclose(alpha[k], 1 + std**2 / (2 * sigma) * dt)
        assert torch.allclose(beta[k], (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt)
        assert torch.allclose(scale[k], std * torch.sqrt(-dt))
    with pytest.raises(ValueError, match="sde_noise_level=0.7 is Flow-GRPO's SDE"):
        sampler_from_scheduler(diffusers.DDIMScheduler(clip_sample=False), 6, sde_noise_level=0.7)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False)


def _check_toggle(wrapper, call, adapters):
    from gradest.integrations import adapters_disabled

    flags = {id(p): p.requires_grad for p in adapters}
    with_adapters = call()
    with adapters_disabled(wrapper):
        without = call()
    assert not torch.allclose(with_adapters, without)
    assert torch.equal(call(), with_adapters)  # back on
    assert {id(p): p.requires_grad for p in adapters} == flags  # trainability kept
    return without


def test_adapters_disabled_diffusers_model():
    pytest.importorskip("peft")
    from diffusers_support import tiny_transformer

    from gradest.integrations import DiffusersVelocity

    base = tiny_transformer("sd3", dtype=torch.float32)
    adapted = copy.deepcopy(base)
    adapted.add_adapter(_lora_config())  # diffusers' PeftAdapterMixin
    z, t = torch.randn(2, 2, 4, 4), torch.full((2,), 0.5)
    cond = {"encoder_hidden_states": torch.randn(2, 3, 6), "pooled_projections": torch.randn(2, 5)}
    adapters = [p for n, p in adapted.named_parameters() if "lora_" in n]
    want = DiffusersVelocity(base)(z, t, **cond)
    for wrapper in (
        adapted,
        DiffusersVelocity(adapted),
        DiffusersVelocity(torch.nn.DataParallel(adapted)),
    ):
        model = wrapper if isinstance(wrapper, DiffusersVelocity) else DiffusersVelocity(adapted)
        without = _check_toggle(wrapper, lambda m=model: m(z, t, **cond), adapters)
        assert torch.allclose(without, want, atol=1e-6)


def test_adapters_disabled_peft_model_and_add_lora():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from gradest.integrations.peft import adapters_disabled, add_lora

    torch.manual_seed(0)
    base = MLPVelocity(dim=2, hidden=8)
    names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)][:2]
    z, t = torch.randn(3, 2), torch.full((3,), 0.5)
    want = base(z, t)

    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, target_modules=names, init_lora_weights=False)
    )
    adapters = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    without = _check_toggle(peft_model, lambda: peft_model(z, t), adapters)
    assert torch.allclose(without, want)

    injected = add_lora(copy.deepcopy(base), rank=2, target_modules=names)
    with torch.no_grad():
        for n, p in injected.named_parameters():
            if "lora_B" in n:
                p.normal_()
    adapters = [p for n, p in injected.named_parameters() if "lora_" in n]
    without = _check_toggle(injected, lambda: injected(z, t), adapters)
    assert torch.allclose(without, want)

    # As the frozen reference of Flow-GRPO's KL, without a copy.
    flow = gradest.FlowSDE(steps=3)
    traj = gradest.rollout(
        injected, flow, torch.randn(4, 2), generator=torch.Generator().manual_seed(0)
    )
    with adapters_disabled(injected):
        reference = gradest.rl.reference_velocities(injected, flow, traj)
    assert torch.allclose(reference, gradest.rl.reference_velocities(base, flow, traj))

    with pytest.raises(InvalidValue, match="no LoRA adapters") as err:
        with adapters_disabled(base):
            pass
    assert "\n" not in str(err.value)


def test_stepwise_value_is_the_full_objective_for_every_estimator():
    torch.manual_seed(0)
    model = MLPVelocity(dim=2, hidden=16).double()
    flow = gradest.FlowSDE(steps=6, noise_level=0.7)
    traj = gradest.rollout(
        model,
        flow,
        torch.randn(8, 2, dtype=torch.float64),
        generator=torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        old = flow.trajectory_log_probs(traj)
    advantages = gradest.rl.group_advantages(-(traj.states[-1] ** 2).sum(-1), group_size=4)
    reference = 0.9 * traj.velocities  # a KL term: the loss is not 0 at the old policy
    objective = gradest.rl.grpo_objective(
        flow, traj, old, advantages, clip=0.2, kl_weight=0.1, reference=reference
    )
    full = sum(float(objective.loss_fn(k, traj.velocities[k], traj)) for k in range(flow.num_steps))
    values, evaluated = {}, {}
    for name in ("exact", "sdo", "sdo:samples=2", "jagg:window=2", "truncated:k=2", "telescope"):
        est = gradest.estimator(name)
        for verb in ("estimate", "surrogate"):
            result = getattr(est, verb)(
                model, flow, objective, trajectory=traj, generator=torch.Generator().manual_seed(2)
            )
            values[name, verb] = result.value
            evaluated[name, verb] = result.info["evaluated_value"]
    for key, value in values.items():
        assert value == pytest.approx(full, rel=1e-9, abs=1e-12), key
    assert evaluated["exact", "estimate"] == pytest.approx(full, rel=1e-9, abs=1e-12)
    assert full != 0.0
    assert evaluated["sdo", "estimate"] != pytest.approx(full, rel=1e-6)  # one step only
    # From noise (the estimator samples the path itself) the value is the same sum.
    noise = torch.randn(8, 2, dtype=torch.float64)
    fm_objective = gradest.flow_matching_objective(torch.zeros(8, 2, dtype=torch.float64), noise)
    got = {
        name: gradest.estimator(name)
        .estimate(
            model, flow, fm_objective, noise=noise, generator=torch.Generator().manual_seed(3)
        )
        .value
        for name in ("exact", "sdo", "jagg:window=2")
    }
    assert got["sdo"] == pytest.approx(got["exact"], rel=1e-9)
    assert got["jagg:window=2"] == pytest.approx(got["exact"], rel=1e-9)
