"""Stochastic layers: every evaluation of a step sees the randomness of its first one.

A model in training mode with dropout draws from torch's global RNG. Estimators evaluate a
step several times (rollout, adjoint sweep, node or checkpoint recomputation), so without
care the gradient would belong to other dropout masks than the path it was taken along.
``gradest.replay`` records the RNG state at a step's first evaluation and replays it:

* ``exact`` (fused, checkpointed, surrogate, both engines), ``truncated:k=N`` and
  ``jagg`` with every step a node equal the hand-written loop bit for bit, given the same
  ``torch.manual_seed``, and leave the global RNG where the loop leaves it;
* an approximate estimator is reproducible from the same seed;
* a model in eval mode, or in training mode without random layers, is untouched (its
  stacked calls stay batched);
* given ``generator=``, the masks come from a stream seeded by
  ``gradest.model_rng_seed(generator)``: a hand-written loop seeded with it equals the
  estimate bit for bit, and the global RNG is neither read nor advanced.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest

DIM, BATCH, STEPS = 4, 3, 5


class DropoutVelocity(nn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(DIM + 1, 16)
            self.drop = nn.Dropout(p)
            self.out = nn.Linear(16, DIM)
        self.double()

    def forward(self, z, t):
        return self.out(self.drop(torch.tanh(self.inp(torch.cat([z, t[:, None]], -1)))))


FLOW = gradest.RectifiedFlow(steps=STEPS)
NOISE = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
OBJECTIVE = gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).sum())


def handwritten(model: nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler with the graph and loss.backward, under torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    z = NOISE
    for k in range(STEPS):
        t = torch.full((BATCH,), float(FLOW.times[k]), dtype=torch.float64)
        z = z + float(FLOW.step_sizes[k]) * model(z, t)
    grads = torch.autograd.grad(OBJECTIVE.loss_fn(z), list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]), torch.get_rng_state()


EXACT_PATHS = [
    ("exact", "estimate", "autograd"),
    ("exact", "estimate", "func"),
    ("exact:checkpoint=true", "estimate", "autograd"),
    ("exact:checkpoint=true", "estimate", "func"),
    (f"truncated:k={STEPS}", "estimate", "autograd"),
    ("jagg:window=2,order=1", "estimate", "autograd"),
    ("exact", "surrogate", None),
    ("exact:checkpoint=true", "surrogate", None),
    ("jagg:window=2,order=1", "surrogate", None),
]


def gradient(model: nn.Module, spec: str, call: str, engine: str | None, seed: int):
    torch.manual_seed(seed)
    est = gradest.estimator(spec)
    if call == "estimate":
        flat = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, engine=engine).flat()
    else:
        sur = est.surrogate(model, FLOW, OBJECTIVE, noise=NOISE)
        flat = torch.cat(
            [g.reshape(-1) for g in torch.autograd.grad(sur.loss, list(model.parameters()))]
        )
    return flat, torch.get_rng_state()


@pytest.mark.parametrize(("spec", "call", "engine"), EXACT_PATHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_paths_equal_the_handwritten_loop_with_dropout(spec, call, engine, seed):
    model = DropoutVelocity().train()
    want, rng_after_loop = handwritten(model, seed)
    got, rng_after = gradient(model, spec, call, engine, seed)
    assert torch.equal(got, want)
    # Consumed exactly like the loop (recomputations replay, they do not draw).
    assert torch.equal(rng_after, rng_after_loop)


def test_dropout_really_changes_the_gradient():
    """Guards the test above: in eval mode (no dropout) the gradient differs."""
    model = DropoutVelocity()
    train, _ = gradient(model.train(), "exact", "estimate", "autograd", 0)
    evaluated, _ = gradient(model.eval(), "exact", "estimate", "autograd", 0)
    assert not torch.allclose(train, evaluated)


def gradient_with_generator(model: nn.Module, spec: str, call: str, generator_seed: int):
    """The gradient given ``generator=``, and the global RNG state before and after."""
    generator = torch.Generator().manual_seed(generator_seed)
    est = gradest.estimator(spec)
    before = torch.get_rng_state()
    if call == "estimate":
        flat = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator).flat()
    else:
        sur = est.surrogate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator)
        flat = torch.cat(
            [g.reshape(-1) for g in torch.autograd.grad(sur.loss, list(model.parameters()))]
        )
    return flat, before, torch.get_rng_state()


@pytest.mark.parametrize(("spec", "call"), [("exact", "estimate"), ("exact", "surrogate")])
@pytest.mark.parametrize("generator_seed", [0, 5])
def test_with_a_generator_the_masks_are_the_generators_stream(spec, call, generator_seed):
    """The documented semantics of ``generator=`` (docs/integrations.md, "Dropout with
    generator="): the masks come from a stream seeded by ``gradest.model_rng_seed(g)``, so
    a hand-written loop seeded with it gets the same gradient bit for bit, the global RNG
    neither decides the masks nor moves, and the loop under the same ``torch.manual_seed``
    alone draws other masks."""
    model = DropoutVelocity().train()
    seed = gradest.model_rng_seed(torch.Generator().manual_seed(generator_seed))
    want, _ = handwritten(model, seed)
    for global_seed in (0, 123):
        torch.manual_seed(global_seed)
        got, before, after = gradient_with_generator(model, spec, call, generator_seed)
        assert torch.equal(got, want)
        assert torch.equal(before, after)  # the global RNG is neither read nor advanced
    unseeded, _ = handwritten(model, generator_seed)
    assert not torch.allclose(unseeded, want)


def test_a_generator_moves_on_so_the_next_estimate_draws_new_masks():
    model = DropoutVelocity().train()
    generator = torch.Generator().manual_seed(3)
    seed = gradest.model_rng_seed(generator)
    assert gradest.model_rng_seed(generator) == seed  # reading the seed moves nothing
    est = gradest.estimator("exact")
    first = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator).flat()
    assert gradest.model_rng_seed(generator) != seed
    second = est.estimate(model, FLOW, OBJECTIVE, noise=NOISE, generator=generator).flat()
    assert not torch.allclose(first, second)
    # In eval mode nothing is drawn and the generator stays where it was.
    still = gradest.model_rng_seed(generator)
    est.estimate(model.eval(), FLOW, OBJECTIVE, noise=NOISE, generator=generator)
    assert gradest.model_rng_seed(generator) == still


@pytest.mark.parametrize("spec", ["jagg:window=3,tau=-1", "sdo:samples=2", "truncated:k=2"])
def test_approximate_estimators_are_reproducible_from_the_seed(spec):
    model = DropoutVelocity().train()
    first, _ = gradient(model, spec, "estimate", "autograd", 4)
    again, _ = gradient(model, spec, "estimate", "autograd", 4)
    surrogate, _ = gradient(model, spec, "surrogate", None, 4)
    assert torch.equal(first, again)
    assert torch.allclose(surrogate, first, rtol=1e-12, atol=0)


def test_jagg_nodes_see_the_masks_of_the_sampling_pass():
    """jagg evaluates each node three times (rollout, adjoint sweep, batched node VJP); with
    the same masks its gate cosines equal those of a deterministic copy of the path."""
    model = DropoutVelocity().train()
    torch.manual_seed(7)
    result = gradest.estimator("jagg:window=3,tau=-1").estimate(model, FLOW, OBJECTIVE, noise=NOISE)
    torch.manual_seed(7)
    rolled = gradest.rollout(model, FLOW, NOISE)
    # The rollout drew the same masks in the same order: the same path.
    torch.manual_seed(7)
    again = gradest.estimator("exact").estimate(model, FLOW, OBJECTIVE, noise=NOISE)
    assert result.info["loss"] == pytest.approx(again.info["loss"], rel=1e-15)
    assert float(OBJECTIVE.loss_fn(rolled.states[-1])) == pytest.approx(
        again.info["loss"], rel=1e-15
    )


def test_deterministic_models_keep_their_batched_calls():
    """No random layer (or eval mode): one stacked call for the stepwise exact, as before."""
    calls = []
    model = DropoutVelocity(p=0.0).train()
    model.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    trajectory = gradest.rollout(model, FLOW, NOISE)
    calls.clear()
    objective = gradest.StepwiseObjective(lambda k, v, trajectory: v.pow(2).sum())
    gradest.estimator("exact").estimate(model, FLOW, objective, trajectory=trajectory)
    assert calls == [STEPS * BATCH]
    calls.clear()
    stochastic = DropoutVelocity().train()
    stochastic.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    gradest.estimator("exact").estimate(stochastic, FLOW, objective, trajectory=trajectory)
    # The stacked first call drew masks for STEPS*BATCH rows; it is redone step by step.
    assert calls == [STEPS * BATCH] + [BATCH] * STEPS
