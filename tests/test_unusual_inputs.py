"""Unusual but valid inputs give the right answer (the accepted rows of ``docs/errors.md``).

Each case is checked against an independent computation: the dense reference
(``gradest.reference``), or the loop a user would write by hand with ``loss.backward()``.

* parameter layouts: tied weights, ``torch.nn.utils.parametrize`` (weight norm), layers in
  two dtypes, buffers a model updates in its forward;
* conditioning: a shared ``[B, ...]`` tensor marked ``gradest.SharedCondition`` (and what goes
  wrong without the marker), non-tensor and 0-dim values;
* inputs carrying graphs or odd layouts: noise with ``requires_grad``, expanded noise, a
  recorded trajectory whose tensors carry a graph, a trajectory of a stochastic sampler
  recorded without its step noise; a model returning float32 for a float64 state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest.reference import exact_gradient, relative_error
from gradest.testing.problems import (
    NoisyAffineSampler,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

pytestmark = pytest.mark.filterwarnings(
    # torch's note that weight norm's backward has no vmap rule (the dense reference's jacrev)
    "ignore:There is a performance drop:UserWarning"
)

DIM, BATCH, STEPS = 3, 2, 4
EXACTNESS = 1e-12
SPECS = ["exact", "exact:checkpoint=true", "jagg:window=2", "truncated:k=4"]  # all exact
FLOW = gradest.RectifiedFlow(steps=STEPS)
NOISE = seeded_normal((BATCH, DIM), 0)
OBJECTIVE = smooth_terminal_objective(DIM)


def handwritten(model: nn.Module, noise: torch.Tensor = NOISE, **cond) -> torch.Tensor:
    """Euler with the graph and ``loss.backward()``-style gradients of the trainables."""
    z = noise
    for k in range(STEPS):
        t = torch.full((noise.shape[0],), float(FLOW.times[k]), dtype=noise.dtype)
        z = z + float(FLOW.step_sizes[k]) * model(z, t, **cond)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(OBJECTIVE.loss_fn(z), params)
    return torch.cat([g.reshape(-1) for g in grads])


def every_path(model: nn.Module, **kwargs) -> list[torch.Tensor]:
    """The exact gradient by every exact configuration, both engines, and the surrogate."""
    out = []
    for spec in SPECS:
        est = gradest.estimator(spec)
        for engine in ("autograd", "func"):
            out.append(est.estimate(model, FLOW, OBJECTIVE, engine=engine, **kwargs).flat())
        sur = est.surrogate(model, FLOW, OBJECTIVE, **kwargs)
        params = [p for p in model.parameters() if p.requires_grad]
        out.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(sur.loss, params)]))
    return out


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.shared = nn.Linear(DIM, DIM).double()
        self.again = self.shared  # one Parameter, used twice

    def forward(self, z, t):
        return self.inner(self.again(torch.tanh(self.shared(z))), t)


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            layer = nn.Linear(DIM + 1, DIM).double()
        self.layer = nn.utils.parametrizations.weight_norm(layer)

    def forward(self, z, t):
        return torch.tanh(self.layer(torch.cat([z, t[:, None]], -1)))


class TwoDtypes(nn.Module):
    """A float32 layer inside a float64 model, cast at the boundaries."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.low = nn.Linear(DIM, DIM).float()

    def forward(self, z, t):
        return self.inner(z, t) + 0.1 * self.low(z.float()).double()


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, z, t):
        self.calls += 1
        return self.inner(z, t)


@pytest.mark.parametrize("make", [Tied, WeightNormed], ids=["tied", "weight_norm"])
def test_parameter_layouts_match_the_dense_reference(make):
    model = make()
    trajectory = gradest.rollout(model, FLOW, NOISE)
    truth, _ = exact_gradient(model, FLOW, OBJECTIVE, trajectory)
    flat = torch.cat([g.reshape(-1) for g in truth.values()])
    assert relative_error(handwritten(model), flat) < EXACTNESS
    for got in every_path(model, noise=NOISE):
        assert relative_error(got, flat) < EXACTNESS


def test_tied_weights_appear_once_under_their_first_name_and_stay_parameters():
    """torch 2.14's functional_call leaves a plain tensor in a submodule registered twice;
    gradest's func engine and dense reference put the Parameter back (gradest.model_lock)."""
    model = Tied()
    originals = list(model.parameters())
    result = gradest.estimator("exact").estimate(model, FLOW, OBJECTIVE, noise=NOISE, engine="func")
    assert "shared.weight" in result.grads and "again.weight" not in result.grads
    exact_gradient(model, FLOW, OBJECTIVE, gradest.rollout(model, FLOW, NOISE))
    assert all(a is b for a, b in zip(model.parameters(), originals, strict=True))
    assert model.again.weight is model.shared.weight is originals[-2]


def test_layers_in_two_dtypes_match_the_handwritten_loop():
    model = TwoDtypes()
    want = handwritten(model)
    for got in every_path(model, noise=NOISE):
        # the float32 layer's gradient is float32: agreement to its round-off
        assert relative_error(got, want) < 1e-6
    grads = gradest.estimator("exact").estimate(model, FLOW, OBJECTIVE, noise=NOISE).grads
    assert grads["low.weight"].dtype == torch.float32


