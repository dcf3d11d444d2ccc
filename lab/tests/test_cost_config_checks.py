"""``gradest cost --reward`` / ``--decoder`` configs checked like the diffusers configs
(issue 45, item 5): every size and count a whole number >= 1, nested sections checked
under dotted paths, known architectures only, each mistake one line naming the file, the
field, its value and the fix (exit status 2), before any model is built.

The defects this pins: a reward config with ``vision.num_hidden_layers`` -1 or 0 was
priced as a reward model with no layers (exit 0, a silent wrong number); ``hidden_size``
-32 and a VAE with ``norm_num_groups`` 0 were raw tracebacks; ``layers_per_block`` 0 was
priced as a decoder without blocks.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_configs import TINY_CLIP_SCORE, TINY_SD3, TINY_VAE

from gradest import InvalidValue
from gradest.cli import main

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from gradest_lab.cost.reward_presets import REWARD_PRESETS, reward_model  # noqa: E402

SIZE = 32


def _with(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``config`` with the field at the dotted ``path`` set to ``value``."""
    changed = copy.deepcopy(config)
    *parents, last = path.split(".")
    node = changed
    for part in parents:
        node = node[part]
    if "[" in last:  # block_out_channels[1]
        name, index = last[:-1].split("[")
        node[name][int(index)] = value
    else:
        node[last] = value
    return changed


def _pipeline(root: Path) -> Path:
    """A tiny SD3 pipeline folder (transformer and VAE configs), priced in seconds."""
    folder = root / "pipeline"
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "transformer" / "config.json").write_text(json.dumps(TINY_SD3))
    (folder / "vae").mkdir(exist_ok=True)
    (folder / "vae" / "config.json").write_text(json.dumps(TINY_VAE))
    return folder


def _cost(root: Path, *extra: str) -> list[str]:
    """``gradest cost`` on the tiny pipeline, decoding with its tiny VAE unless ``extra``
    names another ``--decoder``."""
    pipeline = _pipeline(root)
    decoder = [] if "--decoder" in extra else ["--decoder", str(pipeline)]
    return [
        "cost", "--model", str(pipeline), "--steps", "1", "--height", str(SIZE),
        "--width", str(SIZE), "--prompt-tokens", "5", "--dtype", "fp32", "--estimators",
        "exact", "--quiet", *decoder, *extra,
    ]  # fmt: skip


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``gradest`` with ``argv``: it must exit with status 2 and one line, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# (dotted field, bad value, what the message says about it)
BAD_REWARD_FIELDS = [
    ("vision.num_hidden_layers", -1, "is below 1"),
    ("vision.num_hidden_layers", 0, "is below 1"),
    ("vision.hidden_size", -32, "is below 1"),
    ("vision.hidden_size", 2.5, "is a fraction, not a whole number"),
    ("vision.num_attention_heads", True, "is a boolean, not a whole number"),
    ("vision.patch_size", "8", "is a string, not a whole number"),
    ("vision.intermediate_size", None, "is null"),
    ("vision.projection_dim", {"width": 8}, "is a JSON object, not a whole number"),
    ("text.vocab_size", 0, "is below 1"),
    ("text.max_position_embeddings", -8, "is below 1"),
    ("image_size", 0, "is below 1"),
    ("text_tokens", 6.0, "is a float, not a whole number"),
]


@pytest.mark.parametrize(("path", "value", "problem"), BAD_REWARD_FIELDS)
def test_a_bad_reward_size_is_one_line_naming_the_file_and_field(
    path, value, problem, tmp_path, capsys
) -> None:
    """The user's entry point: ``gradest cost --reward bad.json`` exits 2 with one line
    naming the option, the file, the dotted field, its value and the fix."""
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(_with(TINY_CLIP_SCORE, path, value)))
    err = _one_line_error(_cost(tmp_path, "--reward", str(reward)), capsys)
    name = path.rpartition(".")[2]
    assert f"--reward {str(reward)!r}: field {path}={json.dumps(value)} {problem}" in err, err
    assert f"{name} is a size or a count: set it to a whole number >= 1" in err, err


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("kind", "siglip-score", "is not one this code supports; set kind to one of "
         "aesthetic, blip-score, clip-score"),
        ("kind", ["clip-score"], "is not one this code supports"),
        ("vision", "clip-vit-l", "is a string; vision must be a JSON object"),
        ("text", [1, 2], "is a list; text must be a JSON object"),
        ("logit_scale", "false", "is a string; logit_scale must be true or false"),
    ],
)  # fmt: skip
def test_an_unknown_architecture_or_wrong_type_is_one_line(
    path, value, expected, tmp_path, capsys
) -> None:
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(_with(TINY_CLIP_SCORE, path, value)))
    err = _one_line_error(_cost(tmp_path, "--reward", str(reward)), capsys)
    assert f"--reward {str(reward)!r}: field {path}={json.dumps(value)} {expected}" in err, err


