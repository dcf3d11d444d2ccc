"""The learned rewards (gradest_recipes/learned_rewards.py) on tiny random models of the
originals' architectures, made here and saved as their weights ship (transformers
``save_pretrained`` folders, the LAION MLP's ``.pth``, HPSv2's open_clip checkpoint,
ImageReward's ``ImageReward.pt`` with the original BLIP key names and ``med_config.json``),
then loaded through the rewards' own loading code; no weights are downloaded.

Checked: the preprocessing equals transformers' ``CLIPImageProcessor`` (both backends),
``BlipImageProcessor``, the originals' torchvision transforms and open_clip's, on fixed
images, to the rounding of their uint8 images (bound derived below); each reward is the
original's computation on the same pixels (ImageReward against an independent
re-implementation of BLIP's ViT); the gradient reaches the pixels, finite and non-zero; a
missing checkpoint is one line naming the path, what to put there and the option; and each
reward trains a tiny SD3 recipe one step with a non-zero gradient on the LoRA.

Preprocessing tolerance: the originals resize a uint8 image in two passes (PIL, and torch's
uint8 path that transformers' torchvision backend takes), rounding after each; ours does not
round. The intermediate rounding (at most 0.5 grey level) passes through the second pass's
bicubic weights, whose absolute sum is at most 1.25 (PIL's a = -0.5 kernel at phase 1/2:
-1/16, 9/16, 9/16, -1/16), and the final rounding adds 0.5: at most 0.5 * 1.25 + 0.5 =
1.125 grey levels per pixel, i.e. 1.125 / 255 / std in normalised units (the mean error
is that of rounding, about 0.3 level). Everything else (sizes, crop offsets, mean, std)
must match exactly, which an off-by-one crop (up to 255 levels) or a missing pass clamp
(about 20 levels on a noisy image) would break.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from gradest_recipes import RecipeConfigError  # noqa: E402
from gradest_recipes.learned_rewards import (  # noqa: E402
    CLIP_MEAN,
    CLIP_STD,
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    Preprocess,
    ScoreMLP,
    aesthetic,
    hpsv2,
    imagereward,
)
from gradest_recipes.rewards import resolve_reward  # noqa: E402

ROUNDING_LEVELS = 0.5 * 1.25 + 0.5  # grey levels (see the module docstring)
PROMPTS = ["tiny prompt 0", "a red cat"]


# -- fixed images ------------------------------------------------------------------------------


def fixed_image(height: int, width: int, kind: str = "smooth") -> np.ndarray:
    """A deterministic uint8 RGB image: smooth waves, a saturated block and mild noise, or
    uniform noise (the worst case for bicubic overshoot)."""
    rng = np.random.default_rng(0)
    if kind == "noise":
        pixels = rng.integers(0, 256, (height, width, 3)).astype(np.float64)
    else:
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack(
            [128 + 100 * np.sin(x / 7.0 + c) * np.cos(y / 11.0 - c) for c in range(3)], -1
        )
        pixels[height // 3 : height // 2, width // 4 : width // 2] = [250, 10, 30]
        pixels = pixels + rng.normal(0, 8, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def as_tensor(image: np.ndarray) -> torch.Tensor:
    """``[1, 3, H, W]`` in ``[0, 1]``: the image as the recipe's decoded images are."""
    return torch.from_numpy(image).permute(2, 0, 1)[None].double().float() / 255


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, std=CLIP_STD) -> None:
    assert got.shape == want.shape
    levels = (got - want).abs() * torch.tensor(std)[:, None, None] * 255
    assert float(levels.max()) <= ROUNDING_LEVELS + 1e-3, float(levels.max())
    assert float(levels.mean()) <= 0.4, float(levels.mean())


def processed(processor, image: np.ndarray) -> torch.Tensor:
    out = processor(images=PIL_Image.fromarray(image), return_tensors="pt")["pixel_values"]
    return torch.as_tensor(np.asarray(out))


def clip_transform(side: int):
    """OpenAI CLIP's ``_transform`` (also ImageReward's and open_clip's inference one)."""
    tv = pytest.importorskip("torchvision.transforms")
    return tv.Compose([
        tv.Resize(side, interpolation=tv.InterpolationMode.BICUBIC),
        tv.CenterCrop(side),
        tv.ToTensor(),
        tv.Normalize(CLIP_MEAN, CLIP_STD),
    ])  # fmt: skip


