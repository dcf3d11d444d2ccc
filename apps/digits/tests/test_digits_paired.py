"""The paired digits benchmark runs end to end and reports what issue 12 asks of it.

Tiny settings (2 seeds, 2 steps, batch 8): the numbers mean nothing here, the shape does:
lockstep runs, deterministic backward FLOPs from each estimator's Cost, paired statistics
per backward-GFLOP and per second, the agreement metrics and their rank correlation with
the final reward, and estimators of the other objective kind left out with a note.
"""

from __future__ import annotations

import json

import pytest
import torch
from gradest_digits import paired_benchmark as digits_paired

pytestmark = pytest.mark.slow


def test_the_paired_benchmark_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "paired"
    argv = ["--mode", "grpo", "--seeds", "2", "--steps", "2", "--batch", "8", "--draws", "2"]
    argv += ["--eval-samples", "32", "--estimators", "exact,sdo,refl,telescope,auto"]
    assert digits_paired.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "left out (no stepwise objectives): refl" in printed
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["runs"]) == ["exact", "sdo", "telescope", "auto"]
    for rows in saved["runs"].values():
        assert [r["seed"] for r in rows] == [0, 1]
        assert all(r["backward_flops"] > 0 and r["backward_seconds"] > 0 for r in rows)
    # 37 held-out digits of the target against 64 classifier features: FID/KID left out.
    assert all(
        r["fid"] is None and r["kid_mean"] is None for rs in saved["runs"].values() for r in rs
    )
    assert not digits_paired.fid_reference_is_adequate(torch.zeros(127, 1, 8, 8))
    assert digits_paired.fid_reference_is_adequate(torch.zeros(128, 1, 8, 8))
    summary = saved["summary"]
    # Deterministic cost: sdo evaluates one step of 16 per inner epoch, exact all of them.
    assert summary["sdo"]["backward_flops_ratio"] == pytest.approx(1 / 16, rel=1e-9)
    assert summary["exact"]["reward_gain_fraction_of_exact"] == pytest.approx(1.0)
    assert set(saved["config"]["metric_rank_correlations"]) == {
        "cosine",
        "adam_cosine",
        "sign_agreement",
    }
    # auto probes on its first call (returning exact's gradient), then runs its pick.
    picks = summary["auto"]["selected"]
    assert sum(picks.values()) == 4 and all(isinstance(c, str) and c for c in picks)
    assert "selected" not in summary["exact"] or not summary["exact"]["selected"]
    markdown = (out / "results.md").read_text()
    assert "gain/backward-GFLOP wins" in markdown and "Spearman" in markdown
    assert "`auto` ran, in each training step's last backward" in markdown
    assert f"`{next(iter(picks))}`" in markdown


def test_identical_training_counts_once_in_the_rank_correlation():
    """A jagg that fell back everywhere trains exactly as exact: one row, not two.
    With the duplicate the correlation of these rows is inflated; merged, it is the
    correlation of the distinct rows."""
    pytest.importorskip("scipy")
    from scipy import stats

    def row(reward, cosine):
        return {
            "final_reward_mean": reward,
            "final_reward_std": 0.1,
            "cosine": cosine,
            "adam_cosine": cosine,
            "sign_agreement": cosine,
        }

    summary = {
        "exact": row(-1.0, 1.0),
        "jagg": row(-1.0, 1.0),  # fell back everywhere: identical to exact
        "sdo": row(-1.1, 0.2),
        "truncated:k=1": row(-1.6, 0.5),
        "alignprop": row(-1.3, 0.4),
        "auto": {**row(-1.0, 1.0), "selected": {"exact": 4}},
    }
    groups = digits_paired.distinct_estimators(summary)
    assert sorted(map(sorted, groups)) == [
        ["alignprop"],
        ["exact", "jagg"],
        ["sdo"],
        ["truncated:k=1"],
    ]
    result = digits_paired.metric_rank_correlations(summary)["cosine"]
    distinct = stats.spearmanr([1.0, 0.2, 0.5, 0.4], [-1.0, -1.1, -1.6, -1.3])
    assert result["rows"] == 4
    assert result["rho"] == pytest.approx(distinct.statistic)
    with_duplicate = stats.spearmanr([1.0, 1.0, 0.2, 0.5, 0.4], [-1.0, -1.0, -1.1, -1.6, -1.3])
    assert result["rho"] != pytest.approx(with_duplicate.statistic)