def test_a_reward_config_without_kind_or_not_an_object_is_one_line(tmp_path, capsys) -> None:
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps({k: v for k, v in TINY_CLIP_SCORE.items() if k != "kind"}))
    err = _one_line_error(_cost(tmp_path, "--reward", str(reward)), capsys)
    assert "field kind is missing" in err and str(reward) in err, err
    reward.write_text("[16, 16]")
    err = _one_line_error(_cost(tmp_path, "--reward", str(reward)), capsys)
    assert "must hold a JSON object" in err and str(reward) in err, err


# (dotted field of the VAE config, bad value, what the message says)
BAD_DECODER_FIELDS = [
    ("layers_per_block", 0, "is below 1"),
    ("layers_per_block", -1, "is below 1"),
    ("norm_num_groups", 0, "is below 1"),
    ("latent_channels", 2.5, "is a fraction, not a whole number"),
    ("sample_size", False, "is a boolean, not a whole number"),
    ("in_channels", "3", "is a string, not a whole number"),
    ("block_out_channels[1]", -8, "is below 1"),
]


@pytest.mark.parametrize(("path", "value", "problem"), BAD_DECODER_FIELDS)
def test_a_bad_decoder_size_is_one_line_naming_the_file_and_field(
    path, value, problem, tmp_path, capsys
) -> None:
    """``--decoder`` a folder: the message names the config.json it read."""
    vae = tmp_path / "vae-folder"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps(_with(TINY_VAE, path, value)))
    argv = _cost(tmp_path, "--reward", "pixels", "--decoder", str(vae))
    err = _one_line_error(argv, capsys)
    where = f"--decoder {str(vae / 'config.json')!r}"
    assert f"{where}: field {path}={json.dumps(value)} {problem}" in err, err


def test_the_reward_is_checked_before_the_decoder_is_built(tmp_path, capsys) -> None:
    """Both configs bad: the reward's mistake is reported (read first, before the VAE)."""
    vae = tmp_path / "vae.json"
    vae.write_text(json.dumps(_with(TINY_VAE, "layers_per_block", 0)))
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(_with(TINY_CLIP_SCORE, "vision.num_hidden_layers", 0)))
    argv = _cost(tmp_path, "--reward", str(reward), "--decoder", str(vae))
    assert "vision.num_hidden_layers=0" in _one_line_error(argv, capsys)


def test_valid_configs_still_price(tmp_path, capsys) -> None:
    """A valid reward and decoder config go through (exit 0, the three lines)."""
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(TINY_CLIP_SCORE))
    out = tmp_path / "cost.json"
    argv = _cost(
        tmp_path, "--reward", str(reward), "--decoder", str(tmp_path / "pipeline"),
        "--json", str(out),
    )  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    for line in ("| transformer |", "| decoder (x1) |", "| reward (x1) |"):
        assert line in table
    assert json.loads(out.read_text())["estimators"]["exact"]["flops"] > 0


def test_reward_model_checks_a_python_dict_too() -> None:
    """``reward_model`` called from Python with a dict of its own is checked the same way."""
    bad = _with(TINY_CLIP_SCORE, "text.num_hidden_layers", 0)
    with pytest.raises(InvalidValue, match=r"field text\.num_hidden_layers=0 is below 1"):
        reward_model(bad, dtype=torch.float32)
    for name, preset in REWARD_PRESETS.items():  # the shipped presets pass, unchanged
        model = reward_model(preset, dtype=torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) > 0, name


