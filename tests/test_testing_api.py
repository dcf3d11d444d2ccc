"""gradest.testing, the checks for plugin authors: they pass on the built-in estimators and
fail (``AssertionError``) on a deliberately wrong one."""

from __future__ import annotations

import attrs
import pytest
import torch

import gradest
from gradest import testing
from gradest.reference import dense_chain, exact_gradient
from gradest.strategies.exact import Exact

DIM, BATCH, STEPS = 3, 4, 5


class OffByOnePercent(Exact):
    """Exact with every parameter gradient scaled by 1.01: a subtly wrong estimator that
    still claims exact's definition."""

    name = "off_by_one_percent"

    def estimate(self, *args, **kwargs):
        result = super().estimate(*args, **kwargs)
        return attrs.evolve(result, grads={k: 1.01 * g for k, g in result.grads.items()})


def _problem(conditioned: bool = False):
    model = testing.tiny_mlp(DIM, hidden=8, num_classes=3 if conditioned else None)
    noise = testing.seeded_normal((BATCH, DIM), seed=11)
    cond = {"y": torch.tensor([0, 1, 2, 3])} if conditioned else None
    return model, gradest.RectifiedFlow(steps=STEPS), noise, cond


def _objective(kind: str):
    if kind == "terminal":
        return testing.smooth_terminal_objective(DIM)
    return testing.random_stepwise_objective(STEPS, (BATCH, DIM))


def test_the_public_names():
    assert set(testing.__all__) <= set(dir(testing))
    for name in ("assert_matches_definition", "assert_unbiased", "tiny_mlp", "NoisyAffineSampler"):
        assert name in testing.__all__


# -- assert_matches_definition ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
@pytest.mark.parametrize(
    "spec", ["exact", "jagg:window=2", "sdo:samples=2", "truncated:random=uniform", "telescope"]
)
def test_builtins_match_their_definitions(spec, kind):
    model, flow, noise, cond = _problem(conditioned=True)
    result = testing.assert_matches_definition(
        spec, model, flow, _objective(kind), noise=noise, cond=cond,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    assert isinstance(result, gradest.GradientEstimate) and result.grads


def test_a_recorded_path_and_a_noisy_affine_sampler():
    model, _, noise, _ = _problem()
    sampler = testing.NoisyAffineSampler(STEPS, drift=0.3)
    trajectory = gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(3))
    errors = testing.definition_errors(
        "sdo:samples=2", model, sampler, _objective("terminal"), trajectory=trajectory
    )
    assert errors["decisions"] == []
    assert errors["trajectory"] <= 1e-10 and errors["surrogate"] <= 1e-10
    assert "noise" not in errors  # a path was given, not the noise
    assert testing.definition_error(
        "sdo:samples=2", model, sampler, _objective("terminal"), trajectory=trajectory
    ) == max(errors["trajectory"], errors["surrogate"])


@pytest.mark.parametrize("kind", ["terminal", "stepwise"])
def test_a_wrong_estimator_fails(kind):
    model, flow, noise, cond = _problem()
    with pytest.raises(AssertionError, match="off_by_one_percent|OffByOnePercent"):
        testing.assert_matches_definition(
            OffByOnePercent(), model, flow, _objective(kind), noise=noise, cond=cond
        )
    # The same estimator without the scaling passes.
    testing.assert_matches_definition(Exact(), model, flow, _objective(kind), noise=noise)


def test_the_generator_is_not_advanced_and_drives_the_decisions():
    model, flow, noise, _ = _problem()
    generator = torch.Generator().manual_seed(8)
    state = generator.get_state()
    result = testing.assert_matches_definition(
        "truncated:random=uniform", model, flow, _objective("terminal"), noise=noise,
        generator=generator,
    )  # fmt: skip
    assert torch.equal(generator.get_state(), state)
    again = gradest.estimator("truncated:random=uniform").estimate(
        model, flow, _objective("terminal"), noise=noise, generator=torch.Generator().manual_seed(8)
    )
    assert again.decisions == result.decisions


def test_bad_arguments_are_refused():
    model, flow, noise, _ = _problem()
    stepwise = _objective("stepwise")
    with pytest.raises(ValueError, match="does not take stepwise"):
        testing.assert_matches_definition("refl", model, flow, stepwise, noise=noise)
    with pytest.raises(ValueError, match="exactly one"):
        testing.assert_matches_definition("exact", model, flow, stepwise)


def test_perturb_parameters_is_seeded_and_in_place():
    a, b = testing.tiny_mlp(DIM), testing.tiny_mlp(DIM)
    before = [p.clone() for p in a.parameters()]
    assert testing.perturb_parameters(a, scale=0.1, seed=4) is a
    testing.perturb_parameters(b, scale=0.1, seed=4)
    for p, q, old in zip(a.parameters(), b.parameters(), before, strict=True):
        assert torch.equal(p, q) and not torch.equal(p, old)


# -- the statistical checks ---------------------------------------------------------------

DRAWS = 300


def _telescope_draws(scale: float = 1.0):
    """``DRAWS`` telescope estimates (unbiased for exact) on one path, and exact."""
    model, flow, noise, _ = _problem()
    objective = _objective("terminal")
    trajectory = gradest.rollout(model, flow, noise)
    est = gradest.estimator("telescope:mean_depth=2")
    draws = torch.stack(
        [
            scale
            * est.estimate(
                model,
                flow,
                objective,
                trajectory=trajectory,
                generator=torch.Generator().manual_seed(100 + i),
            ).flat()  # fmt: skip
            for i in range(DRAWS)
        ]
    )
    grads, _ = exact_gradient(
        model, flow, objective, trajectory, chain=dense_chain(model, flow, trajectory)
    )
    return draws, torch.cat([g.reshape(-1) for g in grads.values()])


def test_assert_unbiased_accepts_an_unbiased_estimator_and_rejects_a_biased_one():
    draws, exact = _telescope_draws()
    testing.assert_unbiased(draws, exact)
    testing.assert_biased(draws, 1.5 * exact)
    with pytest.raises(AssertionError, match="biased"):
        testing.assert_unbiased(draws, 1.5 * exact)
    with pytest.raises(AssertionError, match="too few draws"):
        testing.assert_biased(draws, exact)
    # The tolerance is the sample standard error.
    se = testing.standard_error(draws)
    assert se > 0
    assert testing.distance_in_se(draws, draws.mean(0)) == 0.0


def test_standard_error_of_constant_draws_needs_two():
    with pytest.raises(ValueError, match="at least 2"):
        testing.standard_error(torch.ones(1, 3))
    assert testing.standard_error(torch.ones(5, 3)) == 0.0


def test_fits_distribution():
    pytest.importorskip("scipy")
    generator = torch.Generator().manual_seed(0)
    uniform = torch.randint(0, 4, (2000,), generator=generator).tolist()
    assert testing.fits_distribution(uniform, [0.25] * 4)
    assert not testing.fits_distribution(uniform, [0.4, 0.2, 0.2, 0.2])
    assert not testing.fits_distribution([0, 1, 3], [0.5, 0.5, 0.0, 0.0])  # impossible cell
