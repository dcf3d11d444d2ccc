"""The comparison report: rows per estimator, as markdown and as JSON (schema below).

The lab writes a report's folder (``report.md``, ``report.json`` and plots:
``gradest_lab.compare.report_files``); the library only builds the texts.

JSON schema ``gradest.report/1`` (documented in docs/harness.md)::

    {"schema": "gradest.report/1",
     "config": {model, parameters, steps, objective, batch_shape, dtype, device, seeds,
                draws, reference, torch, machine, date},
     "estimators": [{"spec", "label", "name", "stochastic", "draws",
                     "cosine" | "relative_error" | "norm_ratio" | "bias" | "variance" | "mse":
                         {"mean", "stderr"},
                     "counts": {forwards_with_graph, forwards_without_graph, param_vjps,
                                state_vjps, model_units},
                     "cost": {flops, flops_ratio, retained_bytes, retained_ratio,
                              peak_bytes, peak_ratio, wall_time_s, wall_ratio,
                              cuda_peak_bytes} | null,
                     "efficiency": mse x flops_ratio | null,
                     "fallback_fraction": float | null,
                     "reconstruction_error": {"mean", "stderr"} | null,
                     "gate_cosines": [float | null], "groups": [[int]]}],
     "contraction": {seed, iters, samples, steps, mean, max, start_step, at_start,
                     middle_step, at_middle, largest_step, largest, per_step,
                     last_change,
                     one_step_error: {samples, steps, error, cosine, mean_error,
                                      mean_cosine, at_start}} | null}

``contraction`` is ``||dz_N/dz_k||_2`` on the first trajectory at the measured ``steps``
``k`` (``mean`` / ``max`` over its samples, one per step;
:meth:`gradest.harness.ChainContraction.summary` says what each field is), for a terminal
objective; null for a stepwise one or when it was skipped. Its ``one_step_error`` is the
one-step cotangents' error against the exact ones on the same trajectory, every step
(:meth:`gradest.harness.OneStepCotangentError.summary`); a report written before it was
measured lacks the field.

Ratios are to the reference (exact) estimator measured in the same process. The file is
strict JSON: a non-finite float is the string ``"NaN"``, ``"Infinity"`` or
``"-Infinity"``; report.md shows it as ``nan`` / ``inf`` (``-`` means not measured).
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from gradest.harness.cost import COST_DRAWS, ratio
from gradest.harness.statistics import Estimate
from gradest.harness.tensor_metrics import TensorStats, worst_tensors
from gradest.protocol import Cost

SCHEMA = "gradest.report/1"


@attrs.frozen
class CostRow:
    """Measured cost of one estimate call."""

    flops: int
    retained_bytes: int
    wall_time_s: float
    cuda_peak_bytes: int | None = None
    # Every storage the call creates and holds at once (activations, kept states,
    # gradients, temporaries): gradest.harness.peak_allocated_bytes.
    peak_bytes: int | None = None

    def with_wall_time(self, seconds: float) -> CostRow:
        return attrs.evolve(self, wall_time_s=seconds)


@attrs.frozen
class EstimatorRow:
    """One estimator's agreement with the reference and its cost."""

    spec: str
    label: str
    name: str
    stochastic: bool
    draws: int
    cosine: Estimate
    relative_error: Estimate
    norm_ratio: Estimate
    bias: Estimate
    variance: Estimate
    mse: Estimate
    counts: Cost
    mean_param_vjps: float | None = None  # over every draw (random depths vary per call)
    adam_cosine: Estimate | None = None  # gradest.harness.tensor_metrics
    sign_agreement: Estimate | None = None
    tensors: list[TensorStats] = attrs.field(factory=list)
    fallback_fraction: float | None = None
    # ||z^_0 - z_0|| / ||z_0|| of estimators that rebuild the path (adjoint), over seeds.
    reconstruction_error: Estimate | None = None
    gate_cosines: list[Any] = attrs.field(factory=list)
    groups: list[list[int]] = attrs.field(factory=list)
    cost: CostRow | None = None
    flops_ratio: float | None = None
    retained_ratio: float | None = None
    peak_ratio: float | None = None
    wall_ratio: float | None = None

    def with_cost(self, cost: CostRow | None, baseline: CostRow | None) -> EstimatorRow:
        if cost is None or baseline is None:
            return self
        return attrs.evolve(
            self,
            cost=cost,
            flops_ratio=ratio(cost.flops, baseline.flops),
            retained_ratio=ratio(cost.retained_bytes, baseline.retained_bytes),
            peak_ratio=None
            if cost.peak_bytes is None or baseline.peak_bytes is None
            else ratio(cost.peak_bytes, baseline.peak_bytes),
            wall_ratio=ratio(cost.wall_time_s, baseline.wall_time_s),
        )

    @property
    def efficiency(self) -> float | None:
        """MSE x FLOPs ratio: estimators of different cost on one axis (lower is better)."""
        return None if self.flops_ratio is None else self.mse.mean * self.flops_ratio

    def to_dict(self) -> dict[str, Any]:
        stats = {
            key: attrs.asdict(getattr(self, key))
            for key in ("cosine", "relative_error", "norm_ratio", "bias", "variance", "mse")
        }
        return {
            "spec": self.spec,
            "label": self.label,
            "name": self.name,
            "stochastic": self.stochastic,
            "draws": self.draws,
            **stats,
            "counts": {**attrs.asdict(self.counts), "model_units": self.counts.model_units()},
            "mean_param_vjps": self.mean_param_vjps,
            "adam_cosine": None if self.adam_cosine is None else attrs.asdict(self.adam_cosine),
            "sign_agreement": None
            if self.sign_agreement is None
            else attrs.asdict(self.sign_agreement),
            "tensors": [t.to_dict() for t in self.tensors],
            "cost": None
            if self.cost is None
            else {
                "flops": self.cost.flops,
                "flops_ratio": self.flops_ratio,
                "retained_bytes": self.cost.retained_bytes,
                "retained_ratio": self.retained_ratio,
                "peak_bytes": self.cost.peak_bytes,
                "peak_ratio": self.peak_ratio,
                "wall_time_s": self.cost.wall_time_s,
                "wall_ratio": self.wall_ratio,
                "cuda_peak_bytes": self.cost.cuda_peak_bytes,
            },
            "efficiency": self.efficiency,
            "fallback_fraction": self.fallback_fraction,
            "reconstruction_error": None
            if self.reconstruction_error is None
            else attrs.asdict(self.reconstruction_error),
            "gate_cosines": self.gate_cosines,
            "groups": self.groups,
        }


