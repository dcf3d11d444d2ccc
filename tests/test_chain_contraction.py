"""``gradest.harness.chain_contraction``: ``||dz_N/dz_k||_2`` by power iteration, checked
against the dense product of the step Jacobians (``gradest.reference.dense_chain``), a
chain with a known answer, and the report of ``gradest.harness.compare`` (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradest
from gradest import FlowSDE, RectifiedFlow
from gradest.harness import (
    ChainContraction,
    chain_contraction,
    compare,
    draw_generator,
    one_step_cotangent_error,
)
from gradest.harness.comparison import CONTRACTION_ITERS, contraction_steps
from gradest.reference import dense_chain
from gradest.testing.problems import (
    five_step_ddim,
    random_stepwise_objective,
    seeded_normal,
    smooth_terminal_objective,
    tiny_mlp,
)

BATCH, DIM, STEPS = 3, 3, 5
# The relative error asked of a converged estimate: float64 round-off over a few steps.
CONVERGED = 1e-9


SAMPLERS = {
    "rectified": lambda: RectifiedFlow(steps=STEPS),
    "flow-sde": lambda: FlowSDE(steps=STEPS, noise_level=0.5),
    "ddim": five_step_ddim,
}


def mlp() -> nn.Module:
    """A small MLP velocity whose output layer is scaled up, so that the step Jacobians
    are far enough from the identity for the top two singular values to stand apart."""
    model = tiny_mlp(DIM, hidden=16, seed=2)
    with torch.no_grad():
        model.output.weight.mul_(6.0)
    return model


def recorded(model: nn.Module, sampler) -> gradest.Trajectory:
    noise = seeded_normal((BATCH, DIM), seed=11)
    return gradest.rollout(model, sampler, noise, generator=torch.Generator().manual_seed(3))


def dense_singular_values(model: nn.Module, sampler, trajectory) -> torch.Tensor:
    """``[N, B, DIM]``: the singular values of every sample's ``dz_N/dz_k``, from the dense
    step Jacobians ``A_j = alpha_j I + beta_j dv_j/dz_j`` multiplied out."""
    chain = dense_chain(model, sampler, trajectory)
    size = BATCH * DIM
    eye = torch.eye(size, dtype=torch.float64)
    product = eye
    values = torch.zeros(STEPS, BATCH, DIM, dtype=torch.float64)
    for k in reversed(range(STEPS)):
        product = product @ (chain.alpha[k] * eye + chain.beta[k] * chain.state_jacobians[k])
        # The batch's samples are independent chains: the product is block diagonal.
        blocks = product.reshape(BATCH, DIM, BATCH, DIM).diagonal(dim1=0, dim2=2)
        values[k] = torch.linalg.svdvals(blocks.permute(2, 0, 1))
    return values


def converging_iters(values: torch.Tensor) -> int:
    """Iterations after which the estimate's relative error is below ``1e-16`` times the
    start vector's misalignment: the estimate ``||M^T x|| / ||x||`` at ``x = M w`` errs
    by ``O(r^(4T))``, ``r`` the largest ratio of the second to the first singular value."""
    ratio = float((values[..., 1] / values[..., 0]).max())
    assert ratio <= 0.97, f"the test's chains need a singular gap, got ratio {ratio:.4f}"
    return math.ceil(math.log(1e-16) / (4 * math.log(ratio)))


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_the_estimate_is_the_dense_operator_norm(kind):
    model, sampler = mlp(), SAMPLERS[kind]()
    trajectory = recorded(model, sampler)
    values = dense_singular_values(model, sampler, trajectory)
    iters = converging_iters(values)
    result = chain_contraction(
        model, sampler, trajectory, iters=iters, generator=torch.Generator().manual_seed(0)
    )
    assert isinstance(result, ChainContraction)
    assert result.steps == tuple(range(STEPS)) and result.num_steps == STEPS
    assert result.norms.shape == result.change.shape == (STEPS, BATCH)
    truth = values[..., 0]
    assert ((result.norms - truth).abs() / truth).max() < CONVERGED
    assert result.change.max() < CONVERGED
    # Not a property of the estimate alone: the chains differ, k by k and sample by sample.
    assert truth.std() > 0.05
    assert torch.equal(result.mean, result.norms.mean(dim=1))


def test_an_unconverged_estimate_is_a_lower_bound_and_says_it_moved():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    trajectory = recorded(model, sampler)
    truth = dense_singular_values(model, sampler, trajectory)[..., 0]
    result = chain_contraction(
        model, sampler, trajectory, iters=1, generator=torch.Generator().manual_seed(0)
    )
    assert (result.norms <= truth * (1 + 1e-12)).all()
    gap = (truth - result.norms) / truth
    # The last change is the move of an estimate still short of the norm.
    assert gap.max() > 1e-4 and result.change.max() > 1e-4


def test_a_linear_velocity_has_the_product_of_its_step_factors():
    """``v = c z`` gives ``A_j = (alpha_j + beta_j c) I``: every vector is a singular
    vector, so one iteration is exact, and the norm is ``|prod_{j >= k}(alpha_j + beta_j c)|``."""

    class Linear(nn.Module):
        def forward(self, z, t):
            return -1.7 * z

    for sampler in (RectifiedFlow(steps=STEPS), five_step_ddim(eta=0.0)):
        trajectory = gradest.rollout(Linear(), sampler, seeded_normal((BATCH, DIM), seed=1))
        alpha, beta, _ = sampler.coefficients()
        factors = (alpha + beta * -1.7).abs()
        expected = torch.stack([factors[k:].prod() for k in range(STEPS)])
        result = chain_contraction(Linear(), sampler, trajectory, iters=1)
        assert torch.allclose(result.norms, expected[:, None].expand(STEPS, BATCH), rtol=1e-13)
        assert result.change.max() < 1e-13
        summary = result.summary()
        assert summary["per_step"] == pytest.approx(float(expected[0]) ** (1 / STEPS), rel=1e-13)
        assert summary["largest"] == pytest.approx(float(expected.max()), rel=1e-13)
        assert summary["largest_step"] == int(expected.argmax())


def test_measured_steps_chunks_and_the_generator():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    trajectory = recorded(model, sampler)
    values = dense_singular_values(model, sampler, trajectory)
    iters = converging_iters(values)

    def measure(**kwargs) -> ChainContraction:
        return chain_contraction(
            model, sampler, trajectory, generator=torch.Generator().manual_seed(5), **kwargs
        )

    few = measure(iters=iters, steps=[3, 0, 1])
    assert few.steps == (0, 1, 3)
    truth = values[[0, 1, 3], :, 0]
    assert ((few.norms - truth).abs() / truth).max() < CONVERGED
    summary = few.summary()
    assert summary["at_middle"] is None and summary["middle_step"] == STEPS // 2
    # One chain per call instead of all of them stacked: the same numbers.
    assert torch.allclose(measure(iters=3).norms, measure(iters=3, chunk=1).norms, atol=1e-14)
    # The start vectors come from the generator: the same seed, the same estimate.
    assert torch.equal(measure(iters=2).norms, measure(iters=2).norms)
    other = chain_contraction(
        model, sampler, trajectory, iters=2, generator=torch.Generator().manual_seed(6)
    )
    assert not torch.equal(measure(iters=2).norms, other.norms)


def test_parameters_get_no_gradient():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    chain_contraction(model, sampler, recorded(model, sampler), iters=1)
    assert all(p.grad is None for p in model.parameters())


# (argument changed, error, message); "states" stands for the trajectory's states tensor.
BAD_INPUTS = [
    ({"iters": 0}, ValueError, r"iters must be an int >= 1, got iters=0"),
    ({"iters": 2.0}, TypeError, r"iters must be an int >= 1"),
    ({"iters": True}, TypeError, r"iters must be an int >= 1"),
    ({"chunk": 0}, ValueError, r"chunk must be an int >= 1"),
    ({"steps": [STEPS]}, ValueError, r"steps must lie in 0 \.\. N-1 = 0 \.\. 4"),
    ({"steps": [1, 1]}, ValueError, r"steps lists a step twice"),
    ({"steps": []}, ValueError, r"steps is empty"),
    ({"steps": "0"}, TypeError, r"steps must be a sequence of ints"),
    ({"steps": [0.0]}, TypeError, r"steps must hold ints"),
    ({"generator": 3}, TypeError, r"generator must be a torch.Generator"),
    ({"sampler": RectifiedFlow(steps=STEPS + 1)}, ValueError, r"different time grid"),
    ({"trajectory": "states"}, TypeError, r"trajectory must be a gradest.Trajectory"),
    ({"model": nn.Module}, TypeError, r"model must be a torch.nn.Module instance"),
    ({"cond": [1]}, TypeError, r"cond must be a dict of keyword arguments"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_argument(change, error, message):
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    trajectory = recorded(model, sampler)
    if change.get("trajectory") == "states":
        change = {"trajectory": trajectory.states}
    arguments = {"model": model, "sampler": sampler, "trajectory": trajectory, **change}
    with pytest.raises(error, match=message) as raised:
        chain_contraction(**arguments)
    assert "\n" not in str(raised.value)


def test_compare_measures_about_ten_steps_with_the_middle():
    assert contraction_steps(50) == list(range(0, 50, 5))
    assert contraction_steps(STEPS) == list(range(STEPS))
    assert contraction_steps(13) == [0, 2, 4, 6, 8, 10, 12]
    assert contraction_steps(15) == [0, 2, 4, 6, 7, 8, 10, 12, 14]


def test_compare_reports_the_library_function_on_its_first_trajectory():
    steps = 12
    model, sampler = mlp(), RectifiedFlow(steps=steps)
    objective = smooth_terminal_objective(DIM)

    def noise_fn(seed):
        return seeded_normal((BATCH, DIM), 100 + seed)

    report = compare(
        model,
        sampler,
        objective,
        ["exact"],
        noise_fn=noise_fn,
        seeds=[4, 7],
        measure_cost=False,
        show_progress=False,
        contraction_iters=3,
    )
    measured = chain_contraction(
        model,
        sampler,
        gradest.rollout(model, sampler, noise_fn(4)),
        iters=3,
        steps=contraction_steps(steps),
        generator=draw_generator(4, 0),
    )
    assert measured.steps == (0, 2, 4, 6, 8, 10)
    one_step = one_step_cotangent_error(
        model, sampler, gradest.rollout(model, sampler, noise_fn(4)), objective
    ).summary()
    assert report.contraction == {"seed": 4, **measured.summary(), "one_step_error": one_step}
    assert report.contraction["mean"] == measured.mean.tolist()
    assert report.to_dict()["contraction"] == report.contraction
    markdown = report.to_markdown()
    assert "Chain contraction" in markdown
    row = f"| {measured.summary()['at_start']:.4g} | {measured.summary()['at_middle']:.4g} |"
    assert row in markdown
    assert (
        f"relative error {one_step['mean_error']:.4g} and cosine {one_step['mean_cosine']:.4g}"
        in markdown
    )
    # Skipped (0 iterations), and not measured for a stepwise objective, which never
    # differentiates through the chain.
    for kind, iters in (("terminal", 0), ("stepwise", CONTRACTION_ITERS)):
        skipped = compare(
            model,
            sampler,
            objective if kind == "terminal" else random_stepwise_objective(steps, (BATCH, DIM)),
            ["exact"],
            noise_fn=noise_fn,
            seeds=1,
            measure_cost=False,
            show_progress=False,
            contraction_iters=iters,
        )
        assert skipped.contraction is None and "Chain contraction" not in skipped.to_markdown()
        assert skipped.to_dict()["contraction"] is None


def test_compare_refuses_a_negative_iteration_count():
    model, sampler = mlp(), RectifiedFlow(steps=STEPS)
    with pytest.raises(ValueError, match=r"contraction_iters must be an int >= 0"):
        compare(
            model,
            sampler,
            smooth_terminal_objective(DIM),
            ["exact"],
            noise_fn=lambda seed: seeded_normal((BATCH, DIM), seed),
            contraction_iters=-1,
        )
