"""Per-tensor, sign and Adam-normalised agreement (gradest.harness.tensor_metrics).

Planted errors with known answers: a uniformly scaled gradient keeps every sign and
Adam-cosine 1; a zeroed small tensor is the worst tensor with relative error 1 while the
L2 cosine barely moves, and the Adam cosine shows it.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

import gradest
from gradest.base import EstimatorBase
from gradest.harness.comparison import compare
from gradest.harness.tensor_metrics import (
    TensorLayout,
    adam_cosine,
    second_moment,
    sign_agreement,
    tensor_stats,
    worst_tensors,
)
from gradest.options import option
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH, STEPS = 3, 4, 6


def test_sign_agreement_counts_only_nonzero_reference_coordinates():
    reference = torch.tensor([1.0, -2.0, 0.0, 3.0])
    assert sign_agreement(torch.tensor([2.0, -1.0, 5.0, -3.0]), reference) == pytest.approx(2 / 3)
    assert math.isnan(sign_agreement(torch.ones(2), torch.zeros(2)))


def test_adam_cosine_weighs_every_coordinate_by_its_second_moment():
    # Two coordinates on scales 1e3 apart: an error in the small one is invisible to the
    # L2 cosine and dominant after normalisation.
    references = [torch.tensor([1000.0, 1.0]), torch.tensor([-1000.0, -1.0])]
    moment = second_moment(references)
    assert torch.allclose(moment, torch.tensor([1e6, 1.0], dtype=torch.float64))
    wrong_small = torch.tensor([1000.0, -1.0])
    l2 = float(wrong_small @ references[0] / (wrong_small.norm() * references[0].norm()))
    assert l2 > 0.999
    assert adam_cosine(wrong_small, references[0], moment) == pytest.approx(0.0, abs=1e-6)
    assert adam_cosine(3.0 * references[0], references[0], moment) == pytest.approx(1.0)


def test_tensor_stats_and_the_worst_tensors():
    layout = TensorLayout(names=("big", "small"), sizes=(3, 2))
    reference = torch.tensor([4.0, -4.0, 4.0, 0.1, -0.1], dtype=torch.float64)
    draw = reference.clone()
    draw[3:] = 0.0  # the small tensor zeroed
    stats = tensor_stats([[draw]], [reference], second_moment([reference]), layout)
    by_name = {s.name: s for s in stats}
    assert by_name["big"].relative_error == 0 and by_name["big"].sign_agreement == 1
    assert by_name["small"].relative_error == pytest.approx(1.0)
    assert by_name["small"].sign_agreement == 0
    assert [s.name for s in worst_tensors(stats, count=1)] == ["small"]


@attrs.frozen
class ZeroOneTensor(EstimatorBase):
    """exact with one parameter tensor's gradient zeroed, or exact scaled by a factor."""

    name = "zero_one_tensor"
    tensor: str = option("", kind=str, doc="tensor to zero ('' for none)")
    factor: float = option(1.0, kind=float, doc="scale of the whole gradient")

    def _terminal(self, ctx):
        grads, noise_grad = gradest.estimator("exact")._terminal(ctx)
        return {
            n: (torch.zeros_like(g) if n == self.tensor else self.factor * g)
            for n, g in grads.items()
        }, noise_grad


def test_compare_reports_the_new_metrics_and_the_worst_tensors():
    model = tiny_mlp(DIM, hidden=8)
    flow = gradest.RectifiedFlow(steps=STEPS)
    objective = smooth_terminal_objective(DIM)
    small = "time_embed.mlp.0.bias"
    report = compare(
        model,
        flow,
        objective,
        ["exact", ZeroOneTensor(factor=2.0), ZeroOneTensor(tensor=small)],
        noise_fn=lambda seed: seeded_normal((BATCH, DIM), 100 + seed),
        seeds=3,
        measure_cost=False,
    )
    exact, scaled, zeroed = report.rows
    assert exact.adam_cosine.mean == pytest.approx(1.0) and exact.sign_agreement.mean == 1.0
    # A uniformly scaled gradient: same direction in every geometry, every sign kept.
    assert scaled.adam_cosine.mean == pytest.approx(1.0)
    assert scaled.sign_agreement.mean == 1.0
    assert all(t.relative_error == pytest.approx(1.0) for t in scaled.tensors)
    # One zeroed tensor: it is the worst, and the report says so.
    worst = worst_tensors(zeroed.tensors, count=1)[0]
    assert worst.name == small and worst.relative_error == pytest.approx(1.0)
    assert zeroed.adam_cosine.mean < zeroed.cosine.mean
    markdown = report.to_markdown()
    assert "Worst parameter tensors" in markdown and small in markdown
    saved = report.to_dict()["estimators"][2]
    assert saved["tensors"][0]["name"] == next(iter(dict(model.named_parameters())))
    assert {"adam_cosine", "sign_agreement", "tensors"} <= set(saved)