# Downscaled, upscaled, square, one side already 224, and an odd crop offset (323 - 224 =
# 99: torchvision rounds to 50, transformers floors to 49).
SHAPES = [(180, 260), (100, 150), (64, 64), (224, 303), (512, 384)]


# -- 1. preprocessing ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("kind", ["smooth", "noise"])
@pytest.mark.parametrize("shape", SHAPES)
def test_preprocess_matches_clip_image_processor(shape, kind, backend):
    cls = transformers.CLIPImageProcessor if backend == "torchvision" else (
        getattr(transformers, "CLIPImageProcessorPil", None)
    )  # fmt: skip
    if cls is None:
        pytest.skip("this transformers has no PIL-backend CLIPImageProcessorPil")
    processor = cls()  # 224 shortest edge, 224 crop, bicubic, CLIP mean / std
    image = fixed_image(*shape, kind=kind)
    ours = Preprocess.from_image_processor(processor, round_crop=False)  # its floor offset
    assert (ours.size, ours.crop, ours.interpolation) == (224, (224, 224), "bicubic")
    assert_within_rounding(ours(as_tensor(image)), processed(processor, image))


@pytest.mark.parametrize("kind", ["smooth", "noise"])
@pytest.mark.parametrize("shape", SHAPES)
def test_preprocess_matches_the_originals_torchvision_transform(shape, kind):
    """OpenAI CLIP (the aesthetic predictor), open_clip (HPSv2) and ImageReward all run
    Resize(224, bicubic) / CenterCrop(224) / ToTensor / Normalize on a PIL image."""
    image = fixed_image(*shape, kind=kind)
    want = clip_transform(224)(PIL_Image.fromarray(image))[None]
    ours = Preprocess(224, (224, 224), CLIP_MEAN, CLIP_STD, "bicubic", round_crop=True)
    assert_within_rounding(ours(as_tensor(image)), want)
    if shape == (180, 260):  # the odd offset: the other rounding is a column off
        floor = Preprocess(224, (224, 224), round_crop=False)(as_tensor(image))
        assert float(((floor - want).abs() * 0.26 * 255).max()) > 10


@pytest.mark.parametrize("kind", ["smooth", "noise"])
def test_imagereward_preprocess_matches_blip_image_processor(kind):
    """ImageReward's preprocessing (shortest side 224, center crop, BLIP's mean and std,
    which are CLIP's) on a square image is BlipImageProcessor's resize to 224 x 224; on
    others it crops where BlipImageProcessor squashes, as the original does (the
    torchvision test above)."""
    processor = transformers.BlipImageProcessor(size={"height": 224, "width": 224})
    assert (tuple(processor.image_mean), tuple(processor.image_std)) == (CLIP_MEAN, CLIP_STD)
    image = fixed_image(160, 160, kind=kind)
    ours = Preprocess(224, (224, 224), CLIP_MEAN, CLIP_STD, "bicubic", round_crop=True)
    assert_within_rounding(ours(as_tensor(image)), processed(processor, image))


def test_preprocess_is_differentiable_and_batched():
    images = torch.rand(3, 3, 40, 56, requires_grad=True)
    out = Preprocess(32, (32, 32))(images)
    assert out.shape == (3, 3, 32, 32)
    (grad,) = torch.autograd.grad(out.square().sum(), images)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    single = Preprocess(32, (32, 32))(images[1:2])
    torch.testing.assert_close(out[1:2], single)


# -- tiny models, saved as the originals ship ------------------------------------------------------


def _seeded(seed: int):
    torch.manual_seed(seed)
    return torch.random.fork_rng(devices=[])


def clip_folder(root: Path) -> Path:
    """A tiny transformers CLIPModel (ViT 32 px, patch 8, projection 16) with a CLIP BPE
    tokenizer (letters and digits), its CLIPImageProcessor (shortest edge 32, crop 32) and
    a LAION aesthetic MLP head for its 16-wide embeddings, in one folder."""
    folder = root / "clip"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    transformers.CLIPTokenizer.from_pretrained(str(folder)).save_pretrained(folder)
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=77, bos_token_id=0,
            eos_token_id=1, pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=8,
        ),
        projection_dim=16,
    )  # fmt: skip
    with _seeded(0):
        transformers.CLIPModel(config).save_pretrained(folder)
        head = nn.Sequential(  # the original MLP's layout, written out
            nn.Linear(16, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )  # fmt: skip
        for parameter in head.parameters():
            nn.init.normal_(parameter, std=0.2)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()},
               folder / "sac+logos+ava1-l14-linearMSE.pth")  # fmt: skip
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    return folder


TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def hps_folder(root: Path) -> tuple[Path, Path]:
    """A tiny open_clip ViT (its model config ``tiny-hps.json``) and a checkpoint of it
    saved as HPSv2's (``{"state_dict": ...}`` in ``HPS_v2_compressed.pt``)."""
    open_clip = pytest.importorskip("open_clip")
    folder = root / "hps"
    config = folder / "tiny-hps.json"
    if not (folder / "HPS_v2_compressed.pt").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(TINY_OPEN_CLIP))
        open_clip.add_model_config(config)
        with _seeded(1):
            model = open_clip.create_model("tiny-hps", pretrained=None)
        torch.save({"state_dict": model.state_dict()}, folder / "HPS_v2_compressed.pt")
    return folder, config


# salesforce/BLIP's models/vit.py, re-implemented here as the reference (pre-norm blocks,
# fused qkv, LayerNorm eps 1e-6, 64-wide heads), with its parameter names.
class RefAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class RefMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class RefBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), RefAttention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), RefMlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RefPatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)


class RefViT(nn.Module):
    def __init__(self, image_size=32, patch=16, dim=128, depth=2):
        super().__init__()
        self.patch_embed = RefPatchEmbed(dim, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image_size // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList([RefBlock(dim, dim // 64) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "tiny", "prompt", "red", "cat",
              *"abcdefghijklmnopqrstuvwxyz0123456789"]  # fmt: skip
MED_CONFIG = {  # ImageReward's med_config.json, at tiny sizes
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 64, "layer_norm_eps": 1e-12, "max_position_embeddings": 40,
    "model_type": "bert", "num_attention_heads": 2, "num_hidden_layers": 2, "pad_token_id": 0,
    "type_vocab_size": 2, "vocab_size": len(BERT_WORDS) + 2, "encoder_width": 128,
    "add_cross_attention": True,
}  # fmt: skip


