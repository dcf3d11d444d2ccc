"""Classes of mistakes, each met by principle (issue 24): unseen variants of a class get the
same one-line error, or the right answer.

Each test takes a class of input (estimator objects and classes, numpy values, classes
instead of instances, allocations that cannot fit, complex dtypes, in-place losses,
shapes that change at a late step, batch-statistics norms, what a plugin returns or
raises, non-finite report values, output paths, draws that miss every step a loss uses)
and tries several variants of it. ``tests/test_bad_input_sweep.py`` keeps one row per
class in docs/errors.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import attrs
import numpy as np
import pytest
import torch
from torch import nn

import gradest
from gradest import cli, registry
from gradest._checks import check_estimate_grads, trainable_parameters
from gradest.base import surrogate_from_estimate
from gradest.check import run_check
from gradest.errors import GradestError, InvalidType, InvalidValue
from gradest.harness.report import Report
from gradest.harness.statistics import Estimate
from gradest.protocol import Cost, GradientEstimate
from gradest.strategies.exact import Exact
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH, STEPS = 3, 2, 4


@pytest.fixture
def problem():
    model = tiny_mlp(DIM)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    return model, flow, noise, smooth_terminal_objective(DIM)


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


# -- estimator objects and classes ------------------------------------------------------------


def test_an_estimator_object_is_returned_and_a_class_is_refused_saying_what_to_pass():
    est = gradest.estimator("jagg:window=4")
    assert gradest.estimator(est) is est
    assert gradest.estimator(est, window=8) == attrs.evolve(est, window=8)
    with pytest.raises(InvalidType, match="has no option 'windw'"):
        gradest.estimator(est, windw=8)
    for cls in (Exact, type(est)):
        with pytest.raises(InvalidType) as info:
            gradest.estimator(cls)
        message = _one_line(info.value)
        assert f"got the class {cls.__name__}" in message and "instance" in message
        # Never the contradiction of refusing an object while asking for one.
        assert "or pass an estimator object" not in message
    with pytest.raises(InvalidType, match="got the class Exact"):
        gradest.compare(
            tiny_mlp(DIM),
            gradest.RectifiedFlow(steps=2),
            smooth_terminal_objective(DIM),
            [Exact],
            noise_fn=lambda seed: seeded_normal((BATCH, DIM), seed),
            seeds=1,
            draws=1,
            measure_cost=False,
            show_progress=False,
        )


# -- numpy values as options and steps --------------------------------------------------------


@pytest.mark.parametrize(
    "value", [np.int64(4), np.int32(4), np.array(4), torch.tensor(4), np.uint8(4)]
)
def test_integral_numbers_of_any_kind_are_ints(value):
    assert gradest.estimator("jagg", window=value).window == 4
    assert type(gradest.estimator("jagg", window=value).window) is int
    assert gradest.RectifiedFlow(steps=value).num_steps == 4


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.array(0.5)])
def test_real_numbers_of_any_kind_are_floats(value):
    assert gradest.estimator("jagg", tau=value).tau == 0.5


@pytest.mark.parametrize(
    "value", [np.array([4, 8]), np.arange(3), torch.tensor([4.0]), np.zeros((1, 1))]
)
def test_an_array_where_a_scalar_is_expected_is_one_line(value):
    with pytest.raises(InvalidType) as info:
        gradest.estimator("jagg", window=value)
    message = _one_line(info.value)
    assert "option window" in message and "array of shape" in message


def test_bools_are_not_numbers():
    for value in (True, np.bool_(True), np.array(True)):
        with pytest.raises(InvalidType):
            gradest.estimator("jagg", window=value)


# -- classes instead of instances -------------------------------------------------------------


@pytest.mark.parametrize("cls", [gradest.RectifiedFlow, gradest.FlowSDE, gradest.DDIM])
def test_a_sampler_class_is_refused_saying_to_construct_it(problem, cls):
    model, _, noise, objective = problem
    for run in (
        lambda: gradest.rollout(model, cls, noise),
        lambda: gradest.estimator("exact").estimate(model, cls, objective, noise=noise),
        lambda: gradest.estimator("sdo").surrogate(model, cls, objective, noise=noise),
    ):
        with pytest.raises(InvalidType) as info:
            run()
        assert f"got the class {cls.__name__}" in _one_line(info.value)


def test_a_model_class_is_refused_saying_to_construct_it(problem):
    _, flow, noise, _ = problem
    with pytest.raises(InvalidType, match="got the class Linear"):
        gradest.rollout(nn.Linear, flow, noise)


# -- bounds on allocations --------------------------------------------------------------------


@pytest.mark.parametrize("steps", [2**62, 10**15, np.int64(2**40)])
def test_steps_that_cannot_fit_are_refused_naming_the_option_and_a_bound(steps):
    with pytest.raises(InvalidValue) as info:
        gradest.RectifiedFlow(steps=steps)
    message = _one_line(info.value)
    assert f"steps={int(steps)}" in message and "use steps <= " in message


@pytest.mark.parametrize("copies", [10**12, 10**15])
def test_draft_lv_copies_that_cannot_fit_are_refused_before_sampling(problem, copies):
    model, flow, noise, objective = problem
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(InvalidValue) as info:
        gradest.estimator("draft_lv", copies=copies).estimate(model, flow, objective, noise=noise)
    message = _one_line(info.value)
    assert f"copies={copies}" in message and "use copies <= " in message
    assert not calls, "refused before any model call"


def test_a_bound_that_fits_is_accepted(problem):
    model, flow, noise, objective = problem
    result = gradest.estimator("draft_lv", copies=3).estimate(model, flow, objective, noise=noise)
    assert result.usable


# -- complex dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda z: (z * 1j).sum(),
        lambda z: torch.view_as_complex(z[:, :2].contiguous()).sum(),
        lambda z: z.to(torch.complex64).abs().sum() * (1 + 0j),
    ],
)
def test_a_complex_loss_is_one_line(problem, loss_fn):
    model, flow, noise, _ = problem
    for name in ("exact", "sdo", "truncated"):
        with pytest.raises(InvalidType) as info:
            gradest.estimator(name).estimate(
                model, flow, gradest.TerminalObjective(loss_fn), noise=noise
            )
        assert "complex" in _one_line(info.value)


def test_a_complex_stepwise_loss_and_complex_states_are_one_line(problem):
    model, flow, noise, _ = problem
    trajectory = gradest.rollout(model, flow, noise)
    stepwise = gradest.StepwiseObjective(lambda k, v, traj: (v * 1j).sum())
    with pytest.raises(InvalidType, match="complex"):
        gradest.estimator("exact").estimate(model, flow, stepwise, trajectory=trajectory)
    with pytest.raises(InvalidType, match="complex"):
        gradest.rollout(model, flow, noise.to(torch.complex128))


class _ComplexVelocity(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_mlp(DIM)

    def forward(self, z, t):
        return self.inner(z, t) * (1 + 0j)


def test_a_complex_velocity_is_one_line(problem):
    _, flow, noise, _ = problem
    with pytest.raises(InvalidType, match="complex"):
        gradest.rollout(_ComplexVelocity(), flow, noise)


# -- in-place ops on the loss's argument ------------------------------------------------------


@pytest.mark.parametrize(
    ("in_place", "out_of_place"),
    [
        (lambda z: z.mul_(2).pow(2).sum(), lambda z: (z * 2).pow(2).sum()),
        (lambda z: z.add_(1.0).sin().sum(), lambda z: (z + 1.0).sin().sum()),
        (lambda z: z.clamp_(-0.5, 0.5).sum(), lambda z: z.clamp(-0.5, 0.5).sum()),
    ],
)
def test_an_in_place_op_on_the_sample_is_differentiated_like_its_out_of_place_form(
    problem, in_place, out_of_place
):
    model, flow, noise, _ = problem
    for name in ("exact", "truncated:k=2", "draft_lv"):
        estimates = [
            gradest.estimator(name).estimate(
                model,
                flow,
                gradest.TerminalObjective(fn),
                noise=noise,
                generator=torch.Generator().manual_seed(0),
            )
            for fn in (in_place, out_of_place)
        ]
        torch.testing.assert_close(estimates[0].flat(), estimates[1].flat())


def test_an_in_place_op_in_a_stepwise_loss_leaves_the_trajectory_alone(problem):
    model, flow, noise, _ = problem
    trajectory = gradest.rollout(model, flow, noise)
    recorded = trajectory.velocities.clone()
    in_place = gradest.StepwiseObjective(lambda k, v, traj: v.mul_(3).pow(2).sum())
    out_of_place = gradest.StepwiseObjective(lambda k, v, traj: (v * 3).pow(2).sum())
    for name in ("exact", "sdo:full_sum=true"):
        a, b = (
            gradest.estimator(name).estimate(model, flow, objective, trajectory=trajectory)
            for objective in (in_place, out_of_place)
        )
        torch.testing.assert_close(a.flat(), b.flat())
    torch.testing.assert_close(trajectory.velocities[:, :1], recorded[:, :1])


# -- a velocity whose shape changes at a late step --------------------------------------------


class _LateShape(nn.Module):
    """Right shape until ``t`` drops below ``cut``, then ``change(v)``."""

    def __init__(self, cut, change):
        super().__init__()
        self.inner = tiny_mlp(DIM)
        self.cut, self.change = cut, change

    def forward(self, z, t):
        v = self.inner(z, t)
        return v if float(t[0]) > self.cut else self.change(v)


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        (lambda v: v[:, :2], "(2, 2)"),
        (lambda v: v[:1], "(1, 3)"),
        (lambda v: v[..., None], "(2, 3, 1)"),
        (lambda v: v.sum(), "()"),
    ],
)
@pytest.mark.parametrize("name", ["exact", "exact:checkpoint=true", "sdo", "truncated:k=1"])
def test_a_shape_change_at_a_late_step_names_the_step(problem, change, shown, name):
    _, flow, noise, objective = problem
    model = _LateShape(0.3, change)  # t = 0.25 is step 3 of 4
    with pytest.raises(InvalidValue) as info:
        gradest.estimator(name).estimate(model, flow, objective, noise=noise)
    message = _one_line(info.value)
    assert "at step 3" in message and shown in message
    with pytest.raises(InvalidValue, match="at step 3"):
        gradest.rollout(model, flow, noise)


def test_a_non_tensor_at_a_late_step_names_the_step(problem):
    _, flow, noise, _ = problem
    with pytest.raises(InvalidType, match=r"at step 2, got tuple"):
        gradest.rollout(_LateShape(0.6, lambda v: (v,)), flow, noise)


# -- batch-statistics norms -------------------------------------------------------------------


class _Normed(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM).double()
        self.norm = norm.double()

    def forward(self, z, t):
        return self.norm(self.linear(z)) + t[:, None]


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.BatchNorm1d(DIM, track_running_stats=False).eval(),
        lambda: nn.BatchNorm1d(DIM, track_running_stats=False).train(),
        lambda: nn.BatchNorm1d(DIM).train(),
        lambda: nn.BatchNorm1d(DIM, affine=False, track_running_stats=False).eval(),
        lambda: nn.SyncBatchNorm(DIM).train(),
        lambda: nn.SyncBatchNorm(DIM, track_running_stats=False).eval(),
    ],
)
@pytest.mark.parametrize("name", ["exact", "sdo:samples=2", "jagg:window=2"])
def test_a_norm_using_batch_statistics_is_refused_naming_it(problem, norm, name):
    _, flow, noise, objective = problem
    model = _Normed(norm())
    trajectory = gradest.rollout(_Normed(nn.BatchNorm1d(DIM).eval()), flow, noise)
    stepwise = gradest.StepwiseObjective(lambda k, v, traj: v.pow(2).sum())
    for run in (
        lambda: gradest.estimator(name).estimate(model, flow, objective, noise=noise),
        lambda: gradest.estimator(name).surrogate(model, flow, stepwise, trajectory=trajectory),
    ):
        with pytest.raises(InvalidValue) as info:
            run()
        message = _one_line(info.value)
        assert "norm" in message and "GroupNorm" in message


def test_a_norm_with_running_statistics_in_eval_mode_matches_the_hand_written_per_step_loss(
    problem,
):
    """Eval-mode batch norm with running statistics is per-sample: the stepwise estimate
    (several steps in one call) equals the hand-written per-step loss's gradient."""
    _, flow, noise, _ = problem
    norm = nn.BatchNorm1d(DIM)
    with torch.no_grad():
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
    model = _Normed(norm.eval())
    trajectory = gradest.rollout(model, flow, noise)
    target = seeded_normal((BATCH, DIM), 5)

    def loss_fn(k, v, traj):
        return (v - target).pow(2).sum() * (k + 1)

    result = gradest.estimator("exact").estimate(
        model, flow, gradest.StepwiseObjective(loss_fn), trajectory=trajectory
    )
    model.zero_grad()
    total = sum(
        loss_fn(k, model(trajectory.states[k], flow.times[k].expand(BATCH).double()), trajectory)
        for k in range(STEPS)
    )
    total.backward()
    hand = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(result.flat(), hand)


