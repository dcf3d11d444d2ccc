"""The surrogate loss in ordinary training stacks: AMP, GradScaler, accelerate, layer
checkpointing (``torch.utils.checkpoint`` and diffusers' ``enable_gradient_checkpointing``)
and peft LoRA. (DDP and FSDP2 under torchrun: ``tests/test_data_parallel.py``.)

Each is used unchanged, as its documentation shows: the estimator only provides the loss.

Tolerances. In float64/float32 the surrogate and ``estimate()`` evaluate the same VJPs
(``EXACTNESS``). Under autocast the surrogate's backward runs the same lower-precision
kernels as the hand-written loop under the same autocast; the two differ only in where
the terminal loss's gradient enters the chain (``<z_N, a_N>`` in float32 against the
loss's own backward), measured at most 2e-7 relative (bf16 and fp16, 4 seeds), checked
at ``AUTOCAST_AGREEMENT = 1e-5``. With a ``GradScaler`` the fp16 backward carries the
gradient multiplied by the scale, so it rounds differently from the unscaled
``estimate()`` under the same autocast: measured at most 5.7e-4 relative (the five specs,
4 seeds), about fp16's unit round-off 2^-11 = 4.9e-4; checked at
``SCALED_FP16_AGREEMENT = 4 * 2^-11``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradest
from gradest.reference import relative_error
from gradest.testing.problems import seeded_normal, tiny_mlp

DIM, BATCH, STEPS, CLASSES = 4, 4, 5, 3
EXACTNESS = 1e-12
FLOAT32_EXACTNESS = 1e-5
AUTOCAST_AGREEMENT = 1e-5
SCALED_FP16_AGREEMENT = 4 * 2.0**-11
SPECS = ["exact", "exact:checkpoint=true", "jagg:window=3,tau=0.9", "sdo", "truncated:k=2"]


def objective() -> gradest.TerminalObjective:
    weights = seeded_normal((DIM,), 1)

    def loss_fn(z):
        return (torch.sin(z * weights.to(z.dtype)).pow(2).sum(-1) + 0.1 * z.pow(2).sum(-1)).mean()

    return gradest.TerminalObjective(loss_fn)


def inputs(dtype=torch.float64):
    return seeded_normal((BATCH, DIM), 11, dtype), torch.arange(BATCH) % CLASSES


def grads_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


def handwritten_bptt(model, flow, noise, labels, loss_fn) -> torch.Tensor:
    """The loop a user writes: Euler with the graph, then the loss."""
    z = noise
    for k in range(flow.num_steps):
        t = torch.full((noise.shape[0],), float(flow.times[k]), dtype=noise.dtype)
        z = z + float(flow.step_sizes[k]) * model(z, t, y=labels)
    return loss_fn(z)


# -- autocast and GradScaler --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_surrogate_under_autocast_matches_the_handwritten_loop(dtype, seed):
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, labels = inputs(torch.float32)
    loss_fn = objective().loss_fn
    model = tiny_mlp(DIM, hidden=16, num_classes=CLASSES, seed=seed, dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        handwritten_bptt(model, flow, noise, labels, loss_fn).backward()
    by_hand = grads_of(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        sur = gradest.estimator("exact").surrogate(
            model, flow, objective(), noise=noise, cond={"y": labels}
        )
    sur.loss.backward()
    assert relative_error(grads_of(model), by_hand) < AUTOCAST_AGREEMENT
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS)
def test_grad_scaler_with_fp16_autocast(spec):
    """``scaler.scale(loss).backward()``; unscaled gradients equal the fp16-autocast estimate."""
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, labels = inputs(torch.float32)
    model = tiny_mlp(DIM, hidden=16, num_classes=CLASSES, seed=0, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    est = gradest.estimator(spec)
    with torch.autocast("cpu", dtype=torch.float16):
        result = est.estimate(
            model,
            flow,
            objective(),
            noise=noise,
            cond={"y": labels},
            generator=torch.Generator().manual_seed(0),
        )
        sur = est.surrogate(
            model,
            flow,
            objective(),
            noise=noise,
            cond={"y": labels},
            generator=torch.Generator().manual_seed(0),
        )
    scaler.scale(sur.loss).backward()
    scaler.unscale_(optimizer)
    assert relative_error(grads_of(model), result.flat()) < SCALED_FP16_AGREEMENT
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# -- accelerate -----------------------------------------------------------------------------------

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    # accelerate keeps one global state per process (the docs' examples make one too).
    reset()
    yield
    reset()


@pytest.mark.parametrize("spec", SPECS)
def test_accelerator_backward_without_mixed_precision_is_the_estimate(spec, fresh_accelerate_state):
    from accelerate import Accelerator

    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, labels = inputs(torch.float32)
    model = tiny_mlp(DIM, hidden=16, num_classes=CLASSES, seed=0, dtype=torch.float32)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    est = gradest.estimator(spec)
    kwargs = dict(noise=noise, cond={"y": labels})
    result = est.estimate(
        model, flow, objective(), generator=torch.Generator().manual_seed(0), **kwargs
    )
    sur = est.surrogate(
        prepared, flow, objective(), generator=torch.Generator().manual_seed(0), **kwargs
    )
    accelerator.backward(sur.loss)
    assert relative_error(grads_of(model), result.flat()) < FLOAT32_EXACTNESS
    optimizer.step()


def test_accelerator_with_bf16_mixed_precision_matches_the_handwritten_loop(
    fresh_accelerate_state,
):
    """``Accelerator(mixed_precision="bf16")`` wraps the model's forward in autocast; the
    surrogate goes through it like the hand-written loop does."""
    from accelerate import Accelerator

    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, labels = inputs(torch.float32)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(
        tiny_mlp(DIM, hidden=16, num_classes=CLASSES, seed=0, dtype=torch.float32)
    )
    accelerator.backward(handwritten_bptt(model, flow, noise, labels, objective().loss_fn))
    by_hand = grads_of(model)
    model.zero_grad(set_to_none=True)
    sur = gradest.estimator("exact").surrogate(
        model, flow, objective(), noise=noise, cond={"y": labels}
    )
    accelerator.backward(sur.loss)
    assert relative_error(grads_of(model), by_hand) < AUTOCAST_AGREEMENT
    # bf16 really ran: the float32 gradient differs at bf16 rounding.
    reference = gradest.estimator("exact").estimate(
        tiny_mlp(DIM, hidden=16, num_classes=CLASSES, seed=0, dtype=torch.float32),
        flow,
        objective(),
        noise=noise,
        cond={"y": labels},
    )
    assert relative_error(by_hand, reference.flat()) > 1e-4


# -- layer checkpointing --------------------------------------------------------------------------


class CheckpointedMLP(nn.Module):
    """An MLP velocity whose hidden block runs under ``torch.utils.checkpoint`` (non-reentrant),
    as large models do to fit in memory."""

    def __init__(self, use_checkpoint: bool):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(DIM + 1, 16)
            self.hidden = nn.Sequential(nn.SiLU(), nn.Linear(16, 16), nn.SiLU())
            self.out = nn.Linear(16, DIM)
        self.use_checkpoint = use_checkpoint
        self.double()

    def forward(self, z, t):
        h = self.inp(torch.cat([z, t[:, None]], dim=-1))
        h = (
            checkpoint(self.hidden, h, use_reentrant=False)
            if self.use_checkpoint
            else self.hidden(h)
        )
        return self.out(h)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("objective_kind", ["terminal", "stepwise"])
def test_torch_utils_checkpoint_inside_the_model(spec, objective_kind):
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, _ = inputs()
    plain, checkpointed = CheckpointedMLP(False), CheckpointedMLP(True)
    if objective_kind == "terminal":
        obj, kwargs = objective(), {"noise": noise}
    else:
        from gradest.testing.problems import random_stepwise_objective

        obj = random_stepwise_objective(STEPS, (BATCH, DIM))
        kwargs = {"trajectory": gradest.rollout(plain, flow, noise)}
    assert_checkpointing_changes_nothing(spec, plain, checkpointed, flow, obj, **kwargs)


def assert_checkpointing_changes_nothing(spec, plain, checkpointed, flow, obj, **kwargs):
    """estimate() and the surrogate's backward through the checkpointed model both give the
    plain model's estimate."""
    est = gradest.estimator(spec)

    def generator():
        return torch.Generator().manual_seed(0)

    want = est.estimate(plain, flow, obj, generator=generator(), **kwargs)
    got = est.estimate(checkpointed, flow, obj, generator=generator(), **kwargs)
    assert relative_error(got.flat(), want.flat()) < EXACTNESS
    est.surrogate(checkpointed, flow, obj, generator=generator(), **kwargs).loss.backward()
    assert relative_error(grads_of(checkpointed), want.flat()) < EXACTNESS