def imagereward_reference(seed: int = 2) -> tuple[RefViT, nn.Module, nn.Sequential]:
    with _seeded(seed):
        vit = RefViT()
        for name, parameter in vit.named_parameters():  # not LayerNorm's identity init
            nn.init.normal_(parameter, mean=1.0 if "norm" in name and "weight" in name
                            else 0.0, std=0.1)  # fmt: skip
        text_config = transformers.BlipTextConfig(
            vocab_size=MED_CONFIG["vocab_size"], hidden_size=32, encoder_hidden_size=128,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=40, pad_token_id=0, bos_token_id=None, eos_token_id=None,
            sep_token_id=None, is_decoder=True,
        )  # fmt: skip
        text = transformers.BlipTextModel(text_config, add_pooling_layer=False)
        mlp = nn.Sequential(
            nn.Linear(32, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )  # fmt: skip
        for parameter in mlp.parameters():
            nn.init.normal_(parameter, std=0.2)
    return vit.eval(), text.eval(), mlp.eval()


def imagereward_folder(root: Path) -> Path:
    """ImageReward.pt with the original's keys (``blip.visual_encoder.*`` BLIP's ViT,
    ``blip.text_encoder.*`` med.py's BERT, ``mlp.layers.*``), med_config.json and a BERT
    vocab.txt, as the hub repo THUDM/ImageReward (plus bert-base-uncased) lays them out."""
    folder = root / "imagereward"
    if (folder / "ImageReward.pt").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vit, text, mlp = imagereward_reference()
    state = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.layers.{k}": v for k, v in mlp.state_dict().items()})
    state["blip.vision_proj.weight"] = torch.zeros(256, 128)  # unused by ImageReward
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(MED_CONFIG))
    (folder / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
    return folder


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


# -- 2. each reward is the original's computation, differentiable --------------------------------


def assert_differentiable(reward, images: torch.Tensor, prompts=PROMPTS) -> torch.Tensor:
    images = images.clone().requires_grad_(True)
    values = reward(images, prompts=prompts)
    assert values.shape == (images.shape[0],) and torch.isfinite(values).all()
    (grad,) = torch.autograd.grad(values.sum(), images)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
    assert not any(p.requires_grad for p in reward.parameters())  # frozen
    return values.detach()


def test_aesthetic_is_the_laion_predictor_on_the_clip_embedding(weights):
    folder = clip_folder(weights)
    reward = resolve_reward(f"aesthetic:model={folder}")  # the head found in the folder
    images = torch.rand(2, 3, 16, 24)
    values = assert_differentiable(reward, images)
    # The original (simple_inference.py): encode_image, L2-normalised, into the MLP.
    clip = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    state = torch.load(folder / "sac+logos+ava1-l14-linearMSE.pth", weights_only=True)
    head = ScoreMLP(16)
    head.load_state_dict(state)
    with torch.no_grad():
        features = clip.get_image_features(pixel_values=reward.preprocess(images))
        features = features if isinstance(features, torch.Tensor) else features.pooler_output
        want = head.eval()(features / features.norm(dim=-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-6)
    assert (reward.preprocess.size, reward.preprocess.crop) == (32, (32, 32))
    # The head as its own file too; prompts are not needed.
    other = aesthetic(model=str(folder), head=str(folder / "sac+logos+ava1-l14-linearMSE.pth"))
    torch.testing.assert_close(other(images), values)


def test_pickscore_is_logit_scale_times_cosine(weights):
    folder = clip_folder(weights)
    reward = resolve_reward(f"pickscore:model={folder}")
    images = torch.rand(2, 3, 16, 16)
    values = assert_differentiable(reward, images)
    assert reward.preprocess.round_crop is False  # transformers' processor, as PickScore's
    # PickScore's README: the processor, normalised features, logit_scale.exp() * t @ i.T.
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    with torch.no_grad():
        image = model.get_image_features(pixel_values=reward.preprocess(images))
        tokens = tokenizer(PROMPTS, padding=True, truncation=True, max_length=77,
                           return_tensors="pt")  # fmt: skip
        text = model.get_text_features(**tokens)
        image, text = (x if isinstance(x, torch.Tensor) else x.pooler_output for x in (image, text))
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        want = model.logit_scale.exp() * torch.diagonal(text @ image.T)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)
    # The prompt matters; one prompt per image is required.
    swapped = reward(images, prompts=PROMPTS[::-1])
    assert not torch.allclose(swapped, values)
    with pytest.raises(RecipeConfigError, match=r"one prompt per image \(2\), got 1"):
        reward(images, prompts=PROMPTS[:1])


def test_hpsv2_is_hpsv2s_open_clip_score(weights):
    open_clip = pytest.importorskip("open_clip")
    folder, config = hps_folder(weights)
    reward = resolve_reward(f"hpsv2:model={folder},arch={config}")
    images = torch.rand(2, 3, 24, 16)
    values = assert_differentiable(reward, images)
    # hpsv2/img_score.py: create_model_and_transforms, load_state_dict(checkpoint
    # ["state_dict"]), model(image, text), diagonal(image_features @ text_features.T).
    model, _, preprocess_val = open_clip.create_model_and_transforms("tiny-hps", output_dict=True)
    model.load_state_dict(torch.load(folder / "HPS_v2_compressed.pt")["state_dict"])
    model.eval()
    tokenizer = open_clip.get_tokenizer("tiny-hps")
    with torch.no_grad():
        outputs = model(reward.preprocess(images), tokenizer(PROMPTS))
        want = torch.diagonal(outputs["image_features"] @ outputs["text_features"].T)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-6)
    # Its preprocessing is open_clip's inference transform (Resize 32, CenterCrop 32, ...).
    image = fixed_image(45, 70)
    assert_within_rounding(reward.preprocess(as_tensor(image)),
                           preprocess_val(PIL_Image.fromarray(image))[None])  # fmt: skip
    # The checkpoint file itself works as model=, and version 2.1 names its own file.
    same = hpsv2(model=str(folder / "HPS_v2_compressed.pt"), arch=str(config))
    torch.testing.assert_close(same(images, prompts=PROMPTS), values)
    with pytest.raises(RecipeConfigError, match=r"HPS_v2\.1_compressed\.pt"):
        hpsv2(model=str(folder), version="2.1", arch=str(config))


