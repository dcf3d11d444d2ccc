"""A warm start from an existing LoRA (``lora_path``, Flow-GRPO's ``train.lora_path``).

The run's adapters start as the file's update ``(alpha / rank) B A``, module by module,
from a recipe's own diffusers-format export or from a peft adapter folder (what Flow-GRPO's
``save_pretrained`` writes), whatever the run's own alpha; a file written for another rank,
other targets or no LoRA at all is one line naming the file and the tensor.
"""

from __future__ import annotations

import re

import pytest
import torch
from recipe_support import RECIPE_WARNINGS, lora_file, script

pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from gradest_recipes.config import load_config  # noqa: E402
from gradest_recipes.embeddings import tiny_embeddings  # noqa: E402
from gradest_recipes.errors import RecipeConfigError  # noqa: E402
from gradest_recipes.families import build_family, tiny_denoiser  # noqa: E402

pytestmark = RECIPE_WARNINGS
MODULE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(\.[^.]+)?\.weight$")


def updates(tensors: dict[str, torch.Tensor], scale: float, strip: str = "") -> dict:
    """``{module: scale * B @ A}`` of adapter tensors named ``module.lora_A[.name].weight``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name = key[len(strip) :] if key.startswith(strip) else key
        match = MODULE.match(name)
        assert match is not None, key
        module = re.sub(r"^(model\.)?transformer\.", "", match["module"])
        pairs.setdefault(module, {})[match["ab"]] = value.double()
    return {m: scale * ab["B"] @ ab["A"] for m, ab in pairs.items()}


def family_with(**settings):
    config = load_config("sd3", overrides={"tiny": True, **settings})
    return build_family("sd3", config, tiny_embeddings("sd3")), config


def own_updates(family, config) -> dict:
    tensors = {k: v for k, v in family.denoiser.state_dict().items() if "lora_" in k}
    alpha = config.lora_alpha if config.lora_alpha is not None else config.lora_rank
    return updates(tensors, alpha / config.lora_rank)


def test_a_recipe_export_starts_the_next_run_where_it_ended(tmp_path):
    out = tmp_path / "first"
    argv = ["--tiny", "--report_to", "none", "--steps", "1", "--lr", "1e-2", "--out", str(out)]
    assert script("sd3").main(argv) == 0
    trained = lora_file(out / "checkpoints" / "step_000001")
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    for alpha in (None, 8.0):  # the update is the file's whatever the run's alpha
        family, config = family_with(lora_path=str(out / "lora"), lora_alpha=alpha)
        got, want = own_updates(family, config), updates(trained, 1.0)
        assert got.keys() == want.keys()
        for module in want:
            torch.testing.assert_close(got[module], want[module], rtol=1e-6, atol=1e-9)
    # and through the script: a second run from the first one's LoRA
    second = tmp_path / "second"
    argv2 = ["--tiny", "--report_to", "none", "--steps", "1", "--out", str(second)]
    assert script("sd3").main([*argv2, "--lora-path", str(out / "lora")]) == 0


def test_a_peft_adapter_folder_as_flow_grpo_saves_it(tmp_path):
    """``get_peft_model(...).save_pretrained(folder)``, Flow-GRPO's ``save_ckpt``: its
    ``lora_alpha / r`` is read from ``adapter_config.json``."""
    targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
    config = peft.LoraConfig(r=2, lora_alpha=8, init_lora_weights="gaussian",
                             target_modules=targets)  # fmt: skip
    model = peft.get_peft_model(tiny_denoiser("sd3"), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    folder = tmp_path / "peft"
    model.save_pretrained(str(folder))
    saved = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    want = updates(saved, 8 / 2, strip="base_model.model.")
    family, run_config = family_with(lora_path=str(folder), lora_targets=targets)
    got = own_updates(family, run_config)
    assert got.keys() == want.keys() and want
    for module in want:
        torch.testing.assert_close(got[module], want[module], rtol=1e-6, atol=1e-9)


def test_a_lora_of_another_shape_or_not_a_lora_is_one_line(tmp_path):
    out = tmp_path / "first"
    argv = ["--tiny", "--report_to", "none", "--steps", "1", "--out", str(out)]
    assert script("sd3").main(argv) == 0
    cases = [
        ({"lora_path": str(tmp_path / "none")}, "nothing is there"),
        ({"lora_path": str(out / "lora"), "lora_rank": 3}, "has shape"),
        ({"lora_path": str(out / "lora"), "lora_targets": ["to_q", "to_k"]}, "unexpected"),
        ({"lora_path": str(out / "config.toml")}, "is not a safetensors file"),
    ]
    for settings, fragment in cases:
        with pytest.raises(RecipeConfigError) as caught:
            family_with(**settings)
        message = str(caught.value)
        assert "\n" not in message and fragment in message, message
        assert f"lora_path={settings['lora_path']!r}" in message