def test_decoder_config_checks_the_file_it_read_from_python_too(tmp_path) -> None:
    """``decoder_config`` itself checks (the one lookup of ``--decoder``'s file): a folder's
    ``vae/config.json`` is named in the message, as read."""
    from gradest_lab.cost.decoder_presets import decoder_config

    folder = tmp_path / "pipeline"
    (folder / "vae").mkdir(parents=True)
    file = folder / "vae" / "config.json"
    file.write_text(json.dumps(_with(TINY_VAE, "layers_per_block", 0)))
    with pytest.raises(InvalidValue) as caught:
        decoder_config("sd3", folder)
    message = str(caught.value)
    assert f"--decoder {str(file)!r}" in message and "layers_per_block=0" in message
    file.write_text(json.dumps(TINY_VAE))
    assert decoder_config("sd3", folder)[0] == TINY_VAE


def test_an_unknown_activation_is_one_line_too(tmp_path, capsys) -> None:
    """A field the sizes' check leaves to transformers is still one line (its own refusal)."""
    reward = tmp_path / "reward.json"
    reward.write_text(json.dumps(_with(TINY_CLIP_SCORE, "vision.layer_norm_eps", "tiny")))
    err = _one_line_error(_cost(tmp_path, "--reward", str(reward)), capsys)
    assert "the vision config is invalid" in err and "layer_norm_eps" in err, err


# -- the shared check itself (the recipes' learned rewards use it too) ----------------------


def test_size_fields_are_found_by_their_names() -> None:
    from gradest_lab.cost.config_checks import is_size_field

    sizes = [
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "patch_size", "image_size", "projection_dim", "vocab_size", "max_position_embeddings",
        "encoder_hidden_size", "num_channels", "block_out_channels", "latent_channels",
        "norm_num_groups", "layers_per_block", "sample_size", "text_tokens", "embed_dim",
        "width", "layers", "heads", "context_length", "head_width",
    ]  # fmt: skip
    others = [
        "kind", "hidden_act", "layer_norm_eps", "is_decoder", "tie_word_embeddings",
        "use_quant_conv", "pad_token_id", "scaling_factor", "logit_scale",
        "chunk_size_feed_forward", "length_penalty", "output_tokens", "add_cross_attention",
    ]  # fmt: skip
    assert [name for name in sizes if not is_size_field(name)] == []
    assert [name for name in others if is_size_field(name)] == []


def test_configs_transformers_and_open_clip_write_pass() -> None:
    """What the libraries save passes: transformers 5's to_dict (chunk_size_feed_forward
    0, tie_word_embeddings true), a transformers 4 config.json (null
    cross_attention_hidden_size, generation settings at 0: nulls=True, as the recipes
    read such files), open_clip's shipped model configs."""
    import transformers
    from gradest_lab.cost.config_checks import check_config

    for cls in (transformers.CLIPConfig, transformers.BlipConfig, transformers.BertConfig):
        check_config(cls().to_dict(), where=cls.__name__)
    transformers_4 = {  # openai/clip-vit-large-patch14's text_config, as saved by 4.16
        "cross_attention_hidden_size": None, "min_length": 0, "max_length": 20,
        "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "num_beams": 1,
        "pruned_heads": {}, "tie_word_embeddings": True, "hidden_size": 768,
        "num_hidden_layers": 12, "length_penalty": 1.0, "sep_token_id": None,
    }  # fmt: skip
    check_config({"text_config": transformers_4}, where="clip config.json", nulls=True)
    with pytest.raises(InvalidValue, match=r"text_config\.cross_attention_hidden_size=null"):
        check_config({"text_config": transformers_4}, where="clip config.json")
    open_clip = pytest.importorskip("open_clip")
    folder = Path(open_clip.__file__).parent / "model_configs"
    for path in sorted(folder.glob("*.json")):
        check_config(json.loads(path.read_text()), where=path.name, nulls=True)


def test_the_error_type_is_the_callers() -> None:
    from gradest_lab.cost.config_checks import check_config

    class LayerError(InvalidValue):
        pass

    with pytest.raises(LayerError, match=r"^cfg: field a\.b\[0\]\.num_layers=0 is below 1; "):
        check_config({"a": {"b": [{"num_layers": 0}]}}, where="cfg", error=LayerError)
    with pytest.raises(LayerError, match=r"field too_big_size=9223372036854775808 is larger"):
        check_config({"too_big_size": 2**63}, where="cfg", error=LayerError)
