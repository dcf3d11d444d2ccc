"""The adaLN-Zero DiT: shapes, identity at init, parameter counts, and every estimator on it.

Gradient checks run on the "micro" DiT (about 2.4K parameters) in float64 against the
dense-Jacobian reference; at initialisation adaLN-Zero makes the output exactly zero (and
most gradients zero), so those checks use a seeded perturbation of every parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor
from torch.func import functional_call, jacrev, vjp, vmap

import gradest
from gradest.models.dit import (
    DIT_CONFIGS,
    DiT,
    DiTConfig,
    dit_parameter_count,
    sincos_position_embedding,
)
from gradest.objectives import TerminalObjective
from gradest.reference import dense_chain, exact_gradient, relative_error
from gradest.testing.problems import random_stepwise_objective, seeded_normal

BATCH, STEPS = 2, 4
EXACTNESS = 1e-10  # float64 round-off through a few thousand parameters is ~1e-15


def perturbed_dit(name: str, seed: int = 0, scale: float = 0.3, dtype=torch.float64, **overrides):
    """A seeded DiT with every parameter moved off its adaLN-Zero init, so that every
    block, gate and the final layer contribute to the output and to the gradient."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiT.from_config(name, **overrides).to(torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    return model.to(dtype)


def image_batch(
    config: DiTConfig, batch: int = BATCH, seed: int = 5, dtype=torch.float64
) -> Tensor:
    shape = (batch, config.in_channels, config.input_size, config.input_size)
    return seeded_normal(shape, seed, dtype)


def terminal_objective(state_shape: tuple[int, ...], seed: int = 1) -> TerminalObjective:
    """``sum sin(w * z)^2 + 0.1 |z|^2``: smooth, non-quadratic, every pixel weighted differently."""
    weights = seeded_normal(state_shape, seed)

    def loss_fn(z: Tensor) -> Tensor:
        return torch.sin(weights.to(z.dtype) * z).pow(2).sum() + 0.1 * z.pow(2).sum()

    return TerminalObjective(loss_fn)


def require_estimator(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # sibling strategies may be half-written
        available = gradest.available_estimators()
    if name not in available:
        pytest.skip(f"estimator {name!r} is not registered yet")


# -- 1. shapes and conditioning ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("micro", {}),
        ("tiny", {}),
        ("tiny", {"num_classes": None}),
        ("tiny", {"in_channels": 3, "patch_size": 4}),
        ("digits", {}),  # 28x28x1, 49 tokens
        ("digits", {"input_size": 8, "patch_size": 2}),  # sklearn 8x8 digits
    ],
)
def test_output_has_the_input_shape(name, overrides):
    model = perturbed_dit(name, **overrides)
    x = image_batch(model.config, batch=3)
    t = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    assert model(x, t).shape == x.shape
    if model.num_classes is not None:
        labels = torch.tensor([0, model.num_classes - 1, model.num_classes])
        assert model(x, t, labels).shape == x.shape


def test_null_class_is_the_unconditional_label():
    model = perturbed_dit("tiny")
    x, t = image_batch(model.config), torch.tensor([0.9, 0.2], dtype=torch.float64)
    null = torch.full((BATCH,), model.num_classes)
    assert torch.equal(model(x, t), model(x, t, null))
    # Labels and time reach the output (otherwise the equality above would be vacuous).
    conditioned = model(x, t, torch.tensor([1, 2]))
    assert (conditioned - model(x, t)).abs().max() > 1e-3
    assert (model(x, t.flip(0)) - model(x, t)).abs().max() > 1e-3