def test_a_model_updating_a_buffer_sees_every_evaluation():
    """Accepted: the gradient is right; the buffer moves once per model call (an estimator
    calls the model several times per step; an estimate is free of side effects only for
    models whose forward has none)."""
    model = CountsCalls()
    want = handwritten(model)
    for spec in SPECS:
        before = int(model.calls)
        calls: list[int] = []
        hook = model.register_forward_hook(lambda *args, seen=calls: seen.append(1))
        result = gradest.estimator(spec).estimate(model, FLOW, OBJECTIVE, noise=NOISE)
        hook.remove()
        assert relative_error(result.flat(), want) < EXACTNESS
        assert int(model.calls) - before == len(calls) >= STEPS


class UsesATable(nn.Module):
    """Adds ``table.mean(0)`` (a ``[B, DIM]`` table shared by all samples) to the output."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t, table=None, gain=1.0, offset=None):
        return gain * self.inner(z, t) + table.mean(0) * (1.0 if offset is None else offset)


def test_a_shared_conditioning_tensor_with_b_rows_needs_the_marker():
    table = seeded_normal((BATCH, DIM), 5)  # B rows, but shared, not per sample
    model = UsesATable()
    cond = {"table": gradest.SharedCondition(table), "gain": 0.5, "offset": torch.tensor(2.0)}
    want = handwritten(model, table=table, gain=0.5, offset=torch.tensor(2.0))
    trajectory = gradest.rollout(model, FLOW, NOISE, cond=cond)
    stepwise = gradest.StepwiseObjective(lambda k, v, traj: (v * (k + 1)).pow(2).sum())
    exact = gradest.estimator("exact:checkpoint=true").estimate(
        model, FLOW, stepwise, trajectory=trajectory, cond=cond
    )
    # The batched stepwise call stacks 4 steps: with the marker, the table is not repeated.
    batched = gradest.estimator("exact").estimate(
        model, FLOW, stepwise, trajectory=trajectory, cond=cond
    )
    assert relative_error(batched.flat(), exact.flat()) < EXACTNESS
    for got in every_path(model, noise=NOISE, cond=cond):
        assert relative_error(got, want) < EXACTNESS
    # Without the marker the table looks per-sample and is repeated in stacked calls:
    # still mean(0) of equal copies here, but a table used row-wise would be misread.
    unmarked = {"table": table, "gain": 0.5, "offset": torch.tensor(2.0)}
    assert (
        relative_error(
            gradest.estimator("exact")
            .estimate(model, FLOW, stepwise, trajectory=trajectory, cond=unmarked)
            .flat(),
            exact.flat(),
        )
        < EXACTNESS
    )


def test_noise_that_carries_a_graph_or_is_expanded():
    leaf = NOISE.clone().requires_grad_(True)
    expanded = seeded_normal((1, DIM), 0).expand(BATCH, DIM)
    want = handwritten(tiny_mlp(DIM), noise=NOISE)
    model = tiny_mlp(DIM)
    for noise in (leaf, expanded):
        reference = handwritten(model, noise=noise.detach().clone())
        for got in every_path(model, noise=noise):
            assert relative_error(got, reference) < EXACTNESS
    # The estimate never differentiates into the caller's noise leaf.
    gradest.estimator("exact").surrogate(model, FLOW, OBJECTIVE, noise=leaf).loss.backward()
    assert leaf.grad is None
    assert relative_error(every_path(model, noise=NOISE)[0], want) < EXACTNESS


def test_a_trajectory_carrying_a_graph_is_used_as_data():
    model = tiny_mlp(DIM)
    leaf = NOISE.clone().requires_grad_(True)
    with torch.enable_grad():
        recorded = gradest.rollout(model, FLOW, NOISE)
        attached = gradest.Trajectory(
            recorded.times, recorded.states * (1 + 0 * leaf.sum()), recorded.velocities
        )
    assert attached.states.requires_grad
    want = gradest.estimator("exact").estimate(model, FLOW, OBJECTIVE, trajectory=recorded)
    sur = gradest.estimator("exact").surrogate(model, FLOW, OBJECTIVE, trajectory=attached)
    sur.loss.backward()
    assert leaf.grad is None  # nothing flowed into the caller's graph
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert relative_error(got, want.flat()) < EXACTNESS


def test_a_stochastic_trajectory_without_its_step_noise():
    """Estimates on a recorded path use the recorded states; the step noise only made them."""
    sampler = NoisyAffineSampler(STEPS)
    model = tiny_mlp(DIM)
    recorded = gradest.rollout(model, sampler, NOISE, generator=torch.Generator().manual_seed(1))
    stripped = gradest.Trajectory(recorded.times, recorded.states, recorded.velocities)
    for spec in SPECS:
        est = gradest.estimator(spec)
        a = est.estimate(model, sampler, OBJECTIVE, trajectory=recorded).flat()
        b = est.estimate(model, sampler, OBJECTIVE, trajectory=stripped).flat()
        assert relative_error(a, b) < EXACTNESS


class Float32Out(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return self.inner(z, t).float()


def test_a_float32_velocity_for_a_float64_state():
    """Accepted: the Euler step promotes to float64; the gradient is the loop's."""
    model = Float32Out()
    want = handwritten(model)
    for got in every_path(model, noise=NOISE):
        assert relative_error(got, want) < 1e-6
