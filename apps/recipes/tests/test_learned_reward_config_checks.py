"""The learned rewards' model configs checked before a model is built from them (issue 45,
item 5), by the rule ``gradest cost --reward`` applies (gradest_lab.cost.config_checks):
every size and count a whole number >= 1, nested configs under dotted paths, the
architecture one the loader builds, each mistake one RecipeConfigError line naming the
file, the field, its value and the fix.

The defects this pins: a CLIP folder whose config.json says ``num_hidden_layers: 0``
loaded as a reward model without layers (the checkpoint's layer weights dropped with a
warning), a float or boolean size was a raw huggingface_hub traceback, and ImageReward's
``med_config.json`` was read with ``int()`` (2.5 became 2, ``true`` became 1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
transformers = pytest.importorskip("transformers")

from gradest_recipes import RecipeConfigError  # noqa: E402
from gradest_recipes.learned_rewards import AESTHETIC_HEAD, ScoreMLP  # noqa: E402
from gradest_recipes.rewards import resolve_reward  # noqa: E402

TINY_CLIP = transformers.CLIPConfig(
    text_config=dict(
        vocab_size=80, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77,
    ),
    vision_config=dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    ),
    projection_dim=16,
)  # fmt: skip
MED_CONFIG = {  # ImageReward's med_config.json, at tiny sizes
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 64, "layer_norm_eps": 1e-12, "max_position_embeddings": 40,
    "model_type": "bert", "num_attention_heads": 2, "num_hidden_layers": 2, "pad_token_id": 0,
    "type_vocab_size": 2, "vocab_size": 48, "encoder_width": 128, "add_cross_attention": True,
}  # fmt: skip
TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def _with(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``config`` with the field at the dotted ``path`` set to ``value``."""
    changed = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    node = changed
    for part in parents:
        node = node[part]
    node[last] = value
    return changed


def _clip_dict() -> dict[str, Any]:
    return json.loads(TINY_CLIP.to_json_string())


def _aesthetic_folder(root: Path) -> Path:
    """A tiny CLIP model saved as transformers saves it, with its image processor and a
    LAION MLP head for its 16-wide embeddings: everything ``aesthetic`` loads."""
    folder = root / "clip"
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    transformers.CLIPModel(TINY_CLIP).save_pretrained(folder)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    torch.save(ScoreMLP(16).state_dict(), folder / AESTHETIC_HEAD)
    return folder


def _rewrite(file: Path, config: dict[str, Any]) -> None:
    file.write_text(json.dumps(config))


def _refused(spec: str) -> str:
    """``resolve_reward(spec)`` must refuse in one line; the line."""
    with pytest.raises(RecipeConfigError) as caught:
        resolve_reward(spec)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"setting reward={spec!r}: "), message
    return message


def test_a_clip_folder_without_layers_is_refused_not_loaded(tmp_path) -> None:
    """The silent case: config.json says num_hidden_layers 0 beside a checkpoint with two
    layers. Unchecked, transformers builds a tower without layers and drops the weights."""
    folder = _aesthetic_folder(tmp_path)
    assert resolve_reward(f"aesthetic:model={folder}") is not None  # as saved: it loads
    _rewrite(folder / "config.json", _with(_clip_dict(), "vision_config.num_hidden_layers", 0))
    message = _refused(f"aesthetic:model={folder}")
    where = f"reward 'aesthetic': {str(folder / 'config.json')!r}"
    assert f"{where}: field vision_config.num_hidden_layers=0 is below 1; " in message
    assert "num_hidden_layers is a size or a count: set it to a whole number >= 1" in message


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("vision_config.num_hidden_layers", -1, "is below 1"),
        ("text_config.hidden_size", -32, "is below 1"),
        ("vision_config.hidden_size", 2.5, "is a fraction, not a whole number"),
        ("vision_config.num_attention_heads", True, "is a boolean, not a whole number"),
        ("text_config.vocab_size", "80", "is a string, not a whole number"),
        ("projection_dim", 0, "is below 1"),
        ("model_type", "siglip", "is not one this code supports; set model_type to one of clip"),
        ("vision_config", "ViT-L/14", "is a string; vision_config must be a JSON object"),
    ],
)
@pytest.mark.parametrize("name", ["pickscore", "hpsv2"])
def test_a_bad_clip_config_is_one_line_naming_the_file_and_field(
    name, path, value, problem, tmp_path
) -> None:
    """PickScore and HPSv2's transformers conversion load a CLIPModel folder: its
    config.json is checked before anything else of the folder is read."""
    folder = tmp_path / "model"
    folder.mkdir()
    _rewrite(folder / "config.json", _with(_clip_dict(), path, value))
    message = _refused(f"{name}:model={folder}")
    where = f"reward {name!r}: {str(folder / 'config.json')!r}"
    assert f"{where}: field {path}={json.dumps(value)} {problem}" in message, message


def test_the_aesthetic_predictor_takes_a_vision_only_clip(tmp_path) -> None:
    """aesthetic builds a vision tower alone from a clip_vision_model config: that is a known
    architecture for it (its sizes still checked), not for PickScore."""
    folder = tmp_path / "vision"
    folder.mkdir()
    vision = json.loads(TINY_CLIP.vision_config.to_json_string())
    _rewrite(folder / "config.json", _with(vision, "patch_size", 0))
    (folder / AESTHETIC_HEAD).write_bytes(b"")
    message = _refused(f"aesthetic:model={folder}")
    assert "field patch_size=0 is below 1" in message
    message = _refused(f"pickscore:model={folder}")
    assert 'field model_type="clip_vision_model" is not one this code supports' in message


