"""``gradest.compare``: bias, variance and cost of estimators on one model and objective.

Every estimator sees the same trajectories (one per seed, sampled with the current
model) and the same generator seeds for its random choices (common random numbers), so
differences between rows are differences between estimators, not between draws.
Stochastic estimators are drawn ``draws`` times per trajectory; deterministic ones once.
For a terminal objective the report also holds the chain's contraction on the first
trajectory (:func:`~gradest.harness.contraction.chain_contraction`), the condition the
one-step estimators' (``sdo``, ``drtune``) error bound rests on, and on the same trajectory
their cotangents' error against the exact ones
(:func:`~gradest.harness.one_step_error.one_step_cotangent_error`).
"""

from __future__ import annotations

import datetime
import itertools
import math
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from tqdm import tqdm

from gradest._checks import check_allocation, check_estimate_grads, trainable_parameters
from gradest.errors import InvalidType, InvalidValue
from gradest.harness.contraction import chain_contraction
from gradest.harness.cost import (
    COST_DRAWS,
    count_flops,
    interleaved_wall_times,
    peak_allocated_bytes,
    ratio,
    retained_activation_bytes,
)
from gradest.harness.one_step_error import one_step_cotangent_error
from gradest.harness.report import CostRow, EstimatorRow, Report
from gradest.harness.statistics import Estimate, TrajectoryStats, trajectory_stats
from gradest.harness.tensor_metrics import (
    TensorLayout,
    adam_cosine,
    mean_of,
    second_moment,
    sign_agreement,
    tensor_stats,
)
from gradest.objectives import Objective, StepwiseObjective, TerminalObjective
from gradest.protocol import is_estimator, supports
from gradest.registry import call_plugin
from gradest.registry import estimator as build_estimator
from gradest.samplers import AffineSampler
from gradest.trajectory import Trajectory, rollout

NoiseFn = Callable[[int], Tensor]
# compare()'s default power iterations of the chain's contraction: few, to keep its cost
# small beside the estimates; the report prints the last change, so a measurement that
# has not converged says so.
CONTRACTION_ITERS = 8
# About this many evenly spaced steps measured (contraction_steps): chain k costs N - k
# rows of each sweep, so at N = 50 ten steps cost 275 rows where all fifty cost 1275.
CONTRACTION_POINTS = 10
CondFn = Callable[[int], Mapping[str, Any] | None]


def _resolve(spec: Any, what: str) -> Any:
    if isinstance(spec, str) or is_estimator(spec):  # a class gets the registry's message
        return build_estimator(spec)
    raise InvalidType(f"{what} must be an estimator spec string or an estimator, got {spec!r}")


