"""The Flux recipe's true CFG (``true_cfg_scale``, FluxPipeline's): classifier-free guidance
around the guidance embedding, ``ClassifierFreeGuidance(EmbeddedGuidance(...))`` with the
negative prompt's embeddings. Checked on the tiny Flux model: the option doubles every
call's rows and changes the velocity and its gradient to the guidance formula written by
hand; it is off at 1 (the default); it is refused in one line for the other families,
below 1, and without the negative prompt's embeddings; the prompts script writes Flux's
negative prompt as FluxPipeline encodes it; a tiny run trains with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_recipes import RecipeConfigError, load_config  # noqa: E402
from gradest_recipes.config import RecipeConfig  # noqa: E402
from gradest_recipes.embeddings import load_embeddings, tiny_embeddings  # noqa: E402
from gradest_recipes.families import build_family, guided  # noqa: E402
from recipe_support import RECIPE_WARNINGS, assert_run_outputs, records, script  # noqa: E402

from gradest.integrations.guidance import (  # noqa: E402
    ClassifierFreeGuidance,
    EmbeddedGuidance,
)

pytestmark = RECIPE_WARNINGS

TRUE_CFG = 3.0


def flux(**overrides):
    """The tiny Flux family (float64, for comparisons to round-off) and its config."""
    config = load_config("flux", overrides={"tiny": True, **overrides})
    family = build_family("flux", config, tiny_embeddings("flux"), weight_dtype=torch.float64)
    family.denoiser.to(torch.float64)
    return family, config


def inputs(family):
    generator = torch.Generator().manual_seed(5)
    z = torch.randn(2, *family.latent_shape, generator=generator, dtype=torch.float64)
    t = torch.tensor([0.7, 0.4], dtype=torch.float64)
    cond = family.make_cond(tiny_embeddings("flux"), torch.tensor([0, 3]), torch.device("cpu"))
    cond = {k: v.double() if torch.is_tensor(v) else v for k, v in cond.items()}
    return z, t, cond


def rows_per_call(family, z, t, cond) -> list[int]:
    """The batch of every call of the transformer while the guided velocity runs once."""
    seen: list[int] = []
    hook = family.denoiser.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[0]),
        with_kwargs=True,
    )
    try:
        family.velocity(z, t, **cond)
    finally:
        hook.remove()
    return seen


def lora_grad(family, z, t, cond, weights) -> torch.Tensor:
    params = [p for p in family.denoiser.parameters() if p.requires_grad]
    loss = (family.velocity(z, t, **cond) * weights).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_true_cfg_runs_both_halves_around_the_embedding_and_changes_the_gradient():
    plain, plain_config = flux()
    family, config = flux(true_cfg_scale=TRUE_CFG)
    assert plain_config.true_cfg_scale == 1.0 and not guided("flux", plain_config)
    assert guided("flux", config)
    # The library's wrappers, as from_pipeline builds FluxPipeline's true CFG.
    assert isinstance(plain.velocity, EmbeddedGuidance)
    assert isinstance(family.velocity, ClassifierFreeGuidance)
    assert family.velocity.scale == TRUE_CFG
    assert isinstance(family.velocity.model, EmbeddedGuidance)
    assert family.velocity.model.scale == config.guidance_scale == 3.5

    z, t, cond = inputs(family)
    assert {"negative_encoder_hidden_states", "negative_pooled_projections"} <= set(cond)
    _, _, plain_cond = inputs(plain)
    assert not any(k.startswith("negative_") for k in plain_cond)
    assert rows_per_call(plain, z, t, plain_cond) == [2]  # one row per sample
    assert rows_per_call(family, z, t, cond) == [4]  # conditional and unconditional

    # The guided velocity is v_u + w (v_c - v_u), both halves through the embedding.
    inner = family.velocity.model
    positive = {k: v for k, v in cond.items() if not k.startswith("negative_")}
    negative = dict(positive)
    negative.update(
        {
            k.removeprefix("negative_"): v
            for k, v in cond.items()
            if k != k.removeprefix("negative_")
        }
    )
    with torch.no_grad():
        v_c, v_u = inner(z, t, **positive), inner(z, t, **negative)
        got = family.velocity(z, t, **cond)
        unguided = plain.velocity(z, t, **plain_cond)
    torch.testing.assert_close(got, v_u + TRUE_CFG * (v_c - v_u), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(unguided, v_c, rtol=1e-10, atol=1e-10)  # the same weights

    # The gradient is the guidance formula's, not the conditional call's.
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(6), dtype=got.dtype)
    with_cfg = lora_grad(family, z, t, cond, weights)
    params = [p for p in family.denoiser.parameters() if p.requires_grad]
    by_hand_loss = ((inner(z, t, **negative) * (1 - TRUE_CFG)
                     + TRUE_CFG * inner(z, t, **positive)) * weights).sum()  # fmt: skip
    by_hand = torch.cat([g.reshape(-1) for g in torch.autograd.grad(by_hand_loss, params)])
    torch.testing.assert_close(with_cfg, by_hand, rtol=1e-9, atol=1e-12)
    without = lora_grad(plain, z, t, plain_cond, weights)
    assert (with_cfg - without).norm() > 1e-3 * without.norm()


def test_true_cfg_is_refused_for_the_other_families_and_below_one():
    for family in ("sd3", "sd_unet", "sdxl"):
        with pytest.raises(RecipeConfigError) as caught:
            load_config(family, overrides={"tiny": True, "true_cfg_scale": 2.0})
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("setting true_cfg_scale=2.0 is invalid: true CFG is the flux")
        assert f"the {family} recipe's CFG scale is guidance_scale" in message
    # A config built without a family's defaults is refused where the family is built.
    config = RecipeConfig(tiny=True, true_cfg_scale=2.0)
    with pytest.raises(RecipeConfigError, match=r"^setting true_cfg_scale=2\.0 is invalid"):
        build_family("sd3", config, tiny_embeddings("sd3"))
    with pytest.raises(
        RecipeConfigError, match=r"true_cfg_scale=0\.5 is invalid: must be a finite number >= 1"
    ):
        load_config("flux", overrides={"tiny": True, "true_cfg_scale": 0.5})


def test_an_embeddings_file_without_the_negative_prompt_is_refused(tmp_path: Path):
    embeddings = tiny_embeddings("flux")
    tensors = {k: v for k, v in embeddings.tensors.items() if not k.startswith("negative_")}
    file = tmp_path / "flux.pt"
    type(embeddings)(family="flux", prompts=embeddings.prompts, tensors=tensors).to_file(file)
    assert load_embeddings(file, "flux", guided=False).count == 4  # no true CFG: fine
    with pytest.raises(ValueError) as caught:
        load_embeddings(file, "flux", guided=True)
    message = str(caught.value)
    assert "\n" not in message and "negative_prompt_embeds" in message
    assert "--negative-prompt ''" in message and "true_cfg_scale = 1" in message


@pytest.mark.filterwarnings("ignore::FutureWarning")  # diffusers' torch_dtype, as prompts.py
def test_the_prompts_script_writes_fluxs_negative_prompt_as_fluxpipeline(tmp_path: Path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from test_recipe_prompts import PROMPTS, T5_TOKENS, encode, tiny_flux_pipeline_folder

    model = tiny_flux_pipeline_folder(tmp_path / "pipe")
    (tmp_path / "neg").mkdir()
    data = encode(
        tmp_path / "neg", "flux", model, "--dtype", "float32", "--negative-prompt", "dark"
    )
    pipe = diffusers.FluxPipeline.from_pretrained(str(model))
    with torch.no_grad():
        negative, negative_pooled, _ = pipe.encode_prompt(
            prompt=["dark"], prompt_2=None, device="cpu", max_sequence_length=T5_TOKENS
        )
    assert torch.equal(data["negative_prompt_embeds"], negative)
    assert torch.equal(data["negative_pooled_prompt_embeds"], negative_pooled)
    assert data["prompts"] == PROMPTS
    embeddings = load_embeddings(tmp_path / "neg" / "prompts.pt", "flux", guided=True)
    assert embeddings.tensors["negative_prompt_embeds"].shape[1:] == data["prompt_embeds"].shape[1:]


def test_a_tiny_flux_run_trains_with_true_cfg(tmp_path: Path):
    plain, cfg = tmp_path / "plain", tmp_path / "cfg"
    script("flux").main(["--tiny", "--out", str(plain)])
    script("flux").main(["--tiny", "--out", str(cfg), "--true-cfg-scale", str(TRUE_CFG)])
    assert_run_outputs(cfg, steps=2)
    assert "true_cfg_scale = 3.0" in (cfg / "config.toml").read_text()
    # The same seed and weights: the guided run's rewards and gradients are its own.
    assert [r["grad_norm"] for r in records(cfg)] != [r["grad_norm"] for r in records(plain)]
