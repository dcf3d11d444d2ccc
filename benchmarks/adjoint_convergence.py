"""The continuous adjoint's error against ``exact`` as the step count grows, as a figure.

Usage (from the repository root)::

    python -m benchmarks.adjoint_convergence            # writes docs/results/compare_adjoint/
    python -m benchmarks.adjoint_convergence --out /tmp/convergence

For every ``adjoint`` configuration (``order`` 1-3 of the default solver, and
``solver=backsolve``) the relative error of its gradient to ``exact``'s, on the same noise
and grid, at ``N = 4 .. 128`` steps of a rectified flow; float64, the seeded tiny MLP of
``gradest.testing`` (``tests/test_adjoint.py`` asserts the fitted slopes on the same
problem). Writes ``convergence.json`` (the errors and the least-squares slope of
``log(error)`` against ``log(1/N)``) and ``convergence.png`` (log-log, one line per
configuration). Deterministic: no wall time is measured.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import gradest
from gradest.reference import relative_error
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

STEPS = [4, 8, 16, 32, 64, 128]
SPECS = ["adjoint", "adjoint:order=2", "adjoint:order=3", "adjoint:solver=backsolve"]
DIM, BATCH = 3, 4
DEFAULT_OUT = Path("docs") / "results" / "compare_adjoint"


def errors_against_exact(spec: str) -> list[float]:
    """``||g_spec - g_exact|| / ||g_exact||`` at every step count of :data:`STEPS`."""
    model = tiny_mlp(DIM, hidden=8)
    noise = seeded_normal((BATCH, DIM), seed=11)
    objective = smooth_terminal_objective(DIM)
    exact, estimator = gradest.estimator("exact"), gradest.estimator(spec)
    errors = []
    for steps in STEPS:
        flow = gradest.RectifiedFlow(steps=steps)
        truth = exact.estimate(model, flow, objective, noise=noise).grads
        result = estimator.estimate(model, flow, objective, noise=noise)
        errors.append(relative_error(result.grads, truth))
    return errors


def fitted_slope(errors: list[float]) -> float:
    """Least-squares slope of ``log(error)`` against ``log(1/N)``: the observed order."""
    x = torch.tensor([-math.log(n) for n in STEPS], dtype=torch.float64)
    y = torch.tensor([math.log(e) for e in errors], dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], dim=1)
    return float(torch.linalg.lstsq(design, y[:, None]).solution[0, 0])


def plot(rows: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    for spec, row in rows.items():
        errors = row["errors"]
        assert isinstance(errors, list)
        axes.loglog(STEPS, errors, marker="o", label=f"{spec} (slope {row['slope']:.2f})")
    axes.set_xlabel("sampling steps N")
    axes.set_ylabel("relative error of the gradient to exact")
    axes.set_title("adjoint against exact: error falls like h^order")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, object]] = {}
    for spec in SPECS:
        errors = errors_against_exact(spec)
        rows[spec] = {"errors": errors, "slope": fitted_slope(errors)}
        print(f"{spec:28s} slope {rows[spec]['slope']:.3f}  errors {errors}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "problem": f"tiny_mlp({DIM}, hidden=8), batch {BATCH}, smooth terminal loss, float64",
        "steps": STEPS,
        "estimators": rows,
    }
    (args.out / "convergence.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(rows, args.out / "convergence.png")
    print(f"wrote {args.out / 'convergence.json'} and convergence.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
