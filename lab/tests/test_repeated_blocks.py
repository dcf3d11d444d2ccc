"""Measuring a model with long runs of identical blocks from short runs (issue 31, item 2).

``gradest cost`` traces each model-call signature once; for a model that is mostly a stack
of identical blocks (SD3, Flux, a CLIP reward model) it traces the stack cut to 1, 2 and 3
blocks and extrapolates (gradest_lab.cost.repeated_blocks). These tests check that the
extrapolation equals the measurement of the whole model exactly (FLOPs, saved bytes,
transients, for every backward pattern), that it falls back to the whole model when a
model's cost is not linear in a run's length or the model cannot run cut, and that a
step priced this way equals every operator traced.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from gradest_lab.cost import call_replay
from gradest_lab.cost.repeated_blocks import (
    MIN_RUN,
    Measurement,
    measure_with_short_runs,
    repeated_runs,
)
from torch import nn

import gradest

pytest.importorskip("diffusers")

from gradest_lab.cost.diffusers_presets import diffusers_shapes  # noqa: E402

LAYERS = 11
SD3 = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2,
    "in_channels": 4, "num_layers": LAYERS, "attention_head_dim": 8, "num_attention_heads": 2,
    "joint_attention_dim": 16, "caption_projection_dim": 16, "pooled_projection_dim": 8,
    "out_channels": 4, "pos_embed_max_size": 16,
}  # fmt: skip
FLUX = {
    "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16,
    "num_layers": 9, "num_single_layers": 12, "attention_head_dim": 8,
    "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
    "guidance_embeds": True, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip
CONFIGS = {"sd3": SD3, "flux": FLUX}


def _shapes(family: str, device: str = "meta", **options):
    torch.manual_seed(0)
    return diffusers_shapes(
        CONFIGS[family], batch=2, height=64, width=64, dtype=torch.float32,
        prompt_tokens=5, device=device, **options,
    )  # fmt: skip


def _inputs(shapes) -> tuple[list[torch.Tensor], Callable[..., torch.Tensor]]:
    """The call's tensors (state, time, cond leaves) and a function calling the model."""
    from gradest.conditioning import tensor_leaves, with_tensor_leaves

    z = torch.zeros(shapes.latent_shape, device="meta")
    t = torch.zeros(shapes.latent_shape[0], device="meta")
    leaves = tensor_leaves(shapes.cond)

    def call(args):
        return shapes.velocity(args[0], args[1], **with_tensor_leaves(shapes.cond, list(args[2:])))

    return [z, t, *leaves], call


def test_runs_are_the_identical_blocks() -> None:
    """SD3's blocks but the last (context_pre_only) form one run; Flux has two."""
    sd3 = repeated_runs(_shapes("sd3").velocity)
    assert [(r.start, r.length) for r in sd3] == [(0, LAYERS - 1)]
    flux = repeated_runs(_shapes("flux").velocity)
    assert sorted(r.length for r in flux) == [9, 12]
    short = nn.ModuleList(nn.Linear(2, 2) for _ in range(MIN_RUN - 1))
    assert repeated_runs(short) == []
    mixed = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)] * MIN_RUN)
    assert repeated_runs(mixed) == []


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("sd3", {}),
        ("sd3", {"lora_rank": 2, "gradient_checkpointing": True}),
        ("flux", {"lora_rank": 2}),
    ],
)
@pytest.mark.parametrize("pattern", [(True, True), (False, True), (True, False)])
def test_short_runs_measure_what_the_whole_model_does(family, options, pattern) -> None:
    """Forward, saved and backward numbers from the cut model == the whole model's."""
    shapes = _shapes(family, **options)
    model = shapes.velocity
    tensors, call = _inputs(shapes)
    parameters = [p for p in model.parameters() if p.requires_grad]
    blocks_seen = []

    def once() -> Measurement:
        blocks_seen.append(sum(len(r.blocks) for r in repeated_runs(model)))
        return call_replay._as_measurement(
            *call_replay._measure(model, tensors, True, parameters, call, pattern)
        )

    whole = once()
    cut = measure_with_short_runs(model, once)
    assert cut == whole
    assert all(n > 0 for n in whole.numbers[:2])
    # The cut measurements ran on fewer blocks than the whole model has.
    assert len(blocks_seen) > 1 and max(blocks_seen[1:]) < blocks_seen[0]


class _EveryOther(nn.Module):
    """Identical blocks, but only every other one runs: not linear in the run's length."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) if i % 2 == 0 else x
        return x


class _Counted(nn.Module):
    """Indexes its blocks by a count fixed at construction: cannot run cut."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 12
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(self.count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.count):
            x = self.blocks[i](x)
        return x


@pytest.mark.parametrize("model_class", [_EveryOther, _Counted])
def test_models_that_cannot_be_cut_are_measured_whole(model_class) -> None:
    model = model_class().to("meta")
    x = torch.zeros(3, 4, device="meta")

    def once() -> Measurement:
        out, cost = call_replay._measured(lambda: model(x).sum())
        return Measurement((cost.flops, cost.transient), tuple(out.shape))

    assert measure_with_short_runs(model, once) == once()
    assert len(model.blocks) == 12  # restored


def test_a_step_priced_on_short_runs_equals_every_operator_traced() -> None:
    """The whole chain: replayed calls calibrated on cut models == a full trace."""
    from gradest_lab.cost.training_cost import training_step_cost

    costs = {}
    for replay in (True, False):
        shapes = _shapes("sd3", lora_rank=2)
        costs[replay] = training_step_cost(
            gradest.estimator("exact"), shapes.velocity, gradest.RectifiedFlow(steps=3),
            gradest.TerminalObjective(lambda z: z.float().square().mean()),
            noise=torch.zeros(shapes.latent_shape, device="meta"), cond=shapes.cond,
            replay=replay, attention="math",
        )  # fmt: skip
    assert costs[True].flops == costs[False].flops
    assert costs[True].retained_bytes == costs[False].retained_bytes
    assert abs(costs[True].peak_bytes - costs[False].peak_bytes) <= 0.02 * costs[False].peak_bytes