def _resolve_seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, bool):
        raise InvalidType(f"seeds must be a positive int or a list of ints, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds <= 0:
            raise InvalidValue(f"seeds must be >= 1 (the number of trajectories), got {seeds}")
        return list(range(seeds))
    seed_list = list(seeds)
    if not seed_list or not all(isinstance(s, int) and not isinstance(s, bool) for s in seed_list):
        raise InvalidValue(
            f"seeds must be a positive int or a non-empty list of ints, got {seeds!r}"
        )
    return seed_list


def short_label(est: Any) -> str:
    """``jagg:window=8,shared_knots=True``: the name and the options that differ from defaults."""
    name = getattr(est, "name", type(est).__name__)
    if not attrs.has(type(est)):
        return name
    changed = [
        f"{field.name}={getattr(est, field.name)}"
        for field in attrs.fields(type(est))
        if field.default is not attrs.NOTHING and getattr(est, field.name) != field.default
    ]
    return name + (":" + ",".join(changed) if changed else "")


def contraction_steps(num_steps: int) -> list[int]:
    """The steps ``k`` at which :func:`compare` measures the chain's contraction: every
    ``ceil(N / CONTRACTION_POINTS)``-th step from 0 (every step when ``N <= 10``) and
    ``N // 2``, the middle its report quotes."""
    stride = math.ceil(num_steps / CONTRACTION_POINTS)
    return sorted(set(range(0, num_steps, stride)) | {num_steps // 2})


def draw_generator(seed: int, draw: int) -> torch.Generator:
    """The generator of draw ``draw`` on trajectory ``seed``: the same for every estimator."""
    return torch.Generator().manual_seed(1_000_003 * seed + draw)


def _plugin_estimate(
    est: Any, model: torch.nn.Module, sampler: AffineSampler, objective: Objective, **inputs: Any
) -> Any:
    """``est.estimate(model, sampler, objective, **inputs)``, with an exception raised inside a
    plugin's estimate() labelled with the plugin (:func:`gradest.registry.call_plugin`)."""
    return call_plugin(est, "estimate()", est.estimate, model, sampler, objective, **inputs)


def is_stochastic(est: Any, run: Callable[[Any, torch.Generator], Tensor]) -> bool:
    """Whether an estimator's result depends on its generator (two draws differ)."""
    declared = getattr(est, "stochastic", None)
    if isinstance(declared, bool):
        return declared
    return not torch.equal(run(est, draw_generator(0, 0)), run(est, draw_generator(0, 1)))


def compare(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    estimators: Sequence[Any],
    *,
    noise_fn: NoiseFn,
    seeds: int | Sequence[int] = 8,
    cond_fn: CondFn | None = None,
    reference: Any = "exact",
    draws: int = 16,
    timing_repeats: int = 5,
    measure_cost: bool = True,
    show_progress: bool = True,
    contraction_iters: int = CONTRACTION_ITERS,
) -> Report:
    """Measure each estimator's agreement with the reference gradient and its cost.

    ``compare(...)`` is ``prepare_compare(...).run()``: every argument is checked before any
    work starts (:func:`prepare_compare`, for a caller that has more to do in between,
    such as claiming the folder the report goes to).

    Args:
        model: the velocity model (``model(z, t, **cond)``).
        sampler: the sampler, e.g. ``gradest.RectifiedFlow(steps=50)``.
        objective: ``TerminalObjective`` or ``StepwiseObjective`` (evaluated on each
            seed's rollout).
        estimators: spec strings (``"jagg:window=4"``) or estimator instances.
        noise_fn: ``noise_fn(seed) -> [B, ...]`` initial noise of trajectory ``seed``.
        seeds: number of trajectories, or the list of seeds.
        cond_fn: ``cond_fn(seed) -> dict`` of model keyword arguments (or None).
        reference: an exact estimator (spec or instance) giving the reference gradient.
        draws: draws per trajectory for stochastic estimators.
        timing_repeats: repeats of the wall-time measurement (median, interleaved).
        measure_cost: also measure FLOPs, retained activation bytes and wall time.
        show_progress: a progress bar on stderr.
        contraction_iters: power iterations of the chain's contraction
            (:func:`~gradest.harness.contraction.chain_contraction` at the steps
            :func:`contraction_steps` lists, on the first seed's trajectory, start vectors
            from ``draw_generator(seed, 0)``), measured for a terminal objective only (a
            stepwise one never differentiates through the chain); 0 skips it. Each
            iteration costs ``N`` JVP and ``N`` VJP calls on ``sum_k (N - k) x B`` rows
            each way over the measured ``k``: at ``N = 50``, 275 B, about 5.5 rollouts'
            worth of rows.

    Returns:
        A :class:`~gradest.harness.report.Report`.
    """
    return prepare_compare(
        model,
        sampler,
        objective,
        estimators,
        noise_fn=noise_fn,
        seeds=seeds,
        cond_fn=cond_fn,
        reference=reference,
        draws=draws,
        timing_repeats=timing_repeats,
        measure_cost=measure_cost,
        show_progress=show_progress,
        contraction_iters=contraction_iters,
    ).run()


@attrs.frozen(eq=False)
class PreparedCompare:
    """A :func:`compare` whose arguments have all been checked; :meth:`run` does the work.

    Built by :func:`prepare_compare`, never by hand. Attributes as :func:`compare`'s
    arguments, resolved: the estimators and the reference built, the seeds listed, and
    ``parameters`` the model's trainable parameters by name (what every estimate must
    cover).
    """

    model: torch.nn.Module
    parameters: dict[str, torch.Tensor]
    sampler: AffineSampler
    objective: Objective
    estimators: list[Any]
    reference: Any
    noise_fn: NoiseFn
    cond_fn: CondFn | None
    seeds: list[int]
    draws: int
    timing_repeats: int
    measure_cost: bool
    show_progress: bool
    contraction_iters: int = 0

    def run(self) -> Report:
        """Measure every estimator against the reference (the work of :func:`compare`)."""
        return _run_compare(self)


def prepare_compare(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    estimators: Sequence[Any],
    *,
    noise_fn: NoiseFn,
    seeds: int | Sequence[int] = 8,
    cond_fn: CondFn | None = None,
    reference: Any = "exact",
    draws: int = 16,
    timing_repeats: int = 5,
    measure_cost: bool = True,
    show_progress: bool = True,
    contraction_iters: int = CONTRACTION_ITERS,
) -> PreparedCompare:
    """Check :func:`compare`'s arguments (same meaning) without doing any of its work.

    Raises:
        InvalidType / InvalidValue: what :func:`compare` would refuse, before any model
            call: a bad objective, estimator, reference, seed list, draw or repeat count,
            or a number of draws whose kept gradients cannot fit in memory.
    """
    if not isinstance(objective, TerminalObjective | StepwiseObjective):
        raise InvalidType(
            "objective must be gradest.TerminalObjective or gradest.StepwiseObjective, "
            f"got {type(objective).__name__}"
        )
    if isinstance(estimators, str) or not isinstance(estimators, Sequence):
        raise InvalidType(f"estimators must be a list of specs or estimators, got {estimators!r}")
    if not estimators:
        raise InvalidValue("estimators is empty; pass e.g. ['exact', 'jagg:window=4', 'sdo']")
    resolved = [_resolve(spec, "each estimator") for spec in estimators]
    kind = "terminal" if isinstance(objective, TerminalObjective) else "stepwise"
    for est in resolved:
        if not supports(est, kind):
            raise InvalidValue(
                f"estimator {est!r} does not define {kind} objectives (it is for "
                f"{' and '.join(est.objectives)} only); leave it out of estimators"
            )
    reference_est = _resolve(reference, "reference")
    if not getattr(type(reference_est), "always_exact", False):
        raise InvalidValue(
            f"reference={reference!r} is not exact-capable; the reference gradient must come "
            f"from an exact estimator, e.g. reference='exact' or 'exact:checkpoint=true'"
        )
    seed_list = _resolve_seeds(seeds)
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise InvalidValue(f"draws must be an int >= 1, got {draws!r}")
    if not isinstance(timing_repeats, int) or timing_repeats < 1:
        raise InvalidValue(f"timing_repeats must be an int >= 1, got {timing_repeats!r}")
    if (
        not isinstance(contraction_iters, int)
        or isinstance(contraction_iters, bool)
        or contraction_iters < 0
    ):
        raise InvalidValue(
            f"contraction_iters must be an int >= 0 (0 skips the measurement), "
            f"got {contraction_iters!r}"
        )
    if not callable(noise_fn):
        raise InvalidType(
            f"noise_fn must be callable as noise_fn(seed) -> Tensor, got {noise_fn!r}"
        )
    # Every draw's flattened gradient is kept for the statistics (seeds x draws of them):
    # a count that cannot fit is refused now, not by the allocator after hours of work.
    parameters = trainable_parameters(model)
    check_allocation(
        f"draws={draws}",
        draws,
        len(seed_list) * sum(p.numel() * p.element_size() for p in parameters.values()),
        name="draws",
        detail=f"one flattened gradient per draw for each of {len(seed_list)} seeds",
    )
    return PreparedCompare(
        model=model,
        parameters=parameters,
        sampler=sampler,
        objective=objective,
        estimators=resolved,
        reference=reference_est,
        noise_fn=noise_fn,
        cond_fn=cond_fn,
        seeds=seed_list,
        draws=draws,
        timing_repeats=timing_repeats,
        measure_cost=measure_cost,
        show_progress=show_progress,
        contraction_iters=contraction_iters,
    )


def _run_compare(plan: PreparedCompare) -> Report:
    model, sampler, objective = plan.model, plan.sampler, plan.objective
    resolved, reference_est, seed_list = plan.estimators, plan.reference, plan.seeds
    noise_fn, cond_fn, draws = plan.noise_fn, plan.cond_fn, plan.draws

    def cond_of(seed: int) -> Mapping[str, Any] | None:
        return cond_fn(seed) if cond_fn is not None else None

    trajectories: dict[int, Trajectory] = {}

    def trajectory_of(seed: int) -> Trajectory:
        if seed not in trajectories:
            trajectories[seed] = rollout(model, sampler, noise_fn(seed), cond=cond_of(seed))
        return trajectories[seed]

    params = plan.parameters

    def run(est: Any, seed: int, generator: torch.Generator) -> Any:
        trajectory = trajectory_of(seed)
        result = _plugin_estimate(
            est,
            model,
            sampler,
            objective,
            trajectory=trajectory,
            cond=cond_of(seed),
            generator=generator,
        )
        # What a plugin returns is checked like the parameters it must cover: a gradient
        # missing, extra, of another shape or non-finite is one line naming it.
        check_estimate_grads(est, result, params)
        return result

    measure_contraction = plan.contraction_iters > 0 and isinstance(objective, TerminalObjective)
    total_work = (
        len(resolved) * len(seed_list)
        + (len(resolved) + 1) * int(plan.measure_cost)
        + int(measure_contraction)
    )
    progress = tqdm(
        total=total_work, desc="gradest compare", disable=not plan.show_progress, leave=False
    )
    reference_results = {
        seed: run(reference_est, seed, draw_generator(seed, 0)) for seed in seed_list
    }
    references = {seed: result.flat() for seed, result in reference_results.items()}
    layout = TensorLayout.of(reference_results[seed_list[0]].grads)
    # Adam's second moment of the exact gradients over the compared trajectories.
    moment = second_moment(list(references.values()), layout)

    rows: list[EstimatorRow] = []
    for est in resolved:
        stochastic = is_stochastic(est, lambda e, g: run(e, seed_list[0], g).flat())
        per_seed: list[TrajectoryStats] = []
        fallback: list[float] = []
        reconstruction: list[float] = []
        param_vjps: list[int] = []
        flats: list[list[Tensor]] = []
        for seed in seed_list:
            results = [
                run(est, seed, draw_generator(seed, d)) for d in range(draws if stochastic else 1)
            ]
            flats.append([r.flat() for r in results])
            per_seed.append(trajectory_stats(flats[-1], references[seed]))
            param_vjps += [r.cost.param_vjps for r in results]
            fallback += [
                r.info["fallback_fraction"] for r in results if "fallback_fraction" in r.info
            ]
            if "reconstruction_error" in results[0].info:
                # Deterministic in the draw (a rebuilt path): one value per trajectory.
                reconstruction.append(results[0].info["reconstruction_error"])
            progress.update(1)
        first = run(est, seed_list[0], draw_generator(seed_list[0], 0))
        rows.append(
            EstimatorRow(
                spec=repr(est),
                label=short_label(est),
                name=getattr(est, "name", type(est).__name__),
                stochastic=stochastic,
                draws=draws if stochastic else 1,
                cosine=Estimate.of([s.cosine for s in per_seed]),
                relative_error=Estimate.of([s.relative_error for s in per_seed]),
                norm_ratio=Estimate.of([s.norm_ratio for s in per_seed]),
                bias=Estimate.of([math.sqrt(s.bias_squared) for s in per_seed]),
                variance=Estimate.of([s.variance for s in per_seed]),
                mse=Estimate.of([s.mse for s in per_seed]),
                counts=first.cost,
                mean_param_vjps=sum(param_vjps) / len(param_vjps),
                adam_cosine=Estimate.of(
                    [
                        mean_of(adam_cosine(f, references[seed], moment) for f in seed_flats)
                        for seed, seed_flats in zip(seed_list, flats, strict=True)
                    ]
                ),
                sign_agreement=Estimate.of(
                    [
                        mean_of(sign_agreement(f, references[seed]) for f in seed_flats)
                        for seed, seed_flats in zip(seed_list, flats, strict=True)
                    ]
                ),
                tensors=tensor_stats(flats, [references[s] for s in seed_list], moment, layout),
                fallback_fraction=sum(fallback) / len(fallback) if fallback else None,
                reconstruction_error=Estimate.of(reconstruction) if reconstruction else None,
                gate_cosines=list(first.info.get("gate_cosines", []) or []),
                groups=[list(g) for g in first.info.get("groups", [])],
            )
        )

    contraction = None
    # (measure_contraction implies a terminal objective; the isinstance narrows its type)
    if measure_contraction and isinstance(objective, TerminalObjective):
        first_seed = seed_list[0]
        measured = chain_contraction(
            model,
            sampler,
            trajectory_of(first_seed),
            cond_of(first_seed),
            iters=plan.contraction_iters,
            steps=contraction_steps(sampler.num_steps),
            generator=draw_generator(first_seed, 0),
        )
        # On the same trajectory, what the contraction stands in for: how far the one-step
        # cotangents (sdo, drtune) are from the exact ones for this objective's a_N.
        one_step = one_step_cotangent_error(
            model, sampler, trajectory_of(first_seed), objective, cond_of(first_seed)
        )
        contraction = {
            "seed": first_seed,
            **measured.summary(),
            "one_step_error": one_step.summary(),
        }
        progress.update(1)

    costs: dict[str, CostRow] = {}
    if plan.measure_cost:
        costs = _measure_costs(
            model,
            sampler,
            objective,
            [reference_est, *resolved],
            {row.spec for row in rows if row.stochastic},
            noise_fn(seed_list[0]),
            cond_of(seed_list[0]),
            trajectory_of(seed_list[0]),
            plan.timing_repeats,
            progress,
        )
    progress.close()
    baseline = costs.get(repr(reference_est))
    rows = [row.with_cost(costs.get(row.spec), baseline) for row in rows]
    first_noise = noise_fn(seed_list[0])
    config = {
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": sampler.num_steps,
        "objective": "terminal" if isinstance(objective, TerminalObjective) else "stepwise",
        "batch_shape": list(first_noise.shape),
        "dtype": str(first_noise.dtype).replace("torch.", ""),
        "device": str(first_noise.device),
        "seeds": seed_list,
        "draws": draws,
        "reference": repr(reference_est),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return Report(config=config, rows=rows, contraction=contraction)


def _measure_costs(
    model: torch.nn.Module,
    sampler: AffineSampler,
    objective: Objective,
    estimators: Sequence[Any],
    stochastic: set[str],
    noise: Tensor,
    cond: Mapping[str, Any] | None,
    trajectory: Trajectory,
    repeats: int,
    progress: Any,
) -> dict[str, CostRow]:
    """FLOPs, retained activation bytes, wall time (and CUDA peak memory) per estimator.

    Terminal objectives are measured from noise, so each estimator samples the cheapest
    way for its strategy (sampling is part of its cost); stepwise objectives on the
    recorded trajectory, which is what the cost model (docs/design.md#cost-formulas)
    prices. The work of a stochastic estimator (``stochastic``: their reprs) changes with
    its draw (a random depth, a random subset), so its FLOPs and bytes are the mean over
    ``COST_DRAWS`` draws and its timed calls cycle through them.
    """
    terminal = isinstance(objective, TerminalObjective)
    calls = {}
    draw_counts: dict[str, int] = {}
    for est in estimators:
        inputs = {"noise": noise} if terminal else {"trajectory": trajectory}
        spec = repr(est)
        draw_counts[spec] = COST_DRAWS if spec in stochastic else 1
        cycle = itertools.cycle(range(draw_counts[spec]))

        def call(est: Any = est, inputs: dict = inputs, cycle: Any = cycle) -> Any:
            result = _plugin_estimate(
                est, model, sampler, objective, cond=cond, generator=draw_generator(0, next(cycle)),
                **inputs,
            )  # fmt: skip
            if noise.is_cuda:  # time the work, not the kernel launches
                torch.cuda.synchronize()
            return result

        calls[spec] = call
    rows: dict[str, CostRow] = {}
    for spec, call in calls.items():
        cuda_peak = None
        draws = draw_counts[spec]
        if noise.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            for _ in range(draws):
                call()
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated() - before
        # Each measurement runs the draws 0..draws-1 in turn (the cycle restarts in step).
        rows[spec] = CostRow(
            flops=round(sum(count_flops(call) for _ in range(draws)) / draws),
            retained_bytes=round(
                sum(retained_activation_bytes(call) for _ in range(draws)) / draws
            ),
            peak_bytes=round(sum(peak_allocated_bytes(call) for _ in range(draws)) / draws),
            wall_time_s=math.nan,
            cuda_peak_bytes=cuda_peak,
        )
        progress.update(1)
    times = interleaved_wall_times(calls, repeats=repeats, warmup=1)
    return {spec: row.with_wall_time(times[spec]) for spec, row in rows.items()}


__all__ = [
    "PreparedCompare",
    "compare",
    "contraction_steps",
    "draw_generator",
    "is_stochastic",
    "prepare_compare",
    "ratio",
]
