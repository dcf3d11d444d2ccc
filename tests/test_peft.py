"""LoRA (peft) on gradest's DiT: estimators differentiate exactly the adapter parameters.

The micro DiT (float64) gets seeded off-init base weights, then LoRA adapters on the
attention projections through ``gradest.integrations.peft.add_lora`` (peft's
``inject_adapter_in_model``), with the adapters' ``B`` matrices moved off zero so that
both ``A`` and ``B`` receive gradient. Every estimate must be keyed by the LoRA
parameters only and agree with the dense reference restricted to them.
"""

from __future__ import annotations

import pytest
import torch

import gradest
from gradest.models.dit import DiT
from gradest.objectives import TerminalObjective
from gradest.reference import definition_gradient, dense_chain, exact_gradient, relative_error
from gradest.testing.problems import random_stepwise_objective, seeded_normal

pytest.importorskip("peft")

from gradest.integrations.peft import (  # noqa: E402  (after the skip: needs peft)
    DIT_ATTENTION_TARGETS,
    add_lora,
    lora_parameters,
    lora_state_dict,
)

STEPS, BATCH, RANK = 3, 2, 2
EXACTNESS = 1e-10  # float64 round-off through a few hundred parameters is ~1e-15
EXPECTED_LORA = [
    f"blocks.{block}.attn.{layer}.lora_{part}.default.weight"
    for block in range(2)
    for layer in ("qkv", "proj")
    for part in ("A", "B")
]