def test_the_func_engine_refuses_layer_checkpointing_with_the_fix():
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, _ = inputs()
    with pytest.raises(
        ValueError, match="engine='func' cannot differentiate this model.*engine='autograd'"
    ):
        gradest.estimator("exact").estimate(
            CheckpointedMLP(True), flow, objective(), noise=noise, engine="func"
        )


diffusers = pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.filterwarnings("ignore:There are modules in SD3Transformer2DModel")
@pytest.mark.parametrize("spec", SPECS)
def test_diffusers_enable_gradient_checkpointing(spec):
    """A tiny SD3 transformer with diffusers' gradient checkpointing: the surrogate's backward
    and estimate() both run through it and give the gradient of the plain model."""
    from diffusers_support import tiny_transformer

    from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler

    def sd3(gradient_checkpointing: bool) -> DiffusersVelocity:
        transformer = tiny_transformer("sd3", num_layers=2)
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return DiffusersVelocity(transformer.train())

    flow = sampler_from_scheduler(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), 3)
    noise = seeded_normal((2, 2, 4, 4), 11)
    cond = {
        "encoder_hidden_states": seeded_normal((2, 3, 6), 12),
        "pooled_projections": seeded_normal((2, 5), 13),
    }
    obj = gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).mean())
    plain, checkpointed = sd3(False), sd3(True)
    assert checkpointed.transformer.gradient_checkpointing
    assert_checkpointing_changes_nothing(
        spec, plain, checkpointed, flow, obj, noise=noise, cond=cond
    )


# -- forward hooks run on the surrogate path ---------------------------------------------------


def test_forward_hooks_run_for_every_model_call():
    model = tiny_mlp(DIM, hidden=8, num_classes=CLASSES, seed=0)
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise, labels = inputs()
    sur = gradest.estimator("exact").surrogate(
        model, flow, objective(), noise=noise, cond={"y": labels}
    )
    assert len(calls) == STEPS == sur.cost.forwards_with_graph
