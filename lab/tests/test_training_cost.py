"""``gradest cost`` and the training-step cost it predicts (issue 22, item 3).

The prediction runs on the meta device (no weights, no data), replaying each model-call
signature after tracing it once (gradest_lab.cost.call_replay). These tests compare it,
on tiny configs of each diffusers family, against what a user would count by hand on
real tensors: ``FlopCounterMode`` around a hand-written training loop, and
saved-tensor hooks' bytes. Real CPU runs take the math attention path (the CPU's fused
kernel has no FLOP formula in PyTorch), so the meta predictions here use
``attention="math"`` too, except where fused attention itself is tested.
"""

from __future__ import annotations

import json

import pytest
import torch
from gradest_lab.cost.command import model_setup, parse_bytes, predict_costs
from gradest_lab.cost.training_cost import decisions_vary, training_step_cost
from saved_tensor_bytes import saved_bytes
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import gradest
from gradest.cli import main
from gradest.errors import InvalidValue
from gradest.registry import builtin_estimators

pytest.importorskip("diffusers")

from gradest_lab.cost.diffusers_presets import PRESETS, diffusers_shapes  # noqa: E402

TINY = {
    "sd3": {
        "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2,
        "in_channels": 4, "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2,
        "joint_attention_dim": 16, "caption_projection_dim": 16, "pooled_projection_dim": 8,
        "out_channels": 4, "pos_embed_max_size": 16,
    },
    "flux": {
        "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16,
        "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
        "guidance_embeds": True, "axes_dims_rope": [2, 2, 4],
    },
    "unet": {
        "_class_name": "UNet2DConditionModel", "block_out_channels": [8, 16],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1,
        "cross_attention_dim": 16, "attention_head_dim": 2, "norm_num_groups": 4,
        "in_channels": 4, "out_channels": 4, "sample_size": 8,
        "addition_embed_type": "text_time", "addition_time_embed_dim": 4,
        "projection_class_embeddings_input_dim": 40, "transformer_layers_per_block": 1,
    },
}  # fmt: skip
SIZE = {"sd3": 64, "flux": 64, "unet": 64}
STEPS, BATCH, TOKENS = 4, 2, 5

SPECS = [
    "jagg:gate=off" if spec == "jagg" else spec
    for spec in sorted(builtin_estimators())
    if spec != "auto"
] + ["exact:checkpoint=true", "sdo:samples=2", "truncated:k=2", "jagg:gate=off,shared_knots=true"]


def _terminal():
    return gradest.TerminalObjective(lambda z: z.float().square().mean())


def _stepwise():
    return gradest.StepwiseObjective(lambda k, v, trajectory: v.float().square().mean())


def _shapes(family: str, device: str, **kw):
    torch.manual_seed(0)
    return diffusers_shapes(
        TINY[family], batch=BATCH, height=SIZE[family], width=SIZE[family],
        dtype=torch.float32, prompt_tokens=TOKENS, device=device, **kw,
    )  # fmt: skip


def _cost(spec, family, device, objective, *, replay=True, attention="math", **kw):
    shapes = _shapes(family, device, **kw)
    noise = (
        torch.randn(shapes.latent_shape, device=device)
        if device != "meta"
        else (torch.zeros(shapes.latent_shape, device="meta"))
    )
    with sdpa_kernel(SDPBackend.MATH):
        return training_step_cost(
            gradest.estimator(spec), shapes.velocity, gradest.RectifiedFlow(steps=STEPS),
            objective, noise=noise, cond=shapes.cond, replay=replay, attention=attention,
        )  # fmt: skip


CASES = [
    (spec, kind)
    for spec in SPECS
    for kind in ("terminal", "stepwise")
    if kind in type(gradest.estimator(spec)).objectives
]