# -- what a plugin returns --------------------------------------------------------------------


class _Plugin:
    """A plugin estimator (not an EstimatorBase) whose grads come from ``make``."""

    name = "partial"
    objectives = ("terminal", "stepwise")

    def __init__(self, make):
        self.make = make

    def __repr__(self):
        return "Partial()"

    def estimate(self, model, sampler, objective, **inputs):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return GradientEstimate(grads=self.make(params), noise_grad=None, cost=Cost())


def _first_only(params):
    name = next(iter(params))
    return {name: torch.ones_like(params[name])}


BAD_GRADS = {
    "missing": (_first_only, InvalidValue, "no gradient for"),
    "extra": (
        lambda p: {**{n: torch.zeros_like(x) for n, x in p.items()}, "bogus": torch.zeros(1)},
        InvalidValue,
        "bogus",
    ),
    "non-tensor": (lambda p: {n: 0.0 for n in p}, InvalidType, "float"),
    "numpy": (lambda p: {n: x.detach().numpy() for n, x in p.items()}, InvalidType, "ndarray"),
    "a list": (lambda p: [torch.zeros_like(x) for x in p.values()], InvalidType, "list"),
    "wrong shape": (lambda p: {n: torch.zeros(1) for n in p}, InvalidValue, "shape"),
    "wrong dtype": (lambda p: {n: x.detach().float() for n, x in p.items()}, InvalidType, "dtype"),
    "nan": (lambda p: {n: torch.full_like(x, math.nan) for n, x in p.items()}, InvalidValue, "NaN"),
    "inf": (
        lambda p: {n: torch.full_like(x, math.inf) for n, x in p.items()},
        InvalidValue,
        "non-finite",
    ),
}


