"""``gradest cost`` prices guidance as each model guides, and shares the recipes' defaults.

* ``--cfg`` is the pipeline's ``guidance_scale``: classifier-free guidance (every call on
  ``2B`` rows) for SD3 and UNets, off at 1 (``ClassifierFreeGuidance`` then runs the
  conditional half alone); for a model with a guidance embedding (flux-dev) the
  embedding's value, one row per sample. ``--true-cfg`` is Flux's true CFG around the
  embedding (``2B`` rows), refused for the other families and for a Flux model's ``--cfg``
  without an embedding, in one line. The header and the JSON say which, every time.
* The VAE's gradient checkpointing is on by default, as the recipes'
  ``decoder_checkpointing`` (``--no-decoder-checkpointing`` turns it off).
* ``--recipe-defaults`` prices what the reward recipe of the model's family runs by
  default (its settings are checked against ``RecipeConfig`` in
  ``apps/recipes/tests/test_cost_recipe_defaults.py``).
* What the command prints is :func:`format_report` of what ``--json`` writes, so a page can
  quote a run's output from its JSON (``gradest_lab.cost.doc_figures``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradest.cli import main

pytest.importorskip("diffusers")

from gradest_lab.cost.command import (  # noqa: E402
    add_arguments,
    format_report,
    model_setup,
    resolve_options,
)
from gradest_lab.cost.diffusers_presets import LORA_TARGETS  # noqa: E402
from gradest_lab.cost.recipe_defaults import RECIPE_DEFAULTS, cost_options  # noqa: E402
from test_pixel_cost import TINY_SD3, TINY_VAE  # noqa: E402
from test_training_cost import TINY  # noqa: E402

SIZE, STEPS, TOKENS = 32, 2, 5


def folder(tmp_path: Path, config: dict, name: str = "model") -> Path:
    model = tmp_path / name
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    (model / "vae").mkdir()
    (model / "vae" / "config.json").write_text(json.dumps(TINY_VAE))
    return model


def cost(tmp_path: Path, model: Path, *extra: str, capsys=None) -> dict:
    out = tmp_path / "cost.json"
    out.unlink(missing_ok=True)
    argv = [
        "cost", "--model", str(model), "--steps", str(STEPS), "--height", str(SIZE),
        "--width", str(SIZE), "--prompt-tokens", str(TOKENS), "--dtype", "fp32",
        "--estimators", "exact", "--attention", "math", "--json", str(out), "--quiet", *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    if capsys is not None:
        payload["printed"] = capsys.readouterr().out
    return payload


def transformer_flops(payload: dict) -> float:
    exact = payload["estimators"]["exact"]
    return exact.get("transformer", exact)["flops"]


FLUX_NO_EMBEDDING = {**TINY["flux"], "guidance_embeds": False}


def test_flux_cfg_is_its_guidance_embedding_and_true_cfg_doubles_the_rows(tmp_path, capsys):
    model = folder(tmp_path, TINY["flux"])
    plain = cost(tmp_path, model, "--reward", "latent")
    embedding = cost(tmp_path, model, "--reward", "latent", "--cfg", "3.5", capsys=capsys)
    true_cfg = cost(tmp_path, model, "--reward", "latent", "--cfg", "3.5", "--true-cfg", "4")
    off = cost(tmp_path, model, "--reward", "latent", "--true-cfg", "1")
    assert plain["settings"]["guidance"] == "embedding (1 row per sample)"
    assert embedding["settings"]["guidance"] == "embedding 3.5 (1 row per sample)"
    assert "guidance=embedding 3.5 (1 row per sample)" in embedding["printed"]
    assert true_cfg["settings"]["guidance"] == (
        "true cfg 4 around the embedding 3.5 (2 rows per sample: conditional and unconditional)"
    )
    assert off["settings"]["guidance"] == "embedding, true cfg 1: off (1 row per sample)"
    rows = [p["settings"]["rows_per_sample"] for p in (plain, embedding, true_cfg, off)]
    assert rows == [1, 1, 2, 1]
    # The embedding's value costs nothing extra; true CFG runs every call on 2B rows.
    assert transformer_flops(embedding) == transformer_flops(plain) == transformer_flops(off)
    assert transformer_flops(true_cfg) > 1.9 * transformer_flops(plain)


def test_sd3_cfg_doubles_the_rows_and_is_off_at_one(tmp_path):
    model = folder(tmp_path, TINY_SD3)
    plain = cost(tmp_path, model, "--reward", "latent")
    cfg = cost(tmp_path, model, "--reward", "latent", "--cfg", "7")
    one = cost(tmp_path, model, "--reward", "latent", "--cfg", "1")
    assert plain["settings"]["guidance"] == "none (1 row per sample)"
    assert cfg["settings"]["guidance"] == (
        "cfg 7 (2 rows per sample: conditional and unconditional)"
    )
    assert one["settings"]["guidance"] == (
        "cfg 1: off, the conditional half alone (1 row per sample)"
    )
    assert transformer_flops(one) == transformer_flops(plain)
    assert transformer_flops(cfg) > 1.9 * transformer_flops(plain)


@pytest.mark.parametrize(
    ("config", "extra", "message"),
    [
        (
            TINY_SD3,
            ["--true-cfg", "4"],
            "gradest cost: error: true_cfg_scale=4 (--true-cfg) is Flux's true CFG around its "
            "guidance embedding (FluxPipeline's true_cfg_scale); SD3Transformer2DModel has no "
            "guidance embedding and guides with classifier-free guidance: pass --cfg 4",
        ),
        (
            TINY["unet"],
            ["--true-cfg"],
            "gradest cost: error: true_cfg_scale=4 (--true-cfg) is Flux's true CFG",
        ),
        (
            TINY["flux"],
            ["--true-cfg", "0.5"],
            "gradest cost: error: true_cfg_scale=0.5 (--true-cfg) must be >= 1",
        ),
        (
            FLUX_NO_EMBEDDING,
            ["--cfg", "3.5"],
            "gradest cost: error: cfg_scale=3.5 (--cfg): this Flux transformer has "
            "guidance_embeds=False (e.g. FLUX.1-schnell) and takes no guidance value; drop "
            "--cfg, or price classifier-free guidance with --true-cfg",
        ),
        (
            TINY_SD3,
            ["--cfg", "-1"],
            "gradest cost: error: --cfg must be a guidance scale (a finite number >= 0)",
        ),
        (
            TINY_SD3,
            ["--cfg", "nan"],
            "gradest cost: error: --cfg must be a guidance scale (a finite number >= 0)",
        ),
    ],
)
def test_guidance_a_model_does_not_have_is_refused_in_one_line(
    tmp_path, capsys, config, extra, message
):
    model = folder(tmp_path, config)
    argv = ["cost", "--model", str(model), "--steps", "2", "--height", str(SIZE), "--width",
            str(SIZE), "--reward", "latent", "--quiet", *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_flux_without_an_embedding_prices_true_cfg(tmp_path):
    model = folder(tmp_path, FLUX_NO_EMBEDDING)
    plain = cost(tmp_path, model, "--reward", "latent")
    true_cfg = cost(tmp_path, model, "--reward", "latent", "--true-cfg", "4")
    assert plain["settings"]["guidance"] == "none (1 row per sample)"
    assert true_cfg["settings"]["guidance"].startswith("true cfg 4 (2 rows per sample")
    assert transformer_flops(true_cfg) > 1.9 * transformer_flops(plain)


def test_the_decoder_is_checkpointed_by_default_as_in_the_recipes(tmp_path, capsys):
    model = folder(tmp_path, TINY_SD3)
    default = cost(tmp_path, model, "--reward", "pixels", "--decoder", str(model), capsys=capsys)
    plain = cost(tmp_path, model, "--reward", "pixels", "--decoder", str(model),
                 "--no-decoder-checkpointing")  # fmt: skip
    assert default["settings"]["decoder_checkpointing"] is True
    assert "decoder_checkpointing=True" in default["printed"].splitlines()[0]
    assert default["settings"]["decoder"].endswith("(checkpointing)")
    assert plain["settings"]["decoder_checkpointing"] is False
    assert (
        default["parts"]["decoder"]["retained_bytes"] < plain["parts"]["decoder"]["retained_bytes"]
    )
    assert RECIPE_DEFAULTS["decoder_checkpointing"] is True
    # A reward on the latents has no decode: the VAE's setting is not recorded, and an
    # explicit one is refused.
    latent = cost(tmp_path, model, "--reward", "latent")
    assert latent["settings"]["decoder_checkpointing"] is None
    for flag in ("--decoder-checkpointing", "--no-decoder-checkpointing"):
        argv = ["cost", "--model", "mlp", "--reward", "latent", flag, "--quiet"]
        assert main(argv) == 2
        assert "drop them" in capsys.readouterr().err


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("model", "family", "guidance"),
    [
        ("sd3-medium", "sd3", "cfg 7 (2 rows per sample: conditional and unconditional)"),
        ("sd3.5-large", "sd3", "cfg 7 (2 rows per sample: conditional and unconditional)"),
        ("flux-dev", "flux", "embedding 3.5 (1 row per sample)"),
        ("sdxl-unet", "sdxl", "cfg 5 (2 rows per sample: conditional and unconditional)"),
    ],
)
def test_recipe_defaults_are_the_recipe_familys(model, family, guidance):
    args = resolve_options(parse("--model", model, "--recipe-defaults"))
    assert args.recipe_defaults == family
    expected = cost_options(family)
    for key, value in expected.items():
        assert getattr(args, key) == value, key
    assert (args.lora_rank, args.gradient_checkpointing, args.decoder_checkpointing) == (
        8,
        False,
        True,
    )
    assert (args.dtype, args.estimators, args.reward, args.batch) == ("fp32", "sdo", "pixels", 1)
    assert RECIPE_DEFAULTS["lora_targets"] == LORA_TARGETS
    setup = model_setup(
        model, steps=args.steps, height=args.height, width=args.width, batch=args.batch,
        dtype=args.dtype, cfg=args.cfg, true_cfg=args.true_cfg, lora_rank=args.lora_rank,
    )  # fmt: skip
    assert setup.settings["guidance"] == guidance
    # Any option given is the run's, over the recipe's default.
    given = resolve_options(parse("--model", model, "--recipe-defaults", "--dtype", "bf16",
                                  "--cfg", "1", "--estimators", "exact"))  # fmt: skip
    assert (given.dtype, given.cfg, given.estimators, given.lora_rank) == ("bf16", 1.0, "exact", 8)


def test_recipe_defaults_are_refused_where_no_recipe_runs(capsys):
    for argv, message in (
        (["--model", "mlp"], "'mlp' is gradest's embedded model: drop --recipe-defaults"),
        (["--model", "sd3-medium", "--objective", "stepwise"], "prices the reward recipes"),
    ):
        assert main(["cost", *argv, "--recipe-defaults", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_the_printed_report_is_the_jsons(tmp_path, capsys):
    """What the command prints equals :func:`format_report` of the JSON it writes, with a
    pixel reward (the parts' lines) and without; the JSON records the command line."""
    model = folder(tmp_path, TINY_SD3)
    for extra in (["--reward", "latent"], ["--reward", "pixels", "--decoder", str(model)]):
        payload = cost(tmp_path, model, "--lora-rank", "2", "--cfg", *extra, capsys=capsys)
        printed = payload.pop("printed")
        assert printed == format_report(payload) + "\n"
        assert payload["command"].startswith(f"gradest cost --model {model} --steps 2")
        assert "--cfg 4.5" in payload["command"] and "--json" not in payload["command"]
        assert resolve_options(parse(*payload["command"].split()[2:])).cfg == 4.5


def test_help_says_what_cfg_and_true_cfg_price(capsys):
    with pytest.raises(SystemExit):
        main(["cost", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "for a model with a guidance embedding (flux-dev) the embedding's value, B rows" in text
    assert "Flux's true CFG (FluxPipeline's true_cfg_scale" in text
    assert "--no-decoder-checkpointing" in text and "--recipe-defaults" in text