def test_unconditional_model_rejects_labels_and_shapes_are_checked():
    model = DiT.from_config("tiny", num_classes=None)
    x, t = image_batch(model.config, dtype=torch.float32), torch.zeros(BATCH)
    with pytest.raises(TypeError, match="without num_classes"):
        model(x, t, torch.zeros(BATCH, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, 1, 8, 8\]"):
        model(x[:, :, :4], t)


def test_position_embedding_is_a_fixed_buffer():
    model = DiT.from_config("tiny")
    assert "pos_embed" in dict(model.named_buffers())
    assert "pos_embed" not in dict(model.named_parameters())
    grid = model.config.input_size // model.config.patch_size
    embedding = sincos_position_embedding(model.config.hidden, grid)
    assert model.pos_embed.shape == (1, grid * grid, model.config.hidden)
    torch.testing.assert_close(model.pos_embed[0], embedding.to(torch.float32))
    # Every patch position gets a distinct code.
    distances = torch.cdist(embedding, embedding) + torch.eye(grid * grid)
    assert distances.min() > 0.1
    # The buffer follows the model's dtype.
    assert model.to(torch.float64).pos_embed.dtype == torch.float64


# -- 2. adaLN-Zero: identity at init -------------------------------------------------------


def test_adaln_zero_init_is_identity_blocks_and_zero_output():
    torch.manual_seed(0)
    model = DiT.from_config("tiny")
    x = image_batch(model.config, dtype=torch.float32)
    t = torch.tensor([0.7, 0.1])
    labels = torch.tensor([3, model.num_classes])
    seen = []

    def identity_check(block, inputs, output):
        tokens, c = inputs
        seen.append(block)
        assert c.abs().max() > 0  # the conditioning is not trivially zero...
        assert torch.equal(output, tokens)  # ...yet the block is the identity

    handles = [block.register_forward_hook(identity_check) for block in model.blocks]
    try:
        out = model(x, t, labels)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == model.config.depth
    assert torch.equal(out, torch.zeros_like(x))
    # The non-zero-initialised parts really are non-zero.
    assert model.blocks[0].attn.qkv.weight.abs().max() > 0
    assert model.t_embedder.mlp[0].weight.abs().max() > 0


def test_identity_check_can_fail_off_init():
    model = perturbed_dit("tiny", dtype=torch.float32)
    x, t = image_batch(model.config, dtype=torch.float32), torch.tensor([0.7, 0.1])
    tokens = model.x_embedder(x).flatten(2).transpose(1, 2) + model.pos_embed
    c = model.condition(t, None)
    assert (model.blocks[0](tokens, c) - tokens).abs().max() > 1e-3
    assert model(x, t).abs().max() > 1e-3


# -- 3. estimators against the dense reference on the micro DiT ----------------------------


@pytest.fixture(scope="module")
def micro_problem():
    """Micro DiT, class labels (one null), noise, flow, recorded path, dense chain."""
    model = perturbed_dit("micro")
    noise = image_batch(model.config, seed=11)
    cond = {"y": torch.tensor([1, model.num_classes])}
    flow = gradest.RectifiedFlow(steps=STEPS)
    trajectory = gradest.rollout(model, flow, noise, cond=cond)
    chain = dense_chain(model, flow, trajectory, cond)
    return model, noise, cond, flow, trajectory, chain


@pytest.fixture(scope="module", params=["terminal", "stepwise"])
def objective_and_truth(request, micro_problem):
    model, noise, cond, flow, trajectory, chain = micro_problem
    state_shape = tuple(noise.shape)
    if request.param == "terminal":
        objective = terminal_objective(state_shape)
    else:
        objective = random_stepwise_objective(STEPS, state_shape)
    truth, truth_noise = exact_gradient(model, flow, objective, trajectory, cond, chain=chain)
    return objective, truth, truth_noise


def test_reference_gradient_is_nontrivial(micro_problem, objective_and_truth):
    model = micro_problem[0]
    _, truth, _ = objective_and_truth
    # Every parameter tensor gets gradient, so every check below can fail.
    for name, _ in model.named_parameters():
        assert truth[name].abs().max() > 0, name


@pytest.mark.parametrize(
    ("spec", "source"),
    [
        ("exact", "noise"),
        ("exact:checkpoint=true", "noise"),
        ("exact", "trajectory"),
        ("jagg:window=2,order=1,shared_knots=false", "trajectory"),
        ("jagg:window=2,order=1,shared_knots=false", "noise"),
        (f"truncated:k={STEPS}", "trajectory"),
        (f"truncated:k={STEPS}", "noise"),
    ],
)
def test_exact_invariants_on_micro_dit(spec, source, micro_problem, objective_and_truth):
    model, noise, cond, flow, trajectory, _ = micro_problem
    objective, truth, truth_noise = objective_and_truth
    require_estimator(spec.partition(":")[0])
    est = gradest.estimator(spec)
    inputs = {"noise": noise} if source == "noise" else {"trajectory": trajectory}
    check_noise_grad = isinstance(objective, TerminalObjective) and spec.startswith("exact")
    result = est.estimate(model, flow, objective, cond=cond, noise_grad=check_noise_grad, **inputs)
    assert list(result.grads) == [name for name, _ in model.named_parameters()]
    assert relative_error(result.grads, truth) <= EXACTNESS
    if check_noise_grad:
        assert relative_error(result.noise_grad, truth_noise) <= EXACTNESS


def test_sdo_full_sum_is_exact_on_a_stepwise_objective(micro_problem):
    require_estimator("sdo")
    model, noise, cond, flow, trajectory, chain = micro_problem
    objective = random_stepwise_objective(STEPS, tuple(noise.shape))
    truth, _ = exact_gradient(model, flow, objective, trajectory, cond, chain=chain)
    result = gradest.estimator("sdo", full_sum=True).estimate(
        model, flow, objective, trajectory=trajectory, cond=cond
    )
    assert relative_error(result.grads, truth) <= EXACTNESS


@pytest.mark.parametrize("name", ["exact", "jagg", "sdo", "truncated"])
def test_each_estimator_matches_its_dense_definition(name, micro_problem, objective_and_truth):
    """Default options, on the recorded path: the estimate equals its own definition
    (docs/design.md#estimator-table) evaluated from dense Jacobians for the same random choices."""
    require_estimator(name)
    definitions = pytest.importorskip("gradest.reference.definitions")
    model, _, cond, flow, trajectory, chain = micro_problem
    objective, _, _ = objective_and_truth
    est = gradest.estimator(name)
    result = est.estimate(
        model,
        flow,
        objective,
        trajectory=trajectory,
        cond=cond,
        generator=torch.Generator().manual_seed(3),
    )
    flat = definitions.definition_gradient(est, chain, objective, result)
    if flat is None:
        pytest.skip(f"no dense definition registered for {name!r} yet")
    assert relative_error(result.grads, chain.unflatten(flat)) <= EXACTNESS


# -- 4. configurations and parameter counts ------------------------------------------------


def actual_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("micro", {}),
        ("tiny", {}),
        ("tiny", {"num_classes": None, "mlp_ratio": 2.0, "frequency_dim": 16}),
        ("tiny", {"in_channels": 3, "out_channels": 6, "patch_size": 4}),
        ("digits", {}),
        ("digits", {"input_size": 8, "patch_size": 2}),
    ],
)
def test_analytic_parameter_count_matches_the_module(name, overrides):
    model = DiT.from_config(name, **overrides)
    assert dit_parameter_count(name, **overrides) == actual_count(model)
    assert dit_parameter_count(model.config) == actual_count(model)