def _fmt(value: float | None, spec: str = ".3g") -> str:
    """A number for report.md; ``-`` where nothing was measured, and a non-finite value
    as itself (``nan``, ``inf``, ``-inf``), never as a number it is not."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


# report.json is strict JSON (json.dumps(allow_nan=False)): a non-finite float is written
# as one of these strings, which JavaScript's Number() and Python's float() read back.
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``"NaN"`` / ``"Infinity"`` /
    ``"-Infinity"`` (in dicts, lists and tuples), so that report.json is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return NON_FINITE[str(value)]
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def json_restored(value: Any) -> Any:
    """:func:`json_safe`'s inverse: ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` strings back
    to floats, in dicts and lists (a report's raw data read back)."""
    if isinstance(value, str):
        back = {text: float(name) for name, text in NON_FINITE.items()}
        return back.get(value, value)
    if isinstance(value, dict):
        return {key: json_restored(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_restored(item) for item in value]
    return value


def _pm(estimate: Estimate | None, spec: str = ".3g") -> str:
    if estimate is None:
        return "-"
    return f"{_fmt(estimate.mean, spec)} ± {_fmt(estimate.stderr, '.1g')}"


@attrs.frozen
class Report:
    """What :func:`gradest.compare` measured.

    Attributes:
        config: the setup (model, steps, objective, seeds, ...).
        rows: one :class:`EstimatorRow` per estimator, in the order given.
        contraction: the chain's contraction on the first trajectory
            (:meth:`gradest.harness.ChainContraction.summary` plus its ``seed``), or None
            (a stepwise objective, or not measured).
    """

    config: dict[str, Any]
    rows: list[EstimatorRow]
    contraction: dict[str, Any] | None = None

    def row(self, spec_or_name: str) -> EstimatorRow:
        """The row whose spec or label is ``spec_or_name``, else the first of that name
        (``"sdo"`` is the ``sdo`` row even after ``sdo:select=stratified``'s)."""
        for row in self.rows:
            if spec_or_name in (row.spec, row.label):
                return row
        for row in self.rows:
            if spec_or_name == row.name:
                return row
        raise KeyError(f"no row {spec_or_name!r}; rows: {[r.spec for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "config": self.config,
            "estimators": [r.to_dict() for r in self.rows],
            "contraction": self.contraction,
        }

    def to_json(self) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=2, allow_nan=False)

    def to_markdown(self) -> str:
        c = self.config
        lines = [
            f"# gradest compare: {c['model']} ({c['parameters']} trainable parameters), "
            f"{c['objective']} objective, N={c['steps']}",
            "",
            f"{len(c['seeds'])} trajectories, {c['draws']} draws per trajectory for stochastic "
            f"estimators, reference {c['reference']}, {c['dtype']} on {c['device']}, "
            f"torch {c['torch']}, {c['date']}. Mean ± standard error over trajectories; "
            f"cost ratios are to the reference in the same process (stochastic estimators: "
            f"FLOPs and bytes averaged over {COST_DRAWS} draws, wall time over calls cycling "
            f"through them; param VJPs averaged over every draw).",
            "",
            "| estimator | cosine | Adam cosine | sign agree | rel. error | bias | variance | MSE "
            "| FLOPs × | retained × | peak mem × | wall × | param VJPs | fallback "
            "| recon. error | MSE × FLOPs× |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| `{r.label}` | {_pm(r.cosine, '.4f')} | {_pm(r.adam_cosine, '.4f')} "
                f"| {_pm(r.sign_agreement, '.3f')} | {_pm(r.relative_error)} | {_pm(r.bias)} "
                f"| {_pm(r.variance)} | {_pm(r.mse)} | {_fmt(r.flops_ratio)} | "
                f"{_fmt(r.retained_ratio)} | {_fmt(r.peak_ratio)} | {_fmt(r.wall_ratio)} "
                f"| {_param_vjps(r)} | {_fmt(r.fallback_fraction, '.2f')} "
                f"| {_pm(r.reconstruction_error)} | {_fmt(r.efficiency)} |"
            )
        worst = [(r, worst_tensors(r.tensors)) for r in self.rows if r.tensors]
        if any(tensors and tensors[0].relative_error > 0 for _, tensors in worst):
            lines += [
                "",
                "Worst parameter tensors (largest relative error; Adam cosine divides by the "
                "root of the exact gradients' second moment):",
                "",
                "| estimator | tensor | size | rel. error | sign agree | Adam cosine |",
                "|---|---|---|---|---|---|",
                *(
                    f"| `{r.label}` | {t.name} | {t.size} | {_fmt(t.relative_error)} "
                    f"| {_fmt(t.sign_agreement, '.3f')} | {_fmt(t.adam_cosine, '.4f')} |"
                    for r, tensors in worst
                    if tensors and tensors[0].relative_error > 0
                    for t in tensors
                ),
            ]
        if self.contraction is not None:
            lines += ["", *_contraction_lines(self.contraction)]
        debias = (c.get("sweeps") or {}).get("debias")
        if debias:
            lines += [
                "",
                "jagg debias sweep (window 4, gate off, first trajectory; relative to "
                "||exact||²): the interpolation bias traded for variance",
                "",
                "| debias m | bias² | variance | MSE | param VJPs | draws |",
                "|---|---|---|---|---|---|",
                *(
                    f"| {r['debias']} | {_fmt(r['bias_squared'])} | {_fmt(r['variance'])} "
                    f"| {_fmt(r['mse'])} | {_fmt(r['param_vjps'])} | {r['draws']} |"
                    for r in debias
                ),
            ]
        return "\n".join(lines) + "\n"


def _contraction_lines(summary: dict[str, Any]) -> list[str]:
    """report.md's lines on the chain's contraction (:meth:`ChainContraction.summary`)."""
    middle, steps = summary["at_middle"], summary["steps"]
    where = ", ".join(str(k) for k in steps) if len(steps) <= 12 else f"{len(steps)} steps"
    return [
        f"Chain contraction (the condition of sdo's error bound): the largest singular value "
        f"of dz_N/dz_k at k = {where}, mean over the {summary['samples']} samples of "
        f"trajectory {summary['seed']}, {summary['iters']} power iterations (largest last "
        f"relative change {_fmt(summary['last_change'], '.1e')}); below 1, every "
        f"perturbation of z_k shrinks by z_N:",
        "",
        f"| k = {summary['start_step']} | k = N/2 = {summary['middle_step']} "
        f"| largest measured (k = {summary['largest_step']}) | per step (geometric mean) |",
        "|---|---|---|---|",
        f"| {_fmt(summary['at_start'], '.4g')} | {_fmt(middle, '.4g')} "
        f"| {_fmt(summary['largest'], '.4g')} | {_fmt(summary['per_step'], '.6g')} |",
        *_one_step_error_lines(summary.get("one_step_error")),
    ]


def _one_step_error_lines(summary: dict[str, Any] | None) -> list[str]:
    """report.md's sentence on the one-step cotangents' error
    (:meth:`OneStepCotangentError.summary`); none for a report that lacks it."""
    if summary is None:
        return []
    return [
        "",
        f"One-step cotangents (what sdo and drtune put in place of the exact ones) against "
        f"the exact ones on the same trajectory: relative error "
        f"{_fmt(summary['mean_error'], '.4g')} and cosine {_fmt(summary['mean_cosine'], '.4g')} "
        f"(means over every step and sample; at k = 0, where the dropped product is longest, "
        f"relative error {_fmt(summary['at_start'], '.4g')}).",
    ]


def _param_vjps(row: EstimatorRow) -> str:
    if row.mean_param_vjps is None:
        return str(row.counts.param_vjps)
    return f"{row.mean_param_vjps:.3g}"