def test_hpsv2_also_reads_a_transformers_conversion(weights):
    """A folder with config.json is a transformers CLIPModel: scored as HPSv2 scores (the
    cosine, no logit scale), with open_clip's crop rounding."""
    folder = clip_folder(weights)
    reward = resolve_reward(f"hpsv2:model={folder}")
    images = torch.rand(2, 3, 16, 16)
    values = assert_differentiable(reward, images)
    scaled = resolve_reward(f"pickscore:model={folder}")(images, prompts=PROMPTS)
    torch.testing.assert_close(values * reward.model.logit_scale.exp(), scaled)
    assert values.abs().max() <= 1 and reward.preprocess.round_crop


def test_imagereward_is_the_original_blip_computation(weights):
    folder = imagereward_folder(weights)
    reward = resolve_reward(f"imagereward:model={folder}")
    images = torch.rand(2, 3, 16, 16)
    values = assert_differentiable(reward, images)
    assert reward.vision.config.layer_norm_eps == 1e-6 and reward.vision.config.image_size == 32
    assert reward.preprocess == Preprocess(32, (32, 32), CLIP_MEAN, CLIP_STD, "bicubic", True)
    # ImageReward.score on the reference modules: visual_encoder -> text_encoder with
    # cross-attention (padding max_length 35) -> [CLS] -> mlp -> (r - mean) / std.
    vit, text, mlp = imagereward_reference()
    tokenizer = transformers.BertTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    with torch.no_grad():
        image_embeds = vit(reward.preprocess(images))
        tokens = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35,
                           return_tensors="pt")  # fmt: skip
        out = text(
            tokens.input_ids, attention_mask=tokens.attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long),
        )  # fmt: skip
        want = (mlp(out.last_hidden_state[:, 0, :]) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
    torch.testing.assert_close(values, want.squeeze(-1), rtol=1e-5, atol=1e-5)
    assert len(reward.tokenizer) == MED_CONFIG["vocab_size"]  # [DEC] and [ENC] added
    # The checkpoint file itself works as model= (med_config.json and vocab.txt beside it).
    same = imagereward(model=str(folder / "ImageReward.pt"))
    torch.testing.assert_close(same(images, prompts=PROMPTS), values)


def test_a_learned_reward_follows_the_images_dtype_under_autocast(weights):
    reward = resolve_reward(f"pickscore:model={clip_folder(weights)}")
    images = torch.rand(2, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as accelerator.autocast() does
        values = reward(images, prompts=PROMPTS)
    assert values.shape == (2,) and torch.isfinite(values.float()).all()


# -- 3. a missing checkpoint is one line -------------------------------------------------------


MISSING = [
    ("aesthetic", "model", "CLIP model"),
    ("pickscore", "model", "CLIP model"),
    ("hpsv2", "model", "HPSv2 checkpoint"),
    ("imagereward", "model", "ImageReward checkpoint"),
]


@pytest.mark.parametrize(("name", "option", "what"), MISSING)
def test_a_missing_path_is_one_line_naming_it(name, option, what, tmp_path):
    where = tmp_path / "no" / "such" / "weights"
    with pytest.raises(RecipeConfigError) as caught:
        resolve_reward(f"{name}:{option}={where}")
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"setting reward='{name}:{option}={where}': reward '{name}': ")
    assert f"no {what} at '{where}" in message
    assert f"pass --reward '{name}:{option}=/path/to/folder'" in message
    assert "put " in message


@pytest.mark.parametrize(("name", "what"), [(n, w) for n, _, w in MISSING])
def test_a_hub_name_not_in_the_cache_is_one_line_naming_download(name, what, weights):
    hub_name = f"gradest-tests/absent-{name}"  # a hub name no cache holds
    head = f",head={clip_folder(weights) / 'sac+logos+ava1-l14-linearMSE.pth'}"
    with pytest.raises(RecipeConfigError) as caught:
        resolve_reward(f"{name}:model={hub_name}{head if name == 'aesthetic' else ''}")
    message = str(caught.value)
    assert "\n" not in message
    assert f"no {what} at '{hub_name}' (not a local path; as a hub name, not in the hub " in message
    assert message.endswith("or add download=1 to fetch it from the hub")


def test_missing_heads_and_bad_files_are_one_line(weights, tmp_path):
    folder = clip_folder(weights)
    bare = tmp_path / "bare"  # the CLIP model without the MLP head
    bare.mkdir()
    for file in folder.iterdir():
        if not file.name.endswith(".pth"):
            (bare / file.name).write_bytes(file.read_bytes())
    with pytest.raises(
        RecipeConfigError,
        match=r"no MLP head at '.*bare/sac\+logos\+ava1-l14"
        r"-linearMSE\.pth'.*pass --reward 'aesthetic:head=/path/to/folder'",
    ):
        resolve_reward(f"aesthetic:model={bare}")
    with pytest.raises(RecipeConfigError, match=r"needs the predictor's MLP: pass head="):
        resolve_reward("aesthetic:model=someone/clip")  # a hub name: no folder to look in
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(RecipeConfigError, match=r"junk\.pth' is not a readable MLP head \("):
        resolve_reward(f"aesthetic:model={folder},head={junk}")
    wrong = tmp_path / "wrong.pth"
    torch.save(ScoreMLP(8).state_dict(), wrong)
    with pytest.raises(RecipeConfigError, match=r"not an MLP head for 16-wide embeddings"):
        resolve_reward(f"aesthetic:model={folder},head={wrong}")
    broken = tmp_path / "broken"
    broken.mkdir()
    torch.save({"blip.visual_encoder.cls_token": torch.zeros(1, 1, 8)}, broken / "ImageReward.pt")
    (broken / "med_config.json").write_text(json.dumps(MED_CONFIG))
    with pytest.raises(RecipeConfigError, match=r"has no BLIP image encoder weight"):
        resolve_reward(f"imagereward:model={broken}")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("pickscore:colour=1", r"'pickscore' takes options model, processor, download, got"),
        ("pickscore:download=maybe", r"option download='maybe' is not a boolean"),
        ("hpsv2:version=3", r"version='3' is not one of \['2.0', '2.1'\]"),
        ("imagereward:model=", r"option model='' is empty"),
        ("color:r=x", r"option r='x' is not a number"),
    ],
)
def test_bad_options_name_the_setting(spec, match, tmp_path):
    with pytest.raises(RecipeConfigError, match=match):
        resolve_reward(spec)