@pytest.mark.parametrize(("spec", "kind"), CASES)
def test_meta_prediction_equals_a_real_run(spec: str, kind: str) -> None:
    """Replayed meta trace == a real CPU run of the same step: FLOPs and saved bytes
    exactly; the peak of created storages within 2% (a replayed backward returns its
    parameter gradients together, a real one layer by layer; measured <= 1.1% here)."""
    objective = _terminal() if kind == "terminal" else _stepwise()
    real = _cost(spec, "sd3", "cpu", objective, replay=False)
    predicted = _cost(spec, "sd3", "meta", objective)
    assert predicted.flops == real.flops
    assert predicted.flops_range == real.flops_range
    assert predicted.retained_bytes == real.retained_bytes
    assert predicted.draws == real.draws
    assert abs(predicted.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    assert predicted.flops > 0 and predicted.retained_bytes > 0


def _handwritten_step(family: str, device: str):
    """A user's exact training step: sample with the graph, reward, backward, AdamW."""
    shapes = _shapes(family, device)
    model = shapes.velocity
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float64).tolist()
    noise = torch.randn(shapes.latent_shape, device=device)

    def step():
        z = noise
        for k in range(STEPS):
            t = torch.full((BATCH,), times[k], device=device)
            z = z + (times[k + 1] - times[k]) * model(z, t, **shapes.cond)
        z.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


@pytest.mark.parametrize("family", sorted(TINY))
def test_exact_prediction_equals_a_handwritten_loop(family: str) -> None:
    """The acceptance check of the issue: gradest cost's exact on the meta device has the
    FLOPs FlopCounterMode counts on a hand-written loop, and its saved bytes."""
    model, step = _handwritten_step(family, "cpu")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    model, step = _handwritten_step(family, "cpu")
    with sdpa_kernel(SDPBackend.MATH):
        saved = saved_bytes([model], step)
    predicted = _cost("exact", family, "meta", _terminal())
    assert predicted.flops == counter.get_total_flops()
    assert predicted.retained_bytes == saved


def test_fused_attention_keeps_no_attention_matrix() -> None:
    """attention='fused' (a GPU's kernel) keeps nothing of size S x S: its retained bytes
    grow linearly in the number of tokens S (equal steps of 32 prompt tokens add equal
    bytes), the math path's quadratically; FLOPs are the same in both (the model's, not
    the fused kernel's recomputation)."""

    def retained(attention: str, tokens: int) -> tuple[float, float]:
        shapes = diffusers_shapes(
            TINY["sd3"], batch=BATCH, height=64, width=64, dtype=torch.float32, prompt_tokens=tokens
        )
        cost = training_step_cost(
            gradest.estimator("exact"), shapes.velocity, gradest.RectifiedFlow(steps=2),
            _terminal(), noise=torch.zeros(shapes.latent_shape, device="meta"),
            cond=shapes.cond, attention=attention,
        )  # fmt: skip
        return cost.retained_bytes, cost.flops

    # 16 image tokens + 16 / 48 / 80 prompt tokens: S = 32, 64, 96 (the fused kernel pads
    # its log-sum-exp rows to multiples of 32).
    fused = [retained("fused", t) for t in (16, 48, 80)]
    math = [retained("math", t) for t in (16, 48, 80)]
    assert [f for _, f in fused] == [f for _, f in math]
    fused_bytes = [r for r, _ in fused]
    math_bytes = [r for r, _ in math]
    assert fused_bytes[2] - fused_bytes[1] == fused_bytes[1] - fused_bytes[0] > 0
    assert math_bytes[2] - 2 * math_bytes[1] + math_bytes[0] > 0
    assert all(f < m for f, m in zip(fused_bytes, math_bytes, strict=True))


def test_lora_trains_adapters_and_adamw_keeps_two_states() -> None:
    full = _cost("sdo", "sd3", "meta", _terminal())
    lora = _cost("sdo", "sd3", "meta", _terminal(), lora_rank=2)
    shapes = _shapes("sd3", "meta", lora_rank=2)
    adapters = sum(p.numel() for n, p in shapes.model.named_parameters() if "lora_" in n)
    tensors = sum(1 for n, _ in shapes.model.named_parameters() if "lora_" in n)
    assert lora.trainable_parameters == adapters > 0
    # exp_avg and exp_avg_sq per trained element, a float32 step count per tensor.
    assert lora.optimizer_bytes == 2 * 4 * adapters + 4 * tensors
    count = sum(1 for _ in _shapes("sd3", "meta").model.parameters())
    assert full.optimizer_bytes == 2 * 4 * full.trainable_parameters + 4 * count