def lora_dit(seed: int = 0) -> DiT:
    """Micro DiT, every base weight perturbed off adaLN-Zero (else the attention layers
    would not reach the output), LoRA rank 2 on qkv/proj with ``B`` perturbed off zero."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiT.from_config("micro").to(torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        add_lora(model, RANK)
    with torch.no_grad():
        for name, param in lora_parameters(model).items():
            if ".lora_B." in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    return model


def terminal_objective(shape) -> TerminalObjective:
    weights = seeded_normal(shape, 1)
    return TerminalObjective(lambda z: torch.sin(weights * z).pow(2).sum() + 0.1 * z.pow(2).sum())


@pytest.fixture(scope="module")
def problem():
    model = lora_dit()
    noise = seeded_normal((BATCH, 1, 4, 4), 11)
    cond = {"y": torch.tensor([1, model.num_classes])}  # one class label, one null label
    flow = gradest.RectifiedFlow(steps=STEPS)
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    chain = dense_chain(model, flow, trajectory, cond)
    objectives = {
        "terminal": terminal_objective(tuple(noise.shape)),
        "stepwise": random_stepwise_objective(STEPS, tuple(noise.shape)),
    }
    return model, noise, cond, flow, trajectory, chain, objectives


def test_peft_freezes_the_base_and_trains_the_adapters_only():
    model = lora_dit()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == EXPECTED_LORA
    assert list(lora_parameters(model)) == EXPECTED_LORA
    assert "blocks.0.attn.qkv.base_layer.weight" in dict(model.named_parameters())
    # A rank-2 adapter on an 8 -> 24 qkv: A is 2 x 8, B is 24 x 2.
    shapes = {n: tuple(p.shape) for n, p in lora_parameters(model).items()}
    assert shapes["blocks.0.attn.qkv.lora_A.default.weight"] == (RANK, 8)
    assert shapes["blocks.0.attn.qkv.lora_B.default.weight"] == (24, RANK)


def test_fresh_adapters_leave_the_model_unchanged():
    # B = 0 at injection: the LoRA model computes exactly the base model's velocity.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = DiT.from_config("micro").to(torch.float64)
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.3 * torch.randn(param.shape, dtype=torch.float64))
    reference = {n: p.clone() for n, p in base.state_dict().items()}
    x, y = seeded_normal((2, 1, 4, 4), 3), torch.tensor([0, 2])
    t = torch.tensor([0.9, 0.2], dtype=torch.float64)
    before = base(x, t, y=y)
    add_lora(base, RANK)
    assert torch.equal(base(x, t, y=y), before)
    assert torch.equal(
        base.state_dict()["blocks.1.attn.proj.base_layer.weight"],
        reference["blocks.1.attn.proj.weight"],
    )


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("source", ["noise", "trajectory"])
def test_exact_matches_the_dense_reference_on_the_lora_subset(problem, kind, source):
    model, noise, cond, flow, trajectory, chain, objectives = problem
    objective = objectives[kind]
    truth, _ = exact_gradient(model, flow, objective, trajectory, cond, chain=chain)
    assert list(truth) == EXPECTED_LORA
    assert all(truth[name].abs().max() > 0 for name in EXPECTED_LORA)  # A and B both move
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    result = gradest.estimator("exact").estimate(model, flow, objective, cond=cond, **inputs)
    assert list(result.grads) == EXPECTED_LORA
    assert relative_error(result.grads, truth) <= EXACTNESS


@pytest.mark.parametrize("name", ["jagg", "sdo", "truncated"])
def test_approximate_estimators_match_their_definitions_on_the_lora_subset(problem, name):
    model, _, cond, flow, trajectory, chain, objectives = problem
    est = gradest.estimator(name)
    for kind, objective in objectives.items():
        result = est.estimate(
            model,
            flow,
            objective,
            trajectory=trajectory,
            cond=cond,
            generator=torch.Generator().manual_seed(4),
        )
        assert list(result.grads) == EXPECTED_LORA
        definition = definition_gradient(est, chain, objective, result)
        assert definition is not None
        assert relative_error(result.grads, chain.unflatten(definition)) <= EXACTNESS, kind


def test_surrogate_backward_and_an_optimizer_step_touch_the_adapters_only(problem):
    model, noise, cond, flow, _, _, objectives = problem
    model = lora_dit()  # a private copy: this test changes weights
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = lora_state_dict(model)
    optimizer = torch.optim.SGD(lora_parameters(model).values(), lr=0.1)
    gradest.estimator("sdo").surrogate(
        model,
        flow,
        objectives["terminal"],
        noise=noise,
        cond=cond,
        generator=torch.Generator().manual_seed(0),
    ).loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(p.grad is not None for p in lora_parameters(model).values())
    optimizer.step()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    assert any(not torch.equal(p, adapters[n]) for n, p in lora_parameters(model).items())
    # The adapter checkpoint round-trips onto a fresh LoRA model.
    restored = lora_dit(seed=0)
    missing, unexpected = restored.load_state_dict(lora_state_dict(model), strict=False)
    assert not unexpected and all("lora_" not in key for key in missing)
    for name, param in lora_parameters(restored).items():
        assert torch.equal(param, lora_parameters(model)[name])


def test_a_lora_model_with_nothing_trainable_gets_gradests_error(problem):
    _, noise, cond, flow, _, _, objectives = problem
    model = lora_dit()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        gradest.estimator("exact").estimate(
            model, flow, objectives["terminal"], noise=noise, cond=cond
        )


def test_add_lora_rejects_bad_settings():
    model = DiT.from_config("micro")
    with pytest.raises(ValueError, match="LoRA rank must be an int >= 1, got rank=0"):
        add_lora(model, 0)
    with pytest.raises(ValueError, match=r"matches target_modules=\['to_q'\].*blocks.0.attn.qkv"):
        add_lora(model, 2, target_modules=["to_q"])
    with pytest.raises(ValueError, match="alpha must be a number > 0"):
        add_lora(model, 2, alpha=-1.0)
    with pytest.raises(ValueError, match="LoRA init must be one of 'default', 'gaussian'"):
        add_lora(model, 2, init="uniform")
    # Nothing was injected by the failed calls.
    assert not lora_parameters(model)
    assert DIT_ATTENTION_TARGETS == ("qkv", "proj")


def test_gaussian_init_draws_a_from_n_0_one_over_rank():
    """peft's ``init_lora_weights="gaussian"`` (Flow-GRPO's): ``A ~ N(0, (1/r)^2)``, ``B = 0``;
    the default is Kaiming-uniform, std ``1 / sqrt(3 in)``. The sample std of ``n`` normal
    draws has relative standard error about ``1 / sqrt(2n)``; 5 of them bound it."""
    rank, width = 4, 64
    stds = {}
    for init in ("default", "gaussian"):
        torch.manual_seed(0)
        model = add_lora(torch.nn.Sequential(torch.nn.Linear(width, width)), rank,
                         target_modules=["0"], init=init)  # fmt: skip
        lora = lora_parameters(model)
        a = next(v for k, v in lora.items() if "lora_A" in k)
        b = next(v for k, v in lora.items() if "lora_B" in k)
        assert torch.count_nonzero(b) == 0
        stds[init] = (float(a.detach().std()), a.numel())
    for init, want in (("gaussian", 1 / rank), ("default", 1 / (3 * width) ** 0.5)):
        std, n = stds[init]
        assert abs(std / want - 1) < 5 / (2 * n) ** 0.5, (init, std, want)


# torch's note that sdpa's CPU backward has no vmap rule (the dense reference's jacrev).
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_lora_on_a_diffusers_transformer():
    diffusers = pytest.importorskip("diffusers")
    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = (
            diffusers.SD3Transformer2DModel(
                sample_size=4,
                patch_size=2,
                in_channels=2,
                out_channels=2,
                num_layers=1,
                attention_head_dim=4,
                num_attention_heads=2,
                joint_attention_dim=6,
                caption_projection_dim=8,
                pooled_projection_dim=5,
                pos_embed_max_size=4,
            )
            .to(torch.float64)
            .eval()
        )
        add_lora(transformer, RANK, target_modules=("to_q", "to_k", "to_v", "to_out.0"))
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in lora_parameters(transformer).items():
            if ".lora_B." in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    velocity = DiffusersVelocity(transformer)
    flow = sampler_from_scheduler(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), STEPS)
    noise = seeded_normal((BATCH, 2, 4, 4), 11)
    cond = {
        "encoder_hidden_states": seeded_normal((BATCH, 3, 6), 12),
        "pooled_projections": seeded_normal((BATCH, 5), 13),
    }
    objective = terminal_objective(tuple(noise.shape))
    trajectory = gradest.rollout(velocity, flow, noise, cond)
    truth, _ = exact_gradient(velocity, flow, objective, trajectory, cond)
    result = gradest.estimator("exact").estimate(velocity, flow, objective, noise=noise, cond=cond)
    expected = ["transformer." + n for n in lora_parameters(transformer)]
    assert list(result.grads) == expected and len(expected) == 8  # 4 layers x (A, B)
    assert relative_error(result.grads, truth) <= EXACTNESS


@pytest.mark.parametrize("spec", ["exact", "exact:checkpoint=true", "jagg:window=2", "sdo"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_surrogate_backward_fills_the_adapters_grad_only(problem, spec, kind):
    """``surrogate(...).loss.backward()`` on a LoRA model: ``.grad`` on the adapters equals
    the estimate; the frozen base layers get none."""
    _, noise, cond, flow, trajectory, _, objectives = problem
    model = lora_dit()  # a fresh copy: this test writes .grad
    inputs = {"noise": noise} if kind == "terminal" else {"trajectory": trajectory}
    est = gradest.estimator(spec)
    want = est.estimate(
        model,
        flow,
        objectives[kind],
        cond=cond,
        generator=torch.Generator().manual_seed(0),
        **inputs,
    )
    est.surrogate(
        model,
        flow,
        objectives[kind],
        cond=cond,
        generator=torch.Generator().manual_seed(0),
        **inputs,
    ).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert list(grads) == EXPECTED_LORA
    assert relative_error(grads, want.grads) <= EXACTNESS
