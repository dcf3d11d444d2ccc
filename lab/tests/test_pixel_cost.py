"""``gradest cost --reward``: the VAE decode and the reward model priced (issue 31, item 1),
and the composition (each call traced once, replayed) against full traces (item 2).

Checked like the transformer's cost (lab/tests/test_training_cost.py): on tiny configs of each
part, the meta-device prediction equals what a user counts by hand on real CPU tensors
(``FlopCounterMode`` and saved-tensor hooks' bytes), and the whole step with the pixel
reward equals a hand-written exact training loop. Real CPU runs take the math attention
path, so the predictions here use ``attention="math"``.
"""

from __future__ import annotations

import json

import pytest
import torch
from saved_tensor_bytes import saved_bytes
from tiny_configs import TINY_CLIP_SCORE, TINY_SD3, TINY_VAE, TINY_VISION
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gradest.cli import main
from gradest.errors import InvalidValue

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from gradest_lab.cost.command import ModelSetup, predict_step_costs  # noqa: E402
from gradest_lab.cost.decoder_presets import pixel_decoder  # noqa: E402
from gradest_lab.cost.diffusers_presets import diffusers_shapes  # noqa: E402
from gradest_lab.cost.pixel_cost import PixelLoss, PixelSetup, part_cost  # noqa: E402
from gradest_lab.cost.reward_presets import reward_model  # noqa: E402

TINY_REWARDS = {
    "aesthetic": {"kind": "aesthetic", "vision": TINY_VISION, "image_size": 16},
    "clip-score": TINY_CLIP_SCORE,
    "blip-score": {
        "kind": "blip-score",
        "vision": {k: v for k, v in TINY_VISION.items() if k != "projection_dim"},
        "text": {
            "vocab_size": 32, "hidden_size": 16, "encoder_hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 16, "is_decoder": True,
        },
        "image_size": 16, "text_tokens": 5,
    },
}  # fmt: skip
SIZE, STEPS, BATCH, TOKENS = 32, 3, 2, 5