def test_small_configs_have_their_intended_sizes():
    assert dit_parameter_count("micro") <= 3_000
    assert dit_parameter_count("tiny") < 100_000
    assert 200_000 <= dit_parameter_count("digits") <= 1_000_000


@pytest.mark.parametrize(
    ("name", "millions"),
    # DiT paper, Table 1 (32x32x4 latents, patch 2, 1000 classes). The paper's models
    # also predict a variance (learn_sigma); ours predict a velocity, which changes the
    # final layer by hidden * 16 parameters, far below the rounding.
    [("S", 33), ("B", 130), ("L", 458)],
)
def test_paper_configs_match_the_published_counts(name, millions):
    assert round(dit_parameter_count(name) / 1e6) == millions
    assert round(dit_parameter_count(name, out_channels=8) / 1e6) == millions  # learn_sigma


def test_gpu300m_is_about_300m_parameters():
    assert 290e6 <= dit_parameter_count("gpu300m") <= 310e6


def test_dit_s_instantiates_with_the_analytic_count():
    assert actual_count(DiT.from_config("S")) == dit_parameter_count("S")


@pytest.mark.slow
def test_dit_b_instantiates_with_the_analytic_count():
    assert actual_count(DiT.from_config("B")) == dit_parameter_count("B")


def test_unknown_config_name_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown DiT config 'XL'") as info:
        DiT.from_config("XL")
    for name in DIT_CONFIGS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="valid names"):
        dit_parameter_count("XL")