def test_what_transformers_4_wrote_passes_the_check(tmp_path) -> None:
    """A config.json saved by transformers 4 (unset sizes as null, generation settings at
    0) passes the check: the refusal is then the missing weights', as before."""
    config = _clip_dict()
    for part in ("text_config", "vision_config"):
        config[part] |= {
            "cross_attention_hidden_size": None, "min_length": 0, "no_repeat_ngram_size": 0,
            "encoder_no_repeat_ngram_size": 0, "num_beams": 1, "pruned_heads": {},
            "tie_word_embeddings": True, "max_length": 20, "sep_token_id": None,
        }  # fmt: skip
    folder = tmp_path / "old"
    folder.mkdir()
    _rewrite(folder / "config.json", config)
    message = _refused(f"pickscore:model={folder}")
    assert "no CLIP model at" in message and "field " not in message, message


def test_a_config_in_the_hub_cache_is_checked_too(tmp_path, monkeypatch) -> None:
    """A hub name is read from the hub cache: the cached config.json is checked the same."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-clip" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (cache / "models--someone--tiny-clip" / "refs").mkdir()
    (cache / "models--someone--tiny-clip" / "refs" / "main").write_text("0" * 40)
    _rewrite(snapshot / "config.json", _with(_clip_dict(), "text_config.num_hidden_layers", 0))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    message = _refused("pickscore:model=someone/tiny-clip")
    assert "config.json': field text_config.num_hidden_layers=0 is below 1" in message, message


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("num_hidden_layers", 0, "is below 1"),
        ("num_hidden_layers", -1, "is below 1"),
        ("hidden_size", 2.5, "is a fraction, not a whole number"),
        ("num_attention_heads", True, "is a boolean, not a whole number"),
        ("vocab_size", "48", "is a string, not a whole number"),
        ("max_position_embeddings", None, "is null"),
        ("encoder_width", -128, "is below 1"),
        ("model_type", "gpt2", "is not one this code supports; set model_type to one of bert"),
        ("hidden_act", 1, "is a whole number; hidden_act must be a string"),
        ("layer_norm_eps", "tiny", "is a string; layer_norm_eps must be a number"),
    ],
)
def test_a_bad_med_config_is_one_line_naming_the_file_and_field(
    path, value, problem, tmp_path
) -> None:
    """ImageReward's med_config.json is checked before the checkpoint is read."""
    folder = tmp_path / "imagereward"
    folder.mkdir()
    (folder / "ImageReward.pt").write_bytes(b"not read: the config is refused first")
    _rewrite(folder / "med_config.json", _with(MED_CONFIG, path, value))
    message = _refused(f"imagereward:model={folder}")
    where = f"reward 'imagereward': {str(folder / 'med_config.json')!r}"
    assert f"{where}: field {path}={json.dumps(value)} {problem}" in message, message


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("vision_cfg.layers", 0, "is below 1"),
        ("text_cfg.width", -32, "is below 1"),
        ("embed_dim", 16.5, "is a fraction, not a whole number"),
        ("text_cfg.heads", False, "is a boolean, not a whole number"),
        ("vision_cfg", [1], "is a list; vision_cfg must be a JSON object"),
    ],
)
def test_a_bad_open_clip_config_is_one_line_naming_the_file_and_field(
    path, value, problem, tmp_path
) -> None:
    """HPSv2's ``arch=config.json`` (an open_clip model config) is checked before open_clip
    registers it."""
    pytest.importorskip("open_clip")
    folder = tmp_path / "hps"
    folder.mkdir()
    (folder / "HPS_v2_compressed.pt").write_bytes(b"not read: the config is refused first")
    arch = tmp_path / "tiny-bad-hps.json"
    _rewrite(arch, _with(TINY_OPEN_CLIP, path, value))
    message = _refused(f"hpsv2:model={folder},arch={arch}")
    where = f"reward 'hpsv2': {str(arch)!r}"
    assert f"{where}: field {path}={json.dumps(value)} {problem}" in message, message


def test_the_recipe_script_prints_a_bad_config_as_one_line(capsys, tmp_path) -> None:
    """The user's entry point: the recipe script exits 2 with the one line."""
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    from gradest_recipes.train import script_main

    folder = tmp_path / "imagereward"
    folder.mkdir()
    (folder / "ImageReward.pt").write_bytes(b"")
    _rewrite(folder / "med_config.json", _with(MED_CONFIG, "num_hidden_layers", 0))
    argv = ["--tiny", "--out", str(tmp_path / "out"), "--reward", f"imagereward:model={folder}"]
    assert script_main("sd3", argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert "med_config.json': field num_hidden_layers=0 is below 1" in err, err


def test_a_valid_folder_still_scores(tmp_path) -> None:
    """The check changes nothing for a valid folder: the reward loads and scores."""
    reward: Any = resolve_reward(f"aesthetic:model={_aesthetic_folder(tmp_path)}")
    scores = reward(torch.rand(2, 3, 32, 32), ["a", "b"])
    assert scores.shape == (2,) and bool(torch.isfinite(scores).all())