def _decoder(device: str, **options):
    torch.manual_seed(0)
    return pixel_decoder(
        TINY_VAE, family="sd3", latent_size=(SIZE // 8, SIZE // 8), latent_channels=4,
        dtype=torch.float32, device=device, **options,
    )  # fmt: skip


def _by_hand(module, example):
    """A user's count of one frozen call, forward and backward into its input."""

    def step():
        x = example.detach().requires_grad_(True)
        module(x).float().sum().backward()

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    with sdpa_kernel(SDPBackend.MATH):
        saved = saved_bytes([module], step)
    return counter.get_total_flops(), saved


@pytest.mark.parametrize(
    "options", [{}, {"checkpointing": True}, {"tile": 16}, {"checkpointing": True, "tile": 16}]
)
def test_decoder_part_equals_a_handwritten_decode(options) -> None:
    """The decoder's line: FLOPs and saved bytes of a real decode + backward, plain,
    checkpointed, tiled and both."""
    latents = torch.randn(BATCH, 4, SIZE // 8, SIZE // 8)
    flops, saved = _by_hand(_decoder("cpu", **options), latents)
    predicted = part_cost(_decoder("meta", **options), latents.to("meta"), attention="math")
    assert predicted.flops == flops > 0
    assert predicted.retained_bytes == saved > 0
    assert 0 < predicted.forward_flops < predicted.flops


def test_decoder_checkpointing_holds_less_and_recomputes() -> None:
    latents = torch.zeros(BATCH, 4, SIZE // 8, SIZE // 8, device="meta")
    plain = part_cost(_decoder("meta"), latents)
    checkpointed = part_cost(_decoder("meta", checkpointing=True), latents)
    assert checkpointed.retained_bytes < plain.retained_bytes
    assert checkpointed.peak_bytes < plain.peak_bytes
    assert checkpointed.flops > plain.flops


@pytest.mark.parametrize("kind", sorted(TINY_REWARDS))
def test_reward_part_equals_a_handwritten_score(kind: str) -> None:
    """The reward's line, for each architecture: CLIP image embedding + MLP (aesthetic),
    CLIP text-image score (pickscore, hpsv2), BLIP cross-attention + MLP (imagereward)."""
    torch.manual_seed(0)
    real = reward_model(TINY_REWARDS[kind], dtype=torch.float32, device="cpu")
    images = torch.rand(BATCH, 3, SIZE, SIZE)
    flops, saved = _by_hand(real, images)
    meta = reward_model(TINY_REWARDS[kind], dtype=torch.float32)
    predicted = part_cost(meta, images.to("meta"), attention="math")
    assert predicted.flops == flops > 0
    assert predicted.retained_bytes == saved > 0
    assert predicted.parameters == sum(p.numel() for p in real.parameters())


def _setup(device: str) -> tuple[ModelSetup, PixelSetup]:
    """The tiny SD3, its tiny VAE and a tiny aesthetic reward, seeded."""
    torch.manual_seed(0)
    shapes = diffusers_shapes(
        TINY_SD3, batch=BATCH, height=SIZE, width=SIZE, dtype=torch.float32,
        prompt_tokens=TOKENS, device=device,
    )  # fmt: skip
    setup = ModelSetup(
        "tiny", shapes.velocity, shapes.latent_shape, shapes.cond, STEPS, torch.float32,
        {"height": SIZE, "width": SIZE}, "sd3",
    )  # fmt: skip
    decoder = _decoder(device)
    torch.manual_seed(1)
    reward = reward_model(TINY_REWARDS["aesthetic"], dtype=torch.float32, device=device)
    image_shape = (BATCH, 3, SIZE, SIZE)
    return setup, PixelSetup(decoder, reward, "tiny VAE", "tiny aesthetic", image_shape)


def test_whole_step_equals_a_handwritten_loop() -> None:
    """exact with the pixel reward on meta == a hand-written loop on real tensors: sample
    with the graph, decode, score, backward, AdamW (FLOPs and saved bytes)."""
    setup, pixels = _setup("cpu")
    model = setup.velocity
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float64).tolist()
    noise = torch.randn(setup.noise_shape)
    loss_fn = PixelLoss(pixels.decoder, pixels.reward)

    def step():
        z = noise
        for k in range(STEPS):
            t = torch.full((BATCH,), times[k])
            z = z + (times[k + 1] - times[k]) * model(z, t, **setup.cond)
        loss_fn(z, torch.zeros(())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    with sdpa_kernel(SDPBackend.MATH):
        saved = saved_bytes([model, pixels.decoder, pixels.reward], step)
    meta_setup, meta_pixels = _setup("meta")
    predicted = predict_step_costs(meta_setup, ["exact"], pixels=meta_pixels, attention="math")
    whole = predicted["exact"].whole
    assert whole is not None
    assert whole.flops == counter.get_total_flops()
    assert whole.retained_bytes == saved
    assert predicted["exact"].calls == {"graph": 1, "no_graph": 0}


@pytest.mark.parametrize(
    "spec", ["exact", "exact:checkpoint=true", "sdo", "alignprop", "jagg:gate=off"]
)
def test_composition_equals_a_full_trace(spec: str) -> None:
    """Each call traced once and replayed (transformer calls, optimizer step, decode +
    reward) == every operator traced in every step, on the meta device: FLOPs and saved
    bytes exactly; the peak within 10% (a replayed call's backward returns its parameter
    gradients together at its end, a traced one layer by layer: on this one-layer model
    that order is a larger share of the peak than on lab/tests/test_training_cost.py's). And
    the whole step's FLOPs are the transformer's plus each part's over its calls."""
    setup, pixels = _setup("meta")
    composed = predict_step_costs(setup, [spec], pixels=pixels, attention="math")[spec]
    setup, pixels = _setup("meta")
    traced = predict_step_costs(setup, [spec], pixels=pixels, attention="math", replay=False)[spec]
    for mine, full in ((composed.transformer, traced.transformer), (composed.whole, traced.whole)):
        assert mine is not None and full is not None
        assert mine.flops == full.flops and mine.flops_range == full.flops_range
        assert mine.retained_bytes == full.retained_bytes
        assert abs(mine.peak_bytes - full.peak_bytes) <= 0.1 * full.peak_bytes
    assert composed.calls == traced.calls
    latents = torch.zeros(setup.noise_shape, device="meta")
    decoder = part_cost(pixels.decoder, latents, attention="math")
    reward = part_cost(
        pixels.reward, torch.zeros(pixels.image_shape, device="meta"), attention="math"
    )
    assert composed.calls is not None and composed.whole is not None
    graph, no_graph = composed.calls["graph"], composed.calls["no_graph"]
    parts = graph * (decoder.flops + reward.flops)
    parts += no_graph * (decoder.forward_flops + reward.forward_flops)
    assert composed.whole.flops == composed.transformer.flops + parts


def test_cli_prints_transformer_decoder_reward_and_whole_step(tmp_path, capsys) -> None:
    model = tmp_path / "pipeline"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text(json.dumps(TINY_SD3))
    (model / "vae").mkdir()
    (model / "vae" / "config.json").write_text(json.dumps(TINY_VAE))
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(TINY_REWARDS["blip-score"]))
    out = tmp_path / "cost.json"
    argv = [
        "cost", "--model", str(model), "--steps", "2", "--height", str(SIZE), "--width",
        str(SIZE), "--prompt-tokens", str(TOKENS), "--dtype", "fp32", "--estimators",
        "exact,sdo", "--reward", str(reward), "--decoder", str(model),
        "--decoder-checkpointing", "--memory", "1GiB", "--json", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    for line in ("| transformer |", "| decoder (x1) |", "| reward (x1) |", "**whole step**"):
        assert line in table
    payload = json.loads(out.read_text())
    exact = payload["estimators"]["exact"]
    assert exact["flops"] == exact["transformer"]["flops"] + sum(exact["parts_flops"].values())
    assert exact["peak_bytes"] > exact["transformer"]["peak_bytes"]
    assert payload["settings"]["decoder_checkpointing"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "mlp", "--reward", "aesthetic"], "--reward latent"),
        (["--model", "mlp", "--reward", "latent", "--decoder-checkpointing"], "drop them"),
        (["--model", "sd3-medium", "--reward", "nonesuch"], "neither a learned reward"),
        (["--model", "sd3-medium", "--objective", "stepwise", "--reward", "aesthetic"], "stepwise"),
    ],
)
def test_bad_reward_input_is_one_line(argv, message, capsys) -> None:
    assert main(["cost", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_reward_config_fields_are_checked(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "clip-score", "vision": TINY_VISION}))
    from gradest_lab.cost.reward_presets import reward_config

    config, _ = reward_config(str(bad))
    with pytest.raises(InvalidValue, match="needs a 'text' config"):
        reward_model(config, dtype=torch.float32)


@pytest.mark.parametrize(
    ("option", "contents", "problem"),
    [
        ("--reward", b"{not json", "is not JSON"),
        ("--decoder", b"{not json", "is not JSON"),
        ("--model", b"{not json", "is not JSON"),
        ("--reward", b"\xff\xfe", "is not UTF-8"),
        ("--decoder", b"\xff\xfe", "is not UTF-8"),
        ("--model", b"\xff\xfe", "is not UTF-8"),
    ],
)
def test_a_config_that_is_not_json_text_is_one_line_naming_it(
    option, contents, problem, tmp_path, capsys
) -> None:
    """Every config file gradest cost reads back (the model's, the decoder's, the
    reward's) goes through one reader: a file that is not UTF-8 JSON is one line naming
    the option and the file."""
    path = tmp_path / "config.json"
    path.write_bytes(contents)
    argv = {
        "--reward": ["--model", "sd3-medium", "--reward", str(path)],
        "--decoder": ["--model", "sd3-medium", "--decoder", str(path)],
        "--model": ["--model", str(path)],
    }[option]
    assert main(["cost", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert problem in err and str(path) in err, err
