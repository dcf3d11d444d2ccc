"""The GPU benchmark script runs unchanged on the CPU, and its CUDA checks skip cleanly.

The script (benchmarks/gpu_dit.py) is loaded from its file: the tests import nothing from
the top-level ``benchmarks`` folder as a package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_dit.py"


@pytest.fixture(scope="module")
def gpu_dit() -> ModuleType:
    """benchmarks/gpu_dit.py, executed as a module of its own."""
    if not SCRIPT.is_file():
        pytest.skip(f"{SCRIPT} is not in this checkout")
    spec = importlib.util.spec_from_file_location("gpu_dit_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_script_runs_on_cpu_with_a_small_config(gpu_dit, tmp_path):
    out = tmp_path / "gpu"
    code = gpu_dit.main(
        [
            "--device",
            "cpu",
            "--config",
            "micro",
            "--dtype",
            "float64",
            "--steps",
            "4",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert data["reference"]["grad_relative_error"] <= 1e-10
    for kind in ("terminal", "stepwise"):
        rows = data["results"][kind]
        assert set(rows) == set(gpu_dit.ESTIMATORS)
        assert rows["exact"]["cosine"] == pytest.approx(1.0, abs=1e-12)
        assert rows["exact"]["time_ratio"] == 1.0
    # sdo keeps the graph of one sampled step; on a recorded path exact keeps one at a time
    assert data["results"]["stepwise"]["sdo"]["memory_ratio"] <= 1.1
    assert "results.md" in {p.name for p in out.iterdir()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_reference_on_cuda(gpu_dit):
    errors = gpu_dit.reference_check("cuda")
    assert errors["grad_relative_error"] <= 1e-10
    assert errors["noise_grad_relative_error"] <= 1e-10