def test_invalid_configs_name_the_option_and_the_fix():
    with pytest.raises(TypeError, match="unknown DiT option.*hidden_size.*valid options"):
        DiT.from_config("tiny", hidden_size=64)
    with pytest.raises(ValueError, match="patch_size=3 must divide input_size=8"):
        DiT.from_config("tiny", patch_size=3)
    with pytest.raises(ValueError, match="hidden=32 must be divisible by heads=3"):
        DiT.from_config("tiny", heads=3)
    with pytest.raises(ValueError, match="attention='flash'"):
        DiT.from_config("tiny", attention="flash")
    with pytest.raises(ValueError, match="depth must be positive"):
        DiT.from_config("tiny", depth=0)


# -- 5. torch.func, attention kernels, dtypes ---------------------------------------------


def test_sdpa_and_math_attention_agree_under_functional_vjp():
    """Same weights, both kernels: outputs and parameter VJPs agree to float64 round-off."""
    sdpa = perturbed_dit("tiny", attention="sdpa")
    math = perturbed_dit("tiny", attention="math")
    x = image_batch(sdpa.config)
    t = torch.tensor([0.8, 0.3], dtype=torch.float64)
    y = torch.tensor([4, 10])
    cotangent = seeded_normal(tuple(x.shape), 7)

    def pullback(model):
        params = {name: p.detach() for name, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        out, pull = vjp(lambda p: functional_call(model, (p, buffers), (x, t), {"y": y}), params)
        return out, pull(cotangent)[0]

    out_sdpa, grads_sdpa = pullback(sdpa)
    out_math, grads_math = pullback(math)
    torch.testing.assert_close(out_sdpa, out_math, rtol=1e-12, atol=1e-12)
    assert relative_error(grads_sdpa, grads_math) <= EXACTNESS


def test_sdpa_attention_works_under_jacrev():
    """SDPA inside jacrev (vmap over VJPs): correct, just slower on CPU than "math"."""
    model = perturbed_dit("micro", attention="sdpa")
    reference = perturbed_dit("micro", attention="math")
    x, t = image_batch(model.config), torch.tensor([0.6, 0.4], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        jacobian = jacrev(lambda z: model(z, t))(x)
    torch.testing.assert_close(jacobian, jacrev(lambda z: reference(z, t))(x), rtol=0, atol=1e-12)


def test_forward_has_no_hidden_randomness_under_vmap():
    """vmap's default randomness="error" rejects any random op; per-sample == batched."""
    model = perturbed_dit("tiny", attention="sdpa")
    x, t = image_batch(model.config), torch.tensor([0.8, 0.3], dtype=torch.float64)
    y = torch.tensor([2, 10])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        per_sample = vmap(lambda xi, ti, yi: model(xi[None], ti[None], yi[None])[0])(x, t, y)
    torch.testing.assert_close(per_sample, model(x, t, y), rtol=1e-12, atol=1e-12)
    assert torch.equal(model(x, t, y), model(x, t, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_estimators_run_on_the_tiny_dit_in_float32_and_float64(dtype):
    """The fused-chain exact estimator in either dtype against the checkpointed one (a
    different code path: no-graph sampling, then per-step joint VJPs) in float64. float32
    agrees to its own round-off: eps 1.2e-7 amplified through depth and N steps."""
    model64 = perturbed_dit("tiny", scale=0.1)
    model = perturbed_dit("tiny", scale=0.1, dtype=dtype)
    noise = image_batch(model.config, seed=13)
    cond = {"y": torch.tensor([0, 10])}
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = terminal_objective(tuple(noise.shape))
    truth = gradest.estimator("exact", checkpoint=True).estimate(
        model64, flow, objective, noise=noise, cond=cond, noise_grad=True
    )
    result = gradest.estimator("exact", checkpoint=False).estimate(
        model, flow, objective, noise=noise.to(dtype), cond=cond, noise_grad=True
    )
    assert all(g.dtype == dtype for g in result.grads.values())
    assert result.noise_grad.dtype == dtype
    tolerance = EXACTNESS if dtype == torch.float64 else 1e-4
    assert relative_error(result.grads, truth.grads) <= tolerance
    assert relative_error(result.noise_grad, truth.noise_grad) <= tolerance