@pytest.mark.parametrize("case", list(BAD_GRADS))
def test_a_plugins_gradients_are_checked_wherever_gradest_uses_them(problem, case):
    model, flow, noise, objective = problem
    make, error, shown = BAD_GRADS[case]
    plugin = _Plugin(make)
    with pytest.raises(error) as info:
        gradest.compare(
            model,
            flow,
            objective,
            [plugin],
            noise_fn=lambda seed: noise,
            seeds=1,
            draws=1,
            measure_cost=False,
            show_progress=False,
        )
    message = _one_line(info.value)
    assert "'partial'" in message and shown in message
    result = plugin.estimate(model, flow, objective, noise=noise)
    with pytest.raises(error, match=shown):
        surrogate_from_estimate(model, result, estimator=plugin)
    with pytest.raises(error, match="'partial'"):  # the check auto and gradest check run
        check_estimate_grads(plugin, result, trainable_parameters(model))


def test_surrogate_from_estimate_trains_every_parameter_of_a_good_estimate(problem):
    model, flow, noise, objective = problem
    result = gradest.estimator("exact").estimate(model, flow, objective, noise=noise)
    loss = surrogate_from_estimate(model, result)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]), result.flat())


# -- a plugin that raises or exits inside a command -------------------------------------------


def _plugin_class(where, exception):
    class Failing:
        name = "failing"
        objectives = ("terminal", "stepwise")

        def __init__(self):
            if where == "constructor":
                raise exception

        def __repr__(self):
            return "Failing()"

        def estimate(self, *args, **kwargs):
            raise exception

    Failing.__module__ = "failing_plugin"
    return Failing


