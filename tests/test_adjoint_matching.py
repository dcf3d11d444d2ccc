"""Adjoint matching (gradest.rl.adjoint_matching) against the dense reference, the paper's
predictions and a linear-Gaussian toy with a closed-form optimum."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

import gradest
from gradest import rl
from gradest.protocol import supports
from gradest.reference import dense_chain, exact_gradient, relative_error
from gradest.registry import builtin_estimators
from gradest.testing import assert_matches_definition, perturb_parameters, seeded_normal, tiny_mlp

DIM, BATCH, STEPS = 3, 4, 5


def per_sample_loss(z: Tensor) -> Tensor:
    """A smooth non-quadratic per-sample loss ``[B, D] -> [B]``."""
    w = torch.tensor([0.7, -1.3, 0.4], dtype=z.dtype)
    return torch.sin(z * w).pow(2).sum(1) + 0.1 * z.pow(2).sum(1)


def _setup(tuned: bool = True, flow=None):
    """``(base, model, flow, trajectory)``: the trajectory is a rollout of ``model``."""
    base = tiny_mlp(DIM, hidden=8, seed=0)
    base.requires_grad_(False)
    model = copy.deepcopy(base).requires_grad_(True)
    if tuned:
        perturb_parameters(model)
    flow = flow or rl.memoryless_flow(STEPS)
    noise = seeded_normal((BATCH, DIM), seed=11)
    trajectory = gradest.rollout(model, flow, noise, generator=torch.Generator().manual_seed(7))
    return base, model, flow, trajectory


# -- the memoryless sampler ----------------------------------------------------------------


def test_memoryless_flow_coefficients():
    """``sigma_t^2 = 2 t / (1 - t)``, each step the exact Gaussian transition given the data
    prediction ``x^ = z - t v`` (DDPM's posterior, ``r = (1 - t) / (1 - t')``,
    ``c = t'^2 r / t^2``): ``alpha = (1 - t') + c t``, ``beta = -(1 - t') t + c (1 - t) t``,
    ``s^2 = (t'/t)^2 (t^2 - r^2 t'^2)``; steps with ``|h| <= 0.2 (1 - t)`` and the step into
    ``t = 0`` keep Euler-Maruyama's ``1 + h / (1 - t)``, ``2 h``, ``2 t |h| / (1 - t)``. The
    marginals are tested in tests/test_memoryless.py."""
    times = [1.0, 0.8, 0.5, 0.45, 0.1, 0.0]
    flow = rl.memoryless_flow(times=times)
    assert flow.noise_level == math.sqrt(2) == rl.MEMORYLESS_NOISE_LEVEL
    assert isinstance(flow, gradest.FlowSDE)
    assert repr(flow) == "MemorylessFlow(times=<6 points>)"
    alpha, beta, scale = flow.coefficients()
    assert rl.adjoint_matching.STIFFNESS_SWITCH == 0.2
    for k in (0, 1, 3):  # |h| > 0.2 (1 - t): the exact Gaussian step given x^
        t, tn = times[k], times[k + 1]
        r = (1 - t) / (1 - tn)
        c = tn**2 * r / t**2
        assert alpha[k].item() == pytest.approx((1 - tn) + c * t, rel=1e-14, abs=1e-15)
        assert beta[k].item() == pytest.approx(-(1 - tn) * t + c * (1 - t) * t, rel=1e-14)
        assert scale[k].item() ** 2 == pytest.approx(
            (tn / t) ** 2 * (t**2 - r**2 * tn**2), rel=1e-12
        )
    for k in (2, 4):  # |h| <= 0.2 (1 - t), and the step into t = 0: Euler-Maruyama
        t, h = times[k], times[k + 1] - times[k]
        assert alpha[k].item() == pytest.approx(1 + h / (1 - t), rel=1e-14)
        assert beta[k].item() == pytest.approx(2 * h, rel=1e-14)
        assert scale[k].item() ** 2 == pytest.approx(2 * t * abs(h) / (1 - t), rel=1e-14)
    # The first step forgets z_0 but through x^ = z_0 - v_0.
    assert alpha[0].item() == pytest.approx(0.2) and beta[0].item() == pytest.approx(-0.2)
    assert scale[0].item() == pytest.approx(0.8)


class GaussianVelocity(nn.Module):
    """The exact velocity ``E[eps - x | z_t]`` for 1-D data ``x ~ N(mean, std^2)``:
    ``v = g(t) z + c(t)``."""

    def __init__(self, mean: float, std: float):
        super().__init__()
        self.mean, self.std = mean, std

    def slope_offset(self, t: float) -> tuple[float, float]:
        variance = (1 - t) ** 2 * self.std**2 + t**2
        slope = (t - (1 - t) * self.std**2) / variance  # Cov(eps - x, z_t) / Var(z_t)
        return slope, -self.mean - slope * (1 - t) * self.mean

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        t = t[:, None]
        variance = (1 - t) ** 2 * self.std**2 + t**2
        slope = (t - (1 - t) * self.std**2) / variance
        return -self.mean + slope * (z - (1 - t) * self.mean)


def _sensitivity(noise_level: float, steps: int) -> float:
    """``d z_N / d z_0`` of the exact Gaussian model's chain, from the lean adjoint of
    ``l(z) = z``: the coefficient of the initial noise in the final sample."""
    model = GaussianVelocity(0.5, 0.3)
    flow = gradest.FlowSDE(steps, noise_level=noise_level)
    noise = seeded_normal((2, 1), seed=1)
    trajectory = gradest.rollout(model, flow, noise, generator=torch.Generator().manual_seed(0))
    targets = rl.lean_adjoint(model, flow, trajectory, lambda z: z[:, 0])
    return float(targets.adjoints[0, 0, 0])


def test_memoryless_schedule_forgets_the_initial_noise():
    """The chain is linear for Gaussian data, so ``z_N = C z_0 + (independent noise)``.

    The ODE keeps ``C ~ 0.3`` (a deterministic map), Flow-GRPO's ``a = 0.7`` a few
    percent; the memoryless ``a = sqrt(2)`` drives it to zero as the grid refines.
    """
    memoryless = [abs(_sensitivity(math.sqrt(2), n)) for n in (10, 40, 160)]
    assert memoryless[0] < 1e-4 and memoryless[1] < memoryless[0] / 10
    assert memoryless[2] < memoryless[1] / 10
    assert abs(_sensitivity(0.7, 40)) > 0.03
    assert abs(_sensitivity(0.0, 40)) > 0.25
    # Monte Carlo: the empirical correlation of z_0 and z_N is noise (|r| < 4 / sqrt(n)).
    model, samples = GaussianVelocity(0.5, 0.3), 20_000
    noise = seeded_normal((samples, 1), seed=5)
    for level, independent in ((math.sqrt(2), True), (0.0, False)):
        final = gradest.rollout(
            model,
            gradest.FlowSDE(20, noise_level=level),
            noise,
            generator=torch.Generator().manual_seed(6),
        ).states[-1]
        r = torch.corrcoef(torch.stack([noise[:, 0], final[:, 0]]))[0, 1].item()
        assert (abs(r) < 4 / math.sqrt(samples)) is independent


# -- the lean adjoint ------------------------------------------------------------------------


def test_lean_adjoint_is_the_dense_product_of_base_jacobians():
    base, _, flow, trajectory = _setup()
    targets = rl.lean_adjoint(base, flow, trajectory, per_sample_loss)
    # A_k = d v_base / d z at the recorded z_k (dense_chain wants trainable parameters).
    chain = dense_chain(copy.deepcopy(base).requires_grad_(True), flow, trajectory)
    final = trajectory.states[-1].detach().requires_grad_(True)
    (a,) = torch.autograd.grad(per_sample_loss(final).sum(), final)
    a = a.reshape(-1)
    expected = [a]
    size = a.numel()
    for k in reversed(range(STEPS)):
        step = (
            chain.alpha[k] * torch.eye(size, dtype=torch.float64)
            + chain.beta[k] * (chain.state_jacobians[k])
        )
        a = step.T @ a
        expected.insert(0, a)
    expected_adjoints = torch.stack(expected).reshape(targets.adjoints.shape)
    torch.testing.assert_close(targets.adjoints, expected_adjoints, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        targets.base_velocities,
        chain.velocities.reshape(targets.base_velocities.shape),
        rtol=0,
        atol=1e-13,
    )
    torch.testing.assert_close(targets.losses, per_sample_loss(trajectory.states[-1]))
    # A given terminal gradient gives the same adjoints (and no losses).
    given = rl.lean_adjoint(base, flow, trajectory, targets.adjoints[-1])
    assert torch.equal(given.adjoints, targets.adjoints) and given.losses is None


def test_lean_adjoint_uses_the_base_model_only():
    """The adjoint depends on the fine-tuned model only through the recorded states."""
    base, model, flow, trajectory = _setup()
    targets = rl.lean_adjoint(base, flow, trajectory, per_sample_loss)
    other = rl.lean_adjoint(model, flow, trajectory, per_sample_loss)
    assert relative_error(other.adjoints[:-1], targets.adjoints[:-1]) > 1e-3
    assert torch.equal(other.adjoints[-1], targets.adjoints[-1])


# -- the regression objective --------------------------------------------------------------


def _objective(base, flow, trajectory):
    return rl.adjoint_matching_objective(base, flow, trajectory, per_sample_loss)


def test_cotangents_are_the_regression_gradient():
    """``c_k = (beta_k^2 / s_k^2)(v_k - v_base,k) / B + beta_k a_{k+1} / B``."""
    base, model, flow, trajectory = _setup()
    targets = rl.lean_adjoint(base, flow, trajectory, per_sample_loss)
    objective = rl.regression_objective(flow, trajectory, targets)
    _, beta, scale = flow.coefficients()
    for k in range(STEPS):
        v = trajectory.velocities[k]
        loss, cotangent = objective.step_cotangent(k, v, trajectory)
        delta = v - targets.base_velocities[k]
        residual = beta[k] / scale[k] * delta + scale[k] * targets.adjoints[k + 1]
        assert float(loss) == pytest.approx(0.5 * residual.pow(2).sum().item() / BATCH, rel=1e-12)
        expected = (
            beta[k] ** 2 / scale[k] ** 2 * delta + beta[k] * targets.adjoints[k + 1]
        ) / BATCH
        torch.testing.assert_close(cotangent, expected, rtol=1e-12, atol=1e-15)


def _hand_gradient(model, flow, trajectory, objective) -> dict[str, Tensor]:
    """autograd of ``sum_k l_k(model(z_k, t_k))`` on the recorded states."""
    total = 0.0
    for k in range(trajectory.num_steps):
        z = trajectory.states[k]
        t = torch.full((z.shape[0],), float(flow.times[k]), dtype=z.dtype)
        total = total + objective.loss_fn(k, model(z, t), trajectory)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(total, [dict(model.named_parameters())[n] for n in names])
    return dict(zip(names, grads, strict=True))


# Every built-in with its defaults, and options that change which steps / nodes it uses.
SPECS = (
    *builtin_estimators(),
    "jagg:window=2",
    "jagg:window=3,shared_knots=true",
    "jagg:window=3,debias=1",
    "sdo:samples=2",
    "truncated:k=2",
    "truncated:random=uniform",
    "telescope:mean_depth=2",
)


@pytest.mark.parametrize("spec", SPECS)
def test_every_builtin_matches_its_definition_on_adjoint_matching(spec):
    if not supports(gradest.estimator(spec), "stepwise"):
        pytest.skip(f"{spec} is for terminal objectives only")
    base, model, flow, trajectory = _setup()
    objective = _objective(base, flow, trajectory)
    generator = torch.Generator().manual_seed(2)
    assert_matches_definition(
        spec,
        model,
        flow,
        objective,
        trajectory=trajectory,
        generator=generator,
        rtol=1e-10,
        # auto's first call probes (exact), its next the chosen candidate
        surrogate=not spec.startswith("auto"),
    )


def test_exact_is_autograd_of_the_total_loss():
    base, model, flow, trajectory = _setup()
    objective = _objective(base, flow, trajectory)
    result = gradest.estimator("exact").estimate(model, flow, objective, trajectory=trajectory)
    assert relative_error(result.grads, _hand_gradient(model, flow, trajectory, objective)) <= 1e-12
    truth, _ = exact_gradient(model, flow, objective, trajectory)
    assert relative_error(result.grads, truth) <= 1e-10


def test_gradient_at_the_base_model_is_the_reward_gradient():
    """At ``theta = base`` the control term vanishes and the lean adjoint is the full one,
    so the adjoint-matching gradient is the exact gradient of ``mean_b l(z_N)`` through
    the same (reparameterised) memoryless chain: the first update follows the reward."""
    base, model, flow, trajectory = _setup(tuned=False)
    objective = _objective(base, flow, trajectory)
    terminal = gradest.TerminalObjective(lambda z: per_sample_loss(z).mean())
    ours = gradest.estimator("exact").estimate(model, flow, objective, trajectory=trajectory)
    reward_gradient = gradest.estimator("exact").estimate(
        model, flow, terminal, trajectory=trajectory
    )
    assert relative_error(ours.grads, reward_gradient.grads) <= 1e-10
    dense, _ = exact_gradient(model, flow, terminal, trajectory)
    assert relative_error(ours.grads, dense) <= 1e-10
    # Off the base model the two differ (the control cost and the lean adjoint).
    perturb_parameters(model, scale=0.2)
    moved = gradest.rollout(
        model, flow, trajectory.states[0], generator=torch.Generator().manual_seed(7)
    )
    ours = gradest.estimator("exact").estimate(
        model, flow, _objective(base, flow, moved), trajectory=moved
    )
    other = gradest.estimator("exact").estimate(model, flow, terminal, trajectory=moved)
    assert relative_error(ours.grads, other.grads) > 1e-2


def test_objective_refuses_a_fresh_path():
    base, model, flow, trajectory = _setup()
    with pytest.raises(ValueError, match="pass that trajectory to surrogate/estimate"):
        gradest.estimator("exact").estimate(
            model,
            flow,
            _objective(base, flow, trajectory),
            noise=trajectory.states[0],
            generator=torch.Generator().manual_seed(8),
        )


# -- a linear-Gaussian toy with a known optimum ----------------------------------------------

MEAN, STD, TARGET, WEIGHT = 0.5, 0.3, 1.5, 10.0  # data N(0.5, 0.3^2), loss 5 (x - 1.5)^2


class Tuned(nn.Module):
    """The base velocity plus a learned affine correction per grid step, ``p_k z + q_k``:
    the family holds the optimal control of a quadratic loss exactly."""

    def __init__(self, base: GaussianVelocity, steps: int):
        super().__init__()
        self.base, self.steps = base, steps
        self.p = nn.Parameter(torch.zeros(steps, dtype=torch.float64))
        self.q = nn.Parameter(torch.zeros(steps, dtype=torch.float64))

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        k = torch.round((1 - t) * self.steps).long()  # rows may be at different times
        return self.base(z, t) + self.p[k][:, None] * z + self.q[k][:, None]


def _fixed_point_mean(flow, base: GaussianVelocity) -> float:
    """Mean of ``z_N`` at the fixed point of adjoint matching on this grid, in closed form.

    The chain is linear: ``v_base = g_k z + c_k``; the lean adjoint of ``l = w/2 (x - x*)^2``
    is ``a_{k+1} = w (x_N - x*) P_{k+1}``, ``P_{k+1} = prod_{j>k} (alpha_j + beta_j g_j)``, and
    the regression's minimiser is ``v - v_base = -(s_k^2 / beta_k) E[a_{k+1} | z_k]``, affine in
    ``z_k`` with ``E[x_N | z_k] = M_k z_k + m_k`` solved backwards (each step's correction
    enters its own conditional mean, hence the division by ``D``).
    """
    alpha, beta, scale = (c.tolist() for c in flow.coefficients())
    steps = flow.num_steps
    slopes, offsets = zip(*(base.slope_offset(float(t)) for t in flow.times[:-1]), strict=True)
    jac = [alpha[k] + beta[k] * slopes[k] for k in range(steps)]
    tail = [1.0] * (steps + 1)
    for k in reversed(range(steps)):
        tail[k] = tail[k + 1] * jac[k]
    gain, shift = 1.0, 0.0  # E[x_N | z_{k+1} = z] = gain z + shift
    for k in reversed(range(steps)):
        control = -(scale[k] ** 2 / beta[k]) * WEIGHT * tail[k + 1]
        d = 1 - gain * beta[k] * control
        gain, shift = (
            gain * jac[k] / d,
            (gain * beta[k] * offsets[k] + shift - gain * beta[k] * control * TARGET) / d,
        )
    return shift  # E[z_0] = 0


def test_toy_moves_the_sample_mean_to_the_tilted_mean():
    """``p*(x) ∝ N(x; 0.5, 0.3^2) exp(-5 (x - 1.5)^2)`` has mean
    ``(0.5 / 0.09 + 15) / (1 / 0.09 + 10) = 0.9737``. Adjoint matching's fixed point on a
    10-step grid is 0.9848 (closed form above; it converges to 0.9737 as the grid refines,
    which pins the derivation), and 300 Adam steps from the base model (mean 0.5) reach it.

    Tolerances: the trained model's sample mean over ``n = 20000`` fresh samples is within
    4 standard errors of the fixed point plus an optimisation allowance of 0.005 (1% of
    the 0.48 shift; Adam's steady-state jitter at the final lr is about 0.002).
    """
    tilted = (MEAN / STD**2 + WEIGHT * TARGET) / (1 / STD**2 + WEIGHT)
    base = GaussianVelocity(MEAN, STD)
    gaps = [abs(_fixed_point_mean(rl.memoryless_flow(n), base) - tilted) for n in (10, 40, 160)]
    assert gaps[0] < 0.02 and gaps[1] < gaps[0] / 3 and gaps[2] < gaps[1] / 3

    steps, batch, updates = 10, 256, 300
    flow = rl.memoryless_flow(steps)
    model = Tuned(base, steps)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(0)
    est = gradest.estimator("exact")

    def loss(z: Tensor) -> Tensor:
        return 0.5 * WEIGHT * (z[:, 0] - TARGET) ** 2

    for update in range(updates):
        if update == updates // 2:
            for group in optimizer.param_groups:
                group["lr"] = 0.005
        noise = torch.randn((batch, 1), generator=generator, dtype=torch.float64)
        trajectory = gradest.rollout(model, flow, noise, generator=generator)
        objective = rl.adjoint_matching_objective(base, flow, trajectory, loss)
        optimizer.zero_grad()
        est.surrogate(model, flow, objective, trajectory=trajectory).loss.backward()
        optimizer.step()

    samples = 20_000
    noise = torch.randn((samples, 1), generator=generator, dtype=torch.float64)
    with torch.no_grad():
        final = gradest.rollout(model, flow, noise, generator=generator).states[-1][:, 0]
    standard_error = final.std().item() / math.sqrt(samples)
    target = _fixed_point_mean(flow, base)
    assert abs(final.mean().item() - target) <= 4 * standard_error + 0.005
    assert abs(final.mean().item() - MEAN) > 0.4  # it moved (the base mean is 0.5)


# -- bad input -------------------------------------------------------------------------------


def test_bad_input_names_the_argument_and_the_fix():
    base, model, flow, trajectory = _setup()
    with pytest.raises(ValueError, match=r"one loss per sample, shape \[4\].*lambda z: -reward"):
        rl.lean_adjoint(base, flow, trajectory, lambda z: per_sample_loss(z).mean())
    with pytest.raises(ValueError, match="does not depend on z_final"):
        rl.lean_adjoint(base, flow, trajectory, lambda z: per_sample_loss(z.detach()))
    with pytest.raises(TypeError, match="loss must be a function z_final"):
        rl.lean_adjoint(base, flow, trajectory, "reward")
    with pytest.raises(ValueError, match=r"loss gradient at the final state, shape \(4, 3\)"):
        rl.lean_adjoint(base, flow, trajectory, torch.zeros(BATCH, DIM + 1, dtype=torch.float64))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        rl.lean_adjoint(lambda z, t: z, flow, trajectory, per_sample_loss)
    with pytest.raises(ValueError, match="different time grid"):
        rl.adjoint_matching_objective(
            base, rl.memoryless_flow(STEPS + 1), trajectory, per_sample_loss
        )
    ode = gradest.RectifiedFlow(steps=STEPS)
    ode_path = gradest.rollout(model, ode, trajectory.states[0])
    with pytest.raises(ValueError, match=r"stochastic sampler.*memoryless_flow"):
        rl.adjoint_matching_objective(base, ode, ode_path, per_sample_loss)
    with pytest.raises(TypeError, match="targets must be a gradest.rl.LeanAdjoint"):
        rl.regression_objective(flow, trajectory, {"adjoints": None})
    targets = rl.lean_adjoint(base, flow, trajectory, per_sample_loss)
    short = rl.LeanAdjoint(targets.adjoints[1:], targets.base_velocities[1:], None)
    with pytest.raises(ValueError, match="targets do not belong to this trajectory"):
        rl.regression_objective(flow, trajectory, short)
    with pytest.raises(ValueError, match="noise_level must be a finite float"):
        gradest.FlowSDE(STEPS, noise_level=-1.0)