def test_gradient_checkpointing_recomputes_and_keeps_less() -> None:
    plain = _cost("exact", "sd3", "meta", _terminal())
    checkpointed = _cost("exact", "sd3", "meta", _terminal(), gradient_checkpointing=True)
    assert checkpointed.flops > plain.flops
    assert checkpointed.peak_bytes < plain.peak_bytes


def test_stochastic_estimators_report_mean_and_range() -> None:
    cost = _cost("alignprop", "sd3", "meta", _terminal())
    low, high = cost.flops_range
    assert cost.draws == 4 and low < cost.flops < high
    assert not decisions_vary(
        gradest.estimator("exact"), gradest.RectifiedFlow(steps=4), _terminal()
    )
    assert decisions_vary(gradest.estimator("sdo"), gradest.RectifiedFlow(steps=4), _terminal())


def test_presets_build_on_meta_with_their_published_sizes() -> None:
    """Parameter counts of the presets, as the public checkpoints state them."""
    expected = {
        "sd3-medium": 2.03e9,
        "sd3.5-large": 8.05e9,
        "flux-dev": 11.9e9,
        "sdxl-unet": 2.57e9,
    }
    for name, count in expected.items():
        preset = PRESETS[name]
        shapes = diffusers_shapes(
            preset.config, batch=1, height=preset.height, width=preset.width, dtype=torch.bfloat16
        )
        params = sum(p.numel() for p in shapes.model.parameters())
        assert abs(params - count) / count < 0.01, (name, params)
        assert all(p.device.type == "meta" for p in shapes.model.parameters())


def test_cli_on_a_config_folder_writes_json(tmp_path, capsys) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY["sd3"]))
    out = tmp_path / "cost.json"
    code = main([
        "cost", "--model", str(tmp_path), "--steps", str(STEPS), "--height", "64", "--width",
        "64", "--batch", str(BATCH), "--prompt-tokens", str(TOKENS), "--dtype", "fp32",
        "--estimators", "exact,sdo", "--attention", "math", "--memory", "1MiB,1GiB",
        "--reward", "latent",
        "--json", str(out), "--quiet",
    ])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "| `exact` |" in table and "| `sdo` |" in table
    payload = json.loads(out.read_text())
    exact = payload["estimators"]["exact"]
    assert exact["flops"] == _cost("exact", "sd3", "meta", _terminal()).flops
    assert set(exact) >= {"flops", "retained_bytes", "peak_bytes", "fits", "flops_range"}
    assert exact["fits"] == {"1MiB": exact["peak_bytes"] <= 2**20, "1GiB": True}
    assert payload["settings"]["steps"] == STEPS


def test_embedded_model_runs_without_diffusers_arguments() -> None:
    setup = model_setup("mlp", steps=3)
    costs = predict_costs(setup, ["exact", "sdo"])
    assert 0 < costs["sdo"].flops < costs["exact"].flops


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nonesuch"], "neither a preset"),
        (["--model", "mlp", "--height", "64"], "--height apply to diffusers models"),
        (["--model", "mlp", "--memory", "80"], "80GiB"),
        (["--model", "mlp", "--estimators", "exact,jagg"], "gate=off"),
        (["--model", "mlp", "--dtype", "int8"], "bf16, fp16, fp32"),
        (["--model", "sd3-medium", "--height", "1000"], "multiples of 16"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys) -> None:
    assert main(["cost", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_parse_bytes_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1.5 MiB") == int(1.5 * 2**20)
    with pytest.raises(InvalidValue, match="unit"):
        parse_bytes("12")
