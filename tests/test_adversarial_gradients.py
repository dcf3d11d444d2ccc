"""No silent wrong gradient (issue 24, item 3): the attacks that once passed unnoticed.

* Dropout replay is switched on by what the model does at *any* step (dropout active only
  for ``t < 0.6``, so its first call at ``t = 1`` draws nothing): exact (checkpointed
  too, estimate and surrogate), jagg with every step a node and sdo equal the autograd
  gradient of a hand-written loop with the masks the estimate drew, recorded by the model.
* Replay is per call and thread-safe: concurrent estimates on one dropout model with
  their own generators equal the serial ones bit for bit; without a generator (the
  default generator, shared) every concurrent estimate is still the gradient of the
  masks it drew.
* A NaN that appears only in the backward of one step reaches the surrogate's backward
  of exact, exact:checkpoint=true, sdo, truncated and jagg: ``NonFiniteError`` naming that
  step; a later clean call's ``.grad`` is right.
* A surrogate backpropagated after ``optimizer.step()`` raises a one-line gradest error
  for every built-in estimator (``exact:checkpoint=true`` once gave a mixed gradient).
* ``NonFiniteError.steps`` is filled whenever the message names a step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import gradest
from gradest.base import SurrogateOutdated
from gradest.errors import GradestError
from gradest.nonfinite import NonFiniteError
from gradest.registry import available_estimators
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH, STEPS = 3, 2, 5
FLOW = gradest.RectifiedFlow(steps=STEPS)  # times 1, 0.8, 0.6, 0.4, 0.2
NOISE = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
OBJECTIVE = gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).sum())


def flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


# -- b: dropout replay ------------------------------------------------------------------------


class LateDropout(nn.Module):
    """Dropout on the hidden layer for rows with ``t < 0.6`` only (the first call, at t=1,
    draws nothing). Records, per thread and step time, every mask it drew in single-step
    calls; with ``forced`` set it uses the given masks instead of drawing."""

    def __init__(self, p: float = 0.4, sleep: float = 0.0, everywhere: bool = False):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(DIM + 1, 16)
            self.out = nn.Linear(16, DIM)
        self.double()
        self.p, self.sleep, self.everywhere = p, sleep, everywhere
        self.local = threading.local()

    @property
    def masks(self) -> dict[float, list[torch.Tensor]]:
        if not hasattr(self.local, "masks"):
            self.local.masks = {}
        return self.local.masks

    def forward(self, z, t):
        h = torch.tanh(self.inp(torch.cat([z, t[:, None]], -1)))
        if self.sleep:
            time.sleep(self.sleep)  # let other threads run in between
        active = torch.ones_like(t, dtype=torch.bool) if self.everywhere else t < 0.6
        forced = getattr(self.local, "forced", None)
        if forced is not None:
            key = round(float(t[0]), 9)
            if key in forced:
                h = h * forced[key]
            return self.out(h)
        if self.training and bool(active.any()):
            mask = (torch.rand(h.shape, dtype=h.dtype) > self.p).to(h.dtype) / (1 - self.p)
            mask = torch.where(active[:, None], mask, torch.ones_like(mask))
            if bool((t == t[0]).all()):
                self.masks.setdefault(round(float(t[0]), 9), []).append(mask)
            h = h * mask
        return self.out(h)


def first_masks(model: LateDropout) -> dict[float, torch.Tensor]:
    """The mask each step drew first; every later evaluation of the step must agree."""
    out = {}
    for key, masks in model.masks.items():
        for mask in masks[1:]:
            assert torch.equal(mask, masks[0]), f"step at t={key} saw two different masks"
        out[key] = masks[0]
    return out


def reference(model: LateDropout, masks: dict[float, torch.Tensor], spec: str, info: dict):
    """Hand-written Euler loop with the recorded masks; autograd gradient of the loss
    (exact), or of the one-step sum (sdo: the other steps' states detached)."""
    model.local.forced = masks
    try:
        z = NOISE
        states = []
        for k in range(STEPS):
            t = torch.full((BATCH,), float(FLOW.times[k]), dtype=torch.float64)
            states.append(z)
            z = z + float(FLOW.step_sizes[k]) * model(z, t)
        params = list(model.parameters())
        if not spec.startswith("sdo"):
            return flat(torch.autograd.grad(OBJECTIVE.loss_fn(z), params))
        steps = info["sampled_steps"]
        final = NOISE.clone()
        for k in range(STEPS):
            t = torch.full((BATCH,), float(FLOW.times[k]), dtype=torch.float64)
            v = model(states[k].detach(), t)
            final = final + float(FLOW.step_sizes[k]) * (v if k in steps else v.detach())
        assert torch.allclose(final, z)
        return info["scale"] * flat(torch.autograd.grad(OBJECTIVE.loss_fn(final), params))
    finally:
        model.local.forced = None


DROPOUT_SPECS = [
    ("exact", "estimate"),
    ("exact:checkpoint=true", "estimate"),
    ("exact:checkpoint=true", "surrogate"),
    ("exact", "surrogate"),
    ("jagg:window=2,order=1", "estimate"),
    ("jagg:window=2,order=1", "surrogate"),
    ("sdo:full_sum=true", "estimate"),
    ("sdo:samples=2", "surrogate"),
]


def run_estimate(model, spec, call, seed):
    """``(gradient, info)`` of one estimate with its own generator (None: no generator)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    est = gradest.estimator(spec)
    if call == "estimate":
        result = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator)
        return result.flat(), result.info
    sur = est.surrogate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator)
    return flat(torch.autograd.grad(sur.loss, list(model.parameters()))), sur.info


@pytest.mark.parametrize(("spec", "call"), DROPOUT_SPECS)
@pytest.mark.parametrize("seed", [None, 3])
def test_dropout_active_only_late_is_replayed(spec, call, seed):
    model = LateDropout().train()
    model.masks.clear()
    torch.manual_seed(11)
    got, info = run_estimate(model, spec, call, seed)
    masks = first_masks(model)
    # Dropout really fired at the late steps (t = 0.4, 0.2), and only there.
    assert sorted(masks) == [0.2, 0.4]
    want = reference(model, masks, spec, info)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), (got - want).abs().max()


def test_masks_come_from_the_generator_not_the_global_rng():
    model = LateDropout().train()
    torch.manual_seed(0)
    first, _ = run_estimate(model, "exact:checkpoint=true", "estimate", 5)
    state = torch.get_rng_state()
    torch.manual_seed(1)
    again, _ = run_estimate(model, "exact:checkpoint=true", "estimate", 5)
    other, _ = run_estimate(model, "exact:checkpoint=true", "estimate", 6)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    torch.manual_seed(0)
    run_estimate(model, "exact", "estimate", 5)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not consumed


def test_a_persistent_generator_gives_fresh_masks_each_call():
    model = LateDropout().train()
    generator = torch.Generator().manual_seed(0)
    est = gradest.estimator("exact")
    a = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator).flat()
    b = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator).flat()
    assert not torch.equal(a, b)


THREAD_SPECS = [
    ("exact:checkpoint=true", "estimate"),
    ("exact:checkpoint=true", "surrogate"),
    ("jagg:window=2,order=1", "estimate"),
    ("sdo:samples=2", "surrogate"),
]


def test_concurrent_estimates_on_one_dropout_model_equal_the_serial_ones():
    model = LateDropout(sleep=0.001, everywhere=True).train()
    jobs = [(spec, call, seed) for spec, call in THREAD_SPECS for seed in range(2)]
    serial = [run_estimate(model, spec, call, seed)[0] for spec, call, seed in jobs]
    barrier = threading.Barrier(4)

    def worker(offset: int) -> list[torch.Tensor]:
        barrier.wait()
        order = jobs[offset:] + jobs[:offset]
        results = {job: run_estimate(model, *job)[0] for job in order}
        return [results[job] for job in jobs]

    with ThreadPoolExecutor(4) as pool:
        for results in pool.map(worker, range(4)):
            for got, want in zip(results, serial, strict=True):
                assert torch.equal(got, want)


def test_concurrent_estimates_without_a_generator_keep_their_own_masks():
    """The shared default generator: which masks a thread gets depends on timing, but each
    estimate is the gradient of the masks it drew (none mixed in from another thread)."""
    model = LateDropout(sleep=0.001, everywhere=True).train()
    barrier = threading.Barrier(4)

    def worker(spec: str) -> None:
        barrier.wait()
        for _ in range(2):
            model.masks.clear()
            got, info = run_estimate(model, spec, "estimate", None)
            masks = first_masks(model)
            assert len(masks) == STEPS
            want = reference(model, masks, spec, info)
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)

    specs = ["exact:checkpoint=true", "exact", "jagg:window=2,order=1", "exact:checkpoint=true"]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, specs))


# -- c: NaN only in the backward of one step --------------------------------------------------


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, poisoned):
        ctx.save_for_backward(poisoned)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        (poisoned,) = ctx.saved_tensors
        return torch.where(poisoned[:, None], torch.full_like(grad, float("nan")), grad), None


class NanInBackward(nn.Module):
    """Finite forward everywhere; the backward of rows at ``t == poison`` is NaN."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(DIM + 1, 16)
            self.out = nn.Linear(16, DIM)
        self.double()
        self.poison: float | None = None

    def forward(self, z, t):
        h = torch.tanh(self.inp(torch.cat([z, t[:, None]], -1)))
        if self.poison is not None:
            h = _NanBackward.apply(h, (t - self.poison).abs() < 1e-9)
        return self.out(h)


POISONED_STEP = 2  # t = 0.6
NAN_SPECS = [
    "exact",
    "exact:checkpoint=true",
    "sdo:full_sum=true",
    "sdo:samples=5",
    "truncated:k=3",
    "jagg:window=2,order=1",  # every step a node (an interpolated step has no backward)
]


@pytest.mark.parametrize("spec", NAN_SPECS)
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_nan_in_one_steps_backward_is_reported_with_the_step(spec, kind):
    model = NanInBackward()
    est = gradest.estimator(spec)
    if kind == "terminal":
        objective, inputs = OBJECTIVE, {"noise": NOISE}
    else:
        objective = gradest.StepwiseObjective(lambda k, v, trajectory: v.pow(2).sum())
        inputs = {"trajectory": gradest.rollout(model, FLOW, NOISE)}
    model.poison = float(FLOW.times[POISONED_STEP])
    with pytest.raises(NonFiniteError) as caught:
        sur = est.surrogate(
            model, FLOW, objective, generator=torch.Generator().manual_seed(0), **inputs
        )
        sur.loss.backward()
    assert POISONED_STEP in caught.value.steps, str(caught.value)
    assert f"step {POISONED_STEP}" in str(caught.value) or "steps [" in str(caught.value)
    assert "\n" not in str(caught.value)
    # A clean call afterwards: hooks gone, .grad right.
    model.poison = None
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(0)
    est.surrogate(model, FLOW, objective, generator=generator, **inputs).loss.backward()
    want = est.estimate(
        model, FLOW, objective, generator=torch.Generator().manual_seed(0), **inputs
    )
    got = flat(p.grad for p in model.parameters())
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want.flat(), rtol=1e-10, atol=1e-12)