def _run_cli(argv):
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("where", ["constructor", "estimate"])
@pytest.mark.parametrize(
    "exception",
    [SystemExit(0), SystemExit(None), SystemExit("bye"), RuntimeError("boom"), ValueError("bad")],
)
@pytest.mark.parametrize("command", ["compare", "check"])
def test_a_plugin_failing_in_a_command_ends_it_non_zero_with_one_line(
    monkeypatch, tmp_path, where, exception, command
):
    real = registry.available_estimators()
    monkeypatch.setattr(
        registry,
        "available_estimators",
        lambda: {**real, "failing": _plugin_class(where, exception)},
    )
    argv = [command, "--estimators", "failing", "--steps", "2", "--quiet"]
    if command == "compare":
        argv += ["--seeds", "1", "--draws", "1", "--repeats", "1", "--batch", "2"]
        argv += ["--no-plots", "--no-sweeps", "--out", str(tmp_path / "out")]
    status, _, stderr = _run_cli(argv)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status not in (0, None)
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith(f"gradest {command}: error: "), stderr
    assert "'failing'" in lines[0] and type(exception).__name__ in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_keyboard_interrupt_in_a_plugin_names_it(monkeypatch, tmp_path):
    real = registry.available_estimators()
    failing = _plugin_class("estimate", KeyboardInterrupt())
    monkeypatch.setattr(registry, "available_estimators", lambda: {**real, "failing": failing})
    status, _, stderr = _run_cli(["check", "--estimators", "failing", "--steps", "2", "--quiet"])
    assert status == 130
    assert "interrupted" in stderr and "'failing'" in stderr
    with pytest.raises(KeyboardInterrupt):  # still a KeyboardInterrupt for library callers
        run_check(["failing"], steps=2, show_progress=False)


