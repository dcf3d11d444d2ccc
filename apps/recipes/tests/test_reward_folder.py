"""gradest_recipes.reward_folder: a learned reward's folder built from local checkpoint
files laid out otherwise (the hub cache's snapshots of blobs, a head in a downloads folder,
a processor from another repository), then scored by name as a recipe scores it.

Each built folder's score equals the score computed directly from the tiny random modules
the checkpoints were saved from; decoys sit where a miswired builder would read them (a
stale head and another processor and tokenizer in the model's snapshot, another model's
weights in the processor's), so a wrong file changes the number. Bad inputs are one
RecipeConfigError line naming the argument, and leave nothing at ``out``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
transformers = pytest.importorskip("transformers")

from gradest_recipes import RecipeConfigError  # noqa: E402
from gradest_recipes.learned_rewards import Preprocess, ScoreMLP  # noqa: E402
from gradest_recipes.reward_folder import build_reward_folder, main  # noqa: E402
from gradest_recipes.rewards import resolve_reward  # noqa: E402

PROMPTS = ["a red cat", "tiny prompt 0"]
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


# -- tiny checkpoints, laid out as the hub cache and a downloads folder hold them ----------------


def hub_snapshot(saved: Path, hub: Path, repo: str) -> Path:
    """Move the files of ``saved`` into the hub cache's layout: ``blobs/`` holds them,
    ``snapshots/REV/NAME`` are symbolic links to them, as huggingface_hub writes them."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123abcd"
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(saved.iterdir())):
        blob = root / "blobs" / f"blob{index:04d}"
        file.rename(blob)
        # relative, as the hub cache links a snapshot's file to its blob
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    saved.rmdir()
    return snapshot