def test_the_script_prints_a_missing_checkpoint_as_one_line(capsys, tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    from gradest_recipes.train import script_main

    where = tmp_path / "nowhere"
    argv = ["--tiny", "--out", str(tmp_path / "out"), "--reward", f"pickscore:model={where}"]
    assert script_main("sd3", argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"no CLIP model at '{where}'" in err


def test_a_missing_library_is_one_line(monkeypatch, tmp_path):
    import sys

    checkpoint = tmp_path / "HPS_v2_compressed.pt"
    torch.save({"state_dict": {}}, checkpoint)
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip fails
    with pytest.raises(
        RecipeConfigError,
        match=r"reward 'hpsv2' needs open_clip, which is not "
        r"installed: pip install '\./apps/recipes\[learned-rewards\]'",
    ):
        resolve_reward(f"hpsv2:model={checkpoint}")


# -- 4. inside a recipe: the gradient reaches the LoRA --------------------------------------------


def _spec(name: str, weights: Path) -> str:
    if name == "aesthetic" or name == "pickscore":
        return f"{name}:model={clip_folder(weights)}"
    if name == "hpsv2":
        folder, config = hps_folder(weights)
        return f"hpsv2:model={folder},arch={config}"
    return f"imagereward:model={imagereward_folder(weights)}"


@pytest.mark.filterwarnings("ignore:There are modules in .* that should be kept in float32")
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("name", ["aesthetic", "pickscore", "hpsv2", "imagereward"])
def test_each_learned_reward_trains_a_tiny_recipe(name, weights, tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    from gradest_recipes import load_config
    from gradest_recipes.train import train

    spec = _spec(name, weights)
    config = load_config(
        "sd3",
        overrides={"tiny": True, "out": str(tmp_path / "run"), "steps": 1, "reward": spec,
                   "report_to": "none"},
    )  # fmt: skip
    run = train("sd3", config)
    (row,) = [json.loads(line) for line in (run.out / "log.jsonl").read_text().splitlines()]
    assert math.isfinite(row["reward"]) and row["grad_norm"] > 0
    moved = [
        name for name, parameter in run.family.denoiser.named_parameters()
        if "lora_B" in name and bool(parameter.detach().abs().max() > 0)
    ]  # fmt: skip
    assert moved  # the zero-initialised LoRA B matrices took a step: a non-zero gradient
    assert spec in (run.out / "config.toml").read_text()  # a resume reloads the same
