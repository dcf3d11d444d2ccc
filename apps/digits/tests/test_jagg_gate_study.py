"""The jagg gate study's calibration (docs/results/jagg_gate_study)."""

from __future__ import annotations

import pytest
from gradest_digits import jagg_gate_study as study


def _row(error, cosine, velocity, probe):
    return {
        "task": "reward",
        "window": 4,
        "error": error,
        "gate_cosine": cosine,
        "velocity_error": velocity,
        "probe_error": probe,
    }


def test_calibration_admits_groups_in_predictor_order_until_one_is_too_wrong():
    rows = [
        _row(0.01, 0.9999, 0.01, 0.02),
        _row(0.04, 0.9990, 0.03, 0.05),
        _row(0.20, 0.9995, 0.02, 0.40),  # the cosine and velocity error miss this one
        _row(0.08, 0.9900, 0.10, 0.12),
    ]
    table = study.calibration(rows)
    # Cosine order: 0.9999 (ok), 0.9995 (0.20 > 0.05): stops after one group.
    assert table["reward/w4/gate_cosine/0.05"] == {
        "threshold": 0.9999,
        "pass_fraction": 0.25,
        "oracle_pass_fraction": 0.5,
    }
    # The probe orders by the truth here: it passes what the oracle passes.
    assert table["reward/w4/probe_error/0.05"]["pass_fraction"] == 0.5
    assert table["reward/w4/probe_error/0.1"]["pass_fraction"] == 0.75
    assert table["reward/w4/probe_error/0.1"]["threshold"] == 0.12


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    x = [0.3, 0.1, 0.7, 0.2, 0.9]
    y = [1.0, 0.5, 0.4, 0.2, 2.0]
    assert study.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