def clip_tokenizer(folder: Path, *, reverse: bool = False) -> transformers.CLIPTokenizer:
    """A CLIP BPE tokenizer of letters and digits (``reverse``: the same letters, other
    ids, a tokenizer that would change every text embedding), saved in ``folder``."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in LETTERS[::-1] if reverse else LETTERS:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer.from_pretrained(str(folder))
    tokenizer.save_pretrained(folder)
    return tokenizer


def tiny_clip(seed: int) -> transformers.CLIPModel:
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=2 + 2 * len(LETTERS), hidden_size=32, intermediate_size=37,
            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=8,
        ),
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.CLIPModel(config).eval()


def image_processor(mean=(0.48145466, 0.4578275, 0.40821073)) -> transformers.CLIPImageProcessor:
    return transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=list(mean)
    )


def laion_head(seed: int) -> nn.Sequential:
    """The LAION predictor's MLP as its repository writes it (``layers.N`` keys once
    saved as ``{"layers.N...": ...}``), for 16-wide embeddings."""
    torch.manual_seed(seed)
    head = nn.Sequential(
        nn.Linear(16, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
    )  # fmt: skip
    for parameter in head.parameters():
        nn.init.normal_(parameter, std=0.2)
    return head.eval()


def save_head(head: nn.Module, file: Path) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, file)
    return file


def unit(x) -> torch.Tensor:
    x = x if isinstance(x, torch.Tensor) else x.pooler_output  # transformers 4 / 5
    return x / x.norm(dim=-1, keepdim=True)


@pytest.fixture
def aesthetic_checkpoint(tmp_path):
    """The hub cache's snapshot of a CLIP model (with its processor and a stale head of
    another seed under the name the loader looks for) and the real head downloaded
    under a name of its own; the in-memory originals to score against."""
    clip, head, processor = tiny_clip(0), laion_head(1), image_processor()
    saved = tmp_path / "saving"
    clip.save_pretrained(saved)
    processor.save_pretrained(saved)
    save_head(laion_head(2), saved / "sac+logos+ava1-l14-linearMSE.pth")  # the decoy
    snapshot = hub_snapshot(saved, tmp_path / "hub", "openai/clip-vit-large-patch14")
    head_file = save_head(head, tmp_path / "Downloads" / "aesthetic-mlp.pth")
    return snapshot, head_file, (clip, head, processor)


@pytest.fixture
def pickscore_checkpoint(tmp_path):
    """PickScore's snapshot (model, plus a decoy processor and tokenizer) and the
    processor repository's snapshot (the real processor and tokenizer, plus a decoy
    model of its own, as laion/CLIP-ViT-H-14 ships one); the in-memory originals."""
    clip = tiny_clip(3)
    saved = tmp_path / "saving"
    clip.save_pretrained(saved)
    image_processor(mean=(0.5, 0.5, 0.5)).save_pretrained(saved)  # decoy
    clip_tokenizer(saved, reverse=True)  # decoy
    model = hub_snapshot(saved, tmp_path / "hub", "yuvalkirstain/PickScore_v1")
    saved = tmp_path / "saving"
    tiny_clip(4).save_pretrained(saved)  # decoy
    processor = image_processor()
    processor.save_pretrained(saved)
    tokenizer = clip_tokenizer(saved)
    processor_folder = hub_snapshot(saved, tmp_path / "hub", "laion/CLIP-ViT-H-14")
    return model, processor_folder, (clip, processor, tokenizer)


# -- each kind, scored by name as a recipe scores it ---------------------------------------------


@pytest.mark.parametrize("link", [False, True])
def test_aesthetic_folder_scores_as_the_original_modules(aesthetic_checkpoint, tmp_path, link):
    snapshot, head_file, (clip, head, processor) = aesthetic_checkpoint
    out = tmp_path / "models" / "aesthetic"
    built = build_reward_folder("aesthetic", out, model=snapshot, head=head_file, link=link)
    assert built.folder == out and built.reward == f"aesthetic:model={out}"
    assert built.sources["sac+logos+ava1-l14-linearMSE.pth"] == head_file
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        assert (out / name).is_file() and (out / name).is_symlink() is link, name
    images = torch.rand(2, 3, 24, 40)
    values = resolve_reward(f"aesthetic:model={out}")(images, prompts=PROMPTS)
    # LAION's simple_inference: encode_image, L2-normalised, into the MLP.
    pixels = Preprocess.from_image_processor(processor, round_crop=True)(images)
    with torch.no_grad():
        want = head(unit(clip.get_image_features(pixel_values=pixels))).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-6)
    assert not any(p.name.endswith(".partial") for p in out.parent.iterdir())


def test_aesthetic_takes_the_head_in_the_model_folder_when_none_is_given(
    aesthetic_checkpoint, tmp_path
):
    snapshot, _, (clip, _, processor) = aesthetic_checkpoint
    built = build_reward_folder("aesthetic", tmp_path / "out", model=snapshot)
    assert built.sources["sac+logos+ava1-l14-linearMSE.pth"].parent == snapshot
    images = torch.rand(1, 3, 32, 32)
    pixels = Preprocess.from_image_processor(processor, round_crop=True)(images)
    with torch.no_grad():
        want = laion_head(2)(unit(clip.get_image_features(pixel_values=pixels))).squeeze(-1)
    torch.testing.assert_close(resolve_reward(built.reward)(images), want)


def test_pickscore_folder_joins_the_model_and_the_processor_repository(
    pickscore_checkpoint, tmp_path
):
    model, processor_folder, (clip, processor, tokenizer) = pickscore_checkpoint
    out = tmp_path / "pickscore"
    built = build_reward_folder("pickscore", out, model=model, processor=processor_folder)
    assert built.reward == f"pickscore:model={out}"
    assert {built.sources[n].parent for n in ("config.json", "model.safetensors")} == {model}
    assert built.sources["preprocessor_config.json"].parent == processor_folder
    images = torch.rand(2, 3, 40, 24)
    values = resolve_reward(built.reward)(images, prompts=PROMPTS)
    # PickScore's README: logit_scale.exp() * cos(text, image), transformers' processor.
    pixels = Preprocess.from_image_processor(processor, round_crop=False)(images)
    tokens = tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image, text = (
            unit(clip.get_image_features(pixel_values=pixels)),
            unit(clip.get_text_features(**tokens)),
        )
        want = clip.logit_scale.exp() * (image * text).sum(-1)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)


def test_a_sharded_checkpoint_takes_its_index_and_every_shard(pickscore_checkpoint, tmp_path):
    model, processor_folder, (clip, _, _) = pickscore_checkpoint
    sharded = tmp_path / "sharded"
    clip.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    built = build_reward_folder("pickscore", tmp_path / "out", model=sharded,
                                processor=processor_folder, link=True)  # fmt: skip
    assert shards | {"model.safetensors.index.json"} <= set(built.sources)
    single = build_reward_folder("pickscore", tmp_path / "single", model=model,
                                 processor=processor_folder)  # fmt: skip
    images = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(
        resolve_reward(built.reward)(images, prompts=PROMPTS),
        resolve_reward(single.reward)(images, prompts=PROMPTS),
    )
    next(sharded.glob("model-0000*.safetensors")).unlink()
    message = refused("pickscore", tmp_path / "again", model=sharded, processor=processor_folder)
    assert "model.safetensors.index.json names is not in the folder" in message


TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def test_hpsv2_folder_names_its_version_and_arch(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    arch = tmp_path / "configs" / "tiny-hps-folder.json"
    arch.parent.mkdir()
    arch.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(arch)
    torch.manual_seed(5)
    model = open_clip.create_model("tiny-hps-folder", pretrained=None, output_dict=True).eval()
    checkpoint = tmp_path / "Downloads" / "hps-v2.1.pt"
    checkpoint.parent.mkdir()
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    out = tmp_path / "hps"
    built = build_reward_folder("hpsv2", out, model=checkpoint, version="2.1", arch=str(arch))
    assert built.reward == f"hpsv2:model={out},version=2.1,arch={out / arch.name}"
    assert sorted(os.listdir(out)) == ["HPS_v2.1_compressed.pt", arch.name]
    images = torch.rand(2, 3, 32, 48)
    values = resolve_reward(built.reward)(images, prompts=PROMPTS)
    pixels = Preprocess.from_open_clip(model)(images)
    with torch.no_grad():
        image = model.encode_image(pixels, normalize=True)
        text = model.encode_text(
            open_clip.get_tokenizer("tiny-hps-folder")(PROMPTS), normalize=True
        )
    torch.testing.assert_close(values, (image * text).sum(-1), rtol=1e-5, atol=1e-6)


def test_hpsv2_folder_from_a_transformers_conversion(pickscore_checkpoint, tmp_path):
    model, processor_folder, (clip, processor, tokenizer) = pickscore_checkpoint
    built = build_reward_folder("hpsv2", tmp_path / "hps", model=model, processor=processor_folder)
    pickscore = build_reward_folder(
        "pickscore", tmp_path / "pick", model=model, processor=processor_folder
    )
    images = torch.rand(2, 3, 32, 32)
    values = resolve_reward(built.reward)(images, prompts=PROMPTS)
    scaled = resolve_reward(pickscore.reward)(images, prompts=PROMPTS)
    torch.testing.assert_close(values * clip.logit_scale.exp(), scaled)  # cos, no scale


def imagereward_checkpoint(root: Path) -> tuple[Path, Path]:
    """``ImageReward.pt`` with the original's key names and ``med_config.json`` in one
    snapshot, bert-base-uncased's tokenizer (as transformers 5 saves it: tokenizer.json,
    no vocab.txt) in another."""
    torch.manual_seed(6)
    width, dim, patch, grid = 64, 32, 16, 2
    vision = {"cls_token": (1, 1, width), "pos_embed": (1, grid * grid + 1, width),
              "patch_embed.proj.weight": (width, 3, patch, patch),
              "patch_embed.proj.bias": (width,), "norm.weight": (width,),
              "norm.bias": (width,)}  # fmt: skip
    for part, shape in (("norm1", (width,)), ("norm2", (width,)), ("attn.qkv", (3 * width, width)),
                        ("attn.proj", (width, width)), ("mlp.fc1", (4 * width, width)),
                        ("mlp.fc2", (width, 4 * width))):  # fmt: skip
        vision[f"blocks.0.{part}.weight"] = shape
        vision[f"blocks.0.{part}.bias"] = shape[:1]
    state = {f"blip.visual_encoder.{k}": torch.randn(s) * 0.1 for k, s in vision.items()}
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "tiny", "prompt", "red", "cat", *LETTERS]
    med = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": dim,
           "intermediate_size": 64, "layer_norm_eps": 1e-12, "max_position_embeddings": 40,
           "model_type": "bert", "num_attention_heads": 2, "num_hidden_layers": 1,
           "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(words) + 2,
           "encoder_width": width, "add_cross_attention": True}  # fmt: skip
    text = transformers.BlipTextModel(
        transformers.BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=dim, encoder_hidden_size=width,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=40, is_decoder=True, bos_token_id=None, eos_token_id=None,
            sep_token_id=None,
        ),
        add_pooling_layer=False,
    )  # fmt: skip
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.{k}": v for k, v in ScoreMLP(dim).state_dict().items()})
    saved = root / "saving"
    saved.mkdir()
    torch.save(state, saved / "ImageReward.pt")
    (saved / "med_config.json").write_text(json.dumps(med))
    model = hub_snapshot(saved, root / "hub", "THUDM/ImageReward")
    vocab = root / "vocab"
    vocab.mkdir()
    (vocab / "vocab.txt").write_text("\n".join(words) + "\n")
    bert = root / "saving"
    transformers.BertTokenizer.from_pretrained(str(vocab)).save_pretrained(bert)
    return model, hub_snapshot(bert, root / "hub", "bert-base-uncased")


def test_imagereward_folder_scores_as_the_loader_on_the_original_files(tmp_path):
    from gradest_recipes.learned_rewards import imagereward

    model, tokenizer = imagereward_checkpoint(tmp_path)
    out = tmp_path / "imagereward"
    built = build_reward_folder("imagereward", out, model=model / "ImageReward.pt",
                                tokenizer=tokenizer)  # fmt: skip
    if (out / "vocab.txt").is_file():
        assert built.reward == f"imagereward:model={out}"
    else:  # the loader takes the folder as the tokenizer only with vocab.txt: named
        assert built.reward == f"imagereward:model={out},tokenizer={out}"
    images = torch.rand(2, 3, 32, 32)
    values = resolve_reward(built.reward)(images, prompts=PROMPTS)
    want = imagereward(model=str(model), tokenizer=str(tokenizer))(images, prompts=PROMPTS)
    torch.testing.assert_close(values, want)
    assert not torch.allclose(values, want.flip(0))  # the prompts matter


# -- refusals: one line naming the argument, nothing left at out --------------------------------


def refused(kind: str, out: Path, **kwargs) -> str:
    with pytest.raises(RecipeConfigError) as caught:
        build_reward_folder(kind, out, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert not out.exists() or not any(out.iterdir()), message
    assert not any(p.name.endswith(".partial") for p in out.parent.glob(".*")), message
    return message


def test_a_missing_head_names_head(aesthetic_checkpoint, tmp_path):
    snapshot, _, _ = aesthetic_checkpoint
    missing = tmp_path / "Downloads" / "nope.pth"
    message = refused("aesthetic", tmp_path / "out", model=snapshot, head=missing)
    assert message.startswith(f"reward folder 'aesthetic': head={str(missing)!r} does not exist")
    assert "sac+logos+ava1-l14-linearMSE.pth" in message  # what to pass instead


def test_an_unknown_kind_names_kind(tmp_path):
    message = refused("clipscore", tmp_path / "out", model=tmp_path)
    assert message.startswith("reward folder: kind='clipscore' is not one of aesthetic, ")


def test_an_argument_of_another_kind_is_refused(pickscore_checkpoint, tmp_path):
    model, _, _ = pickscore_checkpoint
    message = refused("pickscore", tmp_path / "out", model=model, head=tmp_path / "h.pth")
    assert "head=" in message and "is not an input of 'pickscore'; it takes model, " in message


def test_a_version_that_is_not_text_names_version(tmp_path):
    message = refused("hpsv2", tmp_path / "out", model=tmp_path / "hps.pt", version=2.1)
    assert message.startswith("reward folder 'hpsv2': version=2.1 (float, not text) is not ")


def test_a_folder_that_is_not_a_checkpoint_names_model(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.png").write_bytes(b"not a model")
    message = refused("pickscore", tmp_path / "out", model=folder)
    assert message.startswith(f"reward folder 'pickscore': model={str(folder)!r} holds no ")
    assert "config.json" in message and "save_pretrained" in message


def test_a_model_of_the_wrong_type_names_model(tmp_path):
    message = refused("aesthetic", tmp_path / "out", model=3)
    assert message.startswith("reward folder 'aesthetic': model=3 is int, not a path")


def test_weights_missing_beside_the_config_name_model(aesthetic_checkpoint, tmp_path):
    snapshot, head_file, _ = aesthetic_checkpoint
    (snapshot / "model.safetensors").unlink()
    message = refused("aesthetic", tmp_path / "out", model=snapshot, head=head_file)
    assert f"model={str(snapshot)!r} holds config.json but no weights" in message


def test_a_config_the_loader_refuses_is_refused_before_copying(aesthetic_checkpoint, tmp_path):
    """The loader's own config check (check_config): a vision tower without layers."""
    snapshot, head_file, _ = aesthetic_checkpoint
    config = json.loads((snapshot / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 0
    (snapshot / "config.json").unlink()  # the link into blobs/; write a file of its own
    (snapshot / "config.json").write_text(json.dumps(config))
    message = refused("aesthetic", tmp_path / "out", model=snapshot, head=head_file)
    assert message.startswith(f"reward folder 'aesthetic': model={str(snapshot)!r} is refused: ")
    assert "field vision_config.num_hidden_layers=0 is below 1" in message


def test_a_head_that_does_not_fit_names_head_and_its_file(aesthetic_checkpoint, tmp_path):
    """Found only by loading: the message names the source file, not the folder being
    assembled, and the argument it came from."""
    snapshot, _, _ = aesthetic_checkpoint
    wide = save_head(nn.Sequential(nn.Linear(768, 1024)), tmp_path / "Downloads" / "vit-l.pth")
    message = refused("aesthetic", tmp_path / "out", model=snapshot, head=wide)
    assert message.startswith(f"reward folder 'aesthetic': the folder from head={str(wide)!r} ")
    assert f"{str(wide)!r} is not an MLP head for 16-wide embeddings" in message


def test_weights_of_another_size_than_the_config_name_the_inputs(aesthetic_checkpoint, tmp_path):
    """transformers' own refusal (a RuntimeError naming no file) becomes one line naming
    the arguments the folder was built from."""
    snapshot, head_file, _ = aesthetic_checkpoint
    config = json.loads((snapshot / "config.json").read_text())
    config["vision_config"].update(hidden_size=64, intermediate_size=64)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text(json.dumps(config))
    message = refused("aesthetic", tmp_path / "out", model=snapshot, head=head_file)
    assert message.startswith(
        f"reward folder 'aesthetic': the folder from model={str(snapshot)!r}, "
        f"head={str(head_file)!r} does not load as the recipe loads it (RuntimeError: "
    )


def test_an_existing_folder_is_not_overwritten(aesthetic_checkpoint, tmp_path):
    snapshot, head_file, _ = aesthetic_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RecipeConfigError, match=r"out='.*' exists and is not an empty folder"):
        build_reward_folder("aesthetic", out, model=snapshot, head=head_file)
    assert sorted(os.listdir(out)) == ["keep.txt"]


def test_the_command_line_prints_the_reward_text_or_one_line(
    aesthetic_checkpoint, tmp_path, capsys
):
    snapshot, head_file, _ = aesthetic_checkpoint
    out = tmp_path / "out"
    argv = ["aesthetic", str(out), "--model", str(snapshot), "--head", str(head_file)]
    assert main(argv) == 0
    assert f"use --reward 'aesthetic:model={out}'" in capsys.readouterr().out
    assert main([*argv[:1], str(tmp_path / "other"), "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"model={str(tmp_path / 'nowhere')!r} does not exist" in err