def test_a_plugin_error_is_a_gradest_error_chained_to_the_original(monkeypatch):
    real = registry.available_estimators()
    failing = _plugin_class("constructor", SystemExit(0))
    monkeypatch.setattr(registry, "available_estimators", lambda: {**real, "failing": failing})
    with pytest.raises(GradestError) as info:
        gradest.estimator("failing")
    assert isinstance(info.value, registry.PluginError)
    assert isinstance(info.value.__cause__, SystemExit)


# -- reports show non-finite values as such ---------------------------------------------------


def test_report_shows_non_finite_values_and_stays_valid_json(problem, tmp_path):
    model, flow, noise, objective = problem
    report = gradest.compare(
        model,
        flow,
        objective,
        ["exact"],
        noise_fn=lambda seed: noise,
        seeds=1,
        draws=1,
        measure_cost=False,
        show_progress=False,
    )
    row = attrs.evolve(
        report.rows[0],
        bias=Estimate(math.nan, math.nan),
        variance=Estimate(math.inf, 0.0),
        mse=Estimate(-math.inf, math.nan),
        fallback_fraction=math.nan,
    )
    report = Report(config=report.config, rows=[row])
    markdown = report.to_markdown()
    assert "nan ± nan" in markdown and "inf ± 0" in markdown and "-inf ± nan" in markdown
    assert "0 ± 0 | inf" not in markdown
    text = report.to_json()
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))
    estimator = data["estimators"][0]
    assert estimator["bias"] == {"mean": "NaN", "stderr": "NaN"}
    assert estimator["variance"]["mean"] == "Infinity"
    assert estimator["mse"]["mean"] == "-Infinity"
    from gradest_lab.compare.report_files import write_report

    out = write_report(report, tmp_path / "run", plots=False)
    json.loads((out / "report.json").read_text(), parse_constant=lambda name: pytest.fail(name))


# -- output paths -----------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["a" * 256, "b" * 1000, "é" * 200])
def test_an_output_path_component_the_file_system_cannot_name_is_one_line(tmp_path, component):
    out = tmp_path / component / "report"
    status, _, stderr = _run_cli(["compare", "--out", str(out), "--quiet"])  # default: 50 steps
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in stderr
    assert "--out" in lines[0] and "path component" in lines[0]


def test_compare_checks_its_output_files_before_the_work(tmp_path):
    (tmp_path / "out" / "report.md").mkdir(parents=True)
    status, stdout, stderr = _run_cli(["compare", "--out", str(tmp_path / "out"), "--quiet"])
    assert status == 2 and "report.md" in stderr and stdout == ""


# -- a draw that misses every step a loss uses ------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["sdo", "sdo:samples=2", "truncated:random=uniform", "telescope", "jagg:debias=1"]
)
def test_a_draw_missing_every_step_a_loss_uses_is_a_zero_estimate(problem, spec):
    model, flow, noise, _ = problem
    trajectory = gradest.rollout(model, flow, noise)
    last_only = gradest.StepwiseObjective(
        lambda k, v, traj: v.pow(2).sum() if k == STEPS - 1 else v.detach().sum()
    )
    est = gradest.estimator(spec)
    for seed in range(12):
        generator = torch.Generator().manual_seed(seed)
        result = est.estimate(model, flow, last_only, trajectory=trajectory, generator=generator)
        assert torch.isfinite(result.flat()).all()
        sampled = result.info.get("sampled_steps")
        if sampled is not None and STEPS - 1 not in sampled:
            assert not result.flat().any()
        sur = est.surrogate(
            model,
            flow,
            last_only,
            trajectory=trajectory,
            generator=torch.Generator().manual_seed(seed),
        )
        sur.loss.backward()
    never = gradest.StepwiseObjective(lambda k, v, traj: v.detach().sum())
    with pytest.raises(InvalidValue, match="does not depend on the velocities at any step"):
        est.estimate(model, flow, never, trajectory=trajectory)