def test_the_backward_check_names_the_originating_step_of_the_exact_chain():
    model = NanInBackward()
    model.poison = float(FLOW.times[3])
    sur = gradest.estimator("exact").surrogate(model, FLOW, OBJECTIVE, noise=NOISE)
    with pytest.raises(NonFiniteError) as caught:
        sur.loss.backward()
    assert caught.value.steps == (3,)
    assert "at step 3" in str(caught.value)


def test_a_loss_scaler_overflow_is_left_to_the_scaler():
    """Gradient reaching the loss > 1 (GradScaler): inf/NaN is its signal, no raise."""
    model = NanInBackward()
    model.poison = float(FLOW.times[1])
    sur = gradest.estimator("exact").surrogate(model, FLOW, OBJECTIVE, noise=NOISE)
    (sur.loss * 1024.0).backward()
    assert not torch.isfinite(model.inp.weight.grad).all()


# -- d: a surrogate used after its weights changed ---------------------------------------------


def _builtin_specs() -> list[str]:
    specs = sorted(available_estimators())
    return [*specs, "exact:checkpoint=true"]


@pytest.mark.parametrize("spec", _builtin_specs())
def test_a_surrogate_after_optimizer_step_raises_for_every_estimator(spec):
    model = tiny_mlp(DIM, hidden=8, num_classes=2, seed=0)
    objective = smooth_terminal_objective(DIM)
    cond = {"y": torch.tensor([0, 1])}
    est = gradest.estimator(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = seeded_normal((BATCH, DIM), 4)

    def surrogate():
        return est.surrogate(
            model,
            FLOW,
            objective,
            noise=noise,
            cond=cond,
            generator=torch.Generator().manual_seed(0),
        )

    sur = surrogate()
    sur.loss.backward()  # fine: nothing changed
    stale = surrogate()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(SurrogateOutdated) as caught:
        stale.loss.backward()
    assert isinstance(caught.value, GradestError) and isinstance(caught.value, RuntimeError)
    message = str(caught.value)
    assert "\n" not in message and "optimizer.step()" in message and "surrogate" in message
    assert all(p.grad is None for p in model.parameters())
    surrogate().loss.backward()  # a new surrogate after the step is fine
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# -- NonFiniteError.steps whenever the message names a step ----------------------------------


def test_nonfinite_error_steps_filled_when_the_message_names_the_step():
    model = tiny_mlp(DIM, hidden=8, num_classes=2, seed=0)
    cond = {"y": torch.tensor([0, 1])}
    trajectory = gradest.rollout(model, FLOW, seeded_normal((BATCH, DIM), 0), cond=cond)

    def loss(k, v, trajectory):
        return v.sum() * (float("inf") if k == 2 else 1.0)

    for call in ("estimate", "surrogate"):
        est = gradest.estimator("exact")
        with pytest.raises(NonFiniteError) as caught:
            getattr(est, call)(
                model, FLOW, gradest.StepwiseObjective(loss), trajectory=trajectory, cond=cond
            )
        assert caught.value.steps == (2,), str(caught.value)
        assert "step 2" in str(caught.value)
        assert str(caught.value).count("step 2") == 1
    error = NonFiniteError("gradient of the loss at step 4")
    assert error.steps == (4,) and str(error).count("step 4") == 1
    assert NonFiniteError("velocity", times=[0.5]).locate(FLOW.times, "x").steps == (2,)
