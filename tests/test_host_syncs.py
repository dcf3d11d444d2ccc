"""No host synchronisation inside the sampling loop (docs/design.md, Public API).

A host sync is ``aten._local_scalar_dense`` (what ``.item()``, ``bool(t)``, ``float(t)``
call); a dispatch mode counts them deterministically. Per call (``surrogate`` +
``loss.backward()``, and ``estimate``; terminal and stepwise; every built-in estimator)
the count must not depend on the number of steps ``N``: NaN/Inf checks are decided once
at the end of the call from device flags, the grid and coefficients are read as host
floats once, stepwise losses are converted once, and jagg's gate decides every window in
one transfer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradest
from gradest.registry import builtin_estimators
from gradest.testing.problems import seeded_normal, tiny_mlp

DIM, BATCH = 4, 3
SMALL, LARGE = 16, 64
# A few syncs per call: random draws from a CPU generator, the deferred finiteness
# check, the surrogate backward's check, the terminal loss value.
BOUND = 16

VARIANTS = sorted(builtin_estimators()) + [
    "exact:checkpoint=true",
    "jagg:checkpoint=true",
    "jagg:debias=2",
    "jagg:shared_knots=true,gate=mean",
    "sdo:samples=4",
    "truncated:k=3",
]


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _objective(kind: str):
    if kind == "terminal":
        return gradest.TerminalObjective(lambda z: (z**2).sum())
    return gradest.StepwiseObjective(lambda k, v, trajectory: (v**2).mean() * (k + 1))


def _supports(spec: str, kind: str) -> bool:
    return kind in type(gradest.estimator(spec)).objectives


def _syncs(spec: str, kind: str, steps: int, verb: str, *, warm: bool = False) -> int:
    model = tiny_mlp(DIM, hidden=16, seed=0)
    flow = gradest.RectifiedFlow(steps=steps)
    noise = seeded_normal((BATCH, DIM), 0)
    objective = _objective(kind)
    inputs = (
        {"noise": noise}
        if kind == "terminal"
        else {"trajectory": gradest.rollout(model, flow, noise)}  # recorded outside the count
    )
    est = gradest.estimator(spec)

    def call() -> None:
        generator = torch.Generator().manual_seed(0)
        if verb == "surrogate":
            est.surrogate(model, flow, objective, generator=generator, **inputs).loss.backward()
        else:
            est.estimate(model, flow, objective, generator=generator, **inputs)

    if warm:
        call()  # auto: the probing call, so that the counted one runs the pick
    with SyncCounter() as counter:
        call()
    return counter.count


@pytest.mark.parametrize("verb", ["surrogate", "estimate"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize("spec", VARIANTS)
def test_host_syncs_per_call_do_not_grow_with_the_number_of_steps(spec, kind, verb):
    if not _supports(spec, kind):
        pytest.skip(f"{spec} is not defined for {kind} objectives")
    warm = spec == "auto"
    small = _syncs(spec, kind, SMALL, verb, warm=warm)  # each builds its own estimator
    large = _syncs(spec, kind, LARGE, verb, warm=warm)
    assert small == large, f"{spec} {kind} {verb}: {small} syncs at N={SMALL}, {large} at {LARGE}"
    assert large <= BOUND, f"{spec} {kind} {verb}: {large} host syncs per call"


@pytest.mark.parametrize("verb", ["surrogate", "estimate"])
@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_an_auto_probe_makes_as_many_syncs_at_any_number_of_steps(kind, verb):
    """auto's probing call runs every candidate a few times and compares them (statistics
    on the host), but its syncs do not grow with N either."""
    small = _syncs("auto", kind, SMALL, verb)  # each builds its own estimator (a new schedule)
    assert small == _syncs("auto", kind, LARGE, verb)


class NaNAtStep(nn.Module):
    """A velocity model whose output is NaN at exactly one time ``t``."""

    def __init__(self, t: float):
        super().__init__()
        self.inner = tiny_mlp(DIM, hidden=16, seed=0)
        self.t = t

    def forward(self, z, t):
        poison = torch.where((t[:, None] - self.t).abs() < 1e-9, float("nan"), 0.0)
        return self.inner(z, t) + poison.to(z.dtype)


@pytest.mark.parametrize("verb", ["surrogate", "estimate"])
@pytest.mark.parametrize("spec", ["exact", "exact:checkpoint=true", "jagg", "alignprop:min=0"])
def test_a_nan_at_a_late_step_is_reported_at_that_step(spec, verb):
    """Decided at the end of the call, the error still names the tensor and the first
    step where it went non-finite (the later steps ran on the NaN state)."""
    steps, late = LARGE, LARGE - 3
    flow = gradest.RectifiedFlow(steps=steps)
    model = NaNAtStep(float(flow.times[late]))
    noise = seeded_normal((BATCH, DIM), 0)
    est = gradest.estimator(spec)
    with pytest.raises(gradest.NonFiniteError) as info:
        if verb == "surrogate":
            est.surrogate(model, flow, _objective("terminal"), noise=noise).loss.backward()
        else:
            est.estimate(model, flow, _objective("terminal"), noise=noise)
    assert info.value.tensor == "velocity", str(info.value)
    assert info.value.steps == (late,), str(info.value)
    assert f"velocity at step {late} in estimator" in str(info.value)


def test_a_nan_stepwise_loss_gradient_at_a_late_step_names_it():
    steps, late = LARGE, LARGE - 2
    flow = gradest.RectifiedFlow(steps=steps)
    model = tiny_mlp(DIM, hidden=16, seed=0)
    trajectory = gradest.rollout(model, flow, seeded_normal((BATCH, DIM), 0))

    def loss(k, v, traj):
        return (torch.sqrt(v - v.detach())).sum() if k == late else v.pow(2).sum()

    with pytest.raises(gradest.NonFiniteError, match=rf"gradient of the loss at step {late}\b"):
        gradest.estimator("exact").estimate(
            model, flow, gradest.StepwiseObjective(loss), trajectory=trajectory
        )


def test_a_clean_call_decides_its_checks_in_one_sync():
    """Exact's estimate on a recorded path: no per-step sync at all (the few that remain
    are the trajectory check, the deferred check and the loss values)."""
    small = _syncs("exact", "stepwise", SMALL, "estimate")
    assert small == _syncs("exact", "stepwise", 4 * SMALL, "estimate") <= 6
